"""The data plane's shard side: the Unix socket it listens on, and one thread per
connection that answers HELLO, pushes and pulls with the very same `Shard.push` /
`Shard.pull` as the gRPC servicer. The format both ends share is pserver.wire.frames.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import select
import socket
import stat
import tempfile
import threading

import numpy as np
from google.protobuf.message import DecodeError

from pserver._proto import pserver_pb2 as pb
from pserver.errors import ConfigError, InvalidArgument, RpcError, Unauthenticated, rpc_error_for
from pserver.records import PushRequest
from pserver.wire import frames, security
from pserver.wire.frames import (
    FREE,
    HELLO,
    HELLO_TIMEOUT,
    INIT,
    LEASE,
    LEASE_AT,
    MAGIC,
    MAX_MESSAGE,
    MAX_METRIC_SUMS,
    MAX_SESSION,
    PART,
    PARTS,
    PULL,
    PULL_AFTER,
    PULL_ROWS,
    PUSH,
    PUSH_ROWS,
    READY,
    REPLY,
    REQUEST,
    ROWS_BUFFER,
    SEAL_FUTURE_WRITE,
    SIGNATURE,
    SIZE_SEALS,
    SOCKET_NAME,
    SUMS_LEN,
    THEN_PULL,
    TOKEN_LEN,
    WITH_LEASE,
    WITH_SUMS,
    RowsBuffer,
    connection_limit,
    push_slots,
    recv_exact,
    require_seals,
    row_layout,
    sealed_memfd,
)

log = logging.getLogger("pserver.dataplane")


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
def _acts_as(peer: "Connection", rank: int) -> None:
    """A request names the rank its connection said HELLO as, or is refused."""
    if rank != peer.rank:
        raise Unauthenticated(f"rank: this connection said HELLO as worker {peer.rank}; "
                              f"it cannot act for worker {rank}")


def _refusal(e: Exception) -> RpcError:
    """What a request that raised `e` is answered: its RpcError, or INTERNAL for a bug (logged:
    the shard keeps serving). Without its traceback: that holds a refused push's frames, and with
    them its arrays, for as long as the error lives (until a garbage collection, measured: about
    3.5 MiB kept per refused 100,000-row push)."""
    if isinstance(e, RpcError):
        return e.with_traceback(None)
    log.exception("internal error on the data plane")
    return rpc_error_for("INTERNAL", f"{type(e).__name__}: {e}")


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
        self.accepter = threading.Thread(target=self._accept, name="dataplane-accept", daemon=True)
        self.accepter.start()

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            workers = self.shard.members.num_workers
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
                elif req[1] == LEASE:
                    self._lease(conn, req, peer)
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
            socket.send_fds(conn, [REPLY.pack(0, 0, 0, 0, 0, store.size)], [fd, store.params_fd])
        finally:
            os.close(fd)                                        # the mapping stays
        return Connection(req[2], session, np.frombuffer(mm, dtype=np.float32), store.size)

    def _read_parts(self, conn) -> list[tuple[int, int]]:
        """The [(table index, number of ids)] that follow a sparse request's header. A
        request has at most one part per table: more is refused before it is read, and the
        connection closed (what follows could not be framed)."""
        (k,) = PARTS.unpack(recv_exact(conn, PARTS.size))
        tables = len(self.shard.table_dims())
        if k > tables:
            self._reply(conn, InvalidArgument(f"sparse: {k} parts in one request; the model has "
                                              f"{tables} sparse tables"))
            raise ConnectionError("too many parts")
        return [PART.unpack(recv_exact(conn, PART.size)) for _ in range(k)] if k else []

    def _grow_rows(self, conn, req, peer: Connection) -> None:
        """A new rows buffer of at least the bytes asked (num_elements) and twice the old one,
        within frames.ROWS_BUFFER_MAX and --max-inflight-mb; its fd goes with the reply."""
        wanted, limit = req[6], min(frames.ROWS_BUFFER_MAX, self.shard.limits.max_inflight_bytes)
        if not 0 < wanted <= limit:
            self._reply(conn, InvalidArgument(f"rows buffer: {wanted} bytes asked; a connection's rows "
                                              f"buffer holds 1 to {limit} bytes "
                                              "(larger requests go over gRPC)"))
            return
        size = max(wanted, min(max(2 * peer.rows.size, 1 << 20), limit))
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE     # the limit is whole MiB: still within it
        fd, mm = sealed_memfd(f"pserver-rows-{self.tag}", size, clients_write=True)
        peer.rows.replace(mm)              # before the reply: once told, the client may count on it
        try:
            socket.send_fds(conn, [REPLY.pack(0, 0, 0, 0, 0, size)], [fd])
        finally:
            os.close(fd)                                        # the mapping stays

    def _tables(self, parts: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """[(table name, number of ids, dim)] of a request's parts, or InvalidArgument."""
        dims, out = self.shard.table_dims(), []
        for index, n in parts:
            if index >= len(dims):
                raise InvalidArgument(f"table: index {index}; the model has {len(dims)} sparse tables")
            name, dim = dims[index]
            out.append((name, n, dim))
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

    @staticmethod
    def _sums(conn, flags: int) -> tuple:
        """A leased push's metric sums (WITH_SUMS), or none."""
        if not flags & WITH_SUMS:
            return ()
        (n,) = SUMS_LEN.unpack(recv_exact(conn, SUMS_LEN.size))
        if n > MAX_METRIC_SUMS:       # no client sends that many: the stream is not one to read on
            raise ConnectionError(f"lease_metric_sums: {n} values; at most {MAX_METRIC_SUMS}")
        return tuple(np.frombuffer(recv_exact(conn, 8 * n), "<f8").tolist())

    def _request(self, conn, req, peer: Connection) -> None:
        """A push (with the pull that follows it, under THEN_PULL), a pull or a row request,
        answered in one message."""
        then_pull = lease = None
        if req[1] & THEN_PULL:
            then_pull = PULL_AFTER.unpack(recv_exact(conn, PULL_AFTER.size))
        if req[1] & WITH_LEASE:
            lease = (*LEASE_AT.unpack(recv_exact(conn, LEASE_AT.size)), self._sums(conn, req[1]))
        if req[1] & (THEN_PULL | WITH_LEASE):
            req = (req[0], req[1] & ~(THEN_PULL | WITH_LEASE | WITH_SUMS), *req[2:])
            if req[1] not in (PUSH, PUSH_ROWS):
                what = "a pull" if then_pull is not None else "a data lease"
                self._reply(conn, InvalidArgument(f"op: only a push can carry {what}, "
                                                  f"not operation {req[1]}"))
                # what follows cannot be framed
                raise ConnectionError("a pull or a lease on something other than a push")
        parts = self._read_parts(conn) if req[1] in (PULL_ROWS, PUSH_ROWS) else ()
        answer = self._handle(conn, req, peer, parts=parts, lease=lease)
        reply = self._encode_reply(*answer)
        if then_pull is not None and answer[0] is None:
            # the pull as if it had come alone: this worker's own request, after its push
            pull = (req[0], PULL, req[2], req[3], then_pull[0], then_pull[1], req[6], 0, req[8])
            reply += self._encode_reply(*self._answer(conn, pull, peer, None, "", ()))
        conn.sendall(reply)

    def _handle(self, conn, req, peer: Connection, signature: str = "", parts=(), lease=None):
        """The reply to a request. A dense payload in parts is taken whole whatever the
        answer; a connection that breaks or stalls during one is cut."""
        op, timeout_ms = req[1], req[8]
        fill = peer.push_buf
        if op in (PUSH, PUSH_ROWS, INIT) and push_slots(peer.size)[1] > 1:
            fill = Parts(conn, peer, self.shard.store, timeout_ms / 1000)
        reply = self._answer(conn, req, peer, fill, signature, parts, lease)
        if isinstance(fill, Parts):
            fill.drain()
        return reply

    def _answer(self, conn, req, peer: Connection, fill, signature: str, parts, lease=None):
        _, op, rank, shard, step, clock, num_elements, num_samples, timeout_ms = req
        try:
            _acts_as(peer, rank)
            if op in (PUSH, PUSH_ROWS):
                rows = self._received_rows(peer, parts) if op == PUSH_ROWS else ()
                outcome, version, message, finished = self.shard.push(PushRequest(
                    rank, shard, step, num_elements, "float32", num_samples, clock, fill,
                    session=peer.session, rows=rows, lease=lease and lease[:3],
                    trained=lease[3:] if lease else (0.0, 0.0, ())))
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
        except (ConnectionError, OSError):      # the client went or stalled mid-request
            raise
        except Exception as e:
            return _refusal(e), 0, False, 0, ""

    def _lease(self, conn, req, peer: Connection) -> None:
        """LeaseData (Shard.answer_lease) as this connection's rank and session; a request longer
        than MAX_MESSAGE is refused, and the connection cut (what follows cannot be framed)."""
        rank, size = req[2], req[6]
        if size > MAX_MESSAGE:
            self._reply(conn, InvalidArgument(f"lease: a request of {size} bytes; at most {MAX_MESSAGE} "
                                              f"go over the data plane"))
            raise ConnectionError("a lease request too long")
        payload = recv_exact(conn, size) if size else b""
        try:
            _acts_as(peer, rank)
            try:
                request = pb.LeaseDataRequest.FromString(payload)
            except DecodeError as e:
                raise InvalidArgument(f"lease: not a LeaseDataRequest ({e})") from None
            _acts_as(peer, request.rank)
            request.session = peer.session          # the connection's own, checked at HELLO
            data = self.shard.answer_lease(request).SerializeToString()
        except Exception as e:
            self._reply(conn, _refusal(e))
            return
        conn.sendall(REPLY.pack(0, 0, False, 0, len(data), 0) + data)

    def _reply(self, conn, error, outcome=0, finished=False, version=0, message=""):
        conn.sendall(self._encode_reply(error, outcome, finished, version, message))

    @staticmethod
    def _encode_reply(error, outcome=0, finished=False, version=0, message="") -> bytes:
        code, kind = (0, 0) if error is None else frames.error_codes(error)
        if error is not None:
            message = str(error)
        data = message.encode()[:MAX_MESSAGE]
        return REPLY.pack(code, outcome, bool(finished), kind, len(data), version) + data

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
            # shutdown() first: close() alone leaves the accept thread blocked in accept() for
            # good (Linux does not wake it), one leaked thread per data plane ever closed.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)
