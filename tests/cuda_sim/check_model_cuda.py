"""The CUDA model against the CPU model, and pserver.kernels.device with a CUDA device present.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (see there why).
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from numba import cuda

from pserver.errors import ConfigError
from pserver.kernels.device import Device, describe, parse_device, round_robin, select, visible_gpus
from pserver.models import MODELS, make_model
from pserver.models.ctr import CTR_MODELS  # CPU only: their rows come from the shards
from pserver.models.cuda import CudaModel
from tests.cuda_sim import simfix

# Distinct small widths, so a transposed gradient has the wrong shape or values.
IN, CLASSES, HIDDEN = 5, 3, (4, 6)


def pair(name):
    return (make_model(name, IN, CLASSES, hidden=HIDDEN, backend="cpu"),
            make_model(name, IN, CLASSES, hidden=HIDDEN, backend="cuda"))


def batch(model, n, rng):
    x = rng.standard_normal((n, model.in_features)).astype(np.float32)
    if model.task == "classification":
        return x, rng.integers(0, model.num_classes, n).astype(np.int32)
    return x, rng.standard_normal(n).astype(np.float32)


def random_params(model, rng):
    # Nonzero biases too, so that bias gradients and ReLU masks are exercised.
    return (rng.standard_normal(model.layout.total) * 0.7).astype(np.float32)


# -- the CUDA model equals the CPU model ----------------------------------------------------

@pytest.mark.parametrize("name,n", [("mlp", 1), ("mlp", 20), ("logreg", 7), ("linreg", 7)])
def test_loss_and_grad_equals_cpu(name, n):
    # n = 20 crosses a 16-row tile: two row blocks forward, two K tiles in x.T @ dz.
    cpu_m, gpu_m = pair(name)
    rng = np.random.default_rng(n)
    w, (x, y) = random_params(cpu_m, rng), batch(cpu_m, n, rng)
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c, loss_g = cpu_m.loss_and_grad(w, x, y, g_c), gpu_m.loss_and_grad(w, x, y, g_g)
    assert isinstance(loss_g, float)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-4, atol=1e-6)


def test_the_weights_penalty_joins_the_loss_and_gradient_on_the_gpu_too():
    """Catches: --device cuda training a Keras model with kernel_regularizer without its
    penalty (the GPU kernels compute the data loss only)."""
    import pserver.keras as keras
    from pserver.keras import layers
    l1l2 = keras.regularizers.L1L2(0.1, 0.2)
    model = keras.Sequential([keras.Input(shape=(IN,)),
                              layers.Dense(4, "relu", kernel_regularizer=l1l2, bias_regularizer="l2"),
                              layers.Dense(CLASSES, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    cpu_m = model._core.build()
    gpu_m = CudaModel(cpu_m)
    rng = np.random.default_rng(3)
    w, (x, y) = random_params(cpu_m, rng), batch(cpu_m, 9, rng)
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c, loss_g = cpu_m.loss_and_grad(w, x, y, g_c), gpu_m.loss_and_grad(w, x, y, g_g)
    assert cpu_m._regularize(w) > 0.1 and loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-4, atol=1e-6)
    assert gpu_m.evaluate(w, x, y)["loss"] == pytest.approx(cpu_m.evaluate(w, x, y)["loss"], rel=1e-5)


def test_buffers_are_reused_and_results_repeat():
    _, model = pair("logreg")
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    (x1, y1), (x2, y2) = batch(model, 8, rng), batch(model, 3, rng)
    g1, g2, again = (np.full_like(w, np.nan) for _ in range(3))
    l1 = model.loss_and_grad(w, x1, y1, g1)
    model.loss_and_grad(w, x2, y2, g2)        # another batch size: other buffers
    assert model.loss_and_grad(w, x1, y1, again) == l1
    np.testing.assert_array_equal(g1, again)  # the same sums in the same order
    assert np.isfinite(g2).all() and not np.array_equal(g1, g2)


def test_threads_have_their_own_streams_and_buffers():
    _, model = pair("logreg")
    rng = np.random.default_rng(1)
    w = model.init_params(1)
    batches = [batch(model, 6, rng) for _ in range(2)]
    want = [np.empty_like(w) for _ in batches]
    for (x, y), g in zip(batches, want):
        model.loss_and_grad(w, x, y, g)
    got, states = [np.empty_like(w) for _ in batches], [None, None]

    def run(i):
        model.loss_and_grad(w, *batches[i], got[i])
        states[i] = model._state()

    for i in range(2):
        # One thread at a time: the simulator cannot run two kernels at once (a GPU can).
        t = threading.Thread(target=run, args=(i,))
        t.start()
        t.join()
    assert states[0] is not states[1] and states[0].stream is not states[1].stream
    assert model._state() not in states
    for g, h in zip(got, want):
        np.testing.assert_array_equal(g, h)


def test_evaluate_classification_equals_cpu():
    cpu_m, gpu_m = pair("logreg")
    rng = np.random.default_rng(2)
    w, (x, y) = random_params(cpu_m, rng), batch(cpu_m, 9, rng)
    got, want = gpu_m.evaluate(w, x, y, batch_size=4), cpu_m.evaluate(w, x, y, batch_size=4)
    assert set(got) == {"loss", "accuracy"}       # 2 full batches and a short one
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["accuracy"] == want["accuracy"]


def test_evaluate_regression_equals_cpu():
    cpu_m, gpu_m = pair("linreg")
    rng = np.random.default_rng(3)
    w, (x, y) = random_params(cpu_m, rng), batch(cpu_m, 9, rng)
    got, want = gpu_m.evaluate(w, x, y, batch_size=5), cpu_m.evaluate(w, x, y, batch_size=5)
    assert set(got) == {"loss", "r2"}
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["r2"] == pytest.approx(want["r2"], rel=1e-5)


@pytest.mark.parametrize("name", [m for m in MODELS if m not in ("cnn", *CTR_MODELS)])
def test_same_model_as_cpu(name):
    cpu_m, gpu_m = pair(name)
    assert isinstance(gpu_m, CudaModel) and gpu_m.kernels.__name__ == "pserver.kernels.cuda"
    assert gpu_m.layout == cpu_m.layout and gpu_m.name == cpu_m.name
    assert (gpu_m.task, gpu_m.num_classes, gpu_m.in_features) == (cpu_m.task, cpu_m.num_classes,
                                                                  cpu_m.in_features)
    np.testing.assert_array_equal(gpu_m.init_params(4), cpu_m.init_params(4))
    gpu_m.host.layers[0].trainable = False          # the shards hear of a frozen layer on cuda too
    from pserver.worker.loop import registered_layout
    frozen = [t.name for t in registered_layout(gpu_m).tensors if t.frozen]
    assert frozen == gpu_m.host.frozen_weights() and frozen[0].startswith(gpu_m.layers[0].name + "/")


def test_bad_inputs():
    _, model = pair("mlp")
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    g = np.empty_like(w)
    x, y = batch(model, 4, rng)
    with pytest.raises(ValueError, match="label out of range"):
        model.loss_and_grad(w, x, y + CLASSES, g)
    with pytest.raises(ValueError, match="label out of range"):
        model.evaluate(w, x, y - CLASSES)
    with pytest.raises(ValueError, match="float32"):
        model.loss_and_grad(w.astype(np.float64), x, y, g.astype(np.float64))
    with pytest.raises(ValueError, match="grad_out must be a C-contiguous"):
        model.loss_and_grad(w, x, y, np.empty(2 * w.size, np.float32)[::2])
    with pytest.raises(ValueError, match="x has shape"):
        model.loss_and_grad(w, x[:, :-1], y, g)
    with pytest.raises(ConfigError, match="--hidden"):
        make_model("mlp", IN, CLASSES, hidden=(0,), backend="cuda")
    # A layer without CUDA kernels: asking for the GPU says so, naming the layer.
    from pserver.layers import Dense, Flatten, GroupNormalization
    from pserver.models import on_device
    from pserver.models.sequential import Sequential
    up = Sequential([GroupNormalization(groups=1, input_shape=(3, 2)), Flatten(), Dense(CLASSES)])
    with pytest.raises(ConfigError,
                       match=r"--device cuda: .*layer group_normalization \(GroupNormalization\) has no CUDA "
                             r"kernels"):
        on_device(up, "cuda")


# -- layers beyond Dense: the reference CNN and the rest ------------------------------------

def cnn_pair(layers_fn, shape):
    from pserver.models import on_device
    from pserver.models.sequential import Sequential
    cpu_m = Sequential(layers_fn(), input_shape=shape).build()
    gpu_m = on_device(Sequential(layers_fn(), input_shape=shape), "cuda")
    return cpu_m, gpu_m


def reference_cnn():
    # The layers of `--model cnn` (TensorFlow's distributed-training guide), narrower (4 filters,
    # 6 units instead of 32 and 64) so the simulator runs them in seconds.
    from pserver.layers import Conv2D, Dense, Flatten, MaxPooling2D
    return [Conv2D(4, 3, activation="relu"), MaxPooling2D(2), Flatten(), Dense(6, activation="relu"),
            Dense(CLASSES)]


def other_layers():
    from pserver.layers import AveragePooling2D, Conv2D, Dense, Dropout, Flatten, MaxPooling2D
    return [Conv2D(3, 3, padding="same", activation="tanh", use_bias=False),
            AveragePooling2D(2, strides=1), Conv2D(2, (2, 3), strides=(2, 1), activation="sigmoid"),
            MaxPooling2D(2, padding="same"), Flatten(), Dropout(0.5), Dense(5, activation="relu"),
            Dropout(0.0), Dense(CLASSES)]


@pytest.mark.parametrize("layers_fn", [reference_cnn, other_layers], ids=["cnn", "others"])
def test_layers_beyond_dense_equal_cpu(layers_fn):
    import copy
    layers = layers_fn()
    cpu_m, gpu_m = cnn_pair(lambda: copy.deepcopy(layers), (8, 8, 1))
    assert isinstance(gpu_m, CudaModel) and gpu_m.layout == cpu_m.layout
    rng = np.random.default_rng(3)
    w = random_params(cpu_m, rng)
    x = rng.standard_normal((5, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, CLASSES, 5).astype(np.int32)
    for seed in (11, 12)[:2 if layers_fn is other_layers else 1]:   # Dropout's mask: from the seed
        g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
        loss_c = cpu_m.loss_and_grad(w, x, y, g_c, seed=seed)
        loss_g = gpu_m.loss_and_grad(w, x, y, g_g, seed=seed)
        assert loss_g == pytest.approx(loss_c, rel=1e-5)
        np.testing.assert_allclose(g_g, g_c, rtol=1e-4, atol=1e-6)
        assert np.isfinite(g_g).all() and np.count_nonzero(g_g) > w.size // 2
    got, want = gpu_m.evaluate(w, x, y), cpu_m.evaluate(w, x, y)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["accuracy"] == want["accuracy"]


def test_timings_split_the_step():
    _, gpu_m = pair("mlp")
    rng = np.random.default_rng(1)
    w, (x, y) = random_params(gpu_m, rng), batch(gpu_m, 6, rng)
    g = np.empty_like(w)
    loss, ms = gpu_m.loss_and_grad(w, x, y, g, timings=True)
    assert loss == pytest.approx(gpu_m.loss_and_grad(w, x, y, np.empty_like(w)), rel=1e-6)
    assert set(ms) == {"h2d", "compute", "d2h"}
    # A simulator's events time nothing: numba's returns 0.0, numba-cuda's -1.0.
    assert all(v >= 0 for v in ms.values()) or (simfix.SIMULATOR and set(ms.values()) == {-1.0})


# -- step graphs (pserver.models.cuda.StepGraph) -------------------------------------------------

def _sgd(model, w, batches, between=None, lr=0.05):
    """Plain SGD with the model's gradient: each step's loss and gradient. `between(i)` runs
    before step i."""
    w, seen = w.copy(), []
    for i, (x, y) in enumerate(batches):
        if between:
            between(i, w)
        g = np.full_like(w, np.nan)
        seen.append((model.loss_and_grad(w, x, y, g, seed=i), g))
        w -= np.float32(lr) * g
    return seen


def test_step_graphs_replay_the_eager_steps_bit_for_bit(monkeypatch):
    """From a batch size's second training step on, a GPU replays the step as one CUDA graph: the
    same losses and gradients as every kernel launched on its own, bit for bit, over steps of
    two sizes with evaluations between them. Catches: a graph that reads a buffer freed or moved
    since its capture, staging that the replay does not copy (the last step's x, y or w), a
    capture made before the buffers were. In the simulator (no graphs) every step is eager."""
    import copy
    layers = reference_cnn()
    _, graphed = cnn_pair(lambda: copy.deepcopy(layers), (6, 6, 1))
    monkeypatch.setenv("PSERVER_CUDA_GRAPHS", "0")
    _, eager = cnn_pair(lambda: copy.deepcopy(layers), (6, 6, 1))
    assert graphed.step_graphs is not simfix.SIMULATOR and eager.step_graphs is False
    rng = np.random.default_rng(5)
    w = random_params(graphed, rng)

    def data(n):
        return (rng.standard_normal((n, 6, 6, 1)).astype(np.float32),
                rng.integers(0, CLASSES, n).astype(np.int32))

    # Size 2's graph is captured while the weight gradient's scratch fits 2 samples; size 4's
    # first step then replaces that scratch with a larger one, and size 2's graph runs again.
    batches = [data(2) for _ in range(3)] + [data(4) for _ in range(2)] + [data(2) for _ in range(2)]
    held_out = data(5)

    def between(model):
        def run(i, w):
            if i in (2, 4):
                model.evaluate(w, *held_out)
        return run

    got, want = _sgd(graphed, w, batches, between(graphed)), _sgd(eager, w, batches, between(eager))
    for (lg, gg), (le, ge) in zip(got, want):
        assert lg == le
        np.testing.assert_array_equal(gg, ge)
    made = {n: b.step_graph for n, b in graphed._state()._batches.items()}
    if simfix.SIMULATOR:
        assert not any(made.values())
    else:
        from pserver.models.cuda import StepGraph
        assert isinstance(made[2], StepGraph) and isinstance(made[4], StepGraph)
    assert not any(b.step_graph for b in eager._state()._batches.values())


def test_a_step_that_fails_while_capturing_makes_no_graph():
    """A capture whose work raises midway gives no graph (a partial step must never be replayed)
    and says so once; the stream is usable after it. The simulator has no graphs: there the
    model never tries."""
    _, gpu_m = pair("logreg")
    if simfix.SIMULATOR:
        assert gpu_m.step_graphs is False
        return
    from pserver.models.cuda import StepGraph
    st = gpu_m._state()
    scratch, ones = cuda.device_array(4, np.float32), cuda.to_device(np.ones(4, np.float32))

    def half_a_step():
        scratch.copy_to_device(ones, stream=st.stream)     # device to device: captured
        raise ValueError("a layer refused")

    with pytest.warns(RuntimeWarning, match="a layer refused"):
        assert StepGraph.capture(st.stream, half_a_step) is False
    scratch.copy_to_device(np.full(4, 2, np.float32), stream=st.stream)
    np.testing.assert_array_equal(scratch.copy_to_host(stream=st.stream), [2, 2, 2, 2])


def test_a_model_with_dropout_trains_eagerly():
    """Dropout's mask comes from each step's seed, an argument a replayed graph would repeat:
    such a model makes no step graph, and two steps with two seeds draw two masks."""
    from pserver.layers import Dense, Dropout
    from pserver.models import cuda_support
    _, gpu_m = cnn_pair(lambda: [Dense(6, activation="relu"), Dropout(0.5), Dense(CLASSES)], (IN,))
    assert gpu_m.step_graphs is False
    assert cuda_support.draws_at_random(gpu_m.host) == gpu_m.host.layers[1].label
    rng = np.random.default_rng(2)
    w = random_params(gpu_m, rng)
    x, y = batch(gpu_m, 4, rng)
    g = [np.empty_like(w) for _ in range(3)]
    losses = [gpu_m.loss_and_grad(w, x, y, gi, seed=s) for gi, s in zip(g, (1, 2, 1))]
    assert losses[0] == losses[2] and losses[0] != losses[1]
    np.testing.assert_array_equal(g[0], g[2])


# -- pserver.kernels.device with a device present ------------------------------------------------

def test_select_and_describe():
    # The simulator has one device; a machine has what CUDA_VISIBLE_DEVICES shows.
    count = visible_gpus()
    assert count >= 1 and (count == 1 or not simfix.SIMULATOR)
    assert select(parse_device("cuda")) == Device("cuda", 0)
    assert select(parse_device("cuda:0")) == Device("cuda", 0)
    want = (r"cuda:0 \(CUDA simulator\)" if simfix.SIMULATOR
            else r"cuda:0 \(NVIDIA .+, compute capability \d+\.\d+\)")
    assert re.fullmatch(want, describe(Device("cuda", 0))), describe(Device("cuda", 0))
    assert select(parse_device("cpu")) == Device("cpu") and describe(Device("cpu")) == "cpu"


def test_select_an_index_that_is_not_visible():
    count = visible_gpus()
    with pytest.raises(ConfigError) as e:
        select(parse_device(f"cuda:{count}"))
    where = "the CUDA simulator has one" if simfix.SIMULATOR else "CUDA_VISIBLE_DEVICES="
    choices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
    assert str(e.value).startswith(f"--device cuda:{count}: only {count} CUDA device(s) visible ({where}")
    assert str(e.value).endswith(f"; use {choices}")


def test_round_robin_over_the_visible_devices():
    count = visible_gpus()
    assert round_robin(3, "cuda") == [f"cuda:{r % count}" for r in range(3)]
    assert round_robin(2, "cuda:0") == ["cuda:0"] * 2
    assert round_robin(2, "cpu") == ["cpu"] * 2


def test_logreg_with_sgd_learns_on_the_device_as_on_the_cpu():
    # The worker's loop in miniature: loss_and_grad, then the shard's SGD step, with the same
    # batches for a CPU and a CUDA model: both learn, and their weights stay together.
    from pserver.optim import make_optimizer
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 128).astype(np.int32)
    x = (rng.standard_normal((128, 2)) + np.where(y[:, None] == 1, 3.0, -3.0)).astype(np.float32)
    models = [make_model("logreg", 2, 2, backend=b) for b in ("cpu", "cuda")]
    opts = [make_optimizer("sgd", models[0].layout.total, lr=1.0) for _ in models]
    ws = [m.init_params(0) for m in models]
    g = np.empty_like(ws[0])
    first = models[1].evaluate(ws[1], x, y)
    for t in range(8):
        idx = rng.choice(128, 32, replace=False)
        for m, opt, w in zip(models, opts, ws):
            m.loss_and_grad(w, x[idx], y[idx], g)
            opt.step(w, g, t)
    last = models[1].evaluate(ws[1], x, y)
    assert first["accuracy"] < 0.5 and last["accuracy"] == 1.0
    assert last["loss"] < 1e-3 * first["loss"]
    np.testing.assert_allclose(ws[1], ws[0], rtol=1e-4, atol=1e-5)


def test_evaluation_allocates_no_gradient_buffers():
    # The CPU model's rule on the device too: evaluating 4096 CNN images must not also hold
    # every layer's d loss / d output (hundreds of MB); the first training step makes them.
    _, gpu_m = pair("mlp")
    rng = np.random.default_rng(2)
    w, (x, y) = random_params(gpu_m, rng), batch(gpu_m, 7, rng)
    gpu_m.evaluate(w, x, y)
    b = gpu_m._state()._batches[7]

    def douts():        # every plan's d loss / d output buffers (pserver.models.graph.PlanBuffers)
        return [d for plan in b.graph._of.values() for d in plan.douts.values()]
    assert not douts()
    gpu_m.loss_and_grad(w, x, y, np.empty_like(w))
    assert douts() and len(douts()) == len(gpu_m.layers)
