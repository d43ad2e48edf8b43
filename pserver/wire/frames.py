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
A worker's ask for a data lease, and at an epoch's end for the chief's logs, is a small
protobuf message each way (LEASE): over gRPC it took 1.4 ms on a loaded 2-core machine, over the
socket 0.3 ms, and the other workers' steps wait for it.
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

This module is the format that both ends share (the request and reply headers, the shared
memory's seals and mapping); the shard's side is pserver.server.dataplane, the worker's
pserver.worker.dataplane.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import socket
import struct

import numpy as np

from pserver.errors import KINDS as ERROR_KINDS
from pserver.errors import InvalidArgument, RpcError, rpc_error_for

MAGIC = b"PSD1"
HELLO, PUSH, PULL, INIT, PULL_ROWS, PUSH_ROWS, ROWS_BUFFER = 1, 2, 3, 4, 5, 6, 7
# LeaseData on shard 0 (a data lease, the chief's epoch logs): num_elements is the length of the
# serialized LeaseDataRequest that follows the header (at most MAX_MESSAGE; a larger one goes
# over gRPC); a reply that is OK carries the serialized LeaseDataReply as its message.
LEASE = 8
# Set on PUSH or PUSH_ROWS: the pull that follows the push rides with it. Its seen_version
# and clock come right after the header (before any other tail); the shard answers with
# the push's reply and then, if the push was taken, the pull's, in one message.
THEN_PULL = 0x40
PULL_AFTER = struct.Struct("<qq")
# Set on PUSH or PUSH_ROWS: the push carries a data lease's progress (shard 0's coordinator:
# epoch, chunk, and the epoch's index of the batch it carries; then what the batch's step
# measured: its loss times its samples and the samples classed right), right after PULL_AFTER
# if any.
WITH_LEASE = 0x20
LEASE_AT = struct.Struct("<qqqdd")
# Set with WITH_LEASE when the batch's step measured the compiled metrics' sums too
# (TensorHeader.lease_metric_sums): their number, then as many float64, right after LEASE_AT.
WITH_SUMS = 0x10
SUMS_LEN = struct.Struct("<I")
MAX_METRIC_SUMS = 4096        # AUC's state is 4 per threshold: 200 thresholds take 800
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
# status (index in CODES; 0 = OK), outcome, finished, error kind (index in KINDS; 0 = none),
# message length, version. The kind's byte was padding before: an older peer sends 0 there
# and ignores what it receives there, so both read the same status and message as before.
REPLY = struct.Struct("<BBBBIq")
CODES = ["OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "UNAVAILABLE",
         "DEADLINE_EXCEEDED", "INTERNAL", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED"]
KINDS = ["", *ERROR_KINDS]     # pserver.errors.KINDS, which is append only, after "no kind"
MAX_MESSAGE = 64 * 1024
# A dense payload larger than this many float32 travels in parts through two slots this size.
PART_ELEMENTS = 1 << 19
READY, FREE = b"R", b"F"   # part k is in its slot / slot k % 2 may be written again
HELLO_TIMEOUT = 10.0      # seconds a new connection may take to say HELLO before it is cut
# Seals from <linux/fcntl.h> (Python's fcntl module has no F_SEAL_FUTURE_WRITE, Linux >= 5.1).
SEAL_SEAL, SEAL_SHRINK, SEAL_GROW, SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x10
SIZE_SEALS = SEAL_SHRINK | SEAL_GROW
SOCKET_NAME = re.compile(r"pserver-(\d+)-[\w-]+\.sock(\.new)?")


def error_codes(error: RpcError) -> tuple[int, int]:
    """(status, kind) of a reply that refuses with `error`: their indices in CODES and KINDS
    (a status code the data plane has no index for goes as INTERNAL, an unknown kind as none)."""
    code = CODES.index(error.code_name) if error.code_name in CODES else CODES.index("INTERNAL")
    return code, KINDS.index(error.kind) if error.kind in KINDS else 0


def reply_error(code: int, kind: int, message: str) -> RpcError:
    """The error of a refusing reply: its status and kind bytes (indices into CODES and KINDS;
    out of range: INTERNAL, no kind) and its message."""
    return rpc_error_for(CODES[code] if code < len(CODES) else "INTERNAL", message,
                         KINDS[kind] if kind < len(KINDS) else "")


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
