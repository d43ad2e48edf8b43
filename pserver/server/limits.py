"""Bounds on what clients can make a shard hold: threads, parked pulls, streams, bytes.

The gRPC server runs every call on one pool of `--threads` threads, and a call holds its
thread while it waits (a sync pull parks until the step completes; a push stream holds one
while its chunks trickle in). Unbounded, parked pulls can take every thread, and the pushes
that would complete the step, or a Status, never run. So the pool is split (docs/semantics.md, "Bounds"):

    pulls    at most PULL_SHARE of the threads park in pulls (and 2 per rank)
    streams  push/init streams being received: the rest less RESERVED, fewer when
             their buffers would pass --max-inflight-mb (and 2 per rank)
    control  RESERVED threads no pull or stream can take: Register, Status, Heartbeat,
             Leave, Checkpoint (at most CHECKPOINT_CALLS of those wait at once)

A call past its share is refused at once with RESOURCE_EXHAUSTED naming the bound (the
worker retries with backoff), so a waiting call never holds what the call that would
release it needs. A stream that delivers no chunk for --step-timeout is cancelled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

from pserver.errors import ResourceExhausted

RESERVED = 8               # threads kept for control calls
PULL_SHARE = 0.6           # of the threads not reserved
PER_RANK = 2               # parked pulls, and streams, of one rank at a time (2: a retry may overlap)
CHECKPOINT_CALLS = 4       # Checkpoint calls waiting for a write at once


def pool_threads(requested: int, num_workers: int) -> int:
    """Threads for the gRPC pool: enough for every worker's parked pull and push plus the
    reserve, and never fewer than asked."""
    return max(requested, 2 * num_workers + RESERVED + 4)


@dataclass
class _Stream:
    cancel: object                   # the call's cancel(); run by the idle watchdog
    last: float = field(default_factory=time.monotonic)


class Waiter:
    """What ShardStore.wait_for needs of a waiting call: `park` once before it first
    waits (may refuse), then `alive` every tick (False: the caller went away)."""

    def __init__(self, limits: "Limits", rank: int, alive) -> None:
        self.limits, self.rank, self.alive, self.parked = limits, rank, alive, False

    def park(self) -> None:
        self.limits._park(self.rank)
        self.parked = True


class Limits:
    def __init__(self, threads: int, max_inflight_bytes: int, idle_timeout: float,
                 counters, inflight_flag: str = "--max-inflight-mb") -> None:
        spare = max(threads - RESERVED, 2)
        self.max_pulls = max(1, int(spare * PULL_SHARE))
        self.max_streams = max(1, spare - self.max_pulls)
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight_flag = inflight_flag    # what set the bound, for the refusals' text
        self.idle_timeout = idle_timeout
        self.counters = counters
        self._lock = threading.Lock()
        self._pulls: dict[int, int] = {}              # rank -> parked pulls
        self._streams: dict[int, _Stream] = {}        # id -> stream being received
        self._stream_ranks: dict[int, int] = {}       # rank -> streams past their header
        self._checkpoints = 0
        self._next_id = 0

    # --- parked pulls -----------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self, rank: int, alive):
        """A pull's Waiter: it takes a parking slot only if the pull must wait (a pull whose
        version is there never needs one, so refused pullers always get the step they
        wait for), and gives it back when the pull ends."""
        waiter = Waiter(self, rank, alive)
        try:
            yield waiter
        finally:
            if waiter.parked:
                with self._lock:
                    self._pulls[rank] -= 1

    def _park(self, rank: int) -> None:
        with self._lock:
            total, mine = sum(self._pulls.values()), self._pulls.get(rank, 0)
            if total >= self.max_pulls or mine >= PER_RANK:
                self._refuse(f"pulls: {total} pulls wait on this shard ({mine} of worker {rank}); "
                             f"the bound is {self.max_pulls} (from --threads) and {PER_RANK} per worker")
            self._pulls[rank] = mine + 1

    def parked_pulls(self) -> int:
        with self._lock:
            return sum(self._pulls.values())

    # --- streams (push, init) ---------------------------------------------------------
    def stream_slots(self, stream_bytes: int) -> int:
        by_bytes = self.max_inflight_bytes // max(stream_bytes, 1)
        return max(1, min(self.max_streams, by_bytes))

    @contextlib.contextmanager
    def stream(self, cancel, stream_bytes: int):
        """A push or init stream, counted from its first byte: one stalled before its
        header holds a slot too, until the watchdog cancels it."""
        with self._lock:
            slots = self.stream_slots(stream_bytes)
            if len(self._streams) >= slots:
                self._refuse(f"streams: {len(self._streams)} push/init streams are being received "
                             f"and the bound is {slots} ({self.max_streams} from --threads, "
                             f"{self.max_inflight_bytes >> 20} MiB of in-flight gradients at "
                             f"{stream_bytes} bytes each, {self.inflight_flag})")
            key, self._next_id = self._next_id, self._next_id + 1
            stream = self._streams[key] = _Stream(cancel)
        try:
            yield stream
        finally:
            with self._lock:
                del self._streams[key]

    @contextlib.contextmanager
    def stream_rank(self, rank: int):
        """Once the header names the rank: at most PER_RANK streams of one worker."""
        with self._lock:
            mine = self._stream_ranks.get(rank, 0)
            if mine >= PER_RANK:
                self._refuse(f"streams: worker {rank} already has {mine} push/init streams in "
                             f"flight on this shard; the bound is {PER_RANK} per worker")
            self._stream_ranks[rank] = mine + 1
        try:
            yield
        finally:
            with self._lock:
                self._stream_ranks[rank] -= 1

    @staticmethod
    def progress(stream: _Stream, chunks):
        """Pass a stream's messages through, noting when each arrived."""
        for chunk in chunks:
            stream.last = time.monotonic()
            yield chunk

    def cancel_idle(self) -> int:
        """Cancel streams that delivered nothing for idle_timeout; returns how many."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s in self._streams.values() if now - s.last > self.idle_timeout]
        for s in idle:
            s.last = now                 # cancel once; the handler frees the slot as it ends
            s.cancel()
        return len(idle)

    # --- checkpoint calls -------------------------------------------------------------
    @contextlib.contextmanager
    def checkpoint_call(self):
        with self._lock:
            if self._checkpoints >= CHECKPOINT_CALLS:
                self._refuse(f"checkpoint: {self._checkpoints} Checkpoint calls already wait "
                             f"for a write on this shard; the bound is {CHECKPOINT_CALLS}")
            self._checkpoints += 1
        try:
            yield
        finally:
            with self._lock:
                self._checkpoints -= 1

    def _refuse(self, why: str) -> None:
        self.counters.add("requests_refused_busy")
        raise ResourceExhausted(why)
