"""The retrieval pieces of a two-tower model: keras_rs.layers.BruteForceRetrieval's top k equals a
brute force by NumPy (scores, ids, ties by index), its numba kernel its NumPy twin; the in-batch
softmax's value and gradient equal an independent reference and finite differences; and a
two-tower model trained with it on real shards retrieves each user's planted items."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras, keras_rs
from pserver.errors import ConfigError, DataError
from pserver.keras_rs import retrieval
from pserver.models import losses

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True)
def run_seed(monkeypatch):
    from pserver.launch.run import SEED

    monkeypatch.setenv(SEED, "0")


def _ids(name):
    return keras.Input(shape=(), dtype="int64", name=name)


def _brute_force(query, candidates, k):
    """Every score, each row sorted by a stable argsort of its negation: ties by index."""
    scores = query @ candidates.T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, top, axis=1), top


# -- BruteForceRetrieval -------------------------------------------------------------------------


@st.composite
def _retrievals(draw):
    """Queries and candidates of small integers (exact dot products, many ties), k <= m."""
    n, m, d = draw(st.integers(1, 12)), draw(st.integers(1, 40)), draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([1, 3, 50]))          # 1: mostly ties; 50: few
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    q = rng.integers(-spread, spread + 1, (n, d)).astype(dtype)
    c = rng.integers(-spread, spread + 1, (m, d)).astype(dtype)
    return q, c, draw(st.integers(1, m)), rng


@FAST
@given(_retrievals(), st.booleans(), st.booleans(), st.sampled_from([None, 1, 200]))
def test_brute_force_retrievals_top_k_equals_numpy_brute_force(case, with_ids, return_scores, block_bytes):
    """Scores and ids, highest first, equal scores by candidate index; with ids, the ids of those
    candidates; return_scores=False: the ids alone. block_bytes: the queries scored a block at a
    time (1: one query per block)."""
    q, c, k, rng = case
    ids = rng.permutation(10 * len(c))[: len(c)] if with_ids else None
    want_scores, want = _brute_force(q, c, k)
    layer = keras_rs.layers.BruteForceRetrieval(c, ids, k=k, return_scores=return_scores)
    with pytest.MonkeyPatch.context() as mp:
        if block_bytes is not None:
            mp.setattr(retrieval, "SCORE_BLOCK_BYTES", block_bytes)
        got = layer(q)
    got_scores, got_ids = got if return_scores else (None, got)
    assert np.array_equal(got_ids, want if ids is None else ids[want])
    if return_scores:
        assert got_scores.dtype == q.dtype and np.array_equal(got_scores, want_scores)


@FAST
@given(st.integers(1, 9), st.integers(1, 70), st.sampled_from([0, 2, 1000]), st.integers(0, 2**32 - 1))
def test_the_top_k_kernel_equals_its_numpy_twin(n, m, levels, seed):
    """top_k_into (numba) against top_k_reference (a stable argsort), for every k, on scores with
    many ties (few levels), none (0: normal floats) or some."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(n, m)) if levels == 0 else rng.integers(0, levels, (n, m)).astype(np.float64)
    for dtype in (np.float32, np.float64):
        s = scores.astype(dtype)
        for k in {1, m, (m + 1) // 2, min(m, 3)}:
            top_s, top_i = np.empty((n, k), dtype), np.empty((n, k), np.int64)
            retrieval.top_k_into(s, k, top_s, top_i)
            want_s, want_i = retrieval.top_k_reference(s, k)
            assert np.array_equal(top_i, want_i) and np.array_equal(top_s, want_s)


def test_candidates_update_and_the_keras_io_attribute_way():
    """update_candidates replaces candidates and ids (None: indices); candidates set as an
    attribute (keras.io's basic_retrieval) are checked and used; get_config rebuilds the layer
    without its candidates, as Keras-RS's."""
    c = np.eye(4, dtype=np.float32)
    layer = keras_rs.layers.BruteForceRetrieval(k=2, return_scores=False)
    layer.update_candidates(c, [10, 11, 12, 13])
    assert layer(np.array([[0, 1, 5, 0]], np.float32)).tolist() == [[12, 11]]
    layer.update_candidates(c[::-1])
    assert layer(np.array([[0, 1, 5, 0]], np.float32)).tolist() == [[1, 2]]
    layer.candidate_embeddings = 2 * c
    config = {**layer.get_config(), "return_scores": True}
    scores_ids = keras_rs.layers.BruteForceRetrieval.from_config(config)
    assert scores_ids.candidate_embeddings is None and scores_ids.k == 2
    assert layer(np.array([[3, 0, 0, 1]], np.float32)).tolist() == [[0, 3]]


BruteForce = keras_rs.layers.BruteForceRetrieval
THREE = np.ones((3, 2))          # three candidates of dim 2


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: BruteForce(THREE, k=4), "3 candidates are fewer than the k=4"),
        (lambda: BruteForce(k=4).update_candidates(THREE), "fewer than the k=4"),
        (lambda: BruteForce(k=0), "k must be an integer >= 1"),
        (lambda: BruteForce(np.ones(3), k=1), r"\(num_candidates, embedding_dim\)"),
        (lambda: BruteForce(THREE, [1, 2], k=1), r"one id per candidate, \(3,\)"),
        (lambda: BruteForce(candidate_ids=[1], k=1), "candidate_ids without"),
        (lambda: BruteForce(k=1)(np.ones((1, 2))), "update_candidates first"),
        (lambda: BruteForce(THREE, k=1)(np.ones((1, 3))), r"\(n, 2\)"),
        (lambda: BruteForce(THREE, k=1)(keras.Input(shape=(2,))), "on arrays"),
    ],
)
def test_bad_retrieval_configs_are_one_line(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_nan_embeddings_are_refused():
    with pytest.raises(DataError, match="candidate_embeddings hold NaN"):
        keras_rs.layers.BruteForceRetrieval(np.array([[np.nan, 0.0]]), k=1)
    with pytest.raises(DataError, match="queries hold NaN"):
        keras_rs.layers.BruteForceRetrieval(np.ones((2, 2)), k=1)(np.array([[np.inf, 0.0]]))


# -- the in-batch softmax ---------------------------------------------------------------------------


def _reference_loss(out, y, remove_accidental_hits=False, candidate_sampling_probability=None,
                    num_hard_negatives=None):
    """The mean over rows of -log softmax(row)[positive], row by row in Python, each row's logits
    as TFRS's Retrieval task and Keras-RS's layers make them."""
    n, d = out.shape[0], out.shape[1] // 2
    total = 0.0
    for i in range(n):
        logits = {j: float(out[i, :d] @ out[j, d:]) for j in range(n)}
        if candidate_sampling_probability is not None:
            for j in logits:
                logits[j] -= np.log(min(max(candidate_sampling_probability[y[j]], 1e-6), 1.0))
        kept = [j for j in logits if j == i or not (remove_accidental_hits and y[j] == y[i])]
        if num_hard_negatives is not None:
            kept = [i] + sorted((j for j in kept if j != i), key=lambda j: -logits[j])[:num_hard_negatives]
        top = max(logits[j] for j in kept)
        total += top + np.log(sum(np.exp(logits[j] - top) for j in kept)) - logits[i]
    return total / n


OPTIONS = [
    {},
    {"remove_accidental_hits": True},
    {"candidate_sampling_probability": [0.5, 0.05, 0.0, 0.3, 0.15]},
    {"num_hard_negatives": 2},
    {"remove_accidental_hits": True, "num_hard_negatives": 3,
     "candidate_sampling_probability": [0.1, 0.2, 0.3, 0.25, 0.15]},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o) or "plain")
def test_in_batch_softmax_value_and_gradient_equal_a_reference(options):
    """float64: the value against the Python reference, d loss / d output against central finite
    differences of it; float32 (training's) within float32's rounding of both."""
    rng = np.random.default_rng(len(options))
    loss = keras_rs.losses.InBatchSoftmax(**options)
    n, d = 7, 3
    out, y = rng.normal(size=(n, 2 * d)), rng.integers(0, 5, n)       # ids repeat: accidental hits
    dout = np.empty_like(out)
    value = loss(None, out, y, dout)
    assert value == pytest.approx(_reference_loss(out, y, **options), rel=1e-12)
    eps, fd = 1e-6, np.empty_like(out)
    for at in np.ndindex(out.shape):
        e = np.zeros_like(out)
        e[at] = eps
        fd[at] = (_reference_loss(out + e, y, **options) - _reference_loss(out - e, y, **options)) / (2 * eps)
    assert np.allclose(dout, fd, rtol=1e-6, atol=1e-8), np.abs(dout - fd).max()
    dout32 = np.empty(out.shape, np.float32)
    assert loss(None, out.astype(np.float32), y, dout32) == pytest.approx(value, rel=1e-5)
    assert np.allclose(dout32, dout, rtol=1e-4, atol=1e-6)


def test_in_batch_softmax_through_a_models_graph_matches_finite_differences():
    """The whole model (two Embedding towers, Concatenate, the loss) on the reference kernels:
    every weight's gradient against finite differences of the model's loss."""
    from pserver.layers import Concatenate, Embedding
    from pserver.models import Functional
    from tests.support.gradients import assert_fd

    user, item = _ids("user"), _ids("item")
    out = Concatenate()([Embedding(5, 3)(user), Embedding(6, 3)(item)])
    model = Functional({"user": user, "item": item}, out,
                       loss=losses.InBatchSoftmax(remove_accidental_hits=True))
    x = model.pack({"user": np.array([0, 1, 2, 3, 4, 0]), "item": np.array([5, 1, 1, 2, 0, 3])})
    assert_fd(model, x, np.array([5, 1, 1, 2, 0, 3]))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: losses.InBatchSoftmax(num_hard_negatives=0), ConfigError, "num_hard_negatives must be"),
        (lambda: losses.InBatchSoftmax(candidate_sampling_probability=[[0.5]]), ConfigError, "1-D array"),
        (lambda: losses.InBatchSoftmax().check_outputs(5, "m"), ConfigError, "side by side"),
        (lambda: losses.InBatchSoftmax(remove_accidental_hits=True).labels(np.array([0.5, 1.0])), ValueError,
         r"candidate id \(integers\)"),
        (lambda: losses.InBatchSoftmax(remove_accidental_hits=True).labels(np.array([1, 2**31])), ValueError,
         r"ids in \[0, 2147483648\) \(int32\)"),
        (lambda: losses.InBatchSoftmax(candidate_sampling_probability=[1.0]).labels(np.array([0, 1])),
         ValueError, "candidate id 1"),
        (lambda: losses.weighted(losses.InBatchSoftmax(), None, np.ones((2, 4)), np.arange(2),
                                 np.ones((2, 4)), np.array([1.0, 2.0])), ConfigError,
         "sample weights are not supported"),
    ],
)
def test_in_batch_softmax_refuses_what_it_cannot_compute(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_in_batch_softmax_is_saved_by_name():
    loss = losses.InBatchSoftmax(True, [0.5, 0.5], 4)
    again = losses.get(loss.get_config())
    assert isinstance(again, losses.InBatchSoftmax) and again.get_config() == loss.get_config()


# -- a two-tower model, trained ---------------------------------------------------------------------

USERS, ITEMS, GROUPS, DIM = 60, 120, 12, 8


def _planted(n=3000, seed=0):
    """Users and items in GROUPS groups: each (user, item) pair is a user with an item of its own
    group (group = user % GROUPS; a group's items are a block of ITEMS // GROUPS ids)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, USERS, n)
    per = ITEMS // GROUPS
    return users, (users % GROUPS) * per + rng.integers(0, per, n)


def _two_tower(sparse: bool):
    user, item = _ids("user"), _ids("item")
    if sparse:      # tables on the shards (a model needs dense weights too: a Dense per tower)
        q = keras.layers.Dense(DIM)(keras.layers.Embedding(None, DIM, sparse=True, name="users")(user))
        c = keras.layers.Dense(DIM)(keras.layers.Embedding(None, DIM, sparse=True, name="items")(item))
    else:
        q, c = keras.layers.Embedding(USERS, DIM)(user), keras.layers.Embedding(ITEMS, DIM)(item)
    model = keras.Model({"user": user, "item": item}, keras.layers.Concatenate()([q, c]))
    model.compile(optimizer=keras.optimizers.Adagrad(0.5),
                  loss=keras_rs.losses.InBatchSoftmax(remove_accidental_hits=True))
    return model


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_tables", "sparse_tables"])
def test_a_two_tower_model_trained_with_in_batch_softmax_retrieves_each_users_items(sparse, tmp_path):
    """fit on in-process shards, then each user's top 10 of all items by BruteForceRetrieval over
    the towers' embeddings (model.predict's two halves): at least 90% of them in the user's group,
    where chance is 1 in 12 (a gradient of the wrong sign, or to the wrong tower, raises the loss;
    a gradient to one tower only leaves retrieval near chance). The saved model loads with its
    loss and predicts the same."""
    keras.utils.set_random_seed(1)
    users, items = _planted()
    model = _two_tower(sparse)
    history = model.fit({"user": users, "item": items}, items, batch_size=64, epochs=5, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    everyone = {"user": np.arange(USERS), "item": np.arange(USERS) % ITEMS}
    queries = model.predict(everyone, verbose=0)[:, :DIM]
    all_items = {"user": np.zeros(ITEMS, np.int64), "item": np.arange(ITEMS)}
    candidates = model.predict(all_items, verbose=0)[:, DIM:]
    top = BruteForce(candidates, np.arange(ITEMS), k=10, return_scores=False)(queries)
    right = (top // (ITEMS // GROUPS)) == (np.arange(USERS) % GROUPS)[:, None]
    assert right.mean() >= 0.9, right.mean()
    model.save(tmp_path / "two_tower.keras")
    loaded = keras.models.load_model(tmp_path / "two_tower.keras")
    assert loaded._core.loss.get_config() == model._core.loss.get_config()
    assert np.array_equal(loaded.predict(everyone, verbose=0), model.predict(everyone, verbose=0))
