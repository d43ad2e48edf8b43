"""SimpleRNN, LSTM, GRU and Bidirectional: the numba kernels against their NumPy twins in float32,
the twins' backward through time against central finite differences in float64 (hypothesis over
batch, steps, features, units, return_sequences, return_state, go_backwards, use_bias), outputs
equal to Keras 3's for the same weights, Keras's weights and parameter counts, return_state in the
Functional API, initial_state, save/load, refusals, and keras.io's addition_rnn encoder-decoder learning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.layers import GRU, LSTM, Bidirectional, Dense, SimpleRNN
from pserver.layers.base import Pass
from pserver.models import Functional
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_directional
from tests.support.sequences import addition_data

FAST = settings(max_examples=20, deadline=None)
EPS = 1e-6
CELLS = {"SimpleRNN": SimpleRNN, "LSTM": LSTM, "GRU": GRU}
REF, CPU = get_backend("reference"), get_backend("cpu")


def built(layer, shape):
    layer.build_once(shape)
    return layer


def run(layer, k, p, x):
    first = x[0] if isinstance(x, list) else x
    out = np.empty((first.shape[0], *layer.output_shape), first.dtype)
    s = layer.scratch(first.shape[0], first.dtype)
    layer.forward(k, p, x, out, s, Pass(training=True))
    return out, s


def grads(layer, k, p, x, G):
    out, s = run(layer, k, p, x)
    g = {n: np.empty_like(v) for n, v in p.items()}
    dx = np.empty_like(x)
    layer.backward(k, p, g, x, out, G.copy(), dx, s)
    return out, g, dx


def case(data, cell):
    """A layer of `cell` built for a drawn (steps, features), its weights and a batch, in float64."""
    n, steps, features, units = (data.draw(st.integers(1, hi)) for hi in (3, 4, 3, 3))
    flags = {f: data.draw(st.booleans()) for f in ("return_sequences", "return_state", "go_backwards",
                                                    "use_bias")}
    flags["dropout"] = data.draw(st.sampled_from([0.0, 0.4]))      # the same mask in every pass here
    flags["recurrent_dropout"] = data.draw(st.sampled_from([0.0, 0.3]))
    layer = built(CELLS[cell](units, **flags), (steps, features))
    r = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    return layer, p, r.standard_normal((n, steps, features)), r


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), data=st.data())
def test_the_twin_s_backward_through_time_against_finite_differences(cell, data):
    """<G, d out> along random directions of x and of each weight: catches a gate's derivative or
    order wrong, a missing recurrent term (dh' = dz @ R^T, LSTM's dc * f, GRU's dh * z), go_backwards
    mapping a gradient to the wrong step, and a state output's gradient (return_state) dropped."""
    layer, p, x, r = case(data, cell)
    G = r.standard_normal((x.shape[0], *layer.output_shape))
    _, g, dx = grads(layer, REF, p, x, G)

    assert_directional(lambda p_, x_: float(np.sum(run(layer, REF, p_, x_)[0] * G)), x, p, dx, g, r)


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), data=st.data())
def test_the_numba_kernels_against_the_twins_in_float32(cell, data):
    """Catches a compiled kernel that differs from its twin (an index of a gate, the time step
    read under go_backwards, a state not carried) in the forward pass or any gradient."""
    layer, p, x, r = case(data, cell)
    p = {n: v.astype(np.float32) for n, v in p.items()}
    x = x.astype(np.float32)
    G = r.standard_normal((x.shape[0], *layer.output_shape)).astype(np.float32)
    want, got = grads(layer, REF, p, x, G), grads(layer, CPU, p, x, G)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name in p:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-4)


@FAST
@given(cell=st.sampled_from(sorted(CELLS)), rate=st.floats(0.05, 0.9), seed=st.integers(0, 2**16))
def test_input_dropout_is_one_mask_per_sample_and_feature_at_every_step_in_training_only(cell, rate, seed):
    """Keras's `dropout` on a recurrent layer's inputs: the layer in training equals the layer
    without dropout on x * mask, one mask row per sample shared by every step, 0 or 1/(1 - rate);
    at inference it drops nothing. Catches a mask drawn per step, dropout on the states or the
    outputs, and dropout at inference."""
    r = np.random.default_rng(seed)
    layer = built(CELLS[cell](3, dropout=rate, return_sequences=True), (5, 4))
    plain = built(CELLS[cell](3, return_sequences=True), (5, 4))
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    x = r.standard_normal((6, 5, 4))
    out, s = run(layer, REF, p, x)
    mask = s["input_mask"]
    assert mask.shape == (6, 4) and set(np.unique(mask)) <= {0.0, 1 / (1 - rate)}
    np.testing.assert_allclose(out, run(plain, REF, p, x * mask[:, None, :])[0], rtol=1e-12, atol=1e-12)
    inference = np.empty_like(out)
    layer.forward(REF, p, x, inference, layer.scratch(6, x.dtype), Pass(training=False))
    np.testing.assert_allclose(inference, run(plain, REF, p, x)[0], rtol=1e-12, atol=1e-12)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def keras_cell_with_masks(cell, p, x, gm, rm):
    """Keras's cells as implementation 1 writes them (keras/src/layers/rnn/*.py), in NumPy: gate g
    reads x * gm[g] and h * rm[g]; returns every step's h (n, steps, units)."""
    n, steps, _ = x.shape
    u = p["recurrent_kernel"].shape[0]
    K, R = p["kernel"], p["recurrent_kernel"]
    b = p["bias"] if cell != "GRU" else p["bias"][0]
    rb = p["bias"][1] if cell == "GRU" else 0 * b
    blk = [slice(g * u, (g + 1) * u) for g in range(K.shape[1] // u)]
    h, c, hs = np.zeros((n, u)), np.zeros((n, u)), []
    for t in range(steps):
        xz = [(x[:, t] * gm[g]) @ K[:, blk[g]] + b[blk[g]] for g in range(len(blk))]
        hz = [(h * rm[g]) @ R[:, blk[g]] + rb[blk[g]] for g in range(len(blk))]
        if cell == "SimpleRNN":
            h = np.tanh(xz[0] + hz[0])
        elif cell == "LSTM":
            i, f = _sigmoid(xz[0] + hz[0]), _sigmoid(xz[1] + hz[1])
            c = f * c + i * np.tanh(xz[2] + hz[2])
            h = _sigmoid(xz[3] + hz[3]) * np.tanh(c)
        else:
            z, r = _sigmoid(xz[0] + hz[0]), _sigmoid(xz[1] + hz[1])
            h = z * h + (1 - z) * np.tanh(xz[2] + r * hz[2])
        hs.append(h)
    return np.stack(hs, 1)


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_recurrent_dropout_is_one_mask_per_gate_on_the_state_in_training_only(cell, dropout):
    """Keras's recurrent_dropout (implementation 1): in training, gate g's recurrent product reads
    h * rmask[g], one mask per sample, unit and gate, the same at every step, and with dropout
    each gate reads x * its own input mask; at inference nothing is dropped. Catches a mask on the
    output or the cell state, one mask shared by the gates, a mask drawn per step, and dropout at
    inference."""
    r = np.random.default_rng(3)
    layer = built(CELLS[cell](3, dropout=dropout, recurrent_dropout=0.3, return_sequences=True), (6, 4))
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    x = r.standard_normal((5, 6, 4))
    out, s = run(layer, REF, p, x)
    k = layer.gates
    rm = s["rmask"]
    assert rm.shape == (k, 5, 3) and set(np.unique(rm)) <= {0.0, 1 / 0.7}
    if k > 1:
        assert not all(np.array_equal(rm[0], rm[g]) for g in range(1, k))
    gm = s["gate_masks"] if dropout else np.ones((k, 5, 4))
    if dropout:
        assert gm.shape == (k, 5, 4) and set(np.unique(gm)) <= {0.0, 1 / 0.6}
    np.testing.assert_allclose(out, keras_cell_with_masks(cell, p, x, gm, rm), rtol=1e-10, atol=1e-12)
    inference = np.empty_like(out)
    layer.forward(REF, p, x, inference, layer.scratch(5, x.dtype), Pass(training=False))
    plain = keras_cell_with_masks(cell, p, x, np.ones((k, 5, 4)), np.ones_like(rm))
    np.testing.assert_allclose(inference, plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("merge_mode", ["concat", "sum", "mul", "ave"])
@pytest.mark.parametrize("return_sequences", [False, True])
def test_bidirectional_against_finite_differences(merge_mode, return_sequences):
    """Catches the backward layer's steps not put back in order before the merge (or its
    gradient's), a merge's gradient wrong, and the two layers' input gradients not summed."""
    layer = built(Bidirectional(GRU(2, return_sequences=return_sequences), merge_mode=merge_mode), (3, 2))
    r = np.random.default_rng(len(merge_mode))
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    x = r.standard_normal((2, 3, 2))
    G = r.standard_normal((2, *layer.output_shape))
    _, g, dx = grads(layer, REF, p, x, G)
    d = r.standard_normal(x.shape)
    fd = (np.sum(run(layer, REF, p, x + EPS * d)[0] * G) - np.sum(run(layer, REF, p, x - EPS * d)[0] * G))
    assert abs(fd / (2 * EPS) - np.sum(dx * d)) <= 1e-6 * (1 + abs(fd / (2 * EPS)))
    name = "backward_gru/recurrent_kernel"
    d = r.standard_normal(p[name].shape)
    fd = (np.sum(run(layer, REF, {**p, name: p[name] + EPS * d}, x)[0] * G)
          - np.sum(run(layer, REF, {**p, name: p[name] - EPS * d}, x)[0] * G)) / (2 * EPS)
    assert abs(fd - np.sum(g[name] * d)) <= 1e-6 * (1 + abs(fd))


@pytest.mark.parametrize("cell,merge_mode,return_sequences", [
    ("LSTM", "concat", True), ("LSTM", "mul", False), ("GRU", "ave", True), ("SimpleRNN", "sum", False)])
def test_bidirectional_return_state_packs_each_direction_s_final_states(cell, merge_mode, return_sequences):
    """[output, *forward states, *backward states] as Keras's: each state equals its direction's
    layer run alone (the backward one reading the sequence backwards), and the output is the
    merge as without states. The backward pass against central differences of a functional of
    the output and every state. Catches the directions' states swapped, LSTM's h and c swapped,
    a state's gradient dropped, and the merged output shifted by the packing."""
    layer = built(Bidirectional(CELLS[cell](3, return_state=True, return_sequences=return_sequences),
                                merge_mode=merge_mode), (4, 2))
    plain = built(Bidirectional(CELLS[cell](3, return_sequences=return_sequences), merge_mode=merge_mode),
                  (4, 2))
    states, width = layer.layer.states, (6 if merge_mode == "concat" else 3)
    merged = (4, width) if return_sequences else (width,)
    assert layer.output_shape == (int(np.prod(merged)) + 2 * states * 3,)
    r = np.random.default_rng(len(cell) + return_sequences)
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    x = r.standard_normal((2, 4, 2))
    out = run(layer, REF, p, x)[0]
    size = int(np.prod(merged))
    np.testing.assert_allclose(out[:, :size].reshape(2, *merged), run(plain, REF, p, x)[0], rtol=1e-12)
    for i, prefix in enumerate(layer.prefixes):
        alone = built(CELLS[cell](3, return_state=True, go_backwards=i == 1), (4, 2))
        own = run(alone, REF, {n[len(prefix):]: v for n, v in p.items() if n.startswith(prefix)}, x)[0]
        for j in range(states):
            at = size + (i * states + j) * 3
            np.testing.assert_allclose(out[:, at:at + 3], own[:, 1 + j], rtol=1e-12)
    G = r.standard_normal(out.shape)
    _, g, dx = grads(layer, REF, p, x, G)
    d = r.standard_normal(x.shape)
    fd = (np.sum(run(layer, REF, p, x + EPS * d)[0] * G) - np.sum(run(layer, REF, p, x - EPS * d)[0] * G))
    assert abs(fd / (2 * EPS) - np.sum(dx * d)) <= 1e-6 * (1 + abs(fd / (2 * EPS)))
    for name in p:
        d = r.standard_normal(p[name].shape)
        fd = (np.sum(run(layer, REF, {**p, name: p[name] + EPS * d}, x)[0] * G)
              - np.sum(run(layer, REF, {**p, name: p[name] - EPS * d}, x)[0] * G)) / (2 * EPS)
        assert abs(fd - np.sum(g[name] * d)) <= 1e-6 * (1 + abs(fd)), name


def test_bidirectional_return_state_in_a_model_trains_and_saves(tmp_path):
    """The call's list as Keras's: output, forward h and c, backward h and c; a model reading
    the states alone trains the backward layer's kernel, and a saved model replays the packed
    call with its slices."""
    inputs = keras.Input((5, 3))
    out, fh, fc, bh, bc = keras.layers.Bidirectional(keras.layers.LSTM(4, return_state=True))(inputs)
    assert (out.shape, fh.shape, fc.shape, bh.shape, bc.shape) == ((None, 8), *[(None, 4)] * 4)
    probe = keras.Model(inputs, [out, fh, bh])
    x = np.random.default_rng(0).standard_normal((6, 5, 3)).astype(np.float32)
    o, f, b = probe.predict(x, verbose=0)
    np.testing.assert_array_equal(o, np.concatenate([f, b], axis=1))     # without sequences: h, h
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()([fc, bh, bc])))
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    names = [t.name for t in model._core.layout.tensors]
    before = model.get_weights()[names.index("bidirectional/backward_lstm/kernel")].copy()
    model.fit(x, np.ones((6, 1), np.float32), epochs=1, batch_size=6, verbose=0)
    assert not np.allclose(model.get_weights()[names.index("bidirectional/backward_lstm/kernel")], before)
    model.save(tmp_path / "b.keras")
    again = keras.models.load_model(tmp_path / "b.keras")
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))


# Keras 3.15.1's outputs (TensorFlow 2.18, CPU) for x = cos(0.3 i) as (2, 3, 2) and the i-th weight
# 0.5 sin(0.7 j + i) over its elements j, in Keras's weight order.
KERAS = {
    "lstm": np.reshape([
        0.01427, -0.077999, -0.01159, -0.138108, -0.112156, -0.177933, -0.210067, -0.128408, -0.346433,
        -0.109686, -0.38495, -0.066822], (2, 3, 2)),
    "gru": np.reshape([
        0.056736, -0.05736, 0.007133, -0.14517, -0.120476, -0.251219, -0.180868, -0.187529, -0.333684,
        -0.333266, -0.450549, -0.430909], (2, 3, 2)),
    "simple_rnn_backwards": np.reshape([
        0.453822, 0.346041, 0.788986, 0.753084, 0.907233, 0.875225, -0.031896, -0.486448, -0.166941,
        -0.413612, -0.00403, -0.167178], (2, 3, 2)),
    "gru_backwards": np.reshape([
        -0.112667, -0.152735, -0.085122, -0.195204, -0.010795, -0.176543, -0.211895, -0.209317,
        -0.355736, -0.347885, -0.423906, -0.415568], (2, 3, 2)),
    "bidirectional_lstm": np.reshape([
        -0.112156, -0.177933, -0.04009, 0.130097, -0.38495, -0.066822, 0.209862, 0.174969], (2, 4)),
}
KERAS_LAYERS = {
    "lstm": lambda: LSTM(2, return_sequences=True), "gru": lambda: GRU(2, return_sequences=True),
    "simple_rnn_backwards": lambda: SimpleRNN(2, return_sequences=True, go_backwards=True),
    "gru_backwards": lambda: GRU(2, return_sequences=True, go_backwards=True),
    "bidirectional_lstm": lambda: Bidirectional(LSTM(2)),
}


@pytest.mark.parametrize("name", sorted(KERAS))
def test_outputs_equal_keras_s_for_the_same_weights(name):
    """Catches a formula that is not Keras's: a gate order (LSTM i, f, c, o; GRU z, r, h), GRU's
    reset_after form or its two biases, go_backwards' reversed output, Bidirectional's merge order."""
    layer = built(KERAS_LAYERS[name](), (3, 2))
    x = np.cos(np.arange(12) * 0.3).reshape(2, 3, 2).astype(np.float32)
    p = {w.name: (0.5 * np.sin(np.arange(int(np.prod(w.shape))) * 0.7 + i)).reshape(w.shape)
         for i, w in enumerate(layer.weights())}
    p = {name: v.astype(np.float32) for name, v in p.items()}
    np.testing.assert_allclose(run(layer, CPU, p, x)[0], KERAS[name], atol=2e-6)


def test_bidirectional_return_state_equals_keras_s_for_the_same_weights():
    """Bidirectional(LSTM(2, return_state=True)) on the inputs and weights of the test above:
    [output, forward h, forward c, backward h, backward c] as tf-keras 2.18.0 gives them
    (TensorFlow 2.18.1, CPU; bench/tf_baseline's venv). Catches the states in another order."""
    layer = built(Bidirectional(LSTM(2, return_state=True)), (3, 2))
    x = np.cos(np.arange(12) * 0.3).reshape(2, 3, 2).astype(np.float32)
    p = {w.name: (0.5 * np.sin(np.arange(int(np.prod(w.shape))) * 0.7 + i)).reshape(w.shape)
         for i, w in enumerate(layer.weights())}
    out = run(layer, CPU, {n: v.astype(np.float32) for n, v in p.items()}, x)[0]
    output = KERAS["bidirectional_lstm"]
    keras_states = [output[:, :2], [[-0.245951, -0.345297], [-0.6355, -0.084828]],
                    output[:, 2:], [[-0.060072, 0.19552], [0.425195, 0.484783]]]
    np.testing.assert_allclose(out[:, :4], output, atol=2e-6)
    for j, want in enumerate(keras_states):
        np.testing.assert_allclose(out[:, 4 + 2 * j:6 + 2 * j], want, atol=2e-6)


def test_keras_s_weights_defaults_and_parameter_counts():
    """Weight names, shapes and order as Keras's (set_weights from a Keras model lines up), and
    summary's counts equal Keras 3.15.1's for this model; catches a bias forgotten (GRU has two),
    the default unit_forget_bias not applied, the recurrent kernel not orthogonal."""
    inputs = keras.Input((7, 12))
    h = keras.layers.LSTM(128)(inputs)
    h = keras.layers.RepeatVector(4)(h)
    h = keras.layers.Bidirectional(keras.layers.GRU(4))(h)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    names = [(t.name, tuple(t.shape)) for t in model._core.layout.tensors]
    assert names[:6] == [("lstm/kernel", (12, 512)), ("lstm/recurrent_kernel", (128, 512)),
                         ("lstm/bias", (512,)),
                         ("bidirectional/forward_gru/kernel", (128, 12)),
                         ("bidirectional/forward_gru/recurrent_kernel", (4, 12)),
                         ("bidirectional/forward_gru/bias", (2, 12))]
    text = model._core.summary_text()
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines() if "(" in line}
    assert (rows["lstm"], rows["bidirectional"]) == ("72192", "3216")    # Keras's: 2 * (128*12 + 4*12 + 2*12)
    assert "Total params: 75,435" in text
    bias = dict(zip([t.name for t in model._core.layout.tensors], model.get_weights()))["lstm/bias"]
    np.testing.assert_array_equal(bias, np.r_[np.zeros(128), np.ones(128), np.zeros(256)])
    rk = model.get_weights()[1]
    np.testing.assert_allclose(rk @ rk.T, np.eye(128), atol=1e-4)      # orthonormal rows, as Keras's


def test_return_state_in_the_functional_api_gives_output_and_states():
    """[output, h, c]: without return_sequences the output is h; the cell state differs; with
    return_sequences the last step is h. Catches packed rows sliced wrongly and a state's
    gradient lost (training through h and c alone moves the kernel)."""
    inputs = keras.Input((4, 3))
    seq, h, c = keras.layers.LSTM(5, return_state=True, return_sequences=True)(inputs)
    out, h2 = keras.layers.GRU(5, return_state=True)(inputs)
    assert (seq.shape, h.shape, c.shape, out.shape, h2.shape) == ((None, 4, 5), (None, 5), (None, 5),
                                                                  (None, 5), (None, 5))
    flat = keras.layers.Flatten()(seq)
    dense = keras.layers.Dense(2)
    model = keras.Model(inputs, {"seq": keras.layers.Dense(2)(flat), "h": dense(h), "c": dense(c),
                                 "last": dense(seq[:, -1]), "out": dense(out), "h2": dense(h2)})
    x = np.random.default_rng(0).standard_normal((6, 4, 3)).astype(np.float32)
    got = model.predict(x, verbose=0)
    np.testing.assert_array_equal(got["out"], got["h2"])
    np.testing.assert_array_equal(got["last"], got["h"])
    assert not np.allclose(got["h"], got["c"])
    model2 = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()([h, c])))
    model2.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    before = model2.get_weights()[0].copy()
    model2.fit(x, np.ones((6, 1), np.float32), epochs=1, batch_size=6, verbose=0)
    assert not np.allclose(model2.get_weights()[0], before)


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_initial_state_starts_the_recurrence_and_takes_its_gradient(cell):
    """The states start from initial_state and backward gives them d loss / d state (LSTM's h and
    c): central differences in float64 on the twins. Catches a given state ignored (zeros used),
    LSTM's h and c swapped, and a state's gradient left out."""
    layer = CELLS[cell](3, return_sequences=True, go_backwards=True)
    layer(Symbolic((None, 4, 2)), initial_state=[Symbolic((None, 3))] * layer.states)
    r = np.random.default_rng(1)
    p = {w.name: 0.7 * r.standard_normal(w.shape) for w in layer.weights()}
    xs = [r.standard_normal((2, 4, 2)), *(r.standard_normal((2, 3)) for _ in range(layer.states))]
    G = r.standard_normal((2, 4, 3))
    out, s = run(layer, REF, p, xs)
    dxs = [np.empty_like(a) for a in xs]
    layer.backward(REF, p, {n: np.empty_like(v) for n, v in p.items()}, xs, out, G.copy(), dxs, s)
    zero = run(layer, REF, p, [xs[0], *(np.zeros_like(a) for a in xs[1:])])[0]
    assert not np.allclose(out, zero)
    for j in range(1, len(xs)):
        d = r.standard_normal(xs[j].shape)
        moved = [[a + sign * EPS * d if i == j else a for i, a in enumerate(xs)] for sign in (1, -1)]
        fd = (np.sum(run(layer, REF, p, moved[0])[0] * G)
              - np.sum(run(layer, REF, p, moved[1])[0] * G)) / (2 * EPS)
        assert abs(fd - np.sum(dxs[j] * d)) <= 1e-6 * (1 + abs(fd)), j


def test_an_encoder_s_states_start_a_decoder_and_train_it_and_save(tmp_path):
    """keras.io's seq2seq shape: an encoder LSTM's [h, c] as a decoder LSTM's initial_state.
    Catches the states' gradient not reaching the encoder (its kernel must move in training) and
    a saved graph that does not replay the initial_state call."""
    enc_in, dec_in = keras.Input((5, 3)), keras.Input((4, 2))
    _, h, c = keras.layers.LSTM(6, return_state=True)(enc_in)
    dec = keras.layers.LSTM(6)(dec_in, initial_state=[h, c])
    model = keras.Model([enc_in, dec_in], keras.layers.Dense(2, activation="softmax")(dec))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    r = np.random.default_rng(0)
    x = [r.standard_normal((32, 5, 3)).astype(np.float32), r.standard_normal((32, 4, 2)).astype(np.float32)]
    y = (x[0][:, 0, 0] > 0).astype(int)
    before = model.get_weights()[0].copy()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert not np.allclose(model.get_weights()[0], before)
    model.save(tmp_path / "s2s.keras")
    again = keras.models.load_model(tmp_path / "s2s.keras")
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))


def test_save_and_load_keep_the_recurrent_layers(tmp_path):
    """Catches a config that does not rebuild the layer (Bidirectional's inner layers, GRU's
    reset_after, go_backwards), weights put back in another order, and a return_state call
    replayed as its sliced outputs (the saved slicing ops must read the packed tensor)."""
    inputs = keras.Input((5, 3))
    h = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True), merge_mode="sum")(inputs)
    h = keras.layers.GRU(3, go_backwards=True, activation="relu")(h)
    _, state = keras.layers.SimpleRNN(2, return_state=True, return_sequences=True)(inputs)
    h = keras.layers.Dense(2)(keras.layers.Concatenate()([h, state]))
    model = keras.Model(inputs, h)
    weights = [np.random.default_rng(i).standard_normal(w.shape).astype(np.float32)
               for i, w in enumerate(model.get_weights())]
    model.set_weights(weights)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    x = np.random.default_rng(0).standard_normal((4, 5, 3)).astype(np.float32)
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    config = again._core.layers[0].get_config()
    assert config["merge_mode"] == "sum" and config["layer"]["class_name"] == "LSTM"


@pytest.mark.parametrize("make, message", [
    (lambda: LSTM(4, dropout=1.0), r"dropout must be in \[0, 1\)"),
    (lambda: GRU(4, recurrent_dropout=1.0), r"recurrent_dropout must be in \[0, 1\)"),
    (lambda: SimpleRNN(4, stateful=True), "stateful=True is not supported"),
    (lambda: LSTM(4, unroll=True), "unroll=True is not supported"),
    (lambda: GRU(4, reset_after=False), "reset_after=False is not supported"),
    (lambda: LSTM(4, activation="softmax"), "activation='softmax' is not supported"),
    (lambda: LSTM(4, kernel_constraint="non_neg"), "kernel_constraint='non_neg' is not supported"),
    (lambda: Bidirectional(LSTM(4), merge_mode=None), "merge_mode=None is not supported"),
    (lambda: Bidirectional(LSTM(4, return_state=True), backward_layer=LSTM(4, go_backwards=True)),
     "must agree on return_state"),
    (lambda: Bidirectional(LSTM(4, return_state=True),
                           backward_layer=GRU(4, return_state=True, go_backwards=True)),
     "have as many states"),
    (lambda: Bidirectional(Dense(4)), "must be a SimpleRNN, LSTM or GRU"),
    (lambda: LSTM(4)(Symbolic((None, 3, 2)), mask=Symbolic((None, 4))), r"mask must be \(batch, steps\)"),
    (lambda: LSTM(4)(Symbolic((None, 3, 2)), initial_state=[Symbolic((None, 4))]),
     r"initial_state must be 2 tensor\(s\) of shape \(4,\)"),
])
def test_what_pserver_cannot_run_is_refused_in_one_line(make, message):
    """Catches an argument that would change Keras's meaning accepted silently."""
    with pytest.raises(ConfigError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


def test_cuda_refuses_the_recurrent_layers_in_one_line():
    """Catches a model with a recurrent layer (no CUDA kernels) sent to the GPU."""
    from pserver.models import cuda_support
    inputs = Symbolic((None, 3, 2))
    model = Functional(inputs, Dense(2)(LSTM(4)(inputs))).build()
    with pytest.raises(ConfigError, match=r"LSTM\) has no CUDA kernels") as e:
        cuda_support.check(model)
    assert "\n" not in str(e.value)


def test_keras_io_s_addition_rnn_encoder_decoder_learns():
    """keras.io's addition_rnn: LSTM(128) on (7, 12), RepeatVector(4), LSTM(128, return_sequences=
    True), then Keras's Dense(12, softmax) on each step with a cross-entropy, Adam(1e-3). The
    per-step head, its loss and Adam are NumPy here, around the layers' forward and backward on the
    CPU kernels (tests/test_outputs_with_steps.py trains the whole model with fit). Catches
    gradients that do not train the recurrence (through RepeatVector into the encoder): the loss
    must fall below what the answers' character frequencies alone give."""
    from pserver.layers import RepeatVector
    rng = np.random.default_rng(0)
    layers = [built(LSTM(128), (7, 12)), built(RepeatVector(4), (128,)),
              built(LSTM(128, return_sequences=True), (4, 128))]
    params = [{w.name: np.empty(w.shape, np.float32) for w in layer.weights()} for layer in layers]
    for layer, p in zip(layers, params):
        for w in layer.weights():
            w.initializer(rng, p[w.name])
    head = {"kernel": (rng.uniform(-1, 1, (128, 12)) * np.sqrt(6 / 140)).astype(np.float32),
            "bias": np.zeros(12, np.float32)}
    trained = [*(p[k] for p in params for k in p), head["kernel"], head["bias"]]
    moments = [(np.zeros_like(t), np.zeros_like(t)) for t in trained]
    x_all, y_all = addition_data(3200, rng)
    losses = []
    for step in range(1, 151):
        x, y = x_all[(step - 1) % 100 * 32:][:32], y_all[(step - 1) % 100 * 32:][:32]
        acts, scratch = [x], []
        for layer, p in zip(layers, params):
            out, s = run(layer, CPU, p, acts[-1])
            acts.append(out)
            scratch.append(s)
        logits = acts[-1] @ head["kernel"] + head["bias"]
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        picked = np.take_along_axis(prob, y[..., None], -1)
        losses.append(float(-np.log(picked).mean()))
        dlogits = prob
        np.put_along_axis(dlogits, y[..., None], picked - 1, -1)
        dlogits /= y.size
        grads = [None] * len(layers)
        dout = dlogits @ head["kernel"].T
        hgrads = [np.einsum("nti,ntj->ij", acts[-1], dlogits), dlogits.sum((0, 1))]
        for i in range(len(layers) - 1, -1, -1):
            g = {k: np.empty_like(v) for k, v in params[i].items()}
            dx = np.empty_like(acts[i]) if i else None
            dout = np.ascontiguousarray(dout, np.float32)
            layers[i].backward(CPU, params[i], g, acts[i], acts[i + 1], dout, dx, scratch[i])
            grads[i], dout = g, dx
        flat = [*(g[k] for g in grads for k in g), *hgrads]
        for t, gr, (m, v) in zip(trained, flat, moments):
            m += 0.1 * (gr - m)
            v += 0.001 * (gr * gr - v)
            t -= 1e-3 * np.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step) * m / (np.sqrt(v) + 1e-7)
    first, last = np.mean(losses[:10]), np.mean(losses[-20:])
    # Chance is ln 12 = 2.48; the answers' character frequencies alone give about 1.9. Measured:
    # 2.40 over the first 10 steps, 1.55 over the last 20.
    assert first > 2.2 and last < 1.7, (first, last)
