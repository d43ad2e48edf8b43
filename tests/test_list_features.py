"""List features (multi-hot: several ids per sample, pooled into one vector): a padded batch's
lookup leaves padding out, a pooled sparse table trains exactly as the same pooled dense table,
the dense one's gradient is the finite differences', lists given as Python lists are padded, and
bad lists and arguments are refused with one line."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers
from pserver.layers import Dense, Embedding
from pserver.models import Functional
from pserver.sparse import PaddedIds, TableLookup
from tests.support.gradients import assert_fd

COMBINERS = ["sum", "mean", "sqrtn"]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_a_padded_lookup_leaves_padding_out(n, length, vocab, seed):
    """Padding (0) is in no lookup's ids (the worker would pull, and push, a row for it) and its
    inverse is -1 (the kernels' padding); every other id is found where uniq says."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, length))
    lk = TableLookup.of(PaddedIds(ids, 0), 3)
    keep = ids != 0
    assert 0 not in lk.uniq and len(set(lk.uniq.tolist())) == lk.uniq.size
    assert (lk.inverse[~keep] == -1).all()
    assert np.array_equal(lk.uniq[lk.inverse[keep]].astype(np.int64), ids[keep])
    assert lk.rows.shape == lk.grads.shape == (lk.uniq.size, 3)


def _pooled(sparse: bool, combiner: str, vocab: int, mask_zero=True, weighted=False) -> Functional:
    items = keras.Input(shape=(4,), dtype="int64", name="items")
    table = Embedding(None if sparse else vocab, 3, sparse=sparse, mask_zero=mask_zero, combiner=combiner,
                      name="items_emb")
    inputs = {"items": items}
    if weighted:
        inputs["weights"] = keras.Input(shape=(4,), name="weights")
    out = Dense(1, name="out")(table([items, inputs["weights"]]) if weighted else table(items))
    model = Functional(inputs if sparse or weighted else items, out, loss="binary_crossentropy")
    model.use_backend("reference")
    return model


LISTS = np.array([[3, 5, 5, 0], [0, 0, 0, 0], [1, 2, 3, 4], [4, 0, 0, 0], [2, 2, 1, 0]])
# float32 values (a record's float field holds float32), so both paths weigh the same numbers
WEIGHTS = np.random.default_rng(3).uniform(0.2, 2.0, LISTS.shape).astype(np.float32).astype(np.float64)
Y = np.array([1, 0, 1, 0, 1], np.float64)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_a_pooled_sparse_table_trains_as_the_same_dense_table(combiner, weighted):
    """The sparse model (rows from the shards, padding left out of the lookup) and a dense
    Embedding of the same rows give the same loss, the same dense gradient, and row gradients
    equal to the dense table's at each id; id 0's row gets no gradient. Catches padding read as
    id 0's row, a divisor that counts padding, the sparse path's gradients not summed per id, or
    a list's weights lost on one path."""
    dense, sparse = (_pooled(is_sparse, combiner, 6, weighted=weighted) for is_sparse in (False, True))
    rng = np.random.default_rng(1)
    table = rng.standard_normal((6, 3))
    head = rng.standard_normal(4)              # Dense(1)'s kernel (3) and bias
    wd = np.concatenate([table.ravel(), head])
    assert dense.layout.total == wd.size and sparse.layout.total == head.size
    gd = np.full_like(wd, np.nan)
    loss_d = dense.loss_and_grad(wd, {"items": LISTS, "weights": WEIGHTS} if weighted else LISTS, Y, gd)
    x = np.zeros(len(LISTS), sparse.record)
    x["items"] = LISTS
    if weighted:
        x["weights"] = WEIGHTS
        unweighted = np.full_like(gd, np.nan)
        ones = {"items": LISTS, "weights": np.ones_like(WEIGHTS)}
        assert dense.loss_and_grad(wd, ones, Y, unweighted) != pytest.approx(loss_d)
    lk = TableLookup.of(sparse.batch_ids(x)[0], 3)
    rows = table[lk.uniq.astype(np.int64)]
    lk = TableLookup(lk.uniq, lk.inverse, rows, np.full(rows.shape, np.nan))
    gs = np.full_like(head, np.nan)
    loss_s = sparse.loss_and_grad(head.copy(), x, Y, gs, sparse=[lk])
    assert loss_s == pytest.approx(loss_d, rel=1e-12)
    np.testing.assert_allclose(gs, gd[table.size:], rtol=1e-12, atol=1e-15)
    dtable = gd[:table.size].reshape(table.shape)
    np.testing.assert_allclose(lk.grads, dtable[lk.uniq.astype(np.int64)], rtol=1e-12, atol=1e-15)
    assert not dtable[0].any()


@pytest.mark.parametrize("sparse", [False, True])
def test_padding_id_minus_1_pads_lists_of_ids_from_0(sparse):
    """padding_id=-1 (Keras-RS's tables, whose ids start at 0): the lists shifted down by one, 0 a
    real id and -1 the padding, with the table's rows shifted too, give mask_zero's loss. Catches
    -1 read as a row, or id 0 taken for padding."""
    def model(**pad):
        items = keras.Input(shape=(4,), dtype="int64", name="items")
        e = Embedding(None if sparse else 6, 3, sparse=sparse, combiner="mean", name="e", **pad)(items)
        out = Dense(1, name="out")(e)
        m = Functional({"items": items} if sparse else items, out, loss="binary_crossentropy")
        m.use_backend("reference")
        return m

    rng = np.random.default_rng(4)
    table, head = rng.standard_normal((6, 3)), rng.standard_normal(4)
    shifted = np.where(LISTS == 0, -1, LISTS - 1)
    losses = []
    cases = [(dict(mask_zero=True), LISTS, table), (dict(padding_id=-1), shifted, np.roll(table, -1, 0))]
    for pad, lists, rows in cases:
        m = model(**pad)
        if not sparse:
            losses.append(m.loss_and_grad(np.concatenate([rows.ravel(), head]), lists, Y, np.empty(22)))
            continue
        x = np.zeros(len(lists), m.record)
        x["items"] = lists
        lk = TableLookup.of(m.batch_ids(x)[0], 3)
        got = rows[lk.uniq.astype(np.int64)]
        lk = TableLookup(lk.uniq, lk.inverse, got, np.empty_like(got))
        losses.append(m.loss_and_grad(head.copy(), x, Y, np.empty(4), sparse=[lk]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("mask_zero, weighted", [(True, False), (False, False), (True, True)])
def test_a_pooled_dense_table_has_the_finite_differences_gradient(combiner, mask_zero, weighted):
    x = {"items": LISTS, "weights": WEIGHTS} if weighted else LISTS
    assert_fd(_pooled(False, combiner, 6, mask_zero, weighted), x, Y)


def _keras_lists(n=384, seed=0):
    rng = np.random.default_rng(seed)
    lists = [list(rng.integers(1, 300, rng.integers(0, 7))) for _ in range(n)]
    y = np.array([float(any(i % 4 == 0 for i in a)) for a in lists], np.float32)
    return lists, rng.normal(size=(n, 2)).astype("float32"), y


def _keras_model(combiner="sum", width=6):
    items = keras.Input(shape=(width,), dtype="int64", name="items")
    other = keras.Input(shape=(2,), name="other")
    e = layers.Embedding(None, 8, sparse=True, mask_zero=True, combiner=combiner, name="items_emb")(items)
    h = layers.Concatenate()([layers.Dense(16, activation="relu")(e), other])
    model = keras.Model({"items": items, "other": other}, layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


@pytest.fixture
def run_seed(monkeypatch):
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")


def test_keras_fit_takes_python_lists_and_id_0_never_becomes_a_row(run_seed, tmp_path):
    """fit, evaluate and predict on lists of different lengths (Python lists: padded with 0); the
    model learns which ids make a click; saved and loaded, it predicts the same, the padded array
    predicts as the lists do, and the saved table holds every id seen and not 0 (padding was
    never pushed). Catches lists refused or padded with a real id, and padding pulled as a row."""
    from pserver.persist.model_file import load
    keras.utils.set_random_seed(2)
    lists, other, y = _keras_lists()
    model = _keras_model()
    history = model.fit({"items": lists, "other": other}, y, epochs=10, batch_size=32, verbose=0)
    assert history.history["accuracy"][-1] > 0.9 > history.history["accuracy"][0]
    got = model.predict({"items": lists, "other": other})
    padded = np.zeros((len(lists), 6), np.int64)
    for j, a in enumerate(lists):
        padded[j, :len(a)] = a
    assert np.array_equal(model.predict({"items": padded, "other": other}), got)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    assert np.array_equal(again.predict({"items": lists, "other": other}), got)
    table = load(str(tmp_path / "m.keras")).tables[0]
    seen = np.unique(np.concatenate([np.asarray(a, np.int64) for a in lists if a])).astype(np.uint64)
    assert np.array_equal(np.sort(table.ids), seen)


def test_a_list_longer_than_the_input_or_not_of_ids_is_one_clear_error(run_seed):
    model = _keras_model(width=3)
    other, y = np.zeros((2, 2), np.float32), np.zeros(2, np.float32)
    with pytest.raises((ValueError, DataError), match=r"input 'items': list 1 has 4 ids; the input holds at "
                                                      r"most 3 \(Input\(shape=\(3,\)\)\)"):
        model.fit({"items": [[1], [1, 2, 3, 4]], "other": other}, y, verbose=0)
    with pytest.raises((ValueError, DataError), match=r"input 'items': list 0 holds float64 values"):
        model.fit({"items": [[1.5], [2]], "other": other}, y, verbose=0)


def test_keras_fit_takes_weighted_lists_as_python_lists(run_seed):
    """Keras-RS's weighted list feature: the layer called on [ids, weights], both given as Python
    lists of the same lengths (weights padded with 0). The label is whether a list's weight on
    ids below 50 outweighs the rest, which the weights alone decide: fails if they are ignored."""
    keras.utils.set_random_seed(6)
    rng = np.random.default_rng(1)
    lists = [list(rng.integers(1, 100, rng.integers(1, 6))) for _ in range(512)]
    weights = [list(rng.uniform(0, 1, len(a))) for a in lists]
    low = [sum(w for i, w in zip(a, ws) if i < 50) for a, ws in zip(lists, weights)]
    y = np.array([float(2 * lo > sum(ws)) for lo, ws in zip(low, weights)], np.float32)
    items, wts = keras.Input(shape=(5,), dtype="int64", name="items"), keras.Input(shape=(5,), name="wts")
    table = layers.Embedding(None, 4, sparse=True, mask_zero=True, combiner="sum", name="items_emb")
    e = table([items, wts])
    model = keras.Model({"items": items, "wts": wts}, layers.Dense(1, activation="sigmoid")(e))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit({"items": lists, "wts": weights}, y, epochs=8, batch_size=32, verbose=0)
    assert history.history["accuracy"][-1] > 0.9


def test_a_lists_weights_must_be_a_float_input_of_its_shape():
    items, w3 = keras.Input(shape=(4,), dtype="int64"), keras.Input(shape=(3,))
    with pytest.raises(ConfigError, match=r"weights must have its ids' shape; ids \(4,\), weights \(3,\)"):
        Embedding(9, 2, combiner="sum")([items, w3])
    with pytest.raises(ConfigError, match=r"weights must be a float model input .*not a layer's output"):
        Embedding(9, 2, combiner="sum")([items, Dense(4)(keras.Input(shape=(2,)))])
    with pytest.raises(ConfigError, match=r"takes one tensor of ids, or \[ids, weights\] with a combiner"):
        Embedding(9, 2)([items, keras.Input(shape=(4,))])


@pytest.mark.parametrize("kwargs, match", [
    (dict(combiner="max"), r"combiner must be one of sum, mean, sqrtn .*got 'max'"),
    (dict(mask_zero=True, padding_id=-1, combiner="sum"), r"padding_id must be an integer id \(0 with mask_"),
    (dict(mask_zero=1, combiner="sum"), r"mask_zero must be True or False, got 1"),
])
def test_bad_pooling_arguments_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Embedding(None, 4, sparse=True, **kwargs)


def test_two_sparse_tables_reading_one_field_must_agree_on_padding():
    items = keras.Input(shape=(4,), dtype="int64", name="items")
    a = Embedding(None, 2, sparse=True, mask_zero=True, combiner="sum", name="a")(items)
    b = Embedding(None, 2, sparse=True, combiner="sum", name="b")(items)
    out = Dense(1)(layers.Concatenate()([a, b]))
    with pytest.raises(ConfigError, match=r"'items' feeds sparse Embeddings with and without mask_zero"):
        Functional({"items": items}, out, loss="binary_crossentropy").build()


@pytest.mark.parametrize("sparse", [False, True])
def test_one_id_per_sample_gives_one_vector_as_a_list_of_one(sparse):
    """keras.Input(shape=()) ids (Keras-RS's and keras.io's recommenders): Embedding gives (n, dim),
    the loss and gradients of the same ids as (n, 1) flattened. Catches the rank-0 input refused,
    or its rows read or added at the wrong place."""
    from pserver.layers import Flatten
    rng = np.random.default_rng(8)
    ids, y = rng.integers(0, 5, 7), (rng.random(7) > 0.5).astype(np.float64)
    table, head = rng.standard_normal((5, 3)), rng.standard_normal(4)
    losses, grads = [], []
    for shape in [(), (1,)]:
        i = keras.Input(shape=shape, dtype="int64", name="ids")
        e = Embedding(None if sparse else 5, 3, sparse=sparse, name="e")(i)
        m = Functional({"ids": i} if sparse else i, Dense(1, name="out")(Flatten()(e) if shape else e),
                       loss="binary_crossentropy")
        m.use_backend("reference")
        x = ids.reshape(-1, *shape)
        if sparse:
            rec = np.zeros(len(ids), m.record)
            rec["ids"] = x
            lk = TableLookup.of(m.batch_ids(rec)[0], 3)
            rows = table[lk.uniq.astype(np.int64)]
            lk = TableLookup(lk.uniq, lk.inverse, rows, np.empty_like(rows))
            g = np.empty(4)
            losses.append(m.loss_and_grad(head.copy(), rec, y, g, sparse=[lk]))
            full = np.zeros_like(table)
            full[lk.uniq.astype(np.int64)] = lk.grads
            grads.append(np.concatenate([full.ravel(), g]))
        else:
            g = np.empty(19)
            losses.append(m.loss_and_grad(np.concatenate([table.ravel(), head]), x, y, g))
            grads.append(g)
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12)
    with pytest.raises(ConfigError, match=r"one id per sample \(input shape \(\)\) has no padding"):
        Embedding(5, 3, mask_zero=True, combiner="sum")(keras.Input(shape=(), dtype="int64"))


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_dense_model_takes_python_lists_as_its_padded_array(run_seed, as_dict):
    """A pooled Embedding over a table in the model (no shards' table): fit, evaluate and predict
    take the lists as Python lists, as one input or in a dict, and read them as the array padded
    with 0. Catches the lists refused (NumPy cannot make an array of them) or padded otherwise."""
    keras.utils.set_random_seed(4)
    lists, other, y = _keras_lists(n=256)
    padded = np.zeros((len(lists), 6), np.int64)
    for j, a in enumerate(lists):
        padded[j, :len(a)] = a
    items = keras.Input(shape=(6,), dtype="int64", name="items")
    e = layers.Embedding(300, 4, mask_zero=True, combiner="mean")(items)
    if as_dict:
        o = keras.Input(shape=(2,), name="other")
        model = keras.Model({"items": items, "other": o}, layers.Dense(1)(layers.Concatenate()([e, o])))
        given, same = {"items": lists, "other": other}, {"items": padded, "other": other}
    else:
        model, given, same = keras.Model(items, layers.Dense(1)(e)), lists, padded
    model.compile(optimizer="adam", loss="mse")
    model.fit(given, y, epochs=1, batch_size=64, verbose=0)
    assert np.array_equal(model.predict(given, verbose=0), model.predict(same, verbose=0))
    assert model.evaluate(given, y, verbose=0) == model.evaluate(same, y, verbose=0)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_two_inputs_sharing_a_sparse_table_train_as_one_dense_table_called_twice(combiner):
    """Embedding(table="items") on two inputs: one table on the shards, looked up once for both
    inputs' ids; the loss and the rows' gradients equal a dense Embedding layer called on both
    (its gradient summed over the two uses). Catches a second use's gradient overwriting the
    first's, or each input reading the other's columns of the shared lookup."""
    a_dense = keras.Input(shape=(4,), dtype="int64", name="a")
    b_dense = keras.Input(shape=(4,), dtype="int64", name="b")
    shared = Embedding(6, 3, mask_zero=True, combiner=combiner, name="e")
    head = Dense(1, name="out")
    dense = Functional([a_dense, b_dense], head(layers.Concatenate()([shared(a_dense), shared(b_dense)])),
                       loss="binary_crossentropy")
    a, b = keras.Input(shape=(4,), dtype="int64", name="a"), keras.Input(shape=(4,), dtype="int64", name="b")
    ea = Embedding(None, 3, sparse=True, mask_zero=True, combiner=combiner, table="items", name="ea")(a)
    eb = Embedding(None, 3, sparse=True, mask_zero=True, combiner=combiner, table="items", name="eb")(b)
    sparse = Functional({"a": a, "b": b}, Dense(1, name="out")(layers.Concatenate()([ea, eb])),
                        loss="binary_crossentropy")
    for m in (dense, sparse):
        m.use_backend("reference")
    assert [t.name for t in sparse.sparse_tables] == ["items"]
    rng = np.random.default_rng(9)
    table, w_head = rng.standard_normal((6, 3)), rng.standard_normal(7)
    other = LISTS[::-1].copy()
    gd = np.full(table.size + 7, np.nan)
    loss_d = dense.loss_and_grad(np.concatenate([table.ravel(), w_head]), [LISTS, other], Y, gd)
    x = np.zeros(len(LISTS), sparse.record)
    x["a"], x["b"] = LISTS, other
    (ids,) = sparse.batch_ids(x)
    lk = TableLookup.of(ids, 3)
    rows = table[lk.uniq.astype(np.int64)]
    lk = TableLookup(lk.uniq, lk.inverse, rows, np.full(rows.shape, np.nan))
    gs = np.full(7, np.nan)
    assert sparse.loss_and_grad(w_head.copy(), x, Y, gs, sparse=[lk]) == pytest.approx(loss_d, rel=1e-12)
    np.testing.assert_allclose(gs, gd[table.size:], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lk.grads, gd[:table.size].reshape(table.shape)[lk.uniq.astype(np.int64)],
                               rtol=1e-12, atol=1e-15)


def test_a_shared_table_must_be_one_table_read_from_inputs_of_its_own():
    a, b = keras.Input(shape=(4,), dtype="int64", name="a"), keras.Input(shape=(4,), dtype="int64", name="b")
    ea = Embedding(None, 3, sparse=True, combiner="sum", table="t", name="ea")(a)
    eb = Embedding(None, 4, sparse=True, combiner="sum", table="t", name="eb")(b)
    with pytest.raises(ConfigError, match=r"share table 't' with other settings"):
        Functional({"a": a, "b": b}, Dense(1)(layers.Concatenate()([ea, eb])), loss="mse").build()
    with pytest.raises(ConfigError, match=r"table=3 names a sparse table"):
        Embedding(None, 3, sparse=True, table=3)
    with pytest.raises(ConfigError, match=r"table='t' names a sparse table"):
        Embedding(5, 3, table="t")


def test_an_image_models_nested_python_lists_are_not_taken_for_lists_of_ids():
    """Only an Embedding's padding pads lists: Conv2D's padding ('same') is another thing, and a
    conv model given its images as nested Python lists predicts as on the array. Catches every
    layer's `padding` read as a list feature's (the images were refused as 'lists of ids')."""
    i = keras.Input(shape=(4, 4, 1))
    model = keras.Model(i, layers.Dense(1)(layers.Flatten()(layers.Conv2D(2, 3, padding="same")(i))))
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).random((3, 4, 4, 1)).astype(np.float32)
    assert np.array_equal(model.predict(x.tolist(), verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("kw", [dict(mask_zero=True), dict(padding_id=-1)])
def test_a_padded_sequence_on_the_shards_trains_as_dense_tables_and_its_ids_feed_attention(kw):
    """An unpooled padded Embedding (a sequence: DIN's keys) reads zeros at padding, and its ids
    input may feed another layer too (DINAttention's mask). On the shards, one table shared
    with the candidate: padding is never pulled; the loss, the dense gradients and each row's
    gradient (the keys' and the candidate's summed) equal a model with two dense tables
    holding the same rows. Catches padding reading a row, the attention reading positions for
    ids, and the shared table's two uses not summed."""
    pad = 0 if kw.get("mask_zero") else -1

    def build(sparse):
        items = keras.Input(shape=(5,), dtype="int64", name="items")
        cand = keras.Input(shape=(1,), dtype="int64", name="cand")
        if sparse:
            keys = Embedding(None, 3, sparse=True, table="t", name="keys", **kw)(items)
            q = Embedding(None, 3, sparse=True, table="t", name="q")(cand)
        else:
            keys, q = Embedding(6, 3, name="keys", **kw)(items), Embedding(6, 3, name="q")(cand)
        q = layers.Reshape((3,))(q)
        din = layers.DINAttention(hidden_units=(4,), name="din", **kw)([q, keys, items])
        out = Dense(1, name="out")(layers.Concatenate()([din, q]))
        model = Functional({"items": items, "cand": cand}, out, loss="binary_crossentropy")
        model.use_backend("reference")
        return model

    dense, sparse = build(False), build(True)
    rng = np.random.default_rng(4)
    items = rng.integers(1, 6, (7, 5))
    items[rng.random((7, 5)) < 0.4] = pad
    items[0] = pad                                             # a history of padding only
    cand = rng.integers(1, 6, (7, 1))
    y = rng.integers(0, 2, 7).astype(np.float64)
    table = rng.standard_normal((6, 3))
    w = {t.name: rng.standard_normal(t.shape) for t in sparse.layout.tensors}
    wd = np.concatenate([(table if t.name.endswith("/embeddings") else w[t.name]).ravel()
                         for t in dense.layout.tensors])
    gd = np.full_like(wd, np.nan)
    loss_d = dense.loss_and_grad(wd, {"items": items, "cand": cand}, y, gd)
    x = np.zeros(7, sparse.record)
    x["items"], x["cand"] = items, cand
    (ids,) = sparse.batch_ids(x)
    lk = TableLookup.of(ids, 3)
    assert pad not in lk.uniq.astype(np.int64).tolist()        # padding is never pulled
    rows = table[lk.uniq.astype(np.int64)]
    lk = TableLookup(lk.uniq, lk.inverse, rows, np.full(rows.shape, np.nan))
    ws = np.concatenate([w[t.name].ravel() for t in sparse.layout.tensors])
    gs = np.full_like(ws, np.nan)
    assert sparse.loss_and_grad(ws, x, y, gs, sparse=[lk]) == pytest.approx(loss_d, rel=1e-12)
    views = dense.layout.views(gd)
    for t, g in sparse.layout.views(gs).items():
        np.testing.assert_allclose(g, views[t], rtol=1e-10, atol=1e-14, err_msg=t)
    summed = views["keys/embeddings"] + views["q/embeddings"]
    np.testing.assert_allclose(lk.grads, summed[lk.uniq.astype(np.int64)], rtol=1e-10, atol=1e-14)
    if pad == 0:
        assert not views["keys/embeddings"][0].any()           # padding passes no gradient


def test_a_multi_hot_ctr_model_file_loads_as_the_multi_hot_model_it_was(tmp_path):
    """The model file records each field's list size (ctr_arguments' multi_hot) but the loader
    did not pass it on: a multi-hot model came back one-hot (records of one `cat` array), and
    `evaluate --model-file` refused its own dataset (an adversarial pass)."""
    from pserver import load_model
    from pserver.models import make_model
    from pserver.models.ctr import ctr_arguments
    from pserver.persist import model_file
    sizes = [3, 1, 2]
    model = make_model("lr", (), 2, dense_features=2, fields=3, multi_hot=sizes)
    w = np.zeros(model.layout.total, np.float32)
    ids = np.arange(5, dtype=np.uint64)
    tables = {t.name: (ids, np.ones((5, t.dim), np.float32)) for t in model.sparse_tables}
    definition = {"model": "lr", "arguments": {**ctr_arguments(model), "num_classes": 2}, "dataset": None}
    path = str(tmp_path / "mh")
    model_file.save(path, model, w, definition, {}, tables=tables,
                    origin={"live": True, "num_shards": 1, "versions": [3], "version": 3})
    loaded = load_model(path)
    assert loaded.model.record.names == model.record.names == ("dense", "cat_0", "cat_1", "cat_2")
    assert [loaded.model.record[f"cat_{j}"].shape for j in range(3)] == [(n,) for n in sizes]
