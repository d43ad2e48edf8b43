"""Criteo display-advertising data: a streaming reader of the TSV files, and `criteo-synthetic`.

    load_dataset("criteo:PATH")        -> CriteoFile        (streams PATH, plain or .gz, every epoch)
    load_dataset("criteo-synthetic")   -> CriteoSynthetic   (generated from the seed, planted model known)

A batch x is a structured array of RECORD (13 dense float32 values, 26 int64 categorical ids) and
y is float32 0/1, as the CTR models take them. Both kinds plug into the worker loop as a Dataset
does: steps(), epoch(rank, num_workers, batch_size, seed, epoch), x_test/y_test, num_classes = 2.

Categorical ids: field f's value v (at most 8 hex digits: Criteo hashed its values onto 32 bits)
becomes splitmix64(f * 2**33 + v + 1) as int64, and an empty value splitmix64(f * 2**33). The key
is injective and splitmix64 is a bijection of 64-bit integers, so no two (field, value) pairs,
"missing" included, ever share an id, and the ids are evenly spread for sharding and hashing.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import sys
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from numba import njit

from pserver.data.dataset import ChunkedBatches, check_int, check_rank, steps_per_epoch
from pserver.data.ranges import identity, open_lines
from pserver.errors import ConfigError, DataError
from pserver.kernels.cpu import splitmix64 as _draw
from pserver.sparse import splitmix64  # the standard SplitMix64 output function, a bijection

NUM_DENSE = 13
NUM_CAT = 26
COLUMNS = 1 + NUM_DENSE + NUM_CAT   # label, integer features, categorical features
RECORD = np.dtype([("dense", np.float32, (NUM_DENSE,)), ("cat", np.int64, (NUM_CAT,))])
# MLPerf DLRMv2's multi-hot Criteo: how many ids each categorical feature holds (1 to 100, 214 in all)
MLPERF_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
PADDING = -1            # pads a list shorter than its feature's size (the Embedding's padding_id)
Sizes = tuple[int, ...] | None     # a multi-hot profile's list sizes; None: one id per field
MAX_HEX_DIGITS = 8    # Criteo's categorical values are 32-bit hashes in hex
MAX_INT_DIGITS = 18   # beyond that an integer feature would overflow int64: malformed

# The held-out test set of a file: the 10th, 20th, ... line (0-based index i with i % 10 == 9)
# among its first TEST_EVERY * test_samples lines; those lines are never trained on.
TEST_EVERY = 10
BLOCK_BYTES = 4 << 20   # read and parse the file this many bytes at a time
REPORTED_LINES = 5      # malformed lines reported one by one; the rest only counted
MAX_LINE_BYTES = 1 << 20   # a longer line means the file is not Criteo TSV (and would fill memory)

_ZERO = np.uint64(0)
_FIELD_STRIDE = np.uint64(1 << 33)   # room for v + 1 in [0, 2**32]


# ---------------------------------------------------------------- records

def record(sizes: tuple[int, ...] | None = None) -> np.dtype:
    """The records of one-hot data (sizes None: RECORD, "cat" holding one id per field) or of
    multi-hot data: "dense", then "cat_0" ... "cat_25", field j a list of up to sizes[j] ids,
    padded with PADDING."""
    if sizes is None:
        return RECORD
    return np.dtype([("dense", np.float32, (NUM_DENSE,))]
                    + [(f"cat_{j}", np.int64, (n,)) for j, n in enumerate(check_sizes(sizes))])


def check_sizes(sizes) -> tuple[int, ...]:
    """A multi-hot profile: NUM_CAT list sizes >= 1 (ConfigError naming what is wrong)."""
    sizes = tuple(sizes)
    if len(sizes) != NUM_CAT or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
                                    for n in sizes):
        raise ConfigError(f"multi-hot sizes: {NUM_CAT} integers >= 1 (one per categorical feature), "
                          f"got {sizes!r}")
    return tuple(int(n) for n in sizes)


def _offsets(sizes: tuple[int, ...] | None) -> np.ndarray:
    """Where each field's ids start among a record's categorical columns (NUM_CAT + 1 of them)."""
    return np.concatenate(([0], np.cumsum(sizes or (1,) * NUM_CAT))).astype(np.int64)


def cat_columns(x: np.ndarray) -> np.ndarray:
    """A records array's categorical ids as one int64 (n, columns) view: "cat" of one-hot
    records, or every "cat_j" list of multi-hot records side by side (they are adjacent)."""
    if "cat" in x.dtype.names:
        return x["cat"]
    at = x.dtype.fields["cat_0"][1]
    columns = (x.dtype.itemsize - at) // 8
    return np.ndarray((len(x), columns), np.int64, x, at, (x.dtype.itemsize, 8))


# ---------------------------------------------------------------- hashing

def hash_categorical(field: int, values) -> np.ndarray:
    """Field `field`'s categorical values (integers in [0, 2**32), -1 for an empty value) as int64 ids.

    Deterministic and collision-free across fields: the id is splitmix64(field * 2**33 + value + 1)
    (missing: value + 1 = 0), viewed as int64.
    """
    if not 0 <= field < NUM_CAT:
        raise DataError(f"categorical field: must be in [0, {NUM_CAT}), got {field!r}")
    v = np.asarray(values, dtype=np.int64)
    bad = (v < -1) | (v >= 1 << 32)
    if bad.any():
        i = int(np.argmax(bad.ravel()))
        raise DataError(f"categorical field {field}: value {v.ravel()[i]} at index {i} is not in "
                        "[0, 2**32) or -1 (missing)")
    return _ids(np.uint64(field) * _FIELD_STRIDE, v + 1)


def _ids(base, keys: np.ndarray) -> np.ndarray:
    """splitmix64(base + keys) as int64 (keys: value + 1, 0 for missing)."""
    return splitmix64(base + keys.astype(np.uint64)).view(np.int64)


_FIELD_BASES = np.arange(NUM_CAT, dtype=np.uint64) * _FIELD_STRIDE


@njit(cache=True, nogil=True)
def _mix(x):
    """splitmix64 of one uint64, for the kernels (its twin: splitmix64)."""
    return _draw(x, _ZERO)


# ---------------------------------------------------------------- parsing one block of lines

# Byte -> digit value, -1 for anything else: one lookup per byte in the parser.
_DECIMAL = np.full(256, -1, np.int64)
_DECIMAL[48:58] = np.arange(10)
_HEX = _DECIMAL.copy()
_HEX[97:103] = _HEX[65:71] = np.arange(10, 16)
# log(1 + v) of the small integers, as the twin computes it (float64, then float32): most of
# Criteo's integer features are small, and a lookup costs less than a log.
_LOG1P = np.log1p(np.arange(1 << 16, dtype=np.float64)).astype(np.float32)


@njit(cache=True, nogil=True)
def _scan_number(buf, p, end, digit, base, max_digits, lists=False):
    """The number in buf[p:] up to the next tab (or end; with `lists`, or the next comma):
    (value, digits, where it stopped); digits is -1 for a byte that is not a digit (`digit`:
    byte -> value or -1) or too many digits."""
    v, digits = 0, 0
    while p < end and buf[p] != 9 and not (lists and buf[p] == 44):
        d = digit[buf[p]]
        if d < 0 or digits == max_digits:
            return 0, -1, p
        v, digits, p = v * base + d, digits + 1, p + 1
    return v, digits, p


@njit(cache=True, nogil=True)
def _parse_line(buf, p, end, k, labels, dense, cat, offsets, bases, decimal, hexa, log1p):
    """Line k (buf[p:end], no newline) into row k; False if it is malformed (the row is then junk).
    One pass: each field is decoded as its bytes are scanned for the next tab. Categorical field
    j fills cat[k, offsets[j]:offsets[j + 1]]: one id, or (a list feature) up to that many
    comma-separated values, padded with PADDING."""
    if end > p and buf[end - 1] == 13:   # the '\r' of a CRLF file
        end -= 1
    if end - p < 2 or buf[p + 1] != 9 or not (buf[p] == 48 or buf[p] == 49):
        return False                      # label: one 0 or 1, then a tab
    labels[k] = buf[p] - 48
    p += 2
    for j in range(NUM_DENSE):
        negative = p < end and buf[p] == 45   # '-'
        if negative:
            p += 1
        v, digits, p = _scan_number(buf, p, end, decimal, 10, MAX_INT_DIGITS)
        if digits < 0 or p == end or (negative and digits == 0):
            return False                  # not a number, too few columns, or a lone '-'
        p += 1
        if negative or v == 0:
            dense[k, j] = 0.0
        else:
            dense[k, j] = log1p[v] if v < log1p.shape[0] else np.float32(math.log1p(v))
    for j in range(NUM_CAT):
        q, last = offsets[j], offsets[j + 1]   # field j's columns of cat: one, or a list's
        if last - q == 1:                 # one id (the scan without commas: one-hot files' speed)
            v, digits, p = _scan_number(buf, p, end, hexa, 16, MAX_HEX_DIGITS)
            if digits < 0:
                return False
            cat[k, q] = np.int64(_mix(bases[j] + np.uint64(v + 1 if digits else 0)))
        else:
            while True:
                v, digits, p = _scan_number(buf, p, end, hexa, 16, MAX_HEX_DIGITS, True)
                if digits < 0 or q == last:
                    return False          # not hex, or more values than the list holds
                cat[k, q] = np.int64(_mix(bases[j] + np.uint64(v + 1 if digits else 0)))
                q += 1
                if p == end or buf[p] != 44:   # no comma: the field's last value
                    break
                if digits == 0:
                    return False          # an empty value in a list
                p += 1
                if p == end or buf[p] == 9 or buf[p] == 44:
                    return False          # an empty value after a comma
            while q < last:
                cat[k, q] = PADDING       # a shorter list: padded
                q += 1
        if j < NUM_CAT - 1:
            if p == end:
                return False              # too few columns
            p += 1
    return p == end                       # else too many columns


@njit(cache=True, nogil=True)
def parse_lines(buf, starts, ends, labels, dense, cat, offsets, ok, bases, decimal, hexa, log1p):
    """Parse lines buf[starts[k]:ends[k]] into labels (float32), dense (log1p, float32) and
    cat (int64 ids, field j's in columns offsets[j]:offsets[j + 1]); ok[k] says whether line k
    was well formed."""
    for k in range(starts.shape[0]):
        ok[k] = _parse_line(buf, starts[k], ends[k], k, labels, dense, cat, offsets, bases, decimal, hexa,
                            log1p)


def parse_line_python(line: str, sizes: Sizes = None) -> tuple[float, np.ndarray, np.ndarray]:
    """One line parsed by plain Python, the twin of `parse_lines` (which the tests compare), and
    the source of the reason a malformed line gives: (label, dense, cat) or a DataError. With
    multi-hot `sizes`, cat is every field's list side by side, each padded to its size."""
    cols = (line[:-1] if line.endswith("\r") else line).split("\t")
    if len(cols) != COLUMNS:
        raise DataError(f"{len(cols)} tab-separated columns, expected {COLUMNS}")
    if cols[0] not in ("0", "1"):
        raise DataError(f"label {cols[0]!r} is not 0 or 1")
    dense = np.zeros(NUM_DENSE, np.float32)
    for j, text in enumerate(cols[1:1 + NUM_DENSE]):
        digits = text[1:] if text.startswith("-") else text
        if (text and not digits) or len(digits) > MAX_INT_DIGITS or not all("0" <= c <= "9" for c in digits):
            raise DataError(f"integer feature {j + 1} is {text!r}, not an integer")
        if text and not text.startswith("-"):
            dense[j] = np.log1p(np.float64(int(digits)))
    cat = []
    for j, text in enumerate(cols[1 + NUM_DENSE:]):
        size = sizes[j] if sizes else 1
        values = text.split(",") if size > 1 else [text]
        if len(values) > size:
            raise DataError(f"categorical feature {j + 1} has {len(values)} values, more than its {size}")
        if len(values) > 1 and "" in values:
            raise DataError(f"categorical feature {j + 1} is {text!r}: a list with an empty value")
        for value in values:
            if len(value) > MAX_HEX_DIGITS or not all(c in "0123456789abcdefABCDEF" for c in value):
                raise DataError(f"categorical feature {j + 1} is {text!r}, not "
                                + (f"a hex value of at most {MAX_HEX_DIGITS} digits" if size == 1 else
                                   f"comma-separated hex values of at most {MAX_HEX_DIGITS} digits"))
        ids = [hash_categorical(j, int(v, 16) if v else -1) for v in values]
        cat += [int(i) for i in ids] + [PADDING] * (size - len(values))
    return float(cols[0]), dense, np.array(cat, np.int64)


@dataclass
class Block:
    """The parsed lines of one block of a file: line numbers first..first + n - 1 (0-based)."""
    first: int
    lines: dict[int, bytes] | None   # the first few malformed lines, to explain them
    x: np.ndarray                    # record(sizes) (n,); junk where not ok
    labels: np.ndarray               # float32 (n,)
    ok: np.ndarray                   # bool (n,)
    starts: np.ndarray               # int64 (n,): where each line starts in the block's bytes
    at: int = 0                      # where the block starts in the file's text
    size: int = 0                    # its bytes

    @property
    def offsets(self) -> np.ndarray:
        """Where each line starts in the file's text."""
        return self.starts + self.at

    @property
    def index(self) -> np.ndarray:
        return np.arange(self.first, self.first + len(self.ok))


def parse_block(buf: np.ndarray, first: int, at: int = 0, sizes: tuple[int, ...] | None = None) -> Block:
    """Every line of buf (uint8; lines end with a newline, the last one may not); `at`: where buf
    starts in the file's text; `sizes`: a multi-hot file's list sizes (None: one-hot)."""
    newlines = np.flatnonzero(buf == 10)
    ends = newlines if len(newlines) and newlines[-1] == len(buf) - 1 else np.append(newlines, len(buf))
    starts = np.concatenate(([0], ends[:-1] + 1))
    n = len(starts)
    x, labels, ok = np.empty(n, record(sizes)), np.empty(n, np.float32), np.empty(n, np.bool_)
    parse_lines(buf, starts, ends, labels, x["dense"], cat_columns(x), _offsets(sizes), ok, _FIELD_BASES,
                _DECIMAL, _HEX, _LOG1P)
    bad = np.flatnonzero(~ok)[:REPORTED_LINES]
    lines = None if not len(bad) else {int(k): buf[starts[k]:ends[k]].tobytes() for k in bad}
    return Block(first, lines, x, labels, ok, starts.astype(np.int64), at, len(buf))


def read_blocks(path: str, block_bytes: int = BLOCK_BYTES, sizes: Sizes = None) -> Iterator[Block]:
    """The file's lines, parsed a block at a time (plain or gzip, told by its first bytes)."""
    first, rest, at = 0, b"", 0
    try:
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            f = gzip.GzipFile(fileobj=raw) if gz else raw
            while chunk := f.read(block_bytes):
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                if cut:
                    block = parse_block(np.frombuffer(data, np.uint8, cut), first, at, sizes)
                    first, at = first + len(block.ok), at + cut
                    yield block
                rest = data[cut:]
                if len(rest) > MAX_LINE_BYTES:
                    raise DataError(f"{path}: line {first + 1} is longer than {MAX_LINE_BYTES} bytes: "
                                    "not a Criteo TSV file")
    except (OSError, EOFError, zlib.error) as e:   # a cut or corrupt gzip stream, a vanished file
        raise DataError(f"{path}: cannot read ({' '.join(str(e).split()) or type(e).__name__})") from None
    if rest:
        yield parse_block(np.frombuffer(rest, np.uint8), first, at, sizes)


def _why(block: Block, k: int, sizes: tuple[int, ...] | None = None) -> str:
    try:
        parse_line_python(block.lines[k].decode("utf-8", "replace"), sizes)
    except DataError as e:
        return str(e)
    return "malformed"   # the kernel refused what the twin accepts: the tests rule this out


class MalformedLines:
    """Counts the malformed lines of a pass and reports the first few by line number."""

    def __init__(self, path: str, report: bool, sizes: tuple[int, ...] | None = None):
        self.path, self.report, self.count, self.lines, self.sizes = path, report, 0, 0, sizes

    def see(self, block: Block) -> None:
        self.lines += len(block.ok)
        for k in np.flatnonzero(~block.ok):
            if self.report and self.count < REPORTED_LINES:
                why = _why(block, int(k), self.sizes)
                print(f"warning: {self.path} line {block.first + k + 1}: {why}; skipped",
                      file=sys.stderr, flush=True)
            self.count += 1

    def done(self) -> None:
        if self.report and self.count:
            print(f"warning: {self.path}: skipped {self.count} malformed line(s) of {self.lines}",
                  file=sys.stderr, flush=True)


# ---------------------------------------------------------------- a file, streamed

def _features(sizes: tuple[int, ...] | None) -> str:
    if sizes is None:
        return f"{NUM_DENSE} dense + {NUM_CAT} categorical features, 2 classes"
    return (f"{NUM_DENSE} dense + {NUM_CAT} list features (lists of at most {min(sizes)} to {max(sizes)} "
            f"ids, {sum(sizes)} a sample), 2 classes")


@dataclass(frozen=True, eq=False)
class CriteoData:
    """What the worker loop uses of a dataset, for both kinds of Criteo data."""
    name: str
    x_test: np.ndarray        # record(sizes) (m,)
    y_test: np.ndarray        # float32 (m,)
    sizes: tuple[int, ...] | None = None   # a multi-hot profile's list sizes (None: one id per field)
    num_classes = 2
    sample_shape = ()         # a sample is one record

    @property
    def num_test(self) -> int:
        return len(self.x_test)

    def fit(self, model) -> CriteoData:
        """Itself, its test set checked by the model's `check_data` (the CTR models check the
        training records batch by batch)."""
        check = getattr(model, "check_data", None)
        if check is not None:
            check(self.x_test, self.y_test, f"{self.name} test set")
        return self

    def warm_up_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """A batch to run once before the first timed step: the test set's first (the
        training records are streamed)."""
        return self.x_test[:batch_size], self.y_test[:batch_size]

    def epoch(self, rank: int, num_workers: int, batch_size: int, seed: int,
              epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Rank's batches of this epoch (seed: the dataset's own, given at load)."""
        check_rank(rank, num_workers)
        self.steps(num_workers, batch_size)   # a bad flag fails here, not at the first batch
        check_int("--batch-size", batch_size, 1)
        return self._batches(rank, num_workers, batch_size, epoch)


@dataclass(frozen=True, eq=False)
class CriteoFile(CriteoData):
    """A Criteo TSV file streamed from disk, a block at a time, again each epoch.

    Line i (0-based) is held out for the chief's test set when i % 10 == 9 and
    i < 10 * test_samples. The other well-formed lines are the training lines, in file order;
    training line j belongs to worker j % num_workers. Steps are taken in rounds of
    num_workers * batch_size training lines, one batch per worker, and an incomplete last
    round is left out, so every worker runs the same number of steps. Every worker parses
    every line (cheap next to reading it) so all agree which lines are well formed; rank 0
    reports the malformed ones in its first epoch.
    """
    path: str = ""
    test_lines: int = 0       # lines 0 .. test_lines - 1 hold the test set
    held_out: np.ndarray | None = None   # int64: where each held-out line starts (ok or not)
    mean_line: float = 0.0    # bytes per line in the file's first block

    def steps(self, num_workers: int, batch_size: int) -> int:
        return 0   # unknown until the file has been read

    def leased_batches(self, batch_size: int, seed: int, chunk_batches: int,
                       cache_dir: str | None = None, shuffle: bool = True) -> FileBatches:
        """The file cut into byte ranges for --data-assignment leases (FileBatches). A chunk's
        batches are its byte ranges in file order either way; `shuffle` orders only the chunks
        (shard 0's coordinator hands them out in order with --no-shuffle)."""
        return FileBatches(self, batch_size, chunk_batches, cache_dir)

    def describe(self) -> str:
        return (f"dataset {self.name}: streamed (leased in byte ranges; with slices each worker its "
                f"share of the lines); "
                f"{self.num_test} test samples (every {TEST_EVERY}th of the first {self.test_lines} "
                f"lines), {_features(self.sizes)}")

    def _batches(self, rank, num_workers, batch_size, epoch):
        bad = MalformedLines(self.path, report=rank == 0 and epoch == 0, sizes=self.sizes)
        mine = _Pending(batch_size, record(self.sizes))
        trained = 0   # training lines so far, every worker's
        for block in read_blocks(self.path, sizes=self.sizes):
            bad.see(block)
            train = block.ok & ~_held_out(block.index, self.test_lines)
            j = trained + np.cumsum(train) - 1
            take = train & (j % num_workers == rank)
            mine.add(block.x[take], block.labels[take])
            trained += int(np.count_nonzero(train))
            yield from mine.batches(trained // (num_workers * batch_size))
        bad.done()
        if mine.emitted == 0:
            raise ConfigError(f"--batch-size: {self.path} has {trained} well-formed training lines, fewer "
                              f"than one step of {num_workers} worker(s) x {batch_size}")


class _Pending:
    """One worker's training rows not yet in a batch."""

    def __init__(self, batch_size: int, dtype: np.dtype):
        self.batch_size, self.emitted = batch_size, 0
        self.x, self.y = np.empty(0, dtype), np.empty(0, np.float32)

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = np.concatenate((self.x, x)), np.concatenate((self.y, y))

    def batches(self, complete_rounds: int):
        """A batch for each round complete in the file so far (one batch per worker per round)."""
        taken = 0
        while self.emitted < complete_rounds:
            yield self.x[taken:taken + self.batch_size], self.y[taken:taken + self.batch_size]
            taken += self.batch_size
            self.emitted += 1
        self.x, self.y = self.x[taken:], self.y[taken:]


class FileBatches(ChunkedBatches):
    """A Criteo file under --data-assignment leases: batch b is the lines that start in bytes
    [b * span, (b + 1) * span) of its text (pserver.data.ranges: as Hadoop splits files), span
    being --batch-size lines of the mean length of the first block, less the held-out and the
    malformed lines. The ranges tile the text, so every training line is in exactly one batch of
    every epoch, whatever the lines' lengths; a batch has about --batch-size lines (none where no
    line starts: the worker skips it). A chunk is --chunk-batches consecutive ranges, read at once;
    a .gz file is read through its seek index. The fingerprint is the text's length and a hash of
    the file's ends and the span, so workers that cut another file (or the same one otherwise)
    are refused."""

    def __init__(self, data: CriteoFile, batch_size: int, chunk_batches: int, cache_dir: str | None = None):
        super().__init__(chunk_batches)
        check_int("--batch-size", batch_size, 1)
        self.path, self.held_out, self.sizes = data.path, data.held_out, data.sizes
        self.lines = open_lines(data.path, cache_dir)
        self.span = max(1, round(batch_size * data.mean_line))
        self.num_batches = max(1, math.ceil(self.lines.length / self.span))
        ends = identity(data.path)["sha256_ends"]
        digest = hashlib.sha256(f"{ends}:{self.span}".encode()).hexdigest()[:16]
        self.fingerprint = f"{self.lines.length}:{digest}"
        self.reported = 0

    def read(self, epoch: int, first: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        start, text = self.lines.lines_in(first * self.span, end * self.span)
        if not text:
            return [(np.empty(0, record(self.sizes)), np.empty(0, np.float32))] * (end - first)
        block = parse_block(np.frombuffer(text, np.uint8), 0, start, self.sizes)
        offsets = block.offsets
        for k in np.flatnonzero(~block.ok):
            if epoch == 0 and self.reported < REPORTED_LINES and block.lines and int(k) in block.lines:
                why = _why(block, int(k), self.sizes)
                print(f"warning: {self.path}: the line at byte {offsets[k]}: {why}; skipped",
                      file=sys.stderr, flush=True)
                self.reported += 1
        keep = block.ok & ~np.isin(offsets, self.held_out)
        which = offsets // self.span
        out = []
        for b in range(first, end):
            take = keep & (which == b)
            out.append((block.x[take], block.labels[take]))
        return out


def _held_out(index: np.ndarray, test_lines: int) -> np.ndarray:
    return (index % TEST_EVERY == TEST_EVERY - 1) & (index < test_lines)


def load_file(path: str, test_samples: int, sizes: tuple[int, ...] | None = None) -> CriteoFile:
    """Open a Criteo TSV file: read its held-out lines (the first ones) as the test set, and note
    where every held-out line starts (leases leave those out) and the mean line length of its
    first block (leases cut the file into byte ranges of about --batch-size lines). With
    multi-hot `sizes`, categorical field j holds up to sizes[j] comma-separated values."""
    check_int("--test-samples", test_samples, 1)
    sizes = None if sizes is None else check_sizes(sizes)
    test_lines = TEST_EVERY * test_samples
    xs, ys, held, lines, valid, first_bytes, first_lines = [], [], [], 0, 0, 0, 0
    for block in read_blocks(path, sizes=sizes):
        if not first_lines:
            first_lines, first_bytes = len(block.ok), block.size
        lines += len(block.ok)
        valid += int(np.count_nonzero(block.ok))
        held_out = _held_out(block.index, test_lines)
        test = block.ok & held_out
        xs.append(block.x[test])
        ys.append(block.labels[test])
        held.append(block.offsets[held_out])
        if lines >= test_lines and valid:
            break
    if lines == 0:
        raise DataError(f"{path}: the file is empty")
    if valid == 0:
        raise DataError(f"{path}: no well-formed line among its first {lines} (each needs a 0/1 label, "
                        f"{NUM_DENSE} integer and {NUM_CAT} hex fields, {COLUMNS} columns separated by tabs)")
    x_test, y_test = np.concatenate(xs), np.concatenate(ys)
    if len(x_test) == 0:
        raise DataError(f"{path}: no well-formed held-out line (the test set is every {TEST_EVERY}th "
                        f"of the first {test_lines} lines; the file has {lines})")
    kind = "criteo" if sizes is None else "criteo-multi-hot"
    return CriteoFile(f"{kind}:{path}", x_test, y_test, sizes, path=path, test_lines=test_lines,
                      held_out=np.concatenate(held), mean_line=first_bytes / first_lines)


# ---------------------------------------------------------------- criteo-synthetic

# Fixed parameters: no flag changes them (only --samples and --test-samples, the sizes), so no
# target can be met by tuning the data.
SYNTHETIC_VOCABS = np.round(np.logspace(1, 7, NUM_CAT)).astype(np.int64)   # 10 ... 10**7 ids per field
ZIPF_EXPONENT = 1.2    # P(the k-th id of a field) ~ k**-1.2
WEIGHT_STD = 0.5       # planted per-id weights ~ N(0, 0.5**2)
FACTOR_RANK = 4
FACTOR_STD = 0.3       # planted factorisation-machine factors ~ N(0, 0.3**2)
# Interacting fields: among the smaller vocabularies, where ids repeat often enough in 1M
# samples for a model to learn the interaction.
FM_PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11))
POSITIVE_RATE = 0.25   # Criteo's click rate; the bias is calibrated to it per seed
DENSE_LOG_MEAN, DENSE_LOG_STD = 1.0, 1.5   # integer features: floor(exp(N(1, 1.5**2))), log1p'd as read
# Sample i (0-based) is a pure function of (seed, i). The test set is samples TEST_START + t,
# and the bias is calibrated on samples CALIBRATION_START + c: ranges no training set reaches.
TEST_START = 1 << 40
CALIBRATION_START = 1 << 41
CALIBRATION_SAMPLES = 100_000
ZIPF_ATTEMPTS = 32     # attempts per draw (each rejected with p < 1%); the 32nd attempt's id is kept
_SAMPLE_STREAMS = NUM_CAT * ZIPF_ATTEMPTS   # then a pair per 2 integer features, then the label's
_GENERATE_CHUNK = 1 << 16                  # samples generated at once


def _salt(seed: int, purpose: int) -> np.uint64:
    """The stream of random numbers for samples (purpose 0) or for the planted model's ids (1)."""
    return splitmix64(np.array([seed * 2 + purpose], np.uint64))[0]


# The generator's numba kernels, one sample (or one id) at a time. Their NumPy twins below
# compute the same numbers array-wise; the tests compare the two.
@njit(cache=True, nogil=True)
def _uniform_at(h0, stream):
    """A uniform in (0, 1), never 0, for stream `stream` of a key hashed to h0 = splitmix64(key ^ salt)."""
    h = _mix(h0 + np.uint64(stream))
    return (np.float64(h >> np.uint64(11)) + 0.5) * 2.0 ** -53


@njit(cache=True, nogil=True)
def _normals_at(h0, stream):
    """Two independent standard normals (Box-Muller) from streams stream and stream + 1."""
    r = math.sqrt(-2.0 * math.log(_uniform_at(h0, stream)))
    angle = 2.0 * math.pi * _uniform_at(h0, stream + 1)
    return r * math.cos(angle), r * math.sin(angle)


@njit(cache=True, nogil=True)
def _h_integral(x):
    """The integral of t**-s from 1 to x: rejection-inversion's hat (Hormann & Derflinger 1996)."""
    return (x ** (1.0 - ZIPF_EXPONENT) - 1.0) / (1.0 - ZIPF_EXPONENT)


@njit(cache=True, nogil=True)
def _h_integral_inverse(y):
    return (1.0 + y * (1.0 - ZIPF_EXPONENT)) ** (1.0 / (1.0 - ZIPF_EXPONENT))


_H_X1 = _h_integral.py_func(1.5) - 1.0
_H_N = _h_integral.py_func(SYNTHETIC_VOCABS + 0.5)
_S = 2.0 - _h_integral_inverse.py_func(_h_integral.py_func(2.5) - 2.0 ** -ZIPF_EXPONENT)
_PAIRS = np.array(FM_PAIRS, np.int64)
_PAIRED = np.isin(np.arange(NUM_CAT), _PAIRS)   # the fields whose ids have factors
HEAD_IDS = 1024   # each field's most frequent ids whose params generate() tabulates (~90% of draws)


@njit(cache=True, nogil=True)
def _zipf_at(h0, field, vocab, h_n):
    """The Zipf rank (1 = most frequent, up to vocab) in `field` of the sample hashed to h0, by
    rejection-inversion: exact for a bounded Zipf law; each attempt has its own stream."""
    k = 1.0
    for attempt in range(ZIPF_ATTEMPTS):
        u = h_n + _uniform_at(h0, field * ZIPF_ATTEMPTS + attempt) * (_H_X1 - h_n)
        x = _h_integral_inverse(u)
        k = min(max(math.floor(x + 0.5), 1.0), vocab)
        if k - x <= _S or u >= _h_integral(k + 0.5) - k ** -ZIPF_EXPONENT:
            break
    return k


@njit(cache=True, nogil=True)
def _id_params(h0, out, factors):
    """An id's planted weight (out[0]) and, if `factors`, its FACTOR_RANK factors (out[1:]), from
    normal pairs at streams 0 (the weight), 2, 4, ...; h0 = splitmix64(id ^ salt)."""
    out[0] = WEIGHT_STD * _normals_at(h0, 0)[0]
    if factors:
        for r in range(0, FACTOR_RANK, 2):
            a, b = _normals_at(h0, 2 + r)
            out[1 + r], out[2 + r] = FACTOR_STD * a, FACTOR_STD * b


@njit(cache=True, nogil=True)
def _logit_of(params, pairs, pairwise):
    """The planted logit without bias from one sample's per-field params (26, 1 + FACTOR_RANK)."""
    logit = 0.0
    for f in range(params.shape[0]):
        logit += params[f, 0]
    if pairwise:
        for p in range(pairs.shape[0]):
            for r in range(1, 1 + FACTOR_RANK):   # a loop: np.dot would call BLAS for 4 numbers
                logit += params[pairs[p, 0], r] * params[pairs[p, 1], r]
    return logit


@njit(cache=True, nogil=True)
def _head_params(id_salt, bases, paired, out):
    """out[f, k - 1]: the params of field f's k-th most frequent id, for k up to out.shape[1]."""
    for f in range(out.shape[0]):
        for k in range(out.shape[1]):
            _id_params(_mix(_mix(bases[f] + np.uint64(k + 1)) ^ id_salt), out[f, k], paired[f])


@njit(cache=True, nogil=True)
def _generate_kernel(index, salt, id_salt, bias, vocabs, h_n, bases, pairs, paired, head, cat, dense, y):
    """Samples index[i] into cat[i] (int64 ids), dense[i] and y[i]; head: _head_params' table,
    which spares most ids (Zipf: the frequent ones) the normals of their params."""
    params = np.zeros((NUM_CAT, 1 + FACTOR_RANK))
    for i in range(index.shape[0]):
        h0 = _mix(index[i] ^ salt)
        for f in range(NUM_CAT):
            k = _zipf_at(h0, f, vocabs[f], h_n[f])
            id_ = _mix(bases[f] + np.uint64(k))
            cat[i, f] = np.int64(id_)
            if k <= head.shape[1]:
                params[f] = head[f, int(k) - 1]
            else:
                _id_params(_mix(id_ ^ id_salt), params[f], paired[f])
        for j in range(0, NUM_DENSE, 2):
            pair = _normals_at(h0, _SAMPLE_STREAMS + j)
            for t in range(min(2, NUM_DENSE - j)):
                count = math.floor(math.exp(DENSE_LOG_MEAN + DENSE_LOG_STD * pair[t]))
                dense[i, j + t] = np.float32(math.log1p(count))
        p = 1.0 / (1.0 + math.exp(-(bias + _logit_of(params, pairs, True))))
        y[i] = 1.0 if _uniform_at(h0, _SAMPLE_STREAMS + NUM_DENSE + 1) < p else 0.0


@njit(cache=True, nogil=True)
def _planted_kernel(cat, id_salt, pairs, paired, pairwise, out):
    params = np.zeros((NUM_CAT, 1 + FACTOR_RANK))
    for i in range(cat.shape[0]):
        for f in range(NUM_CAT):
            _id_params(_mix(np.uint64(cat[i, f]) ^ id_salt), params[f], paired[f] and pairwise)
        out[i] = _logit_of(params, pairs, pairwise)


def generate(seed: int, bias: float, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Samples `index` (uint64) of criteo-synthetic with this seed: (RECORD (n,), float32 0/1 (n,))."""
    index, id_salt = np.ascontiguousarray(index, dtype=np.uint64), _salt(seed, 1)
    head = np.zeros((NUM_CAT, HEAD_IDS, 1 + FACTOR_RANK))
    _head_params(id_salt, _FIELD_BASES, _PAIRED, head)
    cat, dense = np.empty((len(index), NUM_CAT), np.int64), np.empty((len(index), NUM_DENSE), np.float32)
    y = np.empty(len(index), np.float32)
    _generate_kernel(index, _salt(seed, 0), id_salt, float(bias), SYNTHETIC_VOCABS.astype(np.float64), _H_N,
                     _FIELD_BASES, _PAIRS, _PAIRED, head, cat, dense, y)
    x = np.empty(len(index), RECORD)
    x["cat"], x["dense"] = cat, dense
    return x, y


@njit(cache=True, nogil=True)
def _expand_kernel(index, salt, vocabs, h_n, bases, offsets, first, out):
    """Multi-hot lists: field f's list of sample index[i] is first[i, f] (its one-hot id), then
    Zipf draws of the same field, the j-th from the sample's hash h + j, into out[i, offsets[f]:]."""
    for i in range(index.shape[0]):
        h = _mix(index[i] ^ salt)
        for f in range(NUM_CAT):
            out[i, offsets[f]] = first[i, f]
            for j in range(1, offsets[f + 1] - offsets[f]):
                k = _zipf_at(_mix(h + np.uint64(j)), f, vocabs[f], h_n[f])
                out[i, offsets[f] + j] = np.int64(_mix(bases[f] + np.uint64(k)))


def generate_multi_hot(seed: int, bias: float, index: np.ndarray,
                       sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Samples `index` of criteo-synthetic-multi-hot: record(sizes) (n,) and float32 0/1 (n,).
    A sample's dense features and its lists' first ids are criteo-synthetic's sample; the rest
    of field f's list are Zipf draws of f (so ids repeat, within a list too), and the label is
    drawn from the planted model over the lists (planted_lists)."""
    index = np.ascontiguousarray(index, dtype=np.uint64)
    one_hot, _ = generate(seed, 0.0, index)
    x = np.empty(len(index), record(sizes))
    x["dense"] = one_hot["dense"]
    _expand_kernel(index, _salt(seed, 2), SYNTHETIC_VOCABS.astype(np.float64), _H_N, _FIELD_BASES,
                   _offsets(sizes), one_hot["cat"], cat_columns(x))
    p = 1.0 / (1.0 + np.exp(-(bias + planted_lists(seed, cat_columns(x), sizes))))
    y = _uniform_numpy(splitmix64(index ^ _salt(seed, 0)), _SAMPLE_STREAMS + NUM_DENSE + 1) < p
    return x, y.astype(np.float32)


def expand_numpy(seed: int, index: np.ndarray, first: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    """_expand_kernel's twin: the lists side by side, int64 (n, sum(sizes))."""
    index = np.asarray(index, np.uint64)
    h = splitmix64(index ^ _salt(seed, 2))
    out = np.empty((len(index), sum(sizes)), np.int64)
    offsets = _offsets(sizes)
    out[:, offsets[:-1]] = first
    for j in range(1, max(sizes)):
        ids = _ids(_FIELD_BASES, _zipf_ranks(splitmix64(h + np.uint64(j))))   # key = rank
        for f in np.flatnonzero(np.array(sizes) > j):
            out[:, offsets[f] + j] = ids[:, f]
    return out


def planted_lists(seed: int, cat: np.ndarray, sizes: tuple[int, ...], pairwise: bool = True) -> np.ndarray:
    """The planted model over lists, without the bias: each field's weight is the mean of its
    list's ids' planted weights, the pairs' factors the means of their factors (padding left
    out of the means); cat: the lists side by side (cat_columns). float64 (n,)."""
    offsets, cat = _offsets(sizes), np.asarray(cat, np.int64)
    kept = cat != PADDING
    counts = np.maximum(np.add.reduceat(kept, offsets[:-1], axis=1), 1)
    h0 = _planted_h0(seed, cat)
    w = np.where(kept, WEIGHT_STD * _normals_numpy(h0, 0)[0], 0.0)
    logit = (np.add.reduceat(w, offsets[:-1], axis=1) / counts).sum(axis=1)
    if pairwise:
        def pooled(f):
            a, b = offsets[f], offsets[f + 1]
            return (_factors_numpy(h0[:, a:b]) * kept[:, a:b, None]).sum(axis=1) / counts[:, f, None]
        for a, b in FM_PAIRS:
            logit += (pooled(a) * pooled(b)).sum(axis=1)
    return logit


def planted(seed: int, cat: np.ndarray, pairwise: bool = True) -> np.ndarray:
    """The planted model's logits without the bias, for int64 ids cat (n, 26): float64 (n,)."""
    out = np.empty(len(cat))
    _planted_kernel(np.ascontiguousarray(cat, dtype=np.int64), _salt(seed, 1), _PAIRS, _PAIRED, pairwise, out)
    return out


# NumPy twins of the kernels: array-wise, the same numbers.

def _uniform_numpy(h0: np.ndarray, streams) -> np.ndarray:
    h = splitmix64(h0 + np.asarray(streams, np.uint64))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def _normals_numpy(h0: np.ndarray, streams) -> tuple[np.ndarray, np.ndarray]:
    streams = np.asarray(streams, np.uint64)
    r = np.sqrt(-2.0 * np.log(_uniform_numpy(h0, streams)))
    angle = 2.0 * np.pi * _uniform_numpy(h0, streams + np.uint64(1))
    return r * np.cos(angle), r * np.sin(angle)


def zipf_ranks_numpy(index: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Every field's Zipf rank for each sample, int64 (n, 26): _zipf_at array-wise."""
    return _zipf_ranks(splitmix64(index ^ salt))


def _zipf_ranks(h0: np.ndarray) -> np.ndarray:
    """Every field's Zipf rank for the samples hashed to h0."""
    h_integral, h_inverse = _h_integral.py_func, _h_integral_inverse.py_func
    ranks = np.ones((len(h0), NUM_CAT), np.int64)
    rows, cols = np.divmod(np.arange(ranks.size), NUM_CAT)
    for attempt in range(ZIPF_ATTEMPTS):
        h_n = _H_N[cols]
        u = h_n + _uniform_numpy(h0[rows], cols * ZIPF_ATTEMPTS + attempt) * (_H_X1 - h_n)
        x = h_inverse(u)
        k = np.clip(np.floor(x + 0.5), 1, SYNTHETIC_VOCABS[cols])
        accept = (k - x <= _S) | (u >= h_integral(k + 0.5) - k ** -ZIPF_EXPONENT)
        ranks[rows, cols] = k.astype(np.int64)   # the last attempt's stays if none is accepted
        rows, cols = rows[~accept], cols[~accept]
        if not len(rows):
            break
    return ranks


def _factors_numpy(h0: np.ndarray) -> np.ndarray:
    pairs = [np.stack(_normals_numpy(h0, 2 + r), axis=-1) for r in range(0, FACTOR_RANK, 2)]
    return FACTOR_STD * np.concatenate(pairs, axis=-1)


def _planted_h0(seed: int, cat: np.ndarray) -> np.ndarray:
    return splitmix64(np.ascontiguousarray(cat).view(np.uint64) ^ _salt(seed, 1))


def planted_weights(seed: int, cat: np.ndarray) -> np.ndarray:
    """The planted per-id weight of every id in `cat` (int64 (n, 26)), float64 (n, 26)."""
    return WEIGHT_STD * _normals_numpy(_planted_h0(seed, cat), 0)[0]


def planted_numpy(seed: int, cat: np.ndarray, pairwise: bool = True) -> np.ndarray:
    h0 = _planted_h0(seed, cat)
    logit = planted_weights(seed, cat).sum(axis=1)
    if pairwise:
        for a, b in FM_PAIRS:
            logit += (_factors_numpy(h0[:, a]) * _factors_numpy(h0[:, b])).sum(axis=1)
    return logit


def generate_numpy(seed: int, bias: float, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    index, salt = np.asarray(index, np.uint64), _salt(seed, 0)
    h0 = splitmix64(index ^ salt)[:, None]
    x = np.empty(len(index), RECORD)
    x["cat"] = _ids(_FIELD_BASES, zipf_ranks_numpy(index, salt))   # key = value + 1 = rank
    z = np.stack(_normals_numpy(h0, _SAMPLE_STREAMS + np.arange(0, NUM_DENSE, 2)), axis=-1)
    z = z.reshape(len(index), -1)[:, :NUM_DENSE]   # pair j gives features 2j and 2j + 1
    x["dense"] = np.log1p(np.floor(np.exp(DENSE_LOG_MEAN + DENSE_LOG_STD * z)))
    p = 1.0 / (1.0 + np.exp(-(bias + planted_numpy(seed, x["cat"]))))
    y = (_uniform_numpy(h0[:, 0], _SAMPLE_STREAMS + NUM_DENSE + 1) < p).astype(np.float32)
    return x, y


def generate_any(seed: int, bias: float, index: np.ndarray,
                 sizes: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    """criteo-synthetic's samples (sizes None) or the multi-hot profile's."""
    return generate(seed, bias, index) if sizes is None else generate_multi_hot(seed, bias, index, sizes)


def calibrate_bias(seed: int, sizes: tuple[int, ...] | None = None) -> float:
    """The bias that makes the planted model's mean click probability POSITIVE_RATE on the
    calibration samples: deterministic in the seed (bisection; the mean is monotone in it)."""
    calibration = CALIBRATION_SAMPLES if sizes is None else CALIBRATION_SAMPLES // 5   # lists cost more
    x, _ = generate_any(seed, 0.0, np.arange(CALIBRATION_START, CALIBRATION_START + calibration,
                                             dtype=np.uint64), sizes)
    z = planted(seed, x["cat"]) if sizes is None else planted_lists(seed, cat_columns(x), sizes)
    low, high = -30.0, 30.0
    for _ in range(60):
        mid = (low + high) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(z + mid)))) < POSITIVE_RATE:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True, eq=False)
class CriteoSynthetic(CriteoData):
    """Criteo-shaped data with labels from a known (planted) model; see the parameters above.

    Round k of an epoch is samples k * num_workers * batch_size ... (k + 1) * num_workers *
    batch_size - 1, and worker r takes the r-th batch_size of them; the last round, when batch_size
    does not divide a worker's share, is num_workers smaller batches of what is left. Samples are
    independent and identically distributed, so every epoch takes them in the same order.
    """
    seed: int = 0
    samples: int = 0
    bias: float = 0.0
    best_auc: float = float("nan")     # the planted model's AUC on the test set
    linear_auc: float = float("nan")   # the same without its pairwise terms

    @property
    def num_train(self) -> int:
        return self.samples

    def steps(self, num_workers: int, batch_size: int) -> int:
        return steps_per_epoch(self.samples, num_workers, batch_size)

    def leased_batches(self, batch_size: int, seed: int, chunk_batches: int,
                       shuffle: bool = True) -> SyntheticBatches:
        """Batch b is samples b * batch_size ... (b + 1) * batch_size - 1, for --data-assignment leases
        (in order either way; `shuffle` orders only the chunks, as for a file)."""
        return SyntheticBatches(self, batch_size, chunk_batches)

    def planted_logits(self, x: np.ndarray, pairwise: bool = True) -> np.ndarray:
        """The planted model's logits for records x (float64 (n,)); pairwise=False leaves the
        factorisation-machine terms out."""
        if self.sizes is not None:
            return self.bias + planted_lists(self.seed, cat_columns(x), self.sizes, pairwise)
        return self.bias + planted(self.seed, x["cat"], pairwise)

    def generate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples `index` (uint64): records and labels."""
        return generate_any(self.seed, self.bias, index, self.sizes)

    def describe(self) -> str:
        return (f"dataset {self.name}: {self.samples} train / {self.num_test} test samples, "
                f"{_features(self.sizes)}; "
                f"the planted model's test AUC is "
                f"{self.best_auc:.4f} ({self.linear_auc:.4f} without its pairwise terms)")

    def _batches(self, rank, num_workers, batch_size, epoch):
        steps = self.steps(num_workers, batch_size)
        last = self.samples // num_workers - (steps - 1) * batch_size    # the last round's batch
        per_chunk = max(1, _GENERATE_CHUNK // batch_size)   # rounds generated at once
        for first in range(0, steps, per_chunk):
            rounds = np.arange(first, min(steps, first + per_chunk), dtype=np.uint64)
            index = ((rounds[:, None] * np.uint64(num_workers) + np.uint64(rank)) * np.uint64(batch_size)
                     + np.arange(batch_size, dtype=np.uint64)).ravel()
            if rounds[-1] == steps - 1 and last < batch_size:   # a smaller last batch per worker
                tail = (np.uint64((steps - 1) * num_workers * batch_size + rank * last)
                        + np.arange(last, dtype=np.uint64))
                index = np.concatenate([index[:-batch_size], tail])
            x, y = self.generate(index)
            for b in range(0, len(index), batch_size):
                yield x[b:b + batch_size], y[b:b + batch_size]


class SyntheticBatches(ChunkedBatches):
    """criteo-synthetic under --data-assignment leases: batch b is samples b * batch_size ...
    (b + 1) * batch_size - 1 (ceil(samples / batch_size) batches, the last with the rest; the
    samples are i.i.d., so each epoch takes them alike and the coordinator's chunk order is the
    shuffle), generated a chunk at a time."""

    def __init__(self, data: CriteoSynthetic, batch_size: int, chunk_batches: int):
        super().__init__(chunk_batches)
        check_int("--batch-size", batch_size, 1)
        self.data, self.batch_size = data, batch_size
        self.num_batches = -(-data.samples // batch_size)
        if data.samples < batch_size:
            raise ConfigError(f"--batch-size: {batch_size} is larger than the {data.samples} "
                              "training samples")
        x, y = data.generate(np.zeros(1, np.uint64))
        h = hashlib.sha256(f"{data.seed}:{data.bias!r}:{data.sizes}".encode() + x.tobytes() + y.tobytes())
        self.fingerprint = f"{data.samples}:{h.hexdigest()[:16]}"

    def read(self, epoch: int, first: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        bs = self.batch_size
        x, y = self.data.generate(np.arange(first * bs, min(end * bs, self.data.samples), dtype=np.uint64))
        return [(x[k:k + bs], y[k:k + bs]) for k in range(0, len(x), bs)]


def load_synthetic(seed: int, samples: int, test_samples: int,
                   sizes: tuple[int, ...] | None = None) -> CriteoSynthetic:
    """criteo-synthetic (or, with list `sizes`, criteo-synthetic-multi-hot): its bias calibrated
    for the seed, its test set and best AUC computed."""
    from pserver.models.metrics import auc
    check_int("--samples", samples, 1)
    check_int("--test-samples", test_samples, 1)
    sizes = None if sizes is None else check_sizes(sizes)
    name = "criteo-synthetic" if sizes is None else "criteo-synthetic-multi-hot"
    bias = calibrate_bias(seed, sizes)
    test = np.arange(TEST_START, TEST_START + test_samples, dtype=np.uint64)
    x_test, y_test = generate_any(seed, bias, test, sizes)
    data = CriteoSynthetic(name, x_test, y_test, sizes, seed=seed, samples=samples, bias=bias)
    return CriteoSynthetic(name, x_test, y_test, sizes, seed=seed, samples=samples, bias=bias,
                           best_auc=auc(data.planted_logits(x_test), y_test),
                           linear_auc=auc(data.planted_logits(x_test, pairwise=False), y_test))
