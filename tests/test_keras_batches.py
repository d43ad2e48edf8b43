"""fit on a generator of batches and on a keras.utils.PyDataset (pserver.keras.data): the same
training as the arrays they cut, a PyDataset's batches shared between workers without overlap.
Each test names the bug it catches."""

from __future__ import annotations

import numpy as np
import pytest

import pserver.keras as keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers
from pserver.keras.data import Batches


def blobs(n=192, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, d))
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(size=(n, d))).astype(np.float32), y


X, Y = blobs()
SW = np.linspace(0.0, 2.0, len(Y))


def _model(w0=None):
    model = keras.Sequential([keras.Input(shape=(6,)), layers.Dense(8, activation="relu"),
                              layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if w0 is not None:
        model.set_weights([a.copy() for a in w0])
    return model


def _same(a, b) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))


class Batched(keras.utils.PyDataset):
    """X, Y in batches of 32 (with SW when `weighted`), counting its epochs' ends."""

    def __init__(self, weighted=False, **kwargs):
        super().__init__(**kwargs)
        self.weighted, self.ends, self.read = weighted, 0, []

    def __len__(self):
        return len(Y) // 32

    def __getitem__(self, i):
        self.read.append(i)
        at = slice(32 * i, 32 * (i + 1))
        return (X[at], Y[at], SW[at]) if self.weighted else (X[at], Y[at])

    def on_epoch_end(self):
        self.ends += 1


def _generator(weighted=False):
    while True:          # endless, as Keras's generators: steps_per_epoch ends the epochs
        for i in range(len(Y) // 32):
            at = slice(32 * i, 32 * (i + 1))
            yield (X[at], Y[at], SW[at]) if weighted else (X[at], Y[at])


@pytest.mark.parametrize("weighted", [False, True])
def test_a_generator_and_a_pydataset_train_as_the_arrays_they_cut(weighted):
    """Catches: a generator started over each epoch (Keras's goes on), its first batch (read
    to trace the model) trained twice or not at all, a PyDataset read out of order with
    shuffle=False or its on_epoch_end not called, a batch's sample weights dropped."""
    arrays = _model()
    w0 = arrays.get_weights()
    h = arrays.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False,
                   sample_weight=SW if weighted else None).history
    gen = _model(w0)
    assert gen.fit(_generator(weighted), steps_per_epoch=6, epochs=2, verbose=0).history == h
    assert _same(arrays, gen)
    ds = Batched(weighted)
    py = _model(w0)
    assert py.fit(ds, epochs=2, verbose=0, shuffle=False).history == h
    assert _same(arrays, py) and ds.ends == 2


def test_a_pydataset_s_batches_are_shared_between_workers_without_overlap():
    """Worker r of 3 takes positions r, r + 3, ... of the epoch's (shuffled) order, every worker
    the same number. Catches: workers drawing different permutations (overlap), a worker given
    one step more than another (sync would wait), steps_per_epoch not capping the batches."""
    for steps, shuffle in ((None, True), (None, False), (5, True)):
        reads = []
        for rank in range(3):
            ds = Batched()
            batches = Batches(ds, steps, shuffle, rank, 3, seed=7)
            batches.convert = lambda b: b
            ds.read.clear()                   # the first batch, read when fit starts
            for epoch in range(2):
                list(batches.epoch())
            reads.append(ds.read)
        per_epoch = [[r[e * len(r) // 2:(e + 1) * len(r) // 2] for r in reads] for e in range(2)]
        total = 6 if steps is None else 5
        for epoch in per_epoch:
            together = sorted(i for r in epoch for i in r)
            assert len(set(together)) == len(together) == total - total % 3
            assert {len(r) for r in epoch} == {total // 3} and max(together) < total
        assert (per_epoch[0] != per_epoch[1]) == shuffle


@pytest.mark.parametrize("kwargs, error, words", [
    ({"x": "gen", "epochs": 2}, ConfigError, "steps_per_epoch"),
    ({"x": "gen", "batch_size": 32, "steps_per_epoch": 2}, ConfigError, "batch_size"),
    ({"x": "gen", "y": Y, "steps_per_epoch": 2}, ConfigError, "y="),
    ({"x": iter([(X[:4],)]), "steps_per_epoch": 1}, DataError, "batch 0 is a tuple of 1 items"),
    ({"x": iter([(X[:4], Y[:4]), (X[:4], Y[:4], SW[:4])]), "steps_per_epoch": 2}, DataError,
     "every batch has a sample_weight"),
    ({"x": X, "y": Y, "steps_per_epoch": 2}, ConfigError, "steps_per_epoch"),
    ({"x": iter([])}, DataError, "yields no batch"),
])
def test_what_batches_cannot_be_is_refused_in_one_line(kwargs, error, words):
    """Catches: a generator's epochs > 1 without an end (the second would read nothing), a
    global batch_size applied to batches the user made, a malformed batch failing deep in
    the loop."""
    if isinstance(kwargs["x"], str):
        kwargs["x"] = _generator()
    with pytest.raises(error, match=words):
        _model().fit(verbose=0, **kwargs)


def test_a_stopping_callback_with_batches_from_python_is_refused_on_a_cluster_only():
    """Catches: EarlyStopping on a generator's cluster fit, where each worker decides on its own
    logs (no lease coordinator shares the chief's): one worker would stop and the others wait."""
    from pserver.keras.models import _refuse_stopping
    with pytest.raises(ConfigError, match="EarlyStopping with a generator or a PyDataset on a cluster"):
        _refuse_stopping([keras.callbacks.CSVLogger("x.csv"), keras.callbacks.EarlyStopping()], 2)
    _refuse_stopping([keras.callbacks.EarlyStopping()], 1)      # one worker: Keras's own fit
    ds = Batched()
    history = _model().fit(ds, epochs=3, verbose=0, validation_data=(X, Y),
                           callbacks=[keras.callbacks.EarlyStopping(min_delta=10.0, patience=0)])
    assert len(history.history["loss"]) == 2


def test_fewer_samples_than_a_batch_train_as_one_batch_of_them_all(monkeypatch):
    """Keras's fit on 8 samples at the default batch_size=32 trains one batch of 8 per epoch.
    Catches the refusal it met ("--batch-size: 32 is larger than each worker's slice"), and a
    batch padded or repeated (the weights would differ from batch_size=8's)."""
    monkeypatch.setenv("PSERVER_RUN_SEED", "0")       # set_random_seed sets it: removed after the test
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 2, 8).astype(np.float32)
    finals = []
    for batch_size in (None, 8):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="sgd", loss="binary_crossentropy")
        history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0)
        assert len(history.history["loss"]) == 2
        finals.append(model.get_weights())
    for a, b in zip(*finals):
        np.testing.assert_array_equal(a, b)
