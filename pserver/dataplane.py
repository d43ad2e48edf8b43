"""The same-host data plane: push and pull payloads through shared memory.

gRPC in Python costs milliseconds per megabyte (framing, copies into bytes objects,
thread hand-offs), which makes it the bottleneck for bulk tensors. When a worker and a
shard run on the same machine, the shard offers this faster path beside its gRPC port:

- a Unix socket (mode 0600, so only the same user can connect) carries 48-byte binary
  request headers and short replies;
- on connect the shard passes two file descriptors over the socket (SCM_RIGHTS): a new
  memfd the size of its range for this worker's pushed gradients, and the memfd that
  holds the shard's parameters themselves, which the worker maps read-only. There are
  no named segments to leak, even when a process is killed.

A push is a memcpy into the shared buffer and one header; the shard validates the
gradient where it lies and its policy may hold that buffer as the pending gradient
until the step completes (the worker writes it again only after the pull that waits
for that step). A pull is one header, the mode's wait, and a memcpy out of the shard's
parameters by the worker (in sync mode they cannot change until this worker pushes
again; in async modes a racy read is the point, as over gRPC). Memory on the shard:
its parameters plus one buffer per worker. Both calls go to the very same `Shard.push`
/ `Shard.pull` as the gRPC servicer, so validation, modes and counters are identical. Workers use it automatically when the
shard's host id matches their own (`--data-plane auto`, the default); `--data-plane
grpc` turns it off on either side.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import struct
import tempfile
import threading

import numpy as np

from pserver import security
from pserver.errors import (InvalidArgument, PServerError, RpcError, Unauthenticated, Unavailable,
                            rpc_error_for)

log = logging.getLogger("pserver.dataplane")

MAGIC = b"PSD1"
HELLO, PUSH, PULL, INIT = 1, 2, 3, 4
SIGNATURE = struct.Struct("16s")       # INIT: the layout signature follows the header
TOKEN_LEN = struct.Struct("<I")        # HELLO: the token's length, then its bytes (0: none)
# magic, op, rank, shard, step (push) or seen_version (pull), clock, num_elements,
# num_samples, timeout in ms
REQUEST = struct.Struct("<4sB3xiiqqqiI")
# status (index in CODES; 0 = OK), outcome, finished, message length, version
REPLY = struct.Struct("<BBBxIq")
CODES = ["OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "UNAVAILABLE",
         "DEADLINE_EXCEEDED", "INTERNAL"]
MAX_MESSAGE = 64 * 1024


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


def host_id() -> str:
    """Names this machine (and boot): equal ids mean a Unix socket path is reachable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the data-plane connection")
        got += k
    return bytes(buf)


def shared_buffer(size: int) -> tuple[int, mmap.mmap, np.ndarray]:
    """A memfd of `size` float32 elements, mapped: (fd, mapping, array view)."""
    fd = os.memfd_create("pserver", os.MFD_CLOEXEC)
    os.ftruncate(fd, size * 4)
    mm = mmap.mmap(fd, size * 4)
    return fd, mm, np.frombuffer(mm, dtype=np.float32, count=size)


class DataPlaneServer:
    """Serves one shard's push and pull over a Unix socket + shared memory."""

    def __init__(self, shard) -> None:
        self.shard = shard
        token = shard.cfg.auth_token
        self.token = token.encode() if token else None     # HELLO must carry it (security.py)
        name = f"pserver-{os.getpid()}-shard{shard.cfg.shard}-{secrets.token_hex(4)}.sock"
        self.path = os.path.join(tempfile.gettempdir(), name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self.closed = False
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="dataplane-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="dataplane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffers = None
        with self.lock:
            self.conns.add(conn)
        try:
            while True:
                req = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                if req[0] != MAGIC:
                    raise ConnectionError("bad magic")
                if req[1] == HELLO:
                    buffers = self._hello(conn, req)
                elif buffers is None and self.token is not None:
                    self._reply(conn, Unauthenticated("authorization: send HELLO with the shard's token first"))
                    raise ConnectionError("unauthenticated")
                elif buffers is None:
                    self._reply(conn, InvalidArgument("op: say hello first"))
                elif req[1] == INIT:
                    sig = SIGNATURE.unpack(recv_exact(conn, SIGNATURE.size))[0].decode(errors="replace")
                    self._reply(conn, *self._handle(req, *buffers, signature=sig))
                else:
                    self._reply(conn, *self._handle(req, *buffers))
        except (ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def _authenticate(self, conn) -> None:
        """Read the token that follows HELLO; refuse and close unless it is the shard's
        (compared in constant time). A refused connection never sees a buffer."""
        (n,) = TOKEN_LEN.unpack(recv_exact(conn, TOKEN_LEN.size))
        if n > security.MAX_TOKEN:             # checked before reading: no allocation by the peer's say-so
            why = f"authorization: a {n}-byte token is longer than {security.MAX_TOKEN} bytes"
        else:
            presented = recv_exact(conn, n) if n else None
            why = None if self.token is None else security.refusal(presented, self.token)
        if why is not None:
            self._reply(conn, Unauthenticated(why))
            raise ConnectionError("unauthenticated")

    def _hello(self, conn, req):
        self._authenticate(conn)
        store = self.shard.store
        if store.params_fd is None:
            raise ConnectionError("the shard has no shared parameters yet")
        fd, _, push_buf = shared_buffer(store.size)
        reply = REPLY.pack(0, 0, 0, 0, store.size)
        socket.send_fds(conn, [reply], [fd, store.params_fd])
        os.close(fd)                                            # the mapping stays
        return (push_buf,)

    def _handle(self, req, push_buf: np.ndarray, signature: str = ""):
        _, op, rank, shard, step, clock, num_elements, num_samples, timeout_ms = req
        try:
            if op == PUSH:
                outcome, version, message, finished = self.shard.push(
                    rank, shard, step, num_elements, "float32", num_samples, clock, push_buf)
                return None, outcome.value, finished, version, message
            if op == PULL:
                version, _, finished = self.shard.pull(rank, shard, step, clock, timeout_ms / 1000)
                return None, 0, finished, version, ""
            if op == INIT:
                already, version = self.shard.init(rank, signature, num_elements, "float32", push_buf)
                return None, int(already), False, version, ""
            raise InvalidArgument(f"op: unknown data-plane operation {op}")
        except RpcError as e:
            return e, 0, False, 0, ""
        except Exception as e:  # a bug: report it to the caller, keep serving
            log.exception("internal error on the data plane")
            return rpc_error_for("INTERNAL", f"{type(e).__name__}: {e}"), 0, False, 0, ""

    def _reply(self, conn, error, outcome=0, finished=False, version=0, message=""):
        if error is not None:
            code = CODES.index(error.code_name) if error.code_name in CODES else CODES.index("INTERNAL")
            message = str(error)
        else:
            code = 0
        data = message.encode()[:MAX_MESSAGE]
        conn.sendall(REPLY.pack(code, outcome, bool(finished), len(data), version) + data)

    def close(self) -> None:
        """Stop accepting and cut every live connection (workers see UNAVAILABLE)."""
        self.closed = True
        with self.lock:
            for conn in self.conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            self.sock.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


class DataPlaneChannel:
    """A worker's connection to one shard's data plane. One call at a time."""

    def __init__(self, address: str, rank: int, shard: int, size: int, label: str,
                 token: str | None = None) -> None:
        self.label = label
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address.removeprefix("unix:"))
        self.rank, self.shard = rank, shard
        blob = token.encode() if token else b""
        self.sock.sendall(REQUEST.pack(MAGIC, HELLO, rank, shard, 0, 0, 0, 0, 0)
                          + TOKEN_LEN.pack(len(blob)) + blob)
        msg, fds, _, _ = socket.recv_fds(self.sock, REPLY.size, 2)
        self._check_hello(msg, fds)
        if len(fds) != 2 or REPLY.unpack(msg)[4] != size:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the shard's data plane answered with the wrong buffers")
        # our push buffer (read-write) and the shard's parameters (read-only)
        self.maps = [mmap.mmap(fds[0], size * 4), mmap.mmap(fds[1], size * 4, prot=mmap.PROT_READ)]
        for fd in fds:
            os.close(fd)
        self.push_buf, self.params = (np.frombuffer(m, dtype=np.float32, count=size) for m in self.maps)

    def _check_hello(self, msg: bytes, fds: list[int]) -> None:
        """A refused HELLO (wrong or missing token) is an error reply with no descriptors."""
        code = REPLY.unpack(msg)[0] if len(msg) == REPLY.size else None
        if code == 0:
            return
        for fd in fds:
            os.close(fd)
        if code is None:
            raise ConnectionError("the shard's data plane closed the connection during HELLO")
        n = REPLY.unpack(msg)[3]
        message = recv_exact(self.sock, n).decode(errors="replace") if n else ""
        self.sock.close()
        raise rpc_error_for(CODES[code] if code < len(CODES) else "INTERNAL", f"{self.label}: {message}")

    def _call(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b""):
        self.sock.settimeout(timeout + 5)
        try:
            self.sock.sendall(REQUEST.pack(MAGIC, op, self.rank, self.shard, step, clock, num_elements,
                                           num_samples, int(min(timeout, 4e6) * 1000)) + tail)
            code, outcome, finished, n, version = REPLY.unpack(recv_exact(self.sock, REPLY.size))
            message = recv_exact(self.sock, n).decode(errors="replace") if n else ""
        except (OSError, ConnectionError) as e:
            raise Unavailable(f"{self.label}: data-plane connection lost ({e})") from None
        if code:
            raise rpc_error_for(CODES[code] if code < len(CODES) else "INTERNAL", f"{self.label}: {message}")
        return outcome, bool(finished), version, message

    def push(self, grad: np.ndarray, step: int, num_samples: int, clock: int, timeout: float):
        np.copyto(self.push_buf, grad)
        outcome, finished, version, _ = self._call(PUSH, step, clock, grad.size, num_samples, timeout)
        return outcome, version, finished

    def init(self, values: np.ndarray, signature: str, timeout: float) -> bool:
        """Initial values through shared memory; True if the shard already had values."""
        np.copyto(self.push_buf, values)
        already, _, _, _ = self._call(INIT, 0, 0, values.size, 0, timeout,
                                      SIGNATURE.pack(signature.encode()))
        return bool(already)

    def pull_into(self, dest: np.ndarray, seen_version: int, clock: int, timeout: float):
        _, finished, version, _ = self._call(PULL, seen_version, clock, dest.size, 0, timeout)
        np.copyto(dest, self.params)
        return version, finished

    def close(self) -> None:
        self.sock.close()
        self.push_buf = self.params = None
        for m in self.maps:
            try:
                m.close()
            except BufferError:       # a view is still alive somewhere; the GC will unmap
                pass


def connect(address: str, expected_host: str, rank: int, shard: int, size: int,
            label: str, token: str | None = None) -> DataPlaneChannel | None:
    """A channel if the shard is on this host and answers; None means: use gRPC."""
    if not address or not supported() or size == 0 or expected_host != host_id():
        return None
    try:
        return DataPlaneChannel(address, rank, shard, size, label, token)
    except (OSError, ConnectionError, PServerError) as e:
        log.info("%s: data plane unavailable (%s); using gRPC streams", label, e)
        return None
