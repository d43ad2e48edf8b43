"""DINAttention (pserver.layers.sequence): DIN's target attention over a padded sequence feature.
Its output against a float64 NumPy twin written from the paper's formula (the concatenation
[q, k, q - k, q * k] through the MLP, padding weighed 0, an optional masked softmax), padding
that changes nothing (neither output nor gradient), gradients against finite differences, the
config and a saved model's round trip, refusals, and a planted task that target attention
learns and mean pooling cannot: whether the user's history holds the candidate item."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.keras import layers
from pserver.layers import LAYERS, DINAttention
from pserver.models import metrics
from tests.support.gradients import assert_fd

FAST = settings(max_examples=30, deadline=None)
ACTIVATIONS = ["sigmoid", "relu", "tanh", "linear"]


# -- the twin: the paper's formula in float64 --------------------------------------------------------

def _act(name, z):
    return {"relu": lambda: np.maximum(z, 0), "sigmoid": lambda: 1 / (1 + np.exp(-z)),
            "tanh": lambda: np.tanh(z), "linear": lambda: z}[name]()


def din_twin(q, keys, keep, w, hidden, activation, normalize):
    """sum_j a_j k_j over the positions `keep` marks, a_j = MLP([q, k_j, q - k_j, q * k_j]) (the
    hidden layers with `activation`, then one linear unit); with normalize="softmax" the a_j are
    a softmax over the kept positions. No kept position: zeros."""
    qq = np.broadcast_to(q[:, None, :], keys.shape)
    h = np.concatenate([qq, keys, qq - keys, qq * keys], axis=-1)
    for i, name in enumerate([f"hidden_{i}" for i in range(len(hidden))] + ["score"]):
        h = (h if i == 0 else _act(activation, h)) @ w[f"{name}/kernel"] + w[f"{name}/bias"]
    s = h[..., 0]
    if normalize == "softmax":
        top = np.where(keep, s, -np.inf).max(axis=-1, keepdims=True)
        e = np.where(keep, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
        total = e.sum(axis=-1, keepdims=True)
        a = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    else:
        a = np.where(keep, s, 0)
    return np.einsum("nl,nld->nd", a, keys)


def _views(core, seed):
    """A random float64 weight vector for the model, and the DIN layer's views by short name."""
    w = np.random.default_rng(seed).normal(0, 0.5, core.layout.total)
    return w, {k.split("/", 1)[1]: v for k, v in core.layout.views(w).items() if k.startswith("din/")}


@FAST
@given(n=st.integers(1, 4), length=st.integers(1, 6), d=st.integers(1, 5),
       hidden=st.sampled_from([(), (3,), (4, 2)]), activation=st.sampled_from(ACTIVATIONS),
       normalize=st.sampled_from([None, "softmax"]), padding=st.sampled_from([None, 0, -1]),
       empty_row=st.booleans(), seed=st.integers(0, 2**16))
def test_din_equals_the_numpy_twin(n, length, d, hidden, activation, normalize, padding, empty_row, seed):
    """Catches: the four parts of the activation unit's input in another order or q - k's sign
    flipped (the first kernel's blocks), an activation on the score unit, the softmax taken over
    padding too or not at all, padding weighed (with either padding id), a list of padding only
    not giving zeros."""
    q_in, k_in = keras.Input(shape=(d,)), keras.Input(shape=(length, d))
    inputs = [q_in, k_in] + ([] if padding is None else [keras.Input(shape=(length,), dtype="int64")])
    din = DINAttention(hidden, activation=activation, normalize=normalize, mask_zero=padding == 0,
                       padding_id=padding if padding == -1 else None, name="din")
    core = keras.Model(inputs, din(inputs))._core.use_backend("reference")
    w, views = _views(core, seed)
    rng = np.random.default_rng(seed + 1)
    q, keys = rng.normal(size=(n, d)), rng.normal(size=(n, length, d))
    keep = rng.random((n, length)) < (rng.uniform(0.2, 1.0) if padding is not None else 2.0)
    if empty_row and padding is not None:
        keep[0] = False
    ids = np.where(keep, rng.integers(1, 9, (n, length)) + (padding or 0), padding or 0)
    x = [q, keys] + ([] if padding is None else [ids])
    got = core.predict(w, core.pack(x))
    expected = din_twin(q, keys, keep, views, hidden, activation, normalize)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    if empty_row and padding is not None:
        assert not got[0].any()


# -- padding and gradients: one shared table, the candidate first and the history after it ---------

V, D, L = 7, 3, 5
ITEMS = np.array([[3, 1, 4, 0, 0], [2, 2, 5, 6, 1], [5, 0, 0, 0, 0], [1, 6, 0, 0, 0]])   # 0 pads
CANDIDATES = np.array([4, 3, 6, 1])                                                     # none is 0


def items_model(normalize, activation="sigmoid", hidden=(4, 3)):
    """keras.Model on one input (the candidate, then the history: (L + 1,) ids), one Embedding
    table for both, DINAttention(mask_zero=True) reading the history's ids, a Dense on top; its
    core on the reference backend (float64)."""
    items = keras.Input(shape=(L + 1,), dtype="int64", name="items")
    e = layers.Embedding(V, D, name="items_emb")(items)
    din = DINAttention(hidden, activation=activation, normalize=normalize, mask_zero=True, name="din")
    model = keras.Model(items, layers.Dense(1, name="out")(din([e[:, 0, :], e[:, 1:, :], items[:, 1:]])))
    model.compile(optimizer="sgd", loss="mse")
    return model._core.use_backend("reference")


def _batch():
    x = np.concatenate([CANDIDATES[:, None], ITEMS], axis=1)
    return x, np.random.default_rng(0).normal(size=(len(x), 1))


@pytest.mark.parametrize("normalize", [None, "softmax"])
def test_padding_changes_neither_the_output_nor_a_gradient(normalize):
    """Row 0 of the table is read only at padded positions (no candidate is 0): its gradient is
    exactly zero, and changing it leaves the loss and every other gradient exactly as they were.
    Catches padding that is weighed, or masked in the output but not in the scores' gradient (the
    MLP's weights would move with the padding's row), or left in the softmax's normalisation."""
    core = items_model(normalize)
    x, y = _batch()
    w = core.init_params(0).astype(np.float64)
    w += np.random.default_rng(1).normal(0, 0.3, w.shape)
    g = np.zeros_like(w)
    loss = core.loss_and_grad(w, x, y, g)
    assert not core.layout.views(g)["items_emb/embeddings"][0].any()
    assert core.layout.views(g)["items_emb/embeddings"][1:].any()
    moved = w.copy()
    core.layout.views(moved)["items_emb/embeddings"][0] = [5.0, -7.0, 11.0]
    g_moved = np.zeros_like(w)
    assert core.loss_and_grad(moved, x, y, g_moved) == loss
    np.testing.assert_array_equal(g_moved, g)


@pytest.mark.parametrize("normalize, activation", [(None, "sigmoid"), ("softmax", "tanh"), (None, "linear")])
def test_gradients_equal_finite_differences(normalize, activation):
    """The table's rows (through q, the keys and the scores' products), the MLP's kernels and
    biases, with a list of padding only in the batch. Catches a wrong VJP of the first kernel's
    blocks (sliced from one weight, one used twice), of the broadcast of q over the positions,
    of the masked softmax."""
    core = items_model(normalize, activation)
    x, y = _batch()
    assert_fd(core, x, y, seed=2)


# -- configs, saving, refusals -------------------------------------------------------------------------

def test_get_config_and_from_config_keep_every_argument():
    options = dict(hidden_units=[6, 3], activation="relu", normalize="softmax", padding_id=-1,
                   kernel_initializer="he_uniform", bias_initializer="ones", name="din")
    config = json.loads(json.dumps(DINAttention(**options).get_config()))
    again = DINAttention.from_config(config)
    assert again.get_config() == config
    assert (again.hidden_units, again.activation, again.normalize, again.padding) == ((6, 3), "relu",
                                                                                     "softmax", -1)
    assert LAYERS.get("DINAttention") is DINAttention and layers.DINAttention is DINAttention
    defaults = DINAttention().get_config()
    names = ("hidden_units", "activation", "normalize", "mask_zero", "padding_id")
    assert {k: defaults[k] for k in names} == {"hidden_units": [80, 40], "activation": "sigmoid",
                                               "normalize": None, "mask_zero": False, "padding_id": None}


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


@pytest.mark.parametrize("options, message", [
    (dict(hidden_units=(8, 0)), "DINAttention: hidden_units must be a positive integer, got 0"),
    (dict(activation="softmax"), "DINAttention: activation='softmax' is not a hidden unit's; choose one of "
                                 "linear, relu, sigmoid, tanh (or None)"),
    (dict(activation="dice"), "DINAttention: unknown activation 'dice'"),
    (dict(normalize="sum"), "DINAttention: normalize must be None (DIN's weights as they are) or 'softmax', "
                            "got 'sum'"),
    (dict(mask_zero=True, padding_id=-1), "DINAttention: padding_id must be an integer id (0 with "
                                          "mask_zero=True), got -1"),
])
def test_bad_arguments_are_refused(options, message):
    with pytest.raises(ConfigError) as e:
        DINAttention(**options)
    assert _one_line(e).startswith(message)


def _inputs(*shapes):
    return [keras.Input(shape=s, dtype="int64" if len(s) == 1 and s != (4,) else "float32") for s in shapes]


@pytest.mark.parametrize("options, shapes, message", [
    (dict(), [(4,), (6, 5)], "takes query (d,) and keys (length, d) of one d (shapes without the batch); got "
                             "query (4,) and keys (6, 5)"),
    (dict(mask_zero=True), [(4,), (6, 4), (5,)], "ids (5,) must be (length,) with the keys' length 6"),
    (dict(), [(4,), (6, 4), (6,)], "the list's ids (a third input) mark its padding: say which id pads"),
    (dict(padding_id=-1), [(4,), (6, 4)], "mask_zero or padding_id needs the list's ids: call it on "
                                          "[query, keys, ids]"),
    (dict(), [(4,)], "is called on [query, keys] or [query, keys, ids], got 1 tensors"),
])
def test_inputs_that_do_not_fit_are_refused_naming_their_shapes(options, shapes, message):
    with pytest.raises(ConfigError) as e:
        DINAttention(**options)(_inputs(*shapes))
    assert _one_line(e).startswith(f"layer din_attention (DINAttention): {message}")


# -- a planted task: is the candidate in the history? ---------------------------------------------------

ITEMS_N, HISTORY = 100, 20


def membership(n, seed):
    """Histories of 1 to HISTORY distinct items of 1..ITEMS_N (0 pads) and a candidate that is one
    of them (label 1) or not (label 0), half and half: as the candidate first, then the history."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, HISTORY + 1, n)
    history = np.zeros((n, HISTORY), np.int64)
    candidate = np.empty(n, np.int64)
    y = (rng.random(n) < 0.5).astype(np.float32)
    for i, m in enumerate(lengths):
        drawn = rng.permutation(np.arange(1, ITEMS_N + 1))[:m + 1]
        history[i, :m] = drawn[:m]
        candidate[i] = drawn[rng.integers(0, m)] if y[i] else drawn[m]
    return np.concatenate([candidate[:, None], history], axis=1), y


@pytest.fixture
def seeded(monkeypatch):
    """keras.utils.set_random_seed sets the run's seed in os.environ: undone after the test."""
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")
    keras.utils.set_random_seed(1)


def _membership_model(pooling):
    """The candidate's embedding and the history's pooled one, their product, an MLP; one table.
    Mean pooling averages the history's embeddings that are not padding (with ops)."""
    items = keras.Input(shape=(HISTORY + 1,), dtype="int64", name="items")
    e = layers.Embedding(ITEMS_N + 1, 4)(items)
    q, keys, ids = e[:, 0, :], e[:, 1:, :], items[:, 1:]
    if pooling == "din":
        pooled = DINAttention(hidden_units=(16, 8), mask_zero=True)([q, keys, ids])
    else:
        keep = keras.ops.expand_dims(keras.ops.cast(keras.ops.not_equal(ids, 0), "float32"), -1)
        pooled = keras.ops.sum(keys * keep, axis=1) / keras.ops.maximum(keras.ops.sum(keep, axis=1), 1.0)
    h = layers.Dense(16, activation="relu")(layers.Concatenate()([pooled, q, layers.Multiply()([pooled, q])]))
    model = keras.Model(items, layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def test_target_attention_learns_membership_that_mean_pooling_cannot(seeded):
    """Whether the candidate is among up to 20 of 100 items, embedded in 4 dimensions: the mean of
    the history's embeddings cannot tell (100 items are far from orthogonal in 4 dimensions), DIN
    scores each position against the candidate and can. Catches an attention that does not depend
    on the candidate, weights that do not reach the output or whose gradient points the wrong way
    (each fails the first assertion; mean pooling, measured here, stays near 0.7)."""
    x, y = membership(4000, 0)
    x_test, y_test = membership(2000, 1)
    auc = {}
    for pooling in ("din", "mean"):
        model = _membership_model(pooling)
        model.fit(x, y, epochs=8, batch_size=64, verbose=0)
        auc[pooling] = metrics.auc(model.predict(x_test, verbose=0)[:, 0], y_test)
    assert auc["din"] > 0.95, auc
    assert auc["din"] - auc["mean"] > 0.2, auc


def test_a_sparse_table_shared_by_the_candidate_and_the_history_trains_and_reloads(seeded, tmp_path):
    """The recommender's form: one sparse table ("items") on the shards for the candidate and the
    history, an unpooled Embedding (combiner=None) over the history, and its ids again as an input
    of their own for the padding (a sparse Embedding reads its input as row positions). Catches
    a sparse sequence's rows or the shared table's gradients not reaching the attention, and a
    reloaded model that predicts otherwise."""
    history = keras.Input(shape=(HISTORY,), dtype="int64", name="history")
    history_ids = keras.Input(shape=(HISTORY,), dtype="int64", name="history_ids")
    candidate = keras.Input(shape=(), dtype="int64", name="candidate")
    table = dict(sparse=True, table="items", optimizer="adam", lr=0.02)
    keys = layers.Embedding(None, 4, **table)(history)
    q = layers.Embedding(None, 4, **table)(candidate)
    pooled = DINAttention(hidden_units=(16, 8), mask_zero=True)([q, keys, history_ids])
    h = layers.Dense(16, activation="relu")(layers.Concatenate()([pooled, q, layers.Multiply()([pooled, q])]))
    model = keras.Model({"history": history, "history_ids": history_ids, "candidate": candidate},
                        layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"])

    def split(items):
        return {"history": items[:, 1:], "history_ids": items[:, 1:], "candidate": items[:, 0]}

    x, y = membership(4000, 0)
    x_test, y_test = membership(1000, 1)
    model.fit(split(x), y, epochs=8, batch_size=64, verbose=0)
    assert [t.name for t in model._core.sparse_tables] == ["items"]
    predicted = model.predict(split(x_test), verbose=0)
    assert metrics.auc(predicted[:, 0], y_test) > 0.9
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(again.predict(split(x_test), verbose=0), predicted)
