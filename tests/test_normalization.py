"""LayerNormalization, BatchNormalization and Rescaling: each layer's forward against an
independent NumPy twin and its backward against central finite differences in float64
(hypothesis over shapes); Keras's weights, arguments and summary; and BatchNormalization's
moving statistics on the shards (ShardStore.update_statistics): in sync, the union of the
workers' batches, a rejected push changing nothing, and Keras's rule with one worker."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError, InvalidArgument
from pserver.kernels import reference
from pserver.layers import BatchNormalization, Dense, GroupNormalization, LayerNormalization, Rescaling
from pserver.layers.base import Pass
from pserver.models import Functional
from pserver.models.layout import Layout, away_means
from pserver.ops.core import Symbolic
from pserver.server import checks
from tests.support.pushes import push_request
from tests.support.shards import SETTINGS, make_cluster

FAST = settings(max_examples=25, deadline=None)
EPS = 1e-6


def shapes(lo=1, hi=3):
    return st.lists(st.integers(1, 4), min_size=lo, max_size=hi).map(tuple)


def built(layer, shape):
    layer(Symbolic((None, *shape)))
    return layer


def params_of(layer, rng):
    return {w.name: rng.uniform(0.5, 2, w.shape) if w.name == "moving_variance"
            else rng.standard_normal(w.shape) for w in layer.weights()}


def run(layer, p, x, training=True):
    """(out, grads, dx) of loss = sum(out * G) for a fixed G, in float64."""
    out = np.empty_like(x)
    s = layer.scratch(x.shape[0], x.dtype)
    layer.forward(reference, p, x, out, s, Pass(training=training))
    return out, s


def grads(layer, p, x, G, training=True):
    out, s = run(layer, p, x, training)
    g = {k: np.zeros_like(v) for k, v in p.items()}
    dx = np.empty_like(x)
    layer.backward(reference, p, g, x, out, G.copy(), dx, s)
    return g, dx


def assert_fd(layer, p, x, training=True, seed=0):
    """<G, d out> by central differences along a random direction, for x and each trainable weight."""
    r = np.random.default_rng(seed)
    G = r.standard_normal(x.shape)
    g, dx = grads(layer, p, x, G, training)

    def loss(p_, x_):
        return float(np.sum(run(layer, p_, x_, training)[0] * G))
    d = r.standard_normal(x.shape)
    fd = (loss(p, x + EPS * d) - loss(p, x - EPS * d)) / (2 * EPS)
    assert abs(fd - np.sum(dx * d)) <= 1e-6 * (1 + abs(fd))
    for w in layer.weights():
        if not w.trainable:
            continue
        d = r.standard_normal(w.shape)
        plus, minus = {**p, w.name: p[w.name] + EPS * d}, {**p, w.name: p[w.name] - EPS * d}
        fd = (loss(plus, x) - loss(minus, x)) / (2 * EPS)
        assert abs(fd - np.sum(g[w.name] * d)) <= 1e-6 * (1 + abs(fd)), w.name
    return g


@FAST
@given(shape=shapes(), n=st.integers(1, 5), seed=st.integers(0, 2**16), data=st.data())
def test_layer_normalization_against_numpy_and_finite_differences(shape, n, seed, data):
    """Catches moments over the wrong axes (the batch, or every axis for a list), a missing mean
    term in the VJP, gamma reshaped onto the wrong axis, and Keras's epsilon (1e-3) not used."""
    rank = len(shape) + 1
    axis = data.draw(st.one_of(st.just(-1), st.sets(st.integers(1, rank - 1), min_size=1).map(sorted)))
    layer = built(LayerNormalization(axis=axis), shape)
    r = np.random.default_rng(seed)
    x = 3 * r.standard_normal((n, *shape)) + 2
    p = params_of(layer, r)
    axes = (rank - 1,) if axis == -1 else tuple(axis)
    bshape = [1] * rank
    for a in axes:
        bshape[a] = x.shape[a]
    want = (x - x.mean(axis=axes, keepdims=True)) / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-3)
    want = want * p["gamma"].reshape(bshape) + p["beta"].reshape(bshape)
    np.testing.assert_allclose(run(layer, p, x)[0], want, rtol=1e-10, atol=1e-10)
    assert [w.name for w in layer.weights()] == ["gamma", "beta"]
    assert_fd(layer, p, x, seed=seed)


@FAST
@given(shape=shapes(), n=st.integers(2, 5), seed=st.integers(0, 2**16),
       center=st.booleans(), scale=st.booleans())
def test_batch_normalization_against_numpy_and_finite_differences(shape, n, seed, center, scale):
    """Training standardizes with the batch's per-channel moments (over the batch and every
    position), inference with the moving ones; catches moments taken per sample or over the
    channels, a VJP without the batch-mean terms, and inference using the batch's moments."""
    layer = built(BatchNormalization(center=center, scale=scale), shape)
    r = np.random.default_rng(seed)
    x = 3 * r.standard_normal((n, *shape)) - 1
    p = params_of(layer, r)
    axes = tuple(range(x.ndim - 1))
    gamma, beta = p.get("gamma", 1.0), p.get("beta", 0.0)
    want = (x - x.mean(axis=axes)) / np.sqrt(x.var(axis=axes) + 1e-3) * gamma + beta
    np.testing.assert_allclose(run(layer, p, x)[0], want, rtol=1e-10, atol=1e-10)
    infer = (x - p["moving_mean"]) / np.sqrt(p["moving_variance"] + 1e-3) * gamma + beta
    np.testing.assert_allclose(run(layer, p, x, training=False)[0], infer, rtol=1e-10, atol=1e-10)
    g = assert_fd(layer, p, x, seed=seed)
    assert_fd(layer, p, x, training=False, seed=seed)
    # the statistics' slots: the batch's mean less the moving one, and its variance plus that squared
    d = x.mean(axis=axes) - p["moving_mean"]
    np.testing.assert_allclose(g["moving_mean"], d, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g["moving_variance"], x.var(axis=axes) + d ** 2, rtol=1e-10)


@FAST
@given(shape=shapes(), seed=st.integers(0, 2**16), per_channel=st.booleans())
def test_rescaling_against_numpy_and_finite_differences(shape, seed, per_channel):
    """Catches the offset added before scaling, and a per-channel scale applied to the wrong axis."""
    r = np.random.default_rng(seed)
    scale = list(r.standard_normal(shape[-1])) if per_channel else 1 / 255
    layer = built(Rescaling(scale, offset=-0.5), shape)
    x = r.standard_normal((3, *shape))
    np.testing.assert_allclose(run(layer, {}, x)[0], x * np.asarray(scale) - 0.5, rtol=1e-12)
    assert_fd(layer, {}, x, seed=seed)


def test_keras_weights_defaults_summary_and_refusals():
    """Keras's weight names and order, and summary's non-trainable count (the moving
    statistics); catches arguments pserver cannot honour accepted silently."""
    inputs = keras.Input((4, 4, 3))
    h = keras.layers.Rescaling(1 / 255)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(h))
    names = [t.name for t in model._core.layout.tensors]
    assert names[:6] == ["batch_normalization/gamma", "batch_normalization/beta",
                         "batch_normalization/moving_mean", "batch_normalization/moving_variance",
                         "layer_normalization/gamma", "layer_normalization/beta"]
    text = model._core.summary_text()
    assert "Total params: 206" in text and "Non-trainable params: 6" in text
    bn = BatchNormalization()
    assert (bn.momentum, bn.epsilon, LayerNormalization().epsilon) == (0.99, 1e-3, 1e-3)
    for bad in (lambda: BatchNormalization(synchronized=True), lambda: BatchNormalization(axis=1),
                lambda: LayerNormalization(rms_scaling=True), lambda: BatchNormalization(momentum=2),
                lambda: Rescaling("x")):
        with pytest.raises(ConfigError):
            bad()


def test_save_and_load_keep_the_layers_and_the_moving_statistics(tmp_path):
    """Catches a layer missing from the registry a file is read with, a config that does not
    rebuild it, and moving statistics lost or reset to their initial values on the way."""
    inputs = keras.Input((3,))
    h = keras.layers.BatchNormalization(momentum=0.5, epsilon=0.01)(inputs)
    h = keras.layers.LayerNormalization(center=False)(keras.layers.Rescaling([1.0, 2.0, 3.0], offset=1.0)(h))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(h))
    weights = [np.random.default_rng(i).standard_normal(w.shape).astype(np.float32) ** 2
               for i, w in enumerate(model.get_weights())]
    model.set_weights(weights)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    for a, b in zip(again.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    assert [la.momentum for la in again._core.layers if isinstance(la, BatchNormalization)] == [0.5]


def test_a_batch_normalization_called_twice_is_refused():
    """Catches a shared BatchNormalization accepted: its backward would sum two batches' statistics."""
    inputs = keras.Input((3,))
    bn = keras.layers.BatchNormalization()
    with pytest.raises(ConfigError, match="called 2 times"):
        keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Add()([bn(inputs), bn(inputs)])))._core.build()


def test_cuda_refuses_group_normalization_in_one_line_and_runs_batch_normalization():
    """Catches a model with a layer that has no CUDA kernels sent to the GPU (BatchNormalization
    has them: tests/cuda_sim/check_graph_cuda.py)."""
    from pserver.models import cuda_support
    inputs = Symbolic((None, 4))
    model = Functional(inputs, Dense(2)(GroupNormalization(groups=2)(inputs))).build()
    with pytest.raises(ConfigError, match=r"GroupNormalization\).*has no CUDA kernels") as e:
        cuda_support.check(model)
    assert "\n" not in str(e.value)
    cuda_support.check(Functional(inputs, Dense(2)(BatchNormalization()(inputs))).build())


# -- the moving statistics on the shards ----------------------------------------------------

def bn_model(features: int, momentum: float = 0.9):
    inputs = keras.Input((features,))
    h = keras.layers.BatchNormalization(momentum=momentum)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(h))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model._core


def pull(shards, total):
    w = np.empty(total, np.float32)
    for j, s in enumerate(shards):
        w[s.store.start:s.store.end] = s.pull(0, j, -1, 0, timeout=5)[1]
    return w


def push(shards, model, w, x, rank, step):
    """As PSClient pushes: each shard's slice, and the means another shard holds for its variances."""
    g = np.empty_like(w)
    model.loss_and_grad(w, x, np.zeros(len(x), np.int64), g)
    pairs = model.layout.statistics_pairs()
    for j, s in enumerate(shards):
        away = g[away_means(pairs, s.store.start, s.store.end)]
        s.push(push_request(g[s.store.start:s.store.end], rank=rank, shard=j, step=step, samples=len(x),
                            statistics=away))
    return g


def moving(model, w):
    views = model.layout.views(w)
    return views["batch_normalization/moving_mean"], views["batch_normalization/moving_variance"]


@SETTINGS
@given(sizes=st.lists(st.integers(1, 7), min_size=2, max_size=3), num_shards=st.integers(1, 3),
       features=st.integers(1, 5), seed=st.integers(0, 2**16), shift=st.sampled_from([0.0, 4.0]))
def test_sync_moving_statistics_are_one_large_batchs(sizes, num_shards, features, seed, shift):
    """In sync, the workers' pushes give the shards the statistics of their batches as one
    batch (the sample-weighted union), on any number of shards: catches an unweighted mean of
    the workers' moments, a variance that forgets the spread of the workers' means ((m_i -
    M)^2), and a variance whose mean another shard holds (2 shards cut this layout between
    them) corrected with the wrong value or not at all."""
    model = bn_model(features)
    r = np.random.default_rng(seed)
    w0 = model.init_params(seed)
    shards = make_cluster(model.layout, w0, num_shards, len(sizes), mode="sync", optimizer="sgd", lr=0.1)
    for step in range(2):
        w = pull(shards, w0.size)
        xs = [(r.standard_normal((n, features)) * r.uniform(0.5, 3) + shift * r.standard_normal())
              .astype(np.float32) for n in sizes]
        for rank, x in enumerate(xs):
            push(shards, model, w, x, rank, step)
        both = np.concatenate(xs).astype(np.float64)
        mm, mv = (v.astype(np.float64) for v in moving(model, w))
        got_mean, got_var = moving(model, pull(shards, w0.size))
        np.testing.assert_allclose(got_mean, 0.9 * mm + 0.1 * both.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_var, 0.9 * mv + 0.1 * both.var(0), rtol=1e-5, atol=1e-5)
    if num_shards == 2 and features > 1:       # the range cut falls inside the moving variance
        assert shards[1].store.moving.away == features - 1


def test_a_rejected_push_leaves_the_statistics_as_they_are():
    """A push with a non-finite value, or without the statistics its shard needs from another
    one, is refused before anything changes: catches statistics updated from a push the
    optimizer refused, or a refused push counted in the step."""
    model = bn_model(3)
    w0 = model.init_params(0)
    shards = make_cluster(model.layout, w0, 1, 2, mode="sync", optimizer="sgd", lr=0.1)
    r = np.random.default_rng(1)
    xs = [r.standard_normal((4, 3)).astype(np.float32) + 2 for _ in range(2)]
    push(shards, model, w0, xs[0], 0, 0)
    g = np.empty_like(w0)
    model.loss_and_grad(w0, xs[1], np.zeros(4, np.int64), g)
    g[model.layout.offsets()["batch_normalization/moving_variance"][0]] = np.nan
    with pytest.raises(InvalidArgument):
        shards[0].push(push_request(g, rank=1, samples=4))
    with pytest.raises(InvalidArgument, match="statistics: 1 values for the 0"):
        shards[0].push(push_request(g, rank=1, samples=4, statistics=np.ones(1, np.float32)))
    np.testing.assert_array_equal(pull(shards, w0.size), w0)       # the step waits for worker 1
    push(shards, model, w0, xs[1], 1, 0)
    both = np.concatenate(xs).astype(np.float64)
    mean, var = moving(model, pull(shards, w0.size))
    np.testing.assert_allclose(mean, 0.1 * both.mean(0), rtol=1e-5)
    np.testing.assert_allclose(var, 0.9 + 0.1 * both.var(0), rtol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_worker_follows_keras_rule(mode):
    """moving = momentum * moving + (1 - momentum) * batch each step, the optimizer never touching
    the statistics (frozen): catches the optimizer's update applied to them too (sgd would move
    them by lr * slot), and a batch variance taken without its correction by the mean's move."""
    model = bn_model(4, momentum=0.8)
    w0 = model.init_params(3)
    shards = make_cluster(model.layout, w0, 1, 1, mode=mode, optimizer="sgd", lr=0.5)
    r = np.random.default_rng(2)
    mean, var = np.zeros(4), np.ones(4)
    for step in range(3):
        w = pull(shards, w0.size)
        x = (r.standard_normal((6, 4)) * 2 + 3).astype(np.float32)
        push(shards, model, w, x, 0, step)
        mean = 0.8 * mean + 0.2 * x.astype(np.float64).mean(0)
        var = 0.8 * var + 0.2 * x.astype(np.float64).var(0)
    got = moving(model, pull(shards, w0.size))
    np.testing.assert_allclose(got[0], mean, rtol=1e-5)
    np.testing.assert_allclose(got[1], var, rtol=1e-5)


def test_a_layout_with_unpaired_statistics_is_refused():
    """Catches a worker's layout with a mean and no variance (or two of different shapes)
    accepted, which update_statistics would pair wrongly."""
    layout = Layout.of([("a", (3,)), ("b", (2,))])
    with pytest.raises(InvalidArgument, match="mean and its variance"):
        checks.checked_registration(1, layout.with_statistics({"a": 0.9, "b": 0.9}))
    with pytest.raises(InvalidArgument, match="without its variance"):
        checks.checked_registration(1, layout.with_statistics({"a": 0.9}))
    assert layout.with_statistics({"a": 0.9}).tensors[0].frozen
    assert Layout.of([("a", (3,)), ("b", (3,))]).with_statistics({"a": 0.5, "b": 0.5}).statistics_pairs() == \
        ((0, 3, 3, 0.5),)


@pytest.mark.parametrize("plane", ["grpc", "auto"])
def test_pushes_over_the_wire_give_two_shards_the_union(shard_server, plane):
    """PSClient registers the statistics (TensorSpec.momentum) and sends each shard the means it
    lacks (TensorHeader.statistics; over gRPC even when the data plane is there): two workers on
    two shards that cut the moving variance get one batch's statistics. Catches the momentum or
    the carried means lost on the wire, and a push with them sent over the data plane (refused)."""
    from pserver.worker.client import PSClient
    from pserver.worker.loop import registered_layout
    model = bn_model(4, momentum=0.75)
    layout = registered_layout(model)
    servers = [shard_server(shard=j, num_shards=2, num_workers=2, optimizer="sgd", lr=0.1) for j in range(2)]
    clients = [PSClient([a for a, _ in servers], rank=r, num_workers=2, rpc_deadline=10, data_plane=plane)
               for r in range(2)]
    for c in clients:
        c.connect(5)
        c.register(layout)
    assert [s.store.statistics for _, s in servers] == [layout.statistics_pairs()] * 2
    assert layout.statistics_pairs() == ((8, 12, 4, 0.75),)
    assert servers[1][1].store.moving.away == 3     # 26 params: shard 1 holds 13.., variances 1 to 3 of 4
    w0 = model.init_params(0)
    clients[0].init(w0)
    r = np.random.default_rng(5)
    xs = [(r.standard_normal((n, 4)) * 2 + r.standard_normal()).astype(np.float32) for n in (3, 6)]
    for c, x in zip(clients, xs):
        w = np.empty_like(w0)
        c.pull(w)
        g = np.empty_like(w0)
        model.loss_and_grad(w, x, np.zeros(len(x), np.int64), g)
        c.push(g, num_samples=len(x))
    w = np.empty_like(w0)
    clients[0].pull(w, clock=1)
    both = np.concatenate(xs).astype(np.float64)
    mean, var = moving(model, w)
    np.testing.assert_allclose(mean, 0.25 * both.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, 0.75 + 0.25 * both.var(0), rtol=1e-5)
    for c in clients:
        c.close()


def test_compression_is_refused_with_moving_statistics(shard_server):
    """Catches a compressing worker accepted (its lossy pushes and their residual would skew the
    statistics)."""
    from pserver.worker.client import PSClient
    from pserver.worker.loop import registered_layout
    addr, _ = shard_server(optimizer="sgd", lr=0.1)
    bf16 = PSClient([addr], rank=0, rpc_deadline=10, data_plane="grpc", compression="bf16")
    with pytest.raises(ConfigError, match="--compress bf16: the model has moving statistics"):
        bf16.register(registered_layout(bn_model(3)))
