"""The CTR models as graphs: a plain NumPy twin of their formulas (pserver.models.ctr's docstring)
against the graph's loss, dense and row gradients, and 100 SGD steps; a model file and a
checkpoint written before the models were graphs (by CTRModel, issue 48) load and evaluate to
the numbers they gave then; and a user's --model FILE.py:build over records trains as the
built-ins do."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pserver.errors import ConfigError
from pserver.keras import Input
from pserver.layers import Dense, Embedding, Flatten, add
from pserver.models import Functional, make_model, metrics
from pserver.models.ctr import CTR_MODELS
from pserver.persist.export import evaluate_files, export_checkpoints
from tests.support.ctr import labels, lookups, planted, pull, records, train_locally

DATA = os.path.join(os.path.dirname(__file__), "data")
SMALL = dict(dense_features=3, fields=4, embedding_dim=5)


def small(name: str) -> Functional:
    return make_model(name, (), 2, hidden=(6, 7), backend="reference", **SMALL)


# -- the twin ---------------------------------------------------------------------------------------

def twin(name, p, x, y, lks):
    """(mean logloss, {tensor: gradient}, [row gradients per table]) of CTR model `name` in
    plain NumPy, float64: p maps the layout's names to arrays, lks the tables' lookups."""
    fm, hidden = CTR_MODELS[name]
    dense, n = x["dense"].astype(np.float64), len(x)
    lin, inv = lks[0].rows, lks[0].inverse
    z = lin[inv].sum(axis=1) + dense @ p["dense_linear/kernel"] + p["dense_linear/bias"]
    if fm or hidden:
        e = lks[1].rows[lks[1].inverse]                                    # (n, fields, k)
        z = z + (0.5 * (e.sum(1) ** 2 - (e ** 2).sum(1))).sum(1, keepdims=True) if fm else z
    hs = [np.concatenate([e.reshape(n, -1), dense], axis=1)] if hidden else []
    for i in range(len(hidden) + 1 if hidden else 0):
        a = hs[-1] @ p[f"deep_{i}/kernel"] + p[f"deep_{i}/bias"]
        hs.append(np.maximum(a, 0) if i < len(hidden) else a)
    if hidden:
        z = z + hs[-1]
    loss = np.mean(np.maximum(z[:, 0], 0) - z[:, 0] * y + np.log1p(np.exp(-np.abs(z[:, 0]))))
    dz = (1 / (1 + np.exp(-z)) - y[:, None]) / n
    g = {"dense_linear/kernel": dense.T @ dz, "dense_linear/bias": dz.sum(0)}
    rows = [np.zeros_like(lks[0].rows)]
    np.add.at(rows[0], inv, np.broadcast_to(dz[:, None, :], inv.shape + (1,)))
    if not (fm or hidden):
        return loss, g, rows
    de = dz[:, :, None] * (e.sum(1, keepdims=True) - e) if fm else np.zeros_like(e)
    d = dz
    for i in range(len(hidden), -1, -1) if hidden else ():
        g[f"deep_{i}/kernel"], g[f"deep_{i}/bias"] = hs[i].T @ d, d.sum(0)
        d = d @ p[f"deep_{i}/kernel"].T
        d = d * (hs[i] > 0) if i else d
    if hidden:
        de = de + d[:, :e[0].size].reshape(e.shape)
    rows.append(np.zeros_like(lks[1].rows))
    np.add.at(rows[1], lks[1].inverse, de)
    return loss, g, rows


WIDE = ("lr", "fm", "wide_deep", "deepfm")              # the models `twin` writes out


@pytest.mark.parametrize("name", WIDE)
def test_the_graph_equals_the_numpy_twin(name):
    """Loss, every dense gradient and every row gradient, float64: a term missing, a sign, a
    misplaced tower input, or row gradients not summed over repeated ids fail this."""
    model, rng = small(name), np.random.default_rng(11)
    x, y = records(model, 17, rng, vocab=3), labels(17, rng, np.float64)
    w = rng.standard_normal(model.layout.total) * 0.5
    lks = lookups(model, x, rng, np.float64)
    grad = np.full_like(w, np.nan)
    loss = model.loss_and_grad(w, x, y, grad, sparse=lks)
    want, g, rows = twin(name, model.layout.views(w), x, y, lks)
    assert loss == pytest.approx(want, rel=1e-12)
    for tensor, view in model.layout.views(grad).items():
        np.testing.assert_allclose(view, g[tensor], rtol=1e-10, atol=1e-14, err_msg=tensor)
    for lk, r in zip(lks, rows):
        np.testing.assert_allclose(lk.grads, r, rtol=1e-10, atol=1e-14)


def interaction_forward(name, p, x, lks) -> np.ndarray:
    """dcn's and dlrm's logits in plain NumPy, float64 (pserver.models.ctr's docstring): the
    FeatureCross and DotInteraction formulas of Keras-RS written out."""
    relu = lambda a: np.maximum(a, 0)   # noqa: E731
    e = lks[0].rows[lks[0].inverse]                                  # (n, fields, k)
    dense, n = x["dense"].astype(np.float64), len(x)
    if name == "dcn":
        x0 = np.concatenate([e.reshape(n, -1), dense], axis=1)
        h = x0
        for c in ("cross_0", "cross_1"):
            h = x0 * (h @ p[f"{c}/dense/kernel"] + p[f"{c}/dense/bias"]) + h
    else:
        bottom = relu(relu(dense @ p["bottom_0/kernel"] + p["bottom_0/bias"]) @ p["bottom_1/kernel"]
                      + p["bottom_1/bias"])
        f = np.concatenate([bottom[:, None, :], e], axis=1)           # (n, 1 + fields, k)
        z = f @ f.transpose(0, 2, 1)
        i, j = np.tril_indices(f.shape[1], -1)                         # Keras-RS: j < i, row by row
        h = np.concatenate([bottom, z[:, i, j]], axis=1)
    for layer in range(2):
        h = relu(h @ p[f"deep_{layer}/kernel"] + p[f"deep_{layer}/bias"])
    return h @ p["deep_2/kernel"] + p["deep_2/bias"]


@pytest.mark.parametrize("name", ["dcn", "dlrm"])
def test_dcn_and_dlrm_equal_their_numpy_forward_and_finite_differences(name):
    """The built-in's logits equal the formulas written out (a cross layer missing, the
    interaction's pairs in another order, the bottom vector left out of the tower), and its dense
    and row gradients equal central finite differences of its loss (float64)."""
    model, rng = small(name), np.random.default_rng(12)
    assert [t.name for t in model.sparse_tables] == ["factors"]
    x, y = records(model, 9, rng, vocab=3), labels(9, rng, np.float64)
    w = rng.standard_normal(model.layout.total) * 0.4
    lks = lookups(model, x, rng, np.float64)
    got = model.predict(w, x, rows=lambda ids: lks)
    np.testing.assert_allclose(got, interaction_forward(name, model.layout.views(w), x, lks), rtol=1e-10)
    grad = np.zeros_like(w)
    model.loss_and_grad(w, x, y, grad, sparse=lks)
    rows_grad = lks[0].grads.copy()

    def loss(wv, rows):
        lk = [type(lks[0])(lks[0].uniq, lks[0].inverse, rows, np.empty_like(rows))]
        return model.loss_and_grad(wv, x, y, np.zeros_like(wv), sparse=lk)

    eps, rows = 1e-6, lks[0].rows
    for j in range(0, w.size, 7):
        d = np.zeros_like(w)
        d[j] = eps
        fd = (loss(w + d, rows) - loss(w - d, rows)) / (2 * eps)
        assert grad[j] == pytest.approx(fd, rel=1e-5, abs=1e-8)
    for u in range(rows.shape[0]):
        for c in range(rows.shape[1]):
            d = np.zeros_like(rows)
            d[u, c] = eps
            fd = (loss(w, rows + d) - loss(w, rows - d)) / (2 * eps)
            assert rows_grad[u, c] == pytest.approx(fd, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("name", ["wide_deep", "deepfm"])
def test_100_sgd_steps_follow_the_twins_loss_curve(name):
    """The graph and the twin, each stepping its own copy of the weights and rows: the same
    losses step for step (a wrong gradient anywhere makes the curves part)."""
    model, rng = small(name), np.random.default_rng(5)
    x, y = records(model, 400, rng, vocab=8), labels(400, rng, np.float64)
    w = model.init_params(0).astype(np.float64)
    tw, g = w.copy(), np.empty_like(w)
    rows, trows = [{} for _ in model.sparse_tables], [{} for _ in model.sparse_tables]
    curves = ([], [])
    for step in range(100):
        a = (step * 40) % 400
        xb, yb = x[a:a + 40], y[a:a + 40]
        lks = pull(model, model.batch_ids(xb), rows, dtype=np.float64)
        curves[0].append(model.loss_and_grad(w, xb, yb, g, sparse=lks))
        w -= 0.5 * g
        _step_rows(rows, lks, [lk.grads for lk in lks])
        tlks = pull(model, model.batch_ids(xb), trows, dtype=np.float64)
        loss, tg, trg = twin(name, model.layout.views(tw), xb, yb, tlks)
        curves[1].append(loss)
        for tensor, view in model.layout.views(tw).items():
            view -= 0.5 * tg[tensor].reshape(view.shape)
        _step_rows(trows, tlks, trg)
    np.testing.assert_allclose(curves[0], curves[1], rtol=1e-9)
    assert curves[0][-1] < curves[0][0] - 0.05        # and it learns


def _step_rows(tables, lks, grads, lr=2.0) -> None:
    for table, lk, grad in zip(tables, lks, grads):
        for uid, row, gr in zip(lk.uniq, lk.rows, grad):
            table[int(uid)] = row - lr * gr


# -- files written before the models were graphs ------------------------------------------------------

# What the fixtures evaluated to when CTRModel wrote them (commit 524b919): a deepfm, --hidden 8
# --embedding-dim 4, trained 1 epoch on 1,000 criteo-synthetic records (seed 3), on 300 test records.
BEFORE = {"test_loss": 0.5333689709752798, "test_accuracy": 0.7633333333333333,
          "test_auc": 0.6623002819548872}
# The forward pass is float32: the loss moves in its 9th digit between CPUs (BLAS and numba pick
# other instructions: 0.5333689737 on a 2-core AMD EPYC of 2026-11-30), so 1e-6 relative; a
# changed formula moves it far more.
REL = 1e-6


def test_a_ctr_model_file_and_checkpoint_from_before_the_graphs_load_and_evaluate_the_same(tmp_path):
    """tests/data/model-files/deepfm-before-issue-48 (its --save) and
    tests/data/checkpoints/deepfm-before-issue-48 (its checkpoint, exported here): a changed
    layer or table name, layout order or table config fails to load; a changed formula
    evaluates to other numbers."""
    model_dir = os.path.join(DATA, "model-files", "deepfm-before-issue-48")
    got = evaluate_files(model_dir, None, {})
    assert {k: got[k] for k in BEFORE} == pytest.approx(BEFORE, rel=REL)
    out = str(tmp_path / "exported")
    export_checkpoints(os.path.join(DATA, "checkpoints", "deepfm-before-issue-48"), out,
                       {"model": "deepfm", "hidden": (8,), "dataset": "criteo-synthetic", "samples": 1000,
                        "test_samples": 300, "seed": 3})
    got = evaluate_files(out, None, {})
    assert {k: got[k] for k in BEFORE} == pytest.approx(BEFORE, rel=REL)


# -- a user's model over records -----------------------------------------------------------------------

USER_MODEL = '''
from pserver.keras import Input
from pserver.layers import Concatenate, Dense, Embedding, Flatten, add
from pserver.models import Functional


def build(num_classes=2):
    dense, cat = Input(shape=(4,), name="dense"), Input(shape=(8,), dtype="int64", name="cat")
    wide = Flatten()(Embedding(None, 1, "zeros", sparse=True, name="wide", optimizer="sgd", lr=2.0)(cat))
    emb = Embedding(None, 4, sparse=True, name="emb", optimizer="sgd", lr=2.0)(cat)
    h = Dense(16, activation="relu")(Concatenate()([Flatten()(emb), dense]))
    logit = add([Dense(1)(Concatenate()([wide, dense])), Dense(1)(h)])
    return Functional({"dense": dense, "cat": cat}, logit, name="my_wide_deep", loss="binary_crossentropy")
'''


def test_a_users_wide_and_deep_over_records_trains_as_a_built_in(tmp_path):
    """--model FILE.py:build returning a Functional with sparse Embedding layers: records in,
    its tables declared from its layers, and trained in process on a planted logistic model to
    near the planted AUC (a user's sparse layer whose rows never learn stays far below)."""
    path = tmp_path / "wd.py"
    path.write_text(USER_MODEL)
    model = make_model(f"{path}:build", (), 2, backend="cpu")
    tables = [(t.name, t.dim, t.optimizer) for t in model.sparse_tables]
    assert tables == [("wide", 1, "sgd"), ("emb", 4, "sgd")]
    x, y, logit = planted(24000, np.random.default_rng(0))
    assert model.record == x.dtype
    train, test = slice(0, 20000), slice(20000, None)
    w, rows = train_locally(model, x[train], y[train])
    got = model.evaluate(w, x[test], y[test], batch_size=1000, rows=lambda ids: pull(model, ids, rows))
    assert got["auc"] > metrics.auc(logit[test], y[test]) - 0.02, got


def _bad_graph(kind: str) -> Functional:
    dense = Input(shape=(3,), name="dense")
    cat = Input(shape=(2,), dtype="float32" if kind == "float ids" else "int64", name="cat")
    ids = cat + 1 if kind == "computed ids" else cat
    logit = Dense(1)(Flatten()(Embedding(None, 1, sparse=True, name="e")(ids)))
    return Functional({"dense": dense, "cat": cat}, add([logit, Dense(1)(dense)]),
                      loss="binary_crossentropy").build()


@pytest.mark.parametrize("kind, match", [
    ("float ids", r"e \(Embedding\) reads input 'cat' of float32; give ids"),
    ("computed ids", "a sparse Embedding is called once, on a model input of ids"),
])
def test_a_sparse_embedding_that_cannot_read_a_record_field_is_refused_at_build(kind, match):
    """Refused when the model is built, not trained on wrong values. (An input of ids may feed
    other layers beside a sparse Embedding: they read the ids, the Embedding its lookup's
    positions; tests/test_list_features.py.)"""
    with pytest.raises(ConfigError, match=match):
        _bad_graph(kind)
