"""Training from a stream: a file of Criteo-style records that grows while the job trains, followed
as `tail -F` follows one (`--dataset stream:PATH`).

Offsets are line numbers. Batch g of the stream is lines g * B .. (g + 1) * B - 1 (B = --batch-size),
the same lines on every worker whatever has arrived so far, so shard 0's coordinator leases them as it
leases a file's batches (pserver/server/coordinator.py): a window of `window_batches` batches is one
of its epochs (window w holds stream batches w * W .. (w + 1) * W - 1), handed out in order, chunk by
chunk. A worker that dies returns the rest of its chunk, which the next worker trains; checkpoints
hold the coordinator's state, so a restart goes on from the offsets it recorded. `--epochs N` trains
N windows and ends; a worker waits for the lines of its batch (polling the file), and a stop signal
ends the wait.

Each window's pushes carry what their step measured before the update (the loss, the samples classed
right, the AUC's sums): the window's progressive validation metrics, "predict before train", which
the chief prints at each window's end. The stream has no held-out test set.

Lines that do not parse are skipped, counted, and the first few named with their line numbers; they
never stop the job. The file may only grow: one that shrinks (truncated, or replaced by a shorter
one) is refused with the offset the job had reached, since its line numbers no longer name the
events they named.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

from pserver.data import criteo
from pserver.data.dataset import check_int
from pserver.errors import ConfigError, DataError

DEFAULT_WINDOW_BATCHES = 100
POLL_SECONDS = 0.02         # how often a waiting worker looks at the file again
SCAN_BYTES = 16 << 20       # read this many new bytes at a time while counting lines
WAITING_SAY_AFTER = 5.0     # a wait longer than this is said once (then every minute)


class Follower:
    """Where each batch of B lines starts in a growing file: `bounds[g]` is the byte offset of line
    g * B. New bytes are scanned for newlines as they arrive; a line counts once its newline is
    written, so a batch is complete once line (g + 1) * B - 1 is."""

    def __init__(self, path: str, lines_per_batch: int, poll: float = POLL_SECONDS) -> None:
        check_int("--batch-size", lines_per_batch, 1)
        self.path, self.lines_per_batch, self.poll = path, lines_per_batch, poll
        self.bounds = [0]
        self.scanned = 0          # bytes of the file counted so far
        self.pending = 0          # complete lines after bounds[-1]

    def scan(self) -> int:
        """Count the lines written since the last scan; the batches complete so far."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = None
        except OSError as e:
            raise DataError(f"stream {self.path}: cannot read it ({e.strerror or e})") from None
        if size is None:
            if self.scanned:
                raise DataError(f"stream {self.path}: the file is gone after {self.scanned:,} bytes "
                                f"(line offset {self.lines():,}); the job's offsets name its lines")
            return 0
        if size < self.scanned:
            raise DataError(f"stream {self.path}: the file shrank to {size:,} bytes from the "
                            f"{self.scanned:,} "
                            f"already read (line offset {self.lines():,}): a stream file may only grow; "
                            f"its line numbers are the job's offsets")
        if size > self.scanned:
            with open(self.path, "rb") as f:
                f.seek(self.scanned)
                while self.scanned < size:
                    buf = f.read(min(SCAN_BYTES, size - self.scanned))
                    if not buf:
                        break
                    self._count(np.frombuffer(buf, np.uint8), self.scanned)
                    self.scanned += len(buf)
        return len(self.bounds) - 1

    def _count(self, buf: np.ndarray, at: int) -> None:
        ends = np.flatnonzero(buf == 10) + at + 1     # where the line after each newline starts
        need = self.lines_per_batch - self.pending     # newlines until the next batch is complete
        cuts = ends[need - 1::self.lines_per_batch]
        self.bounds.extend(int(c) for c in cuts)
        self.pending = (self.pending + len(ends)) % self.lines_per_batch

    def lines(self) -> int:
        """Complete lines counted so far."""
        return (len(self.bounds) - 1) * self.lines_per_batch + self.pending

    def wait(self, g: int, say=None) -> tuple[int, int]:
        """Batch g's bytes [start, end), once all its lines are written (polling the file)."""
        began, next_say = time.monotonic(), WAITING_SAY_AFTER
        while self.scan() <= g:
            waited = time.monotonic() - began
            if say is not None and waited >= next_say:
                say(f"stream {self.path}: waiting for lines {g * self.lines_per_batch + 1:,} to "
                    f"{(g + 1) * self.lines_per_batch:,} ({self.lines():,} written so far)")
                next_say = waited + 60.0
            time.sleep(self.poll)
        return self.bounds[g], self.bounds[g + 1]


class StreamBatches:
    """A stream's batches as shard 0's coordinator numbers them: window `epoch`'s batch b is stream
    batch epoch * num_batches + b. Chunks are handed out in order (`in_order`): the stream is read
    as it arrives, not shuffled."""

    in_order = True

    def __init__(self, data: StreamFile, batch_size: int, window_batches: int, say=None) -> None:
        check_int("--window-batches", window_batches, 1)
        self.path, self.batch_size = data.path, batch_size
        self.num_batches = window_batches
        self.follower = Follower(data.path, batch_size)
        key = f"{os.path.basename(data.path)}:{batch_size}:{window_batches}"
        self.fingerprint = "stream:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        self.malformed, self.reported = 0, 0
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    def batch(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        g = epoch * self.num_batches + b
        start, end = self.follower.wait(g, self.say)
        with open(self.path, "rb") as f:
            f.seek(start)
            text = f.read(end - start)
        first = g * self.batch_size
        block = criteo.parse_block(np.frombuffer(text, np.uint8), first, start)
        for k in np.flatnonzero(~block.ok):
            self.malformed += 1
            if self.reported < criteo.REPORTED_LINES:
                self.reported += 1
                self.say(f"warning: stream {self.path} line {first + int(k) + 1}: "
                         f"{criteo._why(block, int(k))}; skipped (counted)")
        return block.x[block.ok], block.labels[block.ok]


class StreamFile:
    """What the worker loop uses of a stream (as of a dataset): no test set (the metrics are
    progressive), batches leased from shard 0 only."""

    num_classes = 2
    sample_shape = ()
    x_test = None
    y_test = None
    num_test = 0
    stream = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = f"stream:{path}"

    def steps(self, num_workers: int, batch_size: int) -> int:
        return 0                      # no end known

    def fit(self, model):
        return self

    def warm_up_batch(self, batch_size: int) -> None:
        return None                   # the first step warms up (no line is read before it is leased)

    def epoch(self, *args, **kwargs):
        raise ConfigError(f"--dataset {self.name}: a stream is read in offsets leased by shard 0 "
                          f"(--data-assignment leases, the default), not in per-rank slices")

    def leased_batches(self, batch_size: int, seed: int, chunk_batches: int, cache_dir: str | None = None,
                       shuffle: bool = True, window_batches: int = DEFAULT_WINDOW_BATCHES) -> StreamBatches:
        return StreamBatches(self, batch_size, window_batches)

    def describe(self) -> str:
        return (f"dataset {self.name}: Criteo-style lines followed as the file grows, leased by line "
                f"offset, {criteo._features(None)}; metrics progressive (each batch measured "
                f"before it is trained), no test set")


def open_stream(spec: str) -> StreamFile:
    """`stream:PATH`: the file may not exist yet (the worker waits for it)."""
    path = spec.split(":", 1)[1]
    if not path:
        raise ConfigError("--dataset stream:PATH: the path is empty (e.g. stream:events.tsv)")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        raise ConfigError(f"--dataset stream:{path}: is a directory; give the file the events are "
                          f"appended to")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        # nothing (pserver ingest included) can write the file there: the worker waited for ever
        raise ConfigError(f"--dataset stream:{path}: directory {parent} does not exist; the file may "
                          f"appear later, its directory must be there (create it, or check the path)")
    return StreamFile(path)


# ---------------------------------------------------------------- planted click events

EVENT_ADS, EVENT_SITES = 1000, 100     # the two fields a planted event's click depends on


def event_lines(first: int, n: int, seed: int = 0) -> list[str]:
    """Events first .. first + n - 1 of a planted click stream, as Criteo TSV lines (a label, 13
    integer and 26 hex fields): event i is a pure function of (seed, i). Its click is drawn with
    probability sigmoid(-1 + a[ad] + s[site]), ad and site its first two categorical values, a and
    s fixed per seed (N(0, 1)); its first integer field is i itself, so a line names its event.
    For the tests, the streaming guide and bench/freshness.py: a stream a model can learn."""
    from pserver.sparse.hashing import splitmix64
    check_int("first", first, 0)
    check_int("n", n, 0)
    base = np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
    i = np.arange(first, first + n, dtype=np.uint64)
    h = [splitmix64(i * np.uint64(4) + np.uint64(k) + base) for k in range(3)]
    ad = (h[0] % np.uint64(EVENT_ADS)).astype(np.int64)
    site = (h[1] % np.uint64(EVENT_SITES)).astype(np.int64)
    weights = np.random.default_rng([seed, 0x5EED]).normal(0.0, 1.0, EVENT_ADS + EVENT_SITES)
    p = 1.0 / (1.0 + np.exp(1.0 - weights[ad] - weights[EVENT_ADS + site]))
    click = (h[2] >> np.uint64(11)).astype(np.float64) / float(1 << 53) < p
    ints, cats = "\t" * 12, "\t" * 24         # the other integer and categorical fields, empty
    return [f"{int(c)}\t{k}{ints}\t{a:08x}\t{s:08x}{cats}"
            for k, c, a, s in zip(range(first, first + n), click, ad, site)]
