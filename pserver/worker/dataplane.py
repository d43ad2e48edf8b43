"""The data plane's worker side: a connection to one shard's Unix socket that pushes and
pulls through shared memory. The format both ends share is pserver.wire.frames.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Sequence

import numpy as np

from pserver.errors import InvalidArgument, PServerError, RpcError, Unavailable
from pserver.wire.frames import (
    FREE,
    HELLO,
    INIT,
    LEASE,
    LEASE_AT,
    MAGIC,
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
    SIGNATURE,
    SUMS_LEN,
    THEN_PULL,
    TOKEN_LEN,
    WITH_LEASE,
    WITH_SUMS,
    RowsBuffer,
    host_id,
    mapped,
    push_slots,
    recv_exact,
    reply_error,
    row_layout,
    supported,
)

log = logging.getLogger("pserver.dataplane")


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
            self.slot, self.slots = push_slots(size)
            if told != size or [os.fstat(fd).st_size for fd in fds] != [self.slot * self.slots * 4, size * 4]:
                # another version of pserver, say, whose buffers are laid out otherwise: use gRPC
                raise ConnectionError("the shard's data plane answered with the wrong buffers")
            self.maps = [mapped(fds[0], self.slot * self.slots * 4, True, f"{label}: push buffer"),
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
            return REPLY.unpack(msg)[5], fds
        for fd in fds:
            os.close(fd)
        if code is None:
            raise ConnectionError(f"the shard's data plane closed the connection during {what}")
        if code == 0:
            raise ConnectionError(f"the shard's data plane answered {what} with the wrong buffers")
        _, _, _, kind, n, _ = REPLY.unpack(msg)
        message = recv_exact(self.sock, n).decode(errors="replace") if n else ""
        raise reply_error(code, kind, f"{self.label}: {message}")

    def _send(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b"") -> None:
        if self.sock.gettimeout() != timeout + 5:      # each settimeout costs system calls
            self.sock.settimeout(timeout + 5)
        self.sock.sendall(REQUEST.pack(MAGIC, op, self.rank, self.shard, step, clock, num_elements,
                                       num_samples, int(min(timeout, 4e6) * 1000)) + tail)

    def _call(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b"",
              values: np.ndarray | None = None):
        """One request and its reply (_ask, then _answer)."""
        self._ask(op, step, clock, num_elements, num_samples, timeout, tail, values)
        return self._answer()

    def _ask(self, op, step, clock, num_elements, num_samples, timeout: float, tail: bytes = b"",
             values: np.ndarray | None = None) -> None:
        """Send one request; `values`, a dense payload, go through the push buffer (in parts
        through its two slots when they are larger than one)."""
        try:
            if values is None:
                self._send(op, step, clock, num_elements, num_samples, timeout, tail)
            else:
                self._send_values(values, op, step, clock, num_samples, timeout, tail)
        except (OSError, ConnectionError) as e:
            raise Unavailable(f"{self.label}: data-plane connection lost ({e})") from None

    def _answer(self, raw: bool = False):
        """The reply to the request sent (_reply), its error raised."""
        try:
            return self._reply(raw)
        except (OSError, ConnectionError) as e:
            raise Unavailable(f"{self.label}: data-plane connection lost ({e})") from None

    def _reply(self, raw: bool = False):
        """(outcome, finished, version, message) of the next reply, the message as bytes when
        `raw` (a LEASE reply's LeaseDataReply); its error raised."""
        code, outcome, finished, kind, n, version = REPLY.unpack(recv_exact(self.sock, REPLY.size))
        data = recv_exact(self.sock, n) if n else b""
        if code:
            raise reply_error(code, kind, f"{self.label}: {data.decode(errors='replace')}")
        return outcome, bool(finished), version, data if raw else data.decode(errors="replace")

    def lease(self, request: bytes, timeout: float) -> bytes:
        """A serialized LeaseDataRequest (at most MAX_MESSAGE bytes) to shard 0; the serialized
        LeaseDataReply."""
        self._ask(LEASE, 0, 0, len(request), 0, timeout, request)
        return self._answer(raw=True)[3]

    def _send_values(self, values: np.ndarray, op, step, clock, num_samples, timeout: float,
                     tail: bytes) -> None:
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
             then_pull: tuple[np.ndarray, int, int] | None = None, lease: tuple | None = None):
        """Push the dense slice, and sparse rows [(table, unique ids, their gradients)];
        returns (outcome, version, finished, pulled). With then_pull = (dest, seen_version,
        clock), the pull that follows rides with the push: pulled is (version, finished)
        with dest filled, or None when that pull failed (the push was taken all the same;
        pull again on its own, which reports the error or rides it out). `lease`: the data
        lease's (epoch, chunk, batch, loss x samples, samples classed right, metric sums) this
        push carries (shard 0). In two halves, send_push and take_push, which a worker calls
        apart to send to every shard before it waits on any."""
        self.send_push(grad, step, num_samples, clock, timeout, rows, then_pull, lease)
        return self.take_push(then_pull)

    def send_push(self, grad: np.ndarray, step: int, num_samples: int, clock: int, timeout: float,
                  rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                  then_pull: tuple[np.ndarray, int, int] | None = None, lease: tuple | None = None) -> None:
        """push's request, sent: its values in the push buffer, its rows in the rows buffer."""
        op, tail = PUSH, b""
        if rows:
            op, (tail, slots) = PUSH_ROWS, self._place(rows, timeout)
            for (_, _, g), (_, grads_at) in zip(rows, slots):
                np.copyto(self.rows.region(grads_at, np.float32, g.size).reshape(g.shape), g)
        if lease is not None:
            *at, sums = lease
            op, tail = op | WITH_LEASE, LEASE_AT.pack(*at) + _sums(sums) + tail
            op |= WITH_SUMS if len(sums) else 0
        if then_pull is not None:
            op, tail = op | THEN_PULL, PULL_AFTER.pack(then_pull[1], then_pull[2]) + tail
        self._ask(op, step, clock, grad.size, num_samples, timeout, tail, values=grad)

    def take_push(self, then_pull: tuple[np.ndarray, int, int] | None = None):
        """push's replies to the request send_push sent (the same then_pull): push's result."""
        outcome, finished, version, _ = self._answer()
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


def _sums(sums) -> bytes:
    """A leased push's metric sums as WITH_SUMS sends them (nothing when there are none)."""
    return SUMS_LEN.pack(len(sums)) + np.asarray(sums, "<f8").tobytes() if len(sums) else b""


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
