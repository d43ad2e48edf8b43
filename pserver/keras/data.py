"""fit's data when it is not arrays: a Python generator (or any iterator) of batches, or a
keras.utils.PyDataset, each batch (x, y) or (x, y, sample_weight), as Keras's.

Under `pserver run` each worker reads its part (docs/semantics.md, "Keras's fit on generators
and PyDatasets"): a PyDataset can be cut, so worker r of N takes the epoch's batches at
positions r, r + N, ... (of its order: shuffled per epoch from the run's seed when shuffle=True,
the same order on every worker), the last len % N batches sitting the epoch out so that every
worker runs as many steps; a generator cannot be cut, so every worker runs its own (the
script's) and must yield its own part, as in Keras's multi-worker training. The batches become
the worker's Stream (pserver.data.Stream), each one read when it is trained.
"""

from __future__ import annotations

import itertools

import numpy as np

from pserver.errors import ConfigError, DataError


class PyDataset:
    """keras.utils.PyDataset: subclass it with `__len__` (batches per epoch) and
    `__getitem__(index)` (batch `index`: (x, y) or (x, y, sample_weight)); `on_epoch_begin`
    and `on_epoch_end` are called around each epoch. `workers`, `use_multiprocessing` and
    `max_queue_size` are Keras's reading options: pserver reads the batches in order on the
    worker's thread, so they are accepted and change nothing."""

    def __init__(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        self._workers, self._use_multiprocessing = workers, use_multiprocessing
        self._max_queue_size = max_queue_size

    @property
    def workers(self):
        return self._workers

    @property
    def use_multiprocessing(self):
        return self._use_multiprocessing

    @property
    def max_queue_size(self):
        return self._max_queue_size

    def __len__(self):
        raise NotImplementedError(f"{type(self).__name__}: a PyDataset defines __len__")

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__}: a PyDataset defines __getitem__")

    @property
    def num_batches(self):
        return len(self)

    def on_epoch_begin(self):
        pass

    def on_epoch_end(self):
        pass


def streamed(x) -> bool:
    """Whether fit's x is batches (a PyDataset, a generator or another iterator), not arrays."""
    return isinstance(x, PyDataset) or (iter(x) is x if hasattr(x, "__iter__") and
                                        not isinstance(x, (np.ndarray, list, tuple, dict)) else False)


class Batches:
    """A worker's batches of a generator or a PyDataset, per epoch (`epoch()`, the Stream's
    source), each as `convert((x, y, sample_weight or None))` makes it; `first`: the first batch,
    read before training (it traces the model and says whether the batches carry weights)."""

    def __init__(self, source, steps_per_epoch, shuffle: bool, rank: int, workers: int, seed: int):
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ConfigError(f"fit: steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
        self.source, self.shuffle, self.rank, self.workers, self.seed = source, shuffle, rank, workers, seed
        self.dataset = isinstance(source, PyDataset)
        self.steps = steps_per_epoch
        if self.dataset:
            total = len(source) if steps_per_epoch is None else min(steps_per_epoch, len(source))
            if total < workers:
                raise ConfigError(f"fit: the PyDataset has {total} batches an epoch, fewer than the "
                                  f"{workers} workers that share them")
            self.steps = total
        self.epochs_read = 0
        first = source[0] if self.dataset else next(source, None)
        if first is None:
            raise DataError("fit: the generator yields no batch")
        self.first = _batch(first, 0)
        self.convert = None           # set by fit once it knows the model's labels and weights
        self._kept = None if self.dataset else self.first      # a generator's first batch, read already

    def epoch(self):
        """This epoch's batches, converted; a PyDataset's on_epoch_end once they are read."""
        epoch, self.epochs_read = self.epochs_read, self.epochs_read + 1
        if self.dataset:
            return self._dataset_epoch(epoch)
        batches = (_batch(b, i) for i, b in enumerate(self.source))
        if self._kept is not None:
            batches, self._kept = itertools.chain([self._kept], batches), None
        # A generator goes on from where the last epoch left it, as Keras's fit reads one.
        return map(self.convert, batches if self.steps is None else itertools.islice(batches, self.steps))

    def _dataset_epoch(self, epoch: int):
        order = np.arange(self.steps)
        if self.shuffle:            # the same permutation on every worker: their parts stay disjoint
            order = np.random.default_rng(self.seed + epoch).permutation(self.steps)
        mine = order[self.rank:self.steps - self.steps % self.workers:self.workers]
        self.source.on_epoch_begin()
        for i in mine:
            yield self.convert(_batch(self.source[int(i)], int(i)))
        self.source.on_epoch_end()


def _batch(b, i: int) -> tuple:
    """(x, y, sample_weight or None) of a batch; DataError naming it otherwise."""
    if not isinstance(b, (tuple, list)) or len(b) not in (2, 3):
        raise DataError(f"fit: batch {i} is a {type(b).__name__}"
                        f"{f' of {len(b)} items' if isinstance(b, (tuple, list)) else ''}, "
                        "not (x, y) or (x, y, sample_weight)")
    return b[0], b[1], b[2] if len(b) == 3 else None
