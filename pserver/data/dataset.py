"""The Dataset and Stream containers, and the per-rank slices that workers train on.

Every epoch is one permutation of the training set drawn from `seed + epoch`, the same on every
worker; rank r takes the r-th of `num_workers` equal blocks, so the ranks never overlap and all run
the same number of steps (the `num_train % num_workers` left-over samples sit that epoch out). A
block, like the leased epoch (LeasedBatches), is cut into batches of batch_size and one smaller
last batch with the rest, trained as Keras trains it: 1,000 samples at 128 are 8 steps, the last
of 104 samples (a sync step weighs each push by its samples, docs/semantics.md, "Consistency modes").
The kinds of data are their own modules (synthetic, mnist, npz, criteo); `load_dataset` is the
package's.
"""

from __future__ import annotations

import abc
import hashlib
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pserver.errors import ConfigError, DataError

TASKS = ("classification", "regression")




@dataclass(frozen=True, eq=False)  # eq=False: comparing ndarrays with == has no single truth value
class Dataset:
    name: str  # "synthetic", "mnist" or the .npz path
    x_train: np.ndarray  # (n, *sample_shape) float32, C-contiguous: (n, d), or images (n, h, w, c);
    # or (n,) records, a field per input, for a model with sparse tables (SparseProtocol)
    y_train: np.ndarray  # (n,) int32 labels (classification) or float32 targets (regression);
    # float32 (n, outputs) for a model with several (each output's labels a column); (n, steps)
    # for an output with steps (each sample's labels flattened: Functional.labels)
    x_test: np.ndarray  # (m, *sample_shape) float32, C-contiguous
    y_test: np.ndarray  # (m,)
    num_classes: int  # 0 for regression
    padded: tuple[str, ...] = ()  # record fields whose shorter lists of ids are padded with -1 (Parquet)

    def __post_init__(self):
        # The worker's kernels rely on these; checking once here beats a wrong answer later.
        y_dtype = np.float32 if self.num_classes == 0 else np.int32
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            records = x.dtype.names is not None and x.ndim == 1     # a model with sparse tables
            if not records and (x.ndim < 2 or x.dtype != np.float32) or not x.flags.c_contiguous:
                raise DataError(f"{self.name}: x_{split} must be C-contiguous float32 of shape "
                                f"(samples, ...) or a 1-D array of records, got {x.dtype} {x.shape}")
            several = y.ndim == 2 and len(y) == len(x)      # outputs' targets, or steps' labels
            if (y.shape != (len(x),) and not several) or y.dtype != y_dtype:
                raise DataError(f"{self.name}: y_{split} must be {np.dtype(y_dtype)} of shape "
                                f"({len(x)},), got {y.dtype} {y.shape}")
            if len(x) == 0:
                raise DataError(f"{self.name}: the {split} set is empty")
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise DataError(f"{self.name}: x_test has samples of shape {self.x_test.shape[1:]}, "
                            f"x_train {self.x_train.shape[1:]}")

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape: (features,), or (height, width, channels) for images."""
        return tuple(self.x_train.shape[1:])

    @property
    def features(self) -> int:
        """Values per sample."""
        return math.prod(self.sample_shape)

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    @property
    def num_test(self) -> int:
        return len(self.x_test)

    @property
    def task(self) -> str:
        return "regression" if self.num_classes == 0 else "classification"

    def steps(self, num_workers: int, batch_size: int) -> int:
        return steps_per_epoch(self.num_train, num_workers, batch_size)

    def epoch(self, rank: int, num_workers: int, batch_size: int, seed: int,
              epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iterate_batches(self, rank, num_workers, batch_size, seed, epoch)

    def fit(self, model) -> Dataset:
        """The data as `model` takes it: float targets for a regression loss, both sets
        reshaped and checked by the model's `check_data` (a DataError naming layer and
        shapes); as it is for a model without one (a user's protocol object)."""
        ds = as_task(self, "regression") if getattr(model, "task", None) == "regression" else self
        self._check_padding(model)
        check = getattr(model, "check_data", None)
        if check is None:
            return ds
        x_train = check(ds.x_train, ds.y_train, f"{ds.name} training set")
        x_test = check(ds.x_test, ds.y_test, f"{ds.name} test set")
        return Dataset(ds.name, x_train, ds.y_train, x_test, ds.y_test, ds.num_classes, ds.padded)

    def _check_padding(self, model) -> None:
        """A field padded with -1 must be read as padding (padding_id=-1): read with another
        padding, or none, its -1s would be ids (a row on the shards)."""
        if not self.padded:
            return
        paddings = getattr(model, "input_paddings", dict)()
        for name in self.padded:
            if paddings.get(name) != -1:
                how = "no padding" if paddings.get(name) is None else f"padding {paddings[name]!r}"
                raise DataError(f"{self.name}: column {name!r} holds lists of ids padded with -1; the model "
                                f"reads input {name!r} with {how}: give its Embedding padding_id=-1")

    def leased_batches(self, batch_size: int, seed: int, chunk_batches: int,
                       shuffle: bool = True) -> LeasedBatches:
        """The batches as shard 0's coordinator numbers them (--data-assignment leases); not
        `shuffle` (--no-shuffle): in the data's order every epoch."""
        return LeasedBatches(self, batch_size, seed, shuffle)

    def warm_up_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A batch to run once before the first timed step: the training set's first."""
        return self.x_train[:batch_size], self.y_train[:batch_size]

    def describe(self) -> str:
        kind = "regression" if self.num_classes == 0 else f"{self.num_classes} classes"
        shape = (f"{self.features} features" if len(self.sample_shape) == 1
                 else f"samples of shape {self.sample_shape}")
        return f"dataset {self.name}: {self.num_train} train / {self.num_test} test samples, {shape}, {kind}"


@dataclass(frozen=True, eq=False)
class Stream:
    """One worker's training data as (x, y) batches from Python, for data larger than memory.

    `source` is an iterable of batches, or a function returning one: it is called each epoch,
    so a generator that reads the user's files starts over. Each worker is given its own
    batches (the split by rank is the caller's, as with TensorFlow's per-worker datasets);
    in sync mode every worker should yield the same number per epoch. x_test/y_test are the
    chief's evaluation set, or None (no evaluation).
    """
    name: str
    source: object
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    num_classes: int = 0

    def steps(self, num_workers: int, batch_size: int) -> int:
        return 0   # unknown until the source runs out

    def epoch(self, rank: int, num_workers: int, batch_size: int, seed: int,
              epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        batches = self.source() if callable(self.source) else self.source
        if epoch > 0 and iter(batches) is batches and not callable(self.source):
            raise DataError(f"{self.name}: an iterator runs out after one epoch; for --epochs > 1 "
                            "pass a function that returns a fresh one")
        for i, batch in enumerate(batches):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise DataError(f"{self.name}: batch {i} is a {type(batch).__name__}, not an (x, y) pair")
            x = np.asarray(batch[0])
            if x.ndim and x.shape[0] == 0:   # its gradient would weigh nothing (docs/semantics.md)
                raise DataError(f"{self.name}: batch {i} is empty; a step trains on at least one sample")
            yield x, np.asarray(batch[1])

    def fit(self, model) -> Stream:
        """The test set as `model` takes it (its batches are checked by the model as they
        come); as it is without a test set or a model's `check_data`."""
        check = getattr(model, "check_data", None)
        if check is None or self.x_test is None:
            return self
        x_test = check(self.x_test, self.y_test, f"{self.name} test set")
        return Stream(self.name, self.source, x_test, self.y_test, self.num_classes)

    def warm_up_batch(self, batch_size: int) -> None:
        """None: the batches are the user's to read once, so the first step warms up."""
        return None

    def describe(self) -> str:
        test = "no test set" if self.x_test is None else f"{len(self.x_test)} test samples"
        return f"dataset {self.name}: batches from Python, {test}"


def describe(ds) -> str:
    """One line for the worker's log: what it trains on (each kind of data says)."""
    return ds.describe()


def check_int(flag: str, value: int, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{flag}: must be an integer >= {low}, got {value!r}")


def check_rank(rank: int, num_workers: int) -> None:
    check_int("--num-workers", num_workers, 1)
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_workers:
        raise ConfigError(f"--rank: must be in [0, {num_workers}) for {num_workers} workers, got {rank!r}")


def as_task(ds: Dataset, task: str) -> Dataset:
    """Integer labels as float targets when regression was asked for (float y is already)."""
    if task == "classification" or ds.num_classes == 0:
        return ds
    return Dataset(ds.name, ds.x_train, ds.y_train.astype(np.float32), ds.x_test,
                   ds.y_test.astype(np.float32), 0, ds.padded)


# ---------------------------------------------------------------- per-rank slices of an epoch

def steps_per_epoch(num_train: int, num_workers: int, batch_size: int) -> int:
    """Steps every worker runs per epoch: the batches of its equal share of the data, the last one
    smaller when batch_size does not divide the share (as Keras: 54,000 at 128 are 422 steps)."""
    check_int("--num-workers", num_workers, 1)
    check_int("--batch-size", batch_size, 1)
    per_worker = num_train // num_workers
    steps = -(-per_worker // batch_size)
    if per_worker < batch_size:
        raise ConfigError(f"--batch-size: {batch_size} is larger than each worker's slice of {per_worker} "
                          f"samples ({num_train} training samples / {num_workers} workers)")
    return steps


def epoch_indices(num_train: int, rank: int, num_workers: int, seed: int, epoch: int) -> np.ndarray:
    """Rank's block of this epoch's permutation of range(num_train), length num_train // num_workers."""
    check_rank(rank, num_workers)
    check_int("--seed", seed, 0)
    check_int("epoch", epoch, 0)
    check_int("num_train", num_train, 0)
    per_worker = num_train // num_workers
    # Every rank draws the same permutation (same seed), so the blocks partition it.
    order = np.random.default_rng(seed + epoch).permutation(num_train)
    return order[rank * per_worker:(rank + 1) * per_worker].copy()  # copy: don't pin the whole order


def iterate_batches(ds: Dataset, rank: int, num_workers: int, batch_size: int, seed: int,
                    epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Exactly steps_per_epoch(...) batches (x, y) of batch_size rows from this rank's block, the last
    one with what is left of the block (batch_size rows or fewer)."""
    # Validate now, not at the first next(): a bad flag should fail where it is passed.
    steps = steps_per_epoch(ds.num_train, num_workers, batch_size)
    order = epoch_indices(ds.num_train, rank, num_workers, seed, epoch)
    return _batches(ds, order, steps, batch_size)


def _batches(ds: Dataset, order: np.ndarray, steps: int, batch_size: int):
    for step in range(steps):
        take = order[step * batch_size:(step + 1) * batch_size]
        yield ds.x_train[take], ds.y_train[take]  # fancy indexing: fresh C-contiguous copies


class ChunkedBatches(abc.ABC):
    """The epoch's batches as shard 0's coordinator numbers them (--data-assignment leases), read a
    chunk at a time: `read(epoch, first, end)` gives batches first .. end - 1 (one chunk, or the
    rest of one), each (x, y); a batch may be empty (0 samples), and the worker then skips it.
    Subclasses set num_batches and fingerprint (what shard 0 compares between workers)."""

    num_batches: int
    fingerprint: str

    def __init__(self, chunk_batches: int) -> None:
        check_int("--chunk-batches", chunk_batches, 1)
        self.chunk_batches = chunk_batches
        self._key, self._first, self._batches = None, 0, []

    def batch(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        chunk = b // self.chunk_batches
        if (epoch, chunk) != self._key:
            first = chunk * self.chunk_batches
            self._batches = self.read(epoch, first, min(first + self.chunk_batches, self.num_batches))
            self._key, self._first = (epoch, chunk), first
        return self._batches[b - self._first]

    @abc.abstractmethod
    def read(self, epoch: int, first: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Batches first .. end - 1 of `epoch` (each source reads its own way: byte ranges of a
        Criteo file, sample ranges of criteo-synthetic)."""


class LeasedBatches:
    """The epoch's batches as shard 0's coordinator numbers them (--data-assignment leases): epoch e's
    permutation of the training set from `seed + e` (as the slices draw it; not `shuffle`: the
    training set in its order), cut into ceil(num_train / batch_size) batches, the last one with
    the rest (as Keras: 54,000 samples at 128 are 422 batches, the last of 112); batch b of epoch e
    is the same samples on every worker."""

    def __init__(self, ds: Dataset, batch_size: int, seed: int, shuffle: bool = True) -> None:
        check_int("--batch-size", batch_size, 1)
        check_int("--seed", seed, 0)
        self.ds, self.batch_size, self.seed, self.shuffle = ds, batch_size, seed, shuffle
        self.num_batches = -(-ds.num_train // batch_size)
        if ds.num_train < batch_size:
            raise ConfigError(f"--batch-size: {batch_size} is larger than the {ds.num_train} "
                              f"training samples")
        self.fingerprint = fingerprint(ds)
        self._epoch, self._order = -1, None

    def batch(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.shuffle:
            at = slice(b * self.batch_size, (b + 1) * self.batch_size)
            return self.ds.x_train[at], self.ds.y_train[at]
        if epoch != self._epoch:
            order = np.random.default_rng(self.seed + epoch).permutation(self.ds.num_train)
            self._epoch, self._order = epoch, order
        take = self._order[b * self.batch_size:(b + 1) * self.batch_size]
        return self.ds.x_train[take], self.ds.y_train[take]


def fingerprint(ds: Dataset) -> str:
    """What a worker's training set is, for shard 0 to refuse a worker reading other data: its
    length and a hash of its first and last samples (cheap, and different for another file)."""
    h = hashlib.sha256(str((ds.num_train, ds.sample_shape, ds.num_classes)).encode())
    for i in (0, ds.num_train - 1):
        h.update(np.ascontiguousarray(ds.x_train[i]).tobytes())
        h.update(np.ascontiguousarray(ds.y_train[i]).tobytes())
    return f"{ds.num_train}:{h.hexdigest()[:16]}"


def one_line(e: BaseException) -> str:
    """The exception as one line; for a failed connection just its reason ("Name or service not known")."""
    network = isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError)
    reason = e.reason if network else e
    return " ".join(str(reason).split()) or type(e).__name__
