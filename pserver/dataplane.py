"""The same-host data plane: push and pull payloads through shared memory.

gRPC in Python costs milliseconds per megabyte (framing, copies into bytes objects,
thread hand-offs), which makes it the bottleneck for bulk tensors. When a worker and a
shard run on the same machine, the shard offers this faster path beside its gRPC port:

- a Unix socket carries 48-byte binary request headers and short replies. It lives in a
  directory only its user can enter (`<tmp>/pserver-<uid>`, mode 0700, checked at start),
  and sockets left there by killed shards are removed when a shard starts;
- HELLO carries the token (when the shard has one) and the worker's session credential
  from Register, checked before any memory is shared: the connection then acts for that
  rank with that session only;
- the shard answers HELLO with two file descriptors (SCM_RIGHTS): a new memfd the size of
  its range for this worker's pushed gradients, and the memfd that holds the shard's
  parameters. Both are sealed against shrinking and growing, so no client can make the
  shard's own mappings fault (SIGBUS); the parameters are also sealed against writing
  (F_SEAL_FUTURE_WRITE), so a client can only map them read-only. There are no named
  segments to leak, even when a process is killed.

A push is a memcpy into the shared buffer and one header; the shard copies the gradient
into its own memory, checking every value in the same pass, so what it validated is what
it applies whatever the client writes afterwards. A range larger than PART_ELEMENTS goes in
parts through two slots of that size (so a connection's buffer stays small whatever the
model): the client writes part k into slot k % 2 and says READY (part 0: the header), the
shard copies and checks it and says FREE when the client may write that slot again, so
the client writes one part while the shard copies the one before. A pull is one header,
the mode's wait, and a memcpy out of the shard's parameters by the worker (in sync mode
they cannot change until this worker pushes again; in async modes a racy read is the
point, as over gRPC).
A worker's step is a push and then a pull, so a push may carry the pull that follows it
(THEN_PULL): the shard applies the push, waits as the pull would, and answers both in one
message, which saves the pull's request, a wake-up on each side, and the shard's dispatch.
A push that is refused gets its own error reply and no pull; a pull part that fails is
answered as it would have been alone, and the worker then pulls on its own.
A pull that waits notices when its client hangs up, and its thread goes. Memory on the
shard: its parameters plus one buffer per connection (its range, or two parts of it), at
most connection_limit() of them.
Both calls go to the very same `Shard.push` / `Shard.pull` as the gRPC servicer, so
validation, modes and counters are identical. Workers use it automatically when the
shard's host id matches their own (`--data-plane auto`, the default); `--data-plane
grpc` turns it off on either side.

Sparse tables change size every batch, so their rows travel through a second buffer per
connection, made on first use: PULL_ROWS (ids in, rows out) and PUSH_ROWS (a push whose
sparse parts, each table's unique ids then their gradients, follow its dense gradient). The
worker asks for room first (ROWS_BUFFER): when a request outgrows the buffer, the shard
makes a new sealed memfd of at least twice the size and drops its mapping of the old one.
Each connection's rows buffer is bounded by ROWS_BUFFER_MAX (and by --max-inflight-mb),
so the shard maps at most connection_limit() of them; a request too big for it goes over
gRPC. The shard copies the ids and gradients out of the buffer into its own memory before
it checks them (`Shard.row_buffers` / `Shard.push`, as gRPC pushes), and writes pulled rows
into it after the ids were read, so what a client scribbles there can only spoil its own
answer. A request names each table by its index in the registered layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import tempfile
import threading
from typing import Sequence

import numpy as np

from pserver import security
from pserver.errors import (ConfigError, InvalidArgument, PServerError, RpcError, Unauthenticated,
                            Unavailable, rpc_error_for)

log = logging.getLogger("pserver.dataplane")

MAGIC = b"PSD1"
HELLO, PUSH, PULL, INIT, PULL_ROWS, PUSH_ROWS, ROWS_BUFFER = 1, 2, 3, 4, 5, 6, 7
# Set on PUSH or PUSH_ROWS: the pull that follows the push rides with it. Its seen_version
# and clock come right after the header (before any other tail); the shard answers with
# the push's reply and then, if the push was taken, the pull's, in one message.
THEN_PULL = 0x40
PULL_AFTER = struct.Struct("<qq")
SIGNATURE = struct.Struct("16s")       # INIT: the layout signature follows the header
# PULL_ROWS and PUSH_ROWS: the number of sparse parts, then per part the table's index in
# the layout and the number of ids. ROWS_BUFFER: num_elements is the room wanted, in bytes.
PARTS = struct.Struct("<I")
PART = struct.Struct("<IQ")
ROWS_BUFFER_MAX = 64 << 20             # bytes of rows buffer per connection (930k rows of dim 16)
# HELLO: the token's length and bytes (0: none), then the session's length and bytes
TOKEN_LEN = struct.Struct("<I")
MAX_SESSION = 256                      # bytes; Register's credentials are 32 hex characters
# magic, op, rank, shard, step (push) or seen_version (pull), clock, num_elements,
# num_samples, timeout in ms
REQUEST = struct.Struct("<4sB3xiiqqqiI")
# status (index in CODES; 0 = OK), outcome, finished, message length, version
REPLY = struct.Struct("<BBBxIq")
CODES = ["OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "UNAVAILABLE",
         "DEADLINE_EXCEEDED", "INTERNAL", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED"]
MAX_MESSAGE = 64 * 1024
# A dense payload larger than this many float32 travels in parts through two slots this size.
PART_ELEMENTS = 1 << 19
READY, FREE = b"R", b"F"   # part k is in its slot / slot k % 2 may be written again
HELLO_TIMEOUT = 10.0      # seconds a new connection may take to say HELLO before it is cut
# Seals from <linux/fcntl.h> (Python's fcntl module has no F_SEAL_FUTURE_WRITE, Linux >= 5.1).
SEAL_SEAL, SEAL_SHRINK, SEAL_GROW, SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x10
SIZE_SEALS = SEAL_SHRINK | SEAL_GROW
SOCKET_NAME = re.compile(r"pserver-(\d+)-[\w-]+\.sock(\.new)?")


def connection_limit(num_workers: int) -> int:
    """Connections one shard serves at once. Each holds a thread and a buffer the size of
    the shard's range, so the bound follows the cluster: a few per worker (a reconnecting
    worker's new connection may overlap its old one's end), and some for tools."""
    return 4 * max(num_workers, 1) + 16


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
    data = sock.recv(n)            # almost always whole: headers and replies are small
    if len(data) == n:
        return data
    buf = bytearray(n)
    view, got = memoryview(buf), len(data)
    view[:got] = data
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the data-plane connection")
        got += k
    return bytes(buf)


def row_layout(parts: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
    """Where each sparse part [(number of ids, dim)] sits in a rows buffer: ([(offset of its
    ids, offset of its rows)], bytes in all). Parts follow one another, each 8-byte aligned."""
    slots, at = [], 0
    for n, dim in parts:
        rows_at = at + 8 * n
        slots.append((at, rows_at))
        at = rows_at + (4 * n * dim + 7) // 8 * 8
    return slots, at


def push_slots(size: int) -> tuple[int, int]:
    """(elements per slot, slots) of a connection's push buffer for a range of `size`."""
    return (size, 1) if size <= PART_ELEMENTS else (PART_ELEMENTS, 2)


def fits(parts: list[tuple[int, int]]) -> bool:
    """Whether sparse parts [(number of ids, dim)] fit in one connection's rows buffer."""
    return row_layout(parts)[1] <= ROWS_BUFFER_MAX


# --- shared memory -----------------------------------------------------------------------
def sealed_memfd(name: str, nbytes: int, clients_write: bool) -> tuple[int, mmap.mmap]:
    """A memfd of `nbytes`, mapped read-write here, then sealed before anyone else sees it:
    its size is fixed for good, and unless `clients_write` nobody can map it writable or
    write to it any more (this process's mapping, made first, still can)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        seals = SIZE_SEALS | SEAL_SEAL | (0 if clients_write else SEAL_FUTURE_WRITE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def require_seals(fd: int, seals: int, what: str) -> None:
    """Refuse a memfd that someone else could still resize (or write, as `seals` says)."""
    try:
        has = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        has, why = 0, f"not a sealable memfd ({e.strerror})"
    else:
        why = f"seals 0x{has:x}"
    if has & seals != seals:
        raise InvalidArgument(f"{what}: the shared memory lacks seals 0x{seals & ~has:x} ({why}); "
                              f"refusing to map memory that another process could resize or write")


def mapped(fd: int, nbytes: int, writable: bool, what: str) -> mmap.mmap:
    """Map a memfd received from a peer, after checking that nobody can shrink it under us."""
    require_seals(fd, SIZE_SEALS, what)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, prot=prot)


class RowsBuffer:
    """One connection's rows buffer, on either side: a mapping of a sealed memfd that a
    bigger one replaces when a request outgrows it (None until the first sparse request)."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None

    @property
    def size(self) -> int:
        return len(self.map) if self.map is not None else 0

    def region(self, offset: int, dtype, count: int) -> np.ndarray:
        if count == 0:                 # an empty part needs no buffer, and may come before one
            return np.empty(0, dtype)
        return np.frombuffer(self.map, dtype, count, offset)

    def replace(self, mm: mmap.mmap | None) -> None:
        old, self.map = self.map, mm
        if old is not None:
            with contextlib.suppress(BufferError):     # a view still alive: the GC unmaps it
                old.close()


def peer_open(conn: socket.socket) -> bool:
    """False once the peer has hung up: polled while a pull waits for its step."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    events = poller.poll(0)
    if not events:
        return True
    if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
        return False
    try:                       # readable: a request sent early (alive) or end of file (gone)
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


# --- the socket's directory --------------------------------------------------------------
def socket_dir() -> str:
    """`<tmp>/pserver-<uid>`: created with mode 0700 if missing; refused if it is anything
    but a directory of this user that nobody else can enter (someone could then connect
    to, or replace, the shard's socket)."""
    path = os.path.join(tempfile.gettempdir(), f"pserver-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)             # the umask may have taken bits off
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise ConfigError(f"data plane: {path} must be a directory owned by uid {os.getuid()} with mode "
                          f"0700; it is {kind} owned by uid {st.st_uid} with mode "
                          f"{stat.S_IMODE(st.st_mode):04o} (remove it, or run with --data-plane grpc)")
    return path


def remove_stale(directory: str) -> None:
    """Remove the sockets of shards that are gone: SIGKILL leaves them behind. A socket is
    stale when the process named in it is dead, or when it refuses connections (its pid
    was reused). One being set up (`.sock.new`, before listen) is judged by its pid only."""
    for entry in os.scandir(directory):
        m = SOCKET_NAME.fullmatch(entry.name)
        if m and (not pid_alive(int(m.group(1))) or (not m.group(2) and refuses(entry.path))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                log.info("removed the stale data-plane socket %s", entry.path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # alive, another user's
        pass
    return True


def refuses(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:              # busy (a full backlog) or not a socket: not ours to judge
        return False
    finally:
        probe.close()
    return False


# --- the shard's side ----------------------------------------------------------------------
class Connection:
    """One worker's connection after HELLO: who it acts for, its push buffer and its rows
    buffer."""

    def __init__(self, rank: int, session: str, push_buf: np.ndarray, size: int) -> None:
        self.rank, self.session, self.push_buf, self.size = rank, session, push_buf, size
        self.rows = RowsBuffer()


class Parts:
    """A dense payload received part by part from a connection's two slots (see the module's
    docstring): a fill that checks every value as it copies it into shard-owned memory.
    Whatever the shard answers, every part is taken (drain) before the reply, so the stream
    stays framed; a client that stops sending parts is cut after the request's timeout."""

    checks_values = True

    def __init__(self, conn: socket.socket, peer: Connection, store, timeout: float) -> None:
        self.conn, self.store = conn, store
        self.slot, _ = push_slots(peer.size)
        self.slots = peer.push_buf.reshape(2, self.slot)
        self.count = -(-peer.size // self.slot)
        self.taken = 0
        conn.settimeout(timeout + 5)

    def _take(self) -> np.ndarray:
        """Wait until the next part is in its slot (part 0 came with the header); its slot."""
        k = self.taken
        if k and recv_exact(self.conn, 1) != READY:
            raise ConnectionError("a part's READY expected")
        self.taken += 1
        return self.slots[k % 2]

    def _free(self, k: int) -> None:
        if k + 2 < self.count:            # the client writes that slot again only if parts remain
            self.conn.sendall(FREE)

    def __call__(self, dst: np.ndarray) -> None:
        bad = -1
        for k in range(self.count):
            a, b = k * self.slot, min((k + 1) * self.slot, dst.size)
            first = self.store.copy_finite(self._take()[:b - a], dst[a:b])
            self._free(k)
            if bad < 0 <= first:
                bad = a + first
        self.store.refuse_nonfinite(dst, bad)

    def drain(self) -> None:
        """Take the parts the shard did not copy (it refused the call first), then restore
        the connection's blocking reads."""
        while self.taken < self.count:
            self._take()
            self._free(self.taken - 1)
        self.conn.settimeout(None)


class DataPlaneServer:
    """Serves one shard's push and pull over a Unix socket + shared memory."""

    def __init__(self, shard) -> None:
        self.shard = shard
        token = shard.cfg.auth_token
        self.token = token.encode() if token else None     # HELLO must carry it (security.py)
        directory = socket_dir()
        remove_stale(directory)
        # Names this server's socket and its rows buffers (/proc/PID/maps shows memfd names).
        self.tag = f"shard{shard.cfg.shard}-{secrets.token_hex(4)}"
        name = f"pserver-{os.getpid()}-{self.tag}.sock"
        self.path = os.path.join(directory, name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a temporary name and renamed once listening, so that another shard
        # starting now never takes it for a stale socket that refuses connections.
        self.sock.bind(self.path + ".new")
        os.chmod(self.path + ".new", 0o600)
        self.sock.listen(64)
        os.rename(self.path + ".new", self.path)
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
            workers = self.shard.policy.num_workers
            limit = connection_limit(workers)
            with self.lock:
                admitted = len(self.conns) < limit
                if admitted:
                    self.conns.add(conn)
            if admitted:
                threading.Thread(target=self._serve, args=(conn,), name="dataplane-conn", daemon=True).start()
            else:
                self._refuse(conn, rpc_error_for("RESOURCE_EXHAUSTED", (
                    f"connections: shard {self.shard.cfg.shard}'s data plane already serves "
                    f"{limit} connections, its limit for a cluster of {workers} workers")))

    def _refuse(self, conn, error: RpcError) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            self._reply(conn, error)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        peer = None
        try:
            conn.settimeout(HELLO_TIMEOUT)
            while True:
                req = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                if req[0] != MAGIC:
                    raise ConnectionError("bad magic")
                if req[1] == HELLO:
                    peer = self._hello(conn, req)
                    conn.settimeout(None)          # a worker may compute for long between calls
                elif peer is None and self.token is not None:
                    self._reply(conn, Unauthenticated("authorization: send HELLO with the token first"))
                    raise ConnectionError("unauthenticated")
                elif peer is None:
                    self._reply(conn, InvalidArgument("op: say hello first"))
                elif req[1] == INIT:
                    sig = SIGNATURE.unpack(recv_exact(conn, SIGNATURE.size))[0].decode(errors="replace")
                    self._reply(conn, *self._handle(conn, req, peer, signature=sig))
                elif req[1] == ROWS_BUFFER:
                    self._grow_rows(conn, req, peer)
                else:
                    self._request(conn, req, peer)
        except (ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()
            if peer is not None:
                peer.rows.replace(None)

    def _read_field(self, conn, limit: int, field: str, noun: str) -> bytes | None:
        """A length-prefixed HELLO field (None when empty); too long a length is refused
        before anything is read, so the peer cannot make the shard allocate."""
        (n,) = TOKEN_LEN.unpack(recv_exact(conn, TOKEN_LEN.size))
        if n > limit:
            self._reply(conn, Unauthenticated(f"{field}: a {n}-byte {noun} is longer than {limit} bytes"))
            raise ConnectionError("unauthenticated")
        return recv_exact(conn, n) if n else None

    def _authenticate(self, conn) -> str:
        """Read the token and session that follow HELLO; refuse and close unless the token is
        the shard's (compared in constant time). A refused connection never sees a buffer.
        Returns the session."""
        presented = self._read_field(conn, security.MAX_TOKEN, "authorization", "token")
        session = self._read_field(conn, MAX_SESSION, "session", "session credential")
        why = None if self.token is None else security.refusal(presented, self.token)
        if why is not None:
            self._reply(conn, Unauthenticated(why))
            raise ConnectionError("unauthenticated")
        return session.decode(errors="replace") if session else ""

    def _hello(self, conn, req) -> Connection:
        session = self._authenticate(conn)
        try:               # the rank's session, as a gRPC Pull would need it, before any memory
            self.shard.heartbeat(req[2], session)
        except RpcError as e:
            self._reply(conn, e)
            raise ConnectionError("refused") from None
        store = self.shard.store
        if store.params_fd is None:
            raise ConnectionError("the shard has no shared parameters yet")
        require_seals(store.params_fd, SIZE_SEALS | SEAL_FUTURE_WRITE, "parameters")
        slot, slots = push_slots(store.size)
        fd, mm = sealed_memfd("pserver-push", slot * slots * 4, clients_write=True)
        try:
            socket.send_fds(conn, [REPLY.pack(0, 0, 0, 0, store.size)], [fd, store.params_fd])
        finally:
            os.close(fd)                                        # the mapping stays
        return Connection(req[2], session, np.frombuffer(mm, dtype=np.float32), store.size)

    def _read_parts(self, conn) -> list[tuple[int, int]]:
        """The [(table index, number of ids)] that follow a sparse request's header. A
        request has at most one part per table: more is refused before it is read, and the
        connection closed (what follows could not be framed)."""
        (k,) = PARTS.unpack(recv_exact(conn, PARTS.size))
        tables = len(self.shard.store.tables)
        if k > tables:
            self._reply(conn, InvalidArgument(f"sparse: {k} parts in one request; the model has "
                                              f"{tables} sparse tables"))
            raise ConnectionError("too many parts")
        return [PART.unpack(recv_exact(conn, PART.size)) for _ in range(k)] if k else []

    def _grow_rows(self, conn, req, peer: Connection) -> None:
        """A new rows buffer of at least the bytes asked (num_elements) and twice the old one,
        within ROWS_BUFFER_MAX and --max-inflight-mb; its fd goes with the reply."""
        wanted, limit = req[6], min(ROWS_BUFFER_MAX, self.shard.limits.max_inflight_bytes)
        if not 0 < wanted <= limit:
            self._reply(conn, InvalidArgument(f"rows buffer: {wanted} bytes asked; a connection's rows "
                                              f"buffer holds 1 to {limit} bytes (larger requests go over gRPC)"))
            return
        size = max(wanted, min(max(2 * peer.rows.size, 1 << 20), limit))
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE     # the limit is whole MiB: still within it
        fd, mm = sealed_memfd(f"pserver-rows-{self.tag}", size, clients_write=True)
        peer.rows.replace(mm)              # before the reply: once told, the client may count on it
        try:
            socket.send_fds(conn, [REPLY.pack(0, 0, 0, 0, size)], [fd])
        finally:
            os.close(fd)                                        # the mapping stays

    def _tables(self, parts: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """[(table name, number of ids, dim)] of a request's parts, or InvalidArgument."""
        names, out = list(self.shard.store.tables), []
        for index, n in parts:
            if index >= len(names):
                raise InvalidArgument(f"table: index {index}; the model has {len(names)} sparse tables")
            out.append((names[index], n, self.shard.table(names[index]).config.dim))
        return out

    def _placed(self, peer: Connection, tables: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
        """Where the parts sit in the connection's rows buffer, checked to fit in it."""
        slots, end = row_layout([(n, dim) for _, n, dim in tables])
        if end > peer.rows.size:
            raise InvalidArgument(f"num_ids: the request's rows take {end} bytes and this connection's "
                                  f"rows buffer holds {peer.rows.size} (send ROWS_BUFFER first)")
        return slots

    def _received_rows(self, peer: Connection, parts: list[tuple[int, int]]) -> list:
        """A push's sparse parts, copied from the rows buffer into arrays of the shard's own."""
        tables = self._tables(parts)
        slots = self._placed(peer, tables)
        rows = self.shard.row_buffers([(name, n) for name, n, _ in tables])
        for r, (ids_at, grads_at) in zip(rows, slots):
            n, dim = r.grads.shape
            np.copyto(r.ids, peer.rows.region(ids_at, np.uint64, n))
            np.copyto(r.grads, peer.rows.region(grads_at, np.float32, n * dim).reshape(n, dim))
        return rows

    def _pull_rows(self, peer: Connection, rank: int, shard: int, parts: list[tuple[int, int]]) -> int:
        """Rows of one table for the ids in the rows buffer, written after them; the version."""
        if len(parts) != 1:
            raise InvalidArgument(f"sparse: a row pull names one table, this one {len(parts)}")
        [(name, n, dim)] = tables = self._tables(parts)
        [(ids_at, rows_at)] = self._placed(peer, tables)
        ids = peer.rows.region(ids_at, np.uint64, n).copy()      # ours before it is checked
        out = peer.rows.region(rows_at, np.float32, n * dim).reshape(n, dim)
        return self.shard.pull_rows(rank, shard, name, ids, session=peer.session, out=out)[0]

    def _request(self, conn, req, peer: Connection) -> None:
        """A push (with the pull that follows it, under THEN_PULL), a pull or a row request,
        answered in one message."""
        then_pull = None
        if req[1] & THEN_PULL:
            then_pull = PULL_AFTER.unpack(recv_exact(conn, PULL_AFTER.size))
            req = (req[0], req[1] & ~THEN_PULL, *req[2:])
            if req[1] not in (PUSH, PUSH_ROWS):
                self._reply(conn, InvalidArgument(f"op: only a push can carry a pull, not operation {req[1]}"))
                raise ConnectionError("a pull on something other than a push")  # what follows cannot be framed
        parts = self._read_parts(conn) if req[1] in (PULL_ROWS, PUSH_ROWS) else ()
        answer = self._handle(conn, req, peer, parts=parts)
        reply = self._encode_reply(*answer)
        if then_pull is not None and answer[0] is None:
            # the pull as if it had come alone: this worker's own request, after its push
            pull = (req[0], PULL, req[2], req[3], then_pull[0], then_pull[1], req[6], 0, req[8])
            reply += self._encode_reply(*self._answer(conn, pull, peer, None, "", ()))
        conn.sendall(reply)

    def _handle(self, conn, req, peer: Connection, signature: str = "", parts=()):
        """The reply to a request. A dense payload in parts is taken whole whatever the
        answer; a connection that breaks or stalls during one is cut."""
        op, timeout_ms = req[1], req[8]
        fill = peer.push_buf
        if op in (PUSH, PUSH_ROWS, INIT) and push_slots(peer.size)[1] > 1:
            fill = Parts(conn, peer, self.shard.store, timeout_ms / 1000)
        reply = self._answer(conn, req, peer, fill, signature, parts)
        if isinstance(fill, Parts):
            fill.drain()
        return reply

    def _answer(self, conn, req, peer: Connection, fill, signature: str, parts):
        _, op, rank, shard, step, clock, num_elements, num_samples, timeout_ms = req
        try:
            if rank != peer.rank:
                raise Unauthenticated(f"rank: this connection said HELLO as worker {peer.rank}; "
                                      f"it cannot act for worker {rank}")
            if op in (PUSH, PUSH_ROWS):
                rows = self._received_rows(peer, parts) if op == PUSH_ROWS else ()
                outcome, version, message, finished = self.shard.push(
                    rank, shard, step, num_elements, "float32", num_samples, clock, fill,
                    session=peer.session, rows=rows)
                return None, outcome.value, finished, version, message
            if op == PULL_ROWS:
                return None, 0, False, self._pull_rows(peer, rank, shard, parts), ""
            if op == PULL:
                version, _, finished = self.shard.pull(
                    rank, shard, step, clock, timeout_ms / 1000,
                    session=peer.session, alive=lambda: peer_open(conn))
                return None, 0, finished, version, ""
            if op == INIT:
                already, version = self.shard.init(rank, signature, num_elements, "float32", fill,
                                                  session=peer.session)
                return None, int(already), False, version, ""
            raise InvalidArgument(f"op: unknown data-plane operation {op}")
        except RpcError as e:
            return e, 0, False, 0, ""
        except (ConnectionError, OSError):      # the client went or stalled mid-request
            raise
        except Exception as e:  # a bug: report it to the caller, keep serving
            log.exception("internal error on the data plane")
            return rpc_error_for("INTERNAL", f"{type(e).__name__}: {e}"), 0, False, 0, ""

    def _reply(self, conn, error, outcome=0, finished=False, version=0, message=""):
        conn.sendall(self._encode_reply(error, outcome, finished, version, message))

    @staticmethod
    def _encode_reply(error, outcome=0, finished=False, version=0, message="") -> bytes:
        if error is not None:
            code = CODES.index(error.code_name) if error.code_name in CODES else CODES.index("INTERNAL")
            message = str(error)
        else:
            code = 0
        data = message.encode()[:MAX_MESSAGE]
        return REPLY.pack(code, outcome, bool(finished), len(data), version) + data

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
                 token: str | None = None, session: str = "", tables: Sequence[str] = ()) -> None:
        self.label = label
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address.removeprefix("unix:"))
        self.rank, self.shard = rank, shard
        self.tables = {name: i for i, name in enumerate(tables)}   # requests name a table by index
        self.rows = RowsBuffer()
        fields = [(token or "").encode(), session.encode()]
        # A shard at its connection limit answers and hangs up before reading anything:
        # its reply is still there to read when sending fails.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(REQUEST.pack(MAGIC, HELLO, rank, shard, 0, 0, 0, 0, 0)
                              + b"".join(TOKEN_LEN.pack(len(f)) + f for f in fields))
        try:
            told, fds = self._receive_fds(2, "HELLO")
        except BaseException:
            self.sock.close()
            raise
        try:
            # our push buffer (read-write: one or two slots) and the shard's parameters (read-only)
            self.slot, slots = push_slots(size)
            if told != size or [os.fstat(fd).st_size for fd in fds] != [self.slot * slots * 4, size * 4]:
                # another version of pserver, say, whose buffers are laid out otherwise: use gRPC
                raise ConnectionError("the shard's data plane answered with the wrong buffers")
            self.maps = [mapped(fds[0], self.slot * slots * 4, True, f"{label}: push buffer"),
                         mapped(fds[1], size * 4, False, f"{label}: parameters")]
        finally:
            for fd in fds:
                os.close(fd)
        self.push_buf = np.frombuffer(self.maps[0], dtype=np.float32)
        self.params = np.frombuffer(self.maps[1], dtype=np.float32, count=size)

    def _receive_fds(self, count: int, what: str) -> tuple[int, list[int]]:
        """A reply that carries `count` descriptors: (its version field, the fds). A refusal
        (wrong token, too big a buffer) is an error reply with none."""
        msg, fds, _, _ = socket.recv_fds(self.sock, REPLY.size, count)
        code = REPLY.unpack(msg)[0] if len(msg) == REPLY.size else None
        if code == 0 and len(fds) == count:
            return REPLY.unpack(msg)[4], fds
        for fd in fds:
            os.close(fd)
        if code is None:
            raise ConnectionError(f"the shard's data plane closed the connection during {what}")
        if code == 0:
            raise ConnectionError(f"the shard's data plane answered {what} with the wrong buffers")
        n = REPLY.unpack(msg)[3]
        message = recv_exact(self.sock, n).decode(errors="replace") if n else ""
        raise rpc_error_for(CODES[code] if code < len(CODES) else "INTERNAL", f"{self.label}: {message}")

    def _send(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b"") -> None:
        if self.sock.gettimeout() != timeout + 5:      # each settimeout costs system calls
            self.sock.settimeout(timeout + 5)
        self.sock.sendall(REQUEST.pack(MAGIC, op, self.rank, self.shard, step, clock, num_elements,
                                       num_samples, int(min(timeout, 4e6) * 1000)) + tail)

    def _call(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b"",
              values: np.ndarray | None = None):
        """One request and its reply; `values`, a dense payload, go through the push buffer
        (in parts through its two slots when they are larger than one)."""
        try:
            if values is None:
                self._send(op, step, clock, num_elements, num_samples, timeout, tail)
            else:
                self._send_values(values, op, step, clock, num_samples, timeout, tail)
            return self._reply()
        except (OSError, ConnectionError) as e:
            raise Unavailable(f"{self.label}: data-plane connection lost ({e})") from None

    def _reply(self):
        """(outcome, finished, version, message) of the next reply; its error raised."""
        code, outcome, finished, n, version = REPLY.unpack(recv_exact(self.sock, REPLY.size))
        message = recv_exact(self.sock, n).decode(errors="replace") if n else ""
        if code:
            raise rpc_error_for(CODES[code] if code < len(CODES) else "INTERNAL", f"{self.label}: {message}")
        return outcome, bool(finished), version, message

    def _send_values(self, values: np.ndarray, op, step, clock, num_samples, timeout: float, tail: bytes) -> None:
        for k, a in enumerate(range(0, values.size, self.slot)):
            if k >= 2 and recv_exact(self.sock, 1) != FREE:      # the shard has copied part k - 2
                raise ConnectionError("a part's FREE expected")
            part = values[a:a + self.slot]
            np.copyto(self.push_buf[k % 2 * self.slot:][:part.size], part)
            if k == 0:
                self._send(op, step, clock, values.size, num_samples, timeout, tail)
            else:
                self.sock.sendall(READY)

    def _room(self, nbytes: int, timeout: float) -> None:
        """A rows buffer of at least `nbytes`: the shard's new one replaces ours if ours is smaller."""
        if nbytes <= self.rows.size:
            return
        try:
            self._send(ROWS_BUFFER, 0, 0, nbytes, 0, timeout)
            size, [fd] = self._receive_fds(1, "ROWS_BUFFER")
        except (OSError, ConnectionError) as e:
            raise Unavailable(f"{self.label}: data-plane connection lost ({e})") from None
        try:
            if size < nbytes:
                raise Unavailable(f"{self.label}: the shard's rows buffer of {size} bytes is smaller "
                                  f"than the {nbytes} asked")
            self.rows.replace(mapped(fd, size, True, f"{self.label}: rows buffer"))
        finally:
            os.close(fd)

    def _place(self, parts: list[tuple[str, np.ndarray, np.ndarray]],
               timeout: float) -> tuple[bytes, list[tuple[int, int]]]:
        """Write the ids of sparse parts [(table, ids, rows or gradients)] into the rows buffer;
        returns the request's tail and where each part's ids and rows sit."""
        for name, _, _ in parts:
            if name not in self.tables:
                raise InvalidArgument(f"table: the model has no sparse table '{name}' (its tables: "
                                      f"{', '.join(self.tables) or 'none'})")
        slots, end = row_layout([(ids.size, a.shape[1]) for _, ids, a in parts])
        self._room(end, timeout)
        for (_, ids, _), (ids_at, _) in zip(parts, slots):
            np.copyto(self.rows.region(ids_at, np.uint64, ids.size), ids)
        tail = PARTS.pack(len(parts)) + b"".join(PART.pack(self.tables[name], ids.size)
                                                 for name, ids, _ in parts)
        return tail, slots

    def push(self, grad: np.ndarray, step: int, num_samples: int, clock: int, timeout: float,
             rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
             then_pull: tuple[np.ndarray, int, int] | None = None):
        """Push the dense slice, and sparse rows [(table, unique ids, their gradients)];
        returns (outcome, version, finished, pulled). With then_pull = (dest, seen_version,
        clock), the pull that follows rides with the push: pulled is (version, finished)
        with dest filled, or None when that pull failed (the push was taken all the same;
        pull again on its own, which reports the error or rides it out)."""
        op, tail = PUSH, b""
        if rows:
            op, (tail, slots) = PUSH_ROWS, self._place(rows, timeout)
            for (_, _, g), (_, grads_at) in zip(rows, slots):
                np.copyto(self.rows.region(grads_at, np.float32, g.size).reshape(g.shape), g)
        if then_pull is not None:
            op, tail = op | THEN_PULL, PULL_AFTER.pack(then_pull[1], then_pull[2]) + tail
        outcome, finished, version, _ = self._call(op, step, clock, grad.size, num_samples, timeout, tail,
                                                   values=grad)
        pulled = None
        if then_pull is not None:
            try:
                _, pull_finished, pull_version, _ = self._reply()
                np.copyto(then_pull[0], self.params)
                pulled = (pull_version, pull_finished)
            except RpcError as e:
                log.debug("%s: the pull after a push failed (%s); pulling on its own", self.label, e)
            except (OSError, ConnectionError):
                self.sock.close()     # unframed now: the next call fails over (UNAVAILABLE) and rejoins
        return outcome, version, finished, pulled

    def pull_rows(self, table: str, ids: np.ndarray, out: np.ndarray, timeout: float) -> int:
        """Rows of `table` for `ids` (all on this shard) into `out` (len(ids), dim); the version."""
        tail, [(_, rows_at)] = self._place([(table, ids, out)], timeout)
        _, _, version, _ = self._call(PULL_ROWS, 0, 0, ids.size, 0, timeout, tail)
        np.copyto(out, self.rows.region(rows_at, np.float32, out.size).reshape(out.shape))
        return version

    def init(self, values: np.ndarray, signature: str, timeout: float) -> bool:
        """Initial values through shared memory; True if the shard already had values."""
        already, _, _, _ = self._call(INIT, 0, 0, values.size, 0, timeout,
                                      SIGNATURE.pack(signature.encode()), values=values)
        return bool(already)

    def pull_into(self, dest: np.ndarray, seen_version: int, clock: int, timeout: float):
        _, finished, version, _ = self._call(PULL, seen_version, clock, dest.size, 0, timeout)
        np.copyto(dest, self.params)
        return version, finished

    def close(self) -> None:
        self.sock.close()
        self.push_buf = self.params = None
        self.rows.replace(None)
        for m in self.maps:
            try:
                m.close()
            except BufferError:       # a view is still alive somewhere; the GC will unmap
                pass


def connect(address: str, expected_host: str, rank: int, shard: int, size: int,
            label: str, token: str | None = None, session: str = "",
            tables: Sequence[str] = ()) -> DataPlaneChannel | None:
    """A channel if the shard is on this host and answers; None means: use gRPC."""
    if not address or not supported() or size == 0 or expected_host != host_id():
        return None
    try:
        return DataPlaneChannel(address, rank, shard, size, label, token, session, tables)
    except (OSError, ConnectionError, PServerError) as e:
        log.info("%s: data plane unavailable (%s); using gRPC streams", label, e)
        return None
