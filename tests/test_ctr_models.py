"""CTR models (lr, fm, wide_deep, deepfm), the sparse Embedding and the FM layer: kernels
against their twins, dense and row gradients against finite differences, duplicate ids,
training on a planted logistic model, and bad input."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba.core.registry import CPUDispatcher

from pserver.data.criteo import RECORD
from pserver.errors import ConfigError, DataError
from pserver.kernels import CPU_KERNELS, cpu, reference
from pserver.layers import Dense, Embedding, Flatten, Pass
from pserver.models import Sequential, make_model, metrics
from pserver.models.ctr import CTR_MODELS, record_dtype
from pserver.sparse import TableLookup
from tests.support.ctr import labels, lookups, planted, pull, records, train_locally

FAST = settings(max_examples=25, deadline=None)
NAMES = tuple(CTR_MODELS)
WIDE = ("lr", "fm", "wide_deep", "deepfm")   # those with the wide part (dcn, dlrm: tests/test_ctr_graph.py)
# Small and all different, so a transposed or misplaced gradient has the wrong shape or value.
SMALL = dict(dense_features=3, fields=4, embedding_dim=5)


def small(name, backend="reference", **options):
    return make_model(name, (), 2, hidden=(6, 7), backend=backend, **SMALL | options)


def params(model, rng, dtype=np.float32):
    return (rng.standard_normal(model.layout.total) * 0.5).astype(dtype)


# -- kernels against their twins --------------------------------------------------------------

@pytest.mark.parametrize("name", CPU_KERNELS)
def test_same_api_and_compiled(name):
    compiled, twin = getattr(cpu, name), getattr(reference, name)
    assert isinstance(compiled, CPUDispatcher)
    assert inspect.signature(compiled.py_func) == inspect.signature(twin)
    assert compiled.targetoptions.get("nogil") and not compiled.targetoptions.get("parallel")


fm_shapes = st.tuples(st.integers(1, 7), st.integers(1, 9), st.integers(1, 6))


@FAST
@given(fm_shapes, st.integers(0, 2**32 - 1))
def test_fm_forward(shape, seed):
    """The compiled kernel against the twin, and the twin against the pairwise sum it replaces."""
    v = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    got, want = np.full((shape[0], 1), np.nan, np.float32), np.full((shape[0], 1), np.nan, np.float32)
    cpu.fm_forward(v, got)
    reference.fm_forward(v, want)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    v64 = v.astype(np.float64)
    pairs = sum((v64[:, f] * v64[:, g]).sum(axis=1)
                for f, g in itertools.combinations(range(shape[1]), 2))
    np.testing.assert_allclose(want[:, 0], pairs, rtol=1e-4, atol=1e-4)


@FAST
@given(fm_shapes, st.integers(0, 2**32 - 1))
def test_fm_backward(shape, seed):
    """Against the twin, and the twin against central differences of the forward pass (float64)."""
    rng = np.random.default_rng(seed)
    v, dout = rng.standard_normal(shape), rng.standard_normal((shape[0], 1))
    got, want = np.full(shape, np.nan, np.float32), np.full(shape, np.nan)
    cpu.fm_backward(v.astype(np.float32), dout.astype(np.float32), got)
    reference.fm_backward(v, dout, want)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    eps, out = 1e-6, np.empty((shape[0], 1))
    fd = np.empty(shape)
    for idx in np.ndindex(*shape):
        up, down = v.copy(), v.copy()
        up[idx] += eps
        down[idx] -= eps
        reference.fm_forward(up, out)
        hi = out[idx[0], 0]
        reference.fm_forward(down, out)
        fd[idx] = dout[idx[0], 0] * (hi - out[idx[0], 0]) / (2 * eps)
    np.testing.assert_allclose(want, fd, rtol=1e-6, atol=1e-7)


# -- the sparse Embedding -----------------------------------------------------------------------

def test_sparse_embedding_reads_rows_and_sums_gradients_per_unique_id():
    """Forward: rows[inverse]; backward: the segment sum of dout per unique id, into the lookup.
    The positions come with the rows (p["positions"]), not as the layer's input x, which stays
    the ids other layers may read."""
    layer = Embedding(None, 3, sparse=True, name="e")
    layer.build((4,))
    ids = np.array([[7, -1, 7, 2**40], [2**40, 7, 5, -1]], np.int64)
    lk = TableLookup.of(ids, 3)
    np.testing.assert_array_equal(lk.uniq.view(np.int64), [7, -1, 2**40, 5])
    lk.rows[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = np.empty((2, 4, 3), np.float32)
    for k in (cpu, reference):
        p = {"embeddings": lk.rows, "positions": lk.inverse}
        layer.forward(k, p, ids, out, {}, Pass())
        np.testing.assert_array_equal(out, lk.rows[lk.inverse])
        dout = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
        lk.grads[:] = np.nan
        layer.backward(k, p, {"embeddings": lk.grads}, ids, out, dout, None, {})
        want = np.zeros((4, 3), np.float32)
        np.add.at(want, lk.inverse.ravel(), dout.reshape(-1, 3))
        np.testing.assert_array_equal(lk.grads, want)
    assert layer.weights() == []
    assert layer.table_config() == layer.table_config("e")
    assert (layer.table_config().dim, layer.table_config().init_scale) == (3, 0.05)


def test_sparse_embedding_declares_its_table():
    layer = Embedding(None, 16, "zeros", sparse=True, optimizer="ftrl", lr=0.1, min_count=3,
                      max_rows=1000, ttl_steps=50, seed=9, optimizer_params={"l1": 1.0, "beta": 1.0},
                      name="ads")
    t = layer.table_config()
    assert (t.name, t.dim, t.optimizer, t.lr, t.init_scale, t.seed) == ("ads", 16, "ftrl", 0.1, 0.0, 9)
    assert (t.min_count, t.max_rows, t.ttl_steps) == (3, 1000, 50)
    assert t.params == (("beta", 1.0), ("l1", 1.0))


@pytest.mark.parametrize("make, match", [
    (lambda: Embedding(None, 4), "input_dim=None .* needs sparse=True"),
    (lambda: Embedding(None, 4, "glorot_uniform", sparse=True), "embeddings_initializer"),
    (lambda: Embedding(None, 4, sparse=True, optimizer="rmsprop"), "rmsprop"),
    (lambda: Embedding(None, 0, sparse=True), "output_dim"),
])
def test_sparse_embedding_bad_arguments(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_a_sequential_with_a_sparse_embedding_is_a_model_with_sparse_tables():
    """Its one input is a record field of int64 ids (a sparse table's ids are 64-bit: an int32
    field would wrap them), it declares the table, and a step without the batch's rows is refused
    naming the tables. Fails if the input is int32 or the table is not found."""
    model = Sequential([Embedding(None, 2, sparse=True, input_shape=(3,)), Flatten(), Dense(1)],
                       loss="binary_crossentropy", backend="reference")
    w = model.init_params(0)
    assert [t.name for t in model.sparse_tables] == ["embedding"]
    assert model.record["input_0"].base == np.int64
    x = model.pack(np.full((2, 3), 2**40, np.int64))
    assert (x["input_0"] == 2**40).all()
    with pytest.raises(ValueError, match=r"has 1 sparse tables \(embedding\); got 0 lookups"):
        model.loss_and_grad(w, x, np.zeros(2), np.empty_like(w))


# -- the models: structure ----------------------------------------------------------------------

def test_layouts_and_tables():
    lr, fm, wd, dfm = (make_model(n, (), 2, embedding_dim=4, optimizer="sgd", lr=0.3, min_count=2,
                                  max_rows=100, ttl_steps=7, seed=5) for n in WIDE)
    assert lr.layout.describe() == fm.layout.describe() == "dense_linear/kernel[13, 1], dense_linear/bias[1]"
    # The deep tower's defaults, 256 then 128, on 26 embeddings of 4 and the 13 dense features.
    assert wd.layout.describe() == dfm.layout.describe() == (
        "dense_linear/kernel[13, 1], dense_linear/bias[1], deep_0/kernel[117, 256], deep_0/bias[256], "
        "deep_1/kernel[256, 128], deep_1/bias[128], deep_2/kernel[128, 1], deep_2/bias[1]")
    assert [t.name for t in lr.sparse_tables] == ["linear"]
    for m in (fm, wd, dfm):
        assert [(t.name, t.dim) for t in m.sparse_tables] == [("linear", 1), ("factors", 4)]
        for t in m.sparse_tables:
            assert (t.optimizer, t.lr, t.min_count, t.max_rows, t.ttl_steps, t.seed) == (
                "sgd", 0.3, 2, 100, 7, 5)
    assert lr.record == record_dtype() == RECORD   # what the Criteo reader yields
    assert make_model("deepfm", (), 2, hidden=(8,)).layout.tensors[-2].shape == (8, 1)
    # The dense built-ins are unchanged, their default widths included.
    assert make_model("mlp", 5, 3).layout.describe().endswith("dense_2/kernel[256, 3], dense_2/bias[3]")


@pytest.mark.parametrize("name", WIDE)
def test_init_params_deterministic_and_linear_part_starts_at_zero(name):
    model = small(name)
    w = model.init_params(3)
    np.testing.assert_array_equal(w, model.init_params(3))
    if CTR_MODELS[name][1]:    # lr's and fm's dense weights (the linear part) all start at zero
        assert not np.array_equal(w, model.init_params(4))
    views = model.layout.views(w)
    assert not views["dense_linear/kernel"].any() and not views["dense_linear/bias"].any()


# -- the models: gradients ----------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_dense_and_row_gradients_match_central_differences(name):
    """Every dense coordinate and every coordinate of every pulled row, in float64 through the
    NumPy twins; ids repeat in the batch, so a row's gradient is a sum over its uses."""
    model, rng = small(name), np.random.default_rng(len(name))
    x, y = records(model, 7, rng, vocab=3), labels(7, rng, np.float64)
    w = params(model, rng, np.float64)
    lks = lookups(model, x, rng, np.float64)
    assert any(len(lk.uniq) < lk.inverse.size for lk in lks)
    grad = np.full_like(w, np.nan)
    loss = model.loss_and_grad(w, x, y, grad, sparse=lks)

    def f(w_, lks_):
        return model.loss_and_grad(w_, x, y, np.empty_like(w_),
                                   sparse=[TableLookup(lk.uniq, lk.inverse, lk.rows, np.empty_like(lk.rows))
                                           for lk in lks_])

    eps = 1e-6
    fd = np.array([(f(w + eps * e, lks) - f(w - eps * e, lks)) / (2 * eps) for e in np.eye(w.size)])
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)
    for t, lk in enumerate(lks):
        fd = np.empty_like(lk.rows)
        for j in np.ndindex(*lk.rows.shape):
            moved = []
            for sign in (1, -1):
                rows = lk.rows.copy()
                rows[j] += sign * eps
                moved.append(f(w, [TableLookup(o.uniq, o.inverse, rows if i == t else o.rows, o.grads)
                                   for i, o in enumerate(lks)]))
            fd[j] = (moved[0] - moved[1]) / (2 * eps)
        np.testing.assert_allclose(lk.grads, fd, rtol=1e-5, atol=1e-7)
    assert np.isfinite(loss) and np.abs(lks[-1].grads).sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_ids_have_their_gradients_summed(name):
    """A lookup that deduplicates against one that gives every use its own row: the loss is
    the same, and each unique row's gradient is the sum of its uses' gradients."""
    model, rng = small(name), np.random.default_rng(7)
    x, y, w = records(model, 9, rng, vocab=2), labels(9, rng), params(model, rng)
    deduped = lookups(model, x, rng)
    per_use = [_one_row_per_use(lk) for lk in deduped]
    g1, g2 = np.empty_like(w), np.empty_like(w)
    loss1 = model.loss_and_grad(w, x, y, g1, sparse=deduped)
    loss2 = model.loss_and_grad(w, x, y, g2, sparse=per_use)
    assert loss1 == pytest.approx(loss2, rel=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)
    for lk, split in zip(deduped, per_use):
        assert len(lk.uniq) < len(split.uniq)
        summed = np.zeros_like(lk.grads)
        np.add.at(summed, lk.inverse.ravel(), split.grads)
        np.testing.assert_allclose(lk.grads, summed, rtol=1e-5, atol=1e-7)


def _one_row_per_use(lk: TableLookup) -> TableLookup:
    """The same rows without deduplication: every use of an id its own copy of the row."""
    uses = lk.inverse.ravel()
    return TableLookup(lk.uniq[uses], np.arange(uses.size).reshape(lk.inverse.shape), lk.rows[uses],
                       np.full((uses.size, lk.rows.shape[1]), np.nan, lk.rows.dtype))


@pytest.mark.parametrize("name", NAMES)
def test_cpu_equals_reference(name):
    rng = np.random.default_rng(1)
    fast, twin = small(name, "cpu"), small(name, "reference")
    x, y, w = records(fast, 33, rng), labels(33, rng), params(fast, rng)
    got, want = lookups(fast, x, rng), lookups(fast, x, rng)
    for a, b in zip(got, want):
        b.rows[:] = a.rows
    g_fast, g_twin = np.empty_like(w), np.empty_like(w)
    assert fast.loss_and_grad(w, x, y, g_fast, sparse=got) == pytest.approx(
        twin.loss_and_grad(w, x, y, g_twin, sparse=want), rel=1e-5)
    np.testing.assert_allclose(g_fast, g_twin, rtol=1e-4, atol=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.grads, b.grads, rtol=1e-4, atol=1e-6)


# -- the models: training on a planted logistic model ---------------------------------------------

@pytest.mark.parametrize("name", WIDE)
def test_training_in_process_reaches_the_planted_auc(name):
    """SGD in a local loop, rows held in dicts as the shards would hold them: held-out AUC,
    logloss and accuracy come close to the planted model's own. A sign error anywhere, or
    rows that do not learn, fails this."""
    x, y, logit = planted(24000, np.random.default_rng(0))
    train, test = slice(0, 20000), slice(20000, None)
    z, t = logit[test], y[test]
    best = {"auc": metrics.auc(z, t), "accuracy": np.mean((z > 0) == t),
            "loss": np.mean(np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z))))}
    assert 0.2 < y.mean() < 0.35 and best["auc"] > 0.8
    model = make_model(name, (), 2, hidden=(16, 8), backend="cpu", fields=8, dense_features=4,
                       embedding_dim=4)
    w, rows = train_locally(model, x[train], y[train])
    got = model.evaluate(w, x[test], t, batch_size=1000, rows=lambda ids: pull(model, ids, rows))
    assert got["auc"] > best["auc"] - 0.015, (got, best)
    assert got["loss"] < best["loss"] + 0.03 and got["accuracy"] > best["accuracy"] - 0.02, (got, best)


# -- bad input ------------------------------------------------------------------------------------

def _with_field(model, n, field, dtype, shape):
    """Records like the model's, but with `field` of another dtype or shape."""
    spec = [(f, dtype if f == field else model.record[f].base,
             shape if f == field else model.record[f].shape) for f in model.record.names]
    return np.zeros(n, spec)


@pytest.mark.parametrize("make_x, match", [
    (lambda m: _with_field(m, 3, "cat", np.float64, (4,)), r"x\['cat'\] has dtype float64 .* integer ids"),
    (lambda m: _with_field(m, 3, "cat", np.int64, (5,)), r"x\['cat'\] .* shape \(5,\)"),
    (lambda m: _with_field(m, 3, "dense", np.int32, (3,)), r"x\['dense'\] has dtype int32 .* floats"),
    (lambda m: np.zeros((3, 7), np.float32), "x has dtype float32; .* records with fields dense float32"),
    (lambda m: np.zeros((3, 1), m.record), r"x has shape \(3, 1\)"),
])
def test_bad_records_name_the_field(make_x, match):
    model = small("deepfm")
    x, w = make_x(model), model.init_params(0)
    with pytest.raises(ValueError, match=match):
        model.batch_ids(x)
    with pytest.raises(ValueError, match=match):
        model.loss_and_grad(w, x, np.zeros(3), np.empty_like(w), sparse=[])
    with pytest.raises(DataError, match="training set: " + match):
        model.check_data(x, np.zeros(3), "training set")


def test_bad_batches_labels_and_lookups():
    model, rng = small("fm"), np.random.default_rng(2)
    x, y, w = records(model, 4, rng), labels(4, rng), model.init_params(0)
    g, lks = np.empty_like(w), lookups(model, x, rng)
    with pytest.raises(ValueError, match=r"label out of range: y\[1\] = 2.0"):
        model.loss_and_grad(w, x, np.array([0, 2, 1, 0.0]), g, sparse=lks)
    with pytest.raises(ValueError, match=r"y has shape \(3,\); x has 4 records"):
        model.loss_and_grad(w, x, y[:3], g, sparse=lks)
    with pytest.raises(ValueError, match=r"fm has 2 sparse tables \(linear, factors\); got 1 lookups"):
        model.loss_and_grad(w, x, y, g, sparse=lks[:1])
    with pytest.raises(ValueError, match="table factors: the lookup has inverse"):
        model.loss_and_grad(w, x[:2], y[:2], g, sparse=lookups(model, x[:2], rng)[:1] + lks[1:])
    with pytest.raises(ValueError, match="grad_out must be a C-contiguous"):
        model.loss_and_grad(w, x, y, np.empty(w.size * 2, w.dtype)[::2], sparse=lks)
    with pytest.raises(ValueError, match="evaluate needs rows="):
        model.evaluate(w, x, y)
    x["dense"][2, 1] = np.nan
    with pytest.raises(DataError, match=r"test set: x\['dense'\] has NaN or Inf values in 1 records, "
                                        "the first at index 2"):
        model.check_data(x, y, "test set")


@pytest.mark.parametrize("call, match", [
    (lambda: make_model("deepfm", (784,), 2), r"--model deepfm takes Criteo records .* shape \(784,\)"),
    (lambda: make_model("lr", (), 10), r"--model lr predicts clicks \(2 classes\); the dataset has 10"),
    (lambda: make_model("fm", (), 2, optimizer="rmsprop"), "--model fm: .*rmsprop"),
    (lambda: make_model("fm", (), 2, embedding_dim=0), "--model fm: Embedding: output_dim"),
    (lambda: make_model("wide_deep", (), 2, hidden=(8, 0)), "--hidden: layer widths"),
    (lambda: make_model("lr", (), 2, hidden=(8,), min_count=-1), "--model lr: .*min_count"),
    (lambda: make_model("fm", (), 2, fields=0),
     "--model fm: ctr_model: fields must be a positive integer, got 0"),
    (lambda: make_model("fm", (), 2, init_scale=-1),
     "--model fm: ctr_model: init_scale must be a number >= 0"),
    (lambda: make_model("wide_deep", (), 2, dropout=0.5),
     r"--model wide_deep: unknown options \['dropout'\]"),
    (lambda: make_model("mlp", 5, 3, optimizer="sgd"), "--model mlp: takes no sparse table options"),
    (lambda: make_model("lr", (), 2, backend="cuda"), "--device cuda: lr runs on the CPU"),
])
def test_make_model_errors_name_the_flag(call, match):
    with pytest.raises(ConfigError, match=match):
        call()
