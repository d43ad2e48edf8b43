"""MultiHeadAttention, GroupNormalization, SeparableConv2D, Dense on sequences and ops.arange:
each layer's forward against an independent NumPy twin (Keras's formulas: the einsum equations of
its MultiHeadAttention, GroupNormalization's grouped moments, a direct separable convolution) and
its backward against central finite differences in float64 (hypothesis over shapes); masks and
the causal mask; Keras's weights, summary counts, configs and refusals; the model of keras.io's
text_classification_with_transformer (written here), training on synthetic ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.keras import layers, ops
from pserver.kernels import reference
from pserver.layers import (
    Dense,
    Flatten,
    GroupNormalization,
    LayerNormalization,
    MultiHeadAttention,
    SeparableConv2D,
)
from pserver.layers.base import Pass
from pserver.models import Functional
from pserver.ops.core import Symbolic

FAST = settings(max_examples=15, deadline=None)
EPS = 1e-6


def params_of(layer, rng):
    return {w.name: rng.standard_normal(w.shape) for w in layer.weights()}


def run(layer, p, x):
    n = (x[0] if isinstance(x, list) else x).shape[0]
    out = np.empty((n, *layer.output_shape))
    s = layer.scratch(n, np.float64)
    layer.forward(reference, p, x, out, s, Pass(training=True))
    return out, s


def assert_fd(layer, p, x, seed=0, floats=None):
    """<G, d out> by central differences along a random direction, for each float input (all of
    a list's, or those `floats` names) and each weight, against the layer's backward."""
    r = np.random.default_rng(seed)
    xs = x if isinstance(x, list) else [x]
    floats = range(len(xs)) if floats is None else floats
    out, s = run(layer, p, x)
    G = r.standard_normal(out.shape)
    g = {k: np.zeros_like(v) for k, v in p.items()}
    dxs = [np.empty_like(a) for a in xs]
    layer.backward(reference, p, g, x, out, G.copy(), dxs if isinstance(x, list) else dxs[0], s)

    def loss(p_, xs_):
        return float(np.sum(run(layer, p_, xs_ if isinstance(x, list) else xs_[0])[0] * G))
    for i in floats:
        d = r.standard_normal(xs[i].shape)
        plus, minus = list(xs), list(xs)
        plus[i], minus[i] = xs[i] + EPS * d, xs[i] - EPS * d
        fd = (loss(p, plus) - loss(p, minus)) / (2 * EPS)
        assert abs(fd - np.sum(dxs[i] * d)) <= 1e-6 * (1 + abs(fd)), f"input {i}"
    for name in p:
        d = r.standard_normal(p[name].shape)
        fd = (loss({**p, name: p[name] + EPS * d}, xs) - loss({**p, name: p[name] - EPS * d}, xs)) / (2 * EPS)
        assert abs(fd - np.sum(g[name] * d)) <= 1e-6 * (1 + abs(fd)), name


# -- MultiHeadAttention ---------------------------------------------------------------------------

def attention_twin(p, query, value, key=None, mask=None, causal=False, key_dim=1, dropped=None,
                   with_weights=False):
    """Keras's MultiHeadAttention with its einsum equations (EinsumDense "abc,cde->abde", scores
    "aecd,abcd->acbe", combine "acbe,aecd->abcd", output "abcd,cde->abe"), its masked softmax and
    its dropout on the probabilities (`dropped`: 0 or 1 / (1 - rate) per weight); with `with_weights`,
    (output, the softmax's weights before dropout), as Keras's return_attention_scores."""
    key = value if key is None else key
    b = {n: p.get(f"{n}/bias", 0) for n in ("query", "key", "value", "attention_output")}
    q = np.einsum("abc,cde->abde", query, p["query/kernel"]) + b["query"]
    k = np.einsum("abc,cde->abde", key, p["key/kernel"]) + b["key"]
    v = np.einsum("abc,cde->abde", value, p["value/kernel"]) + b["value"]
    scores = np.einsum("aecd,abcd->acbe", k, q / np.sqrt(key_dim))
    keep = np.ones(scores.shape, bool)
    if mask is not None:
        keep &= (mask > 0.5)[:, None]
    if causal:
        keep &= np.tril(np.ones(scores.shape[-2:], bool))
    scores = np.where(keep, scores, -1e9)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    weights = e / e.sum(-1, keepdims=True)
    probs = weights * (1 if dropped is None else dropped)
    context = np.einsum("acbe,aecd->abcd", probs, v)
    out = np.einsum("abcd,cde->abe", context, p["attention_output/kernel"]) + b["attention_output"]
    return (out, weights) if with_weights else out


def mha_built(layer, shapes, **call):
    """The layer called on symbolic (query, value[, key]) of `shapes` (and a mask if given)."""
    tensors = [Symbolic((None, *s)) for s in shapes]
    key = tensors[2] if len(tensors) > 2 else None
    mask = call.pop("mask", None)
    layer(tensors[0], tensors[1], key=key, attention_mask=None if mask is None else Symbolic((None, *mask)),
          **call)
    return layer


@FAST
@given(n=st.integers(1, 3), t=st.integers(1, 4), s=st.integers(1, 4), heads=st.integers(1, 3),
       key_dim=st.integers(1, 3), dims=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
       own_key=st.booleans(), use_bias=st.booleans(), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_multi_head_attention_against_keras_formula_and_finite_differences(n, t, s, heads, key_dim, dims,
                                                                          own_key, use_bias, masked, seed):
    """Catches a head split in the wrong order (heads and steps swapped), the scale 1/sqrt(key_dim)
    missing or applied to the wrong side in the VJP, a softmax over queries, the mask ignored or
    broadcast onto the wrong axis, and key's gradient not added into value's when key is value."""
    r = np.random.default_rng(seed)
    dq, dv, dk = dims
    shapes = [(t, dq), (s, dv)] + ([(s, dk)] if own_key else [])
    layer = mha_built(MultiHeadAttention(heads, key_dim, value_dim=key_dim + 1, use_bias=use_bias,
                                         output_shape=3),
                      shapes, mask=(t, s) if masked else None)
    p = params_of(layer, r)
    xs = [r.standard_normal((n, *sh)) for sh in shapes]
    mask = (r.random((n, t, s)) > 0.3).astype(np.float64) if masked else None
    x = xs + ([mask] if masked else [])
    want = attention_twin(p, xs[0], xs[1], xs[2] if own_key else None, mask, key_dim=key_dim)
    np.testing.assert_allclose(run(layer, p, x)[0], want, rtol=1e-9, atol=1e-9)
    assert_fd(layer, p, x, seed=seed, floats=range(len(xs)))


@FAST
@given(rate=st.floats(0.05, 0.9), seed=st.integers(0, 2**16), causal=st.booleans())
def test_attention_dropout_drops_weights_after_the_softmax_in_training_only(rate, seed, causal):
    """Keras's dropout in MultiHeadAttention: the attention weights dropped after the softmax and
    the kept ones scaled, in training only. Catches dropout on the scores before the softmax, the
    mask left out of the backward (checked by finite differences on the same mask), the value's
    gradient through the undropped weights, and dropout at inference."""
    r = np.random.default_rng(seed)
    layer = mha_built(MultiHeadAttention(2, 3, dropout=rate), [(4, 5), (6, 5)], use_causal_mask=causal)
    p = params_of(layer, r)
    x = [r.standard_normal((3, 4, 5)), r.standard_normal((3, 6, 5))]
    out, s = run(layer, p, x)
    dropped = s["mask"]
    assert set(np.unique(dropped)) <= {0.0, 1 / (1 - rate)}
    np.testing.assert_allclose(out, attention_twin(p, *x, causal=causal, key_dim=3, dropped=dropped),
                               rtol=1e-9, atol=1e-9)
    inference = np.empty_like(out)
    layer.forward(reference, p, x, inference, layer.scratch(3, np.float64), Pass(training=False))
    np.testing.assert_allclose(inference, attention_twin(p, *x, causal=causal, key_dim=3),
                               rtol=1e-9, atol=1e-9)
    assert_fd(layer, p, x, seed=seed)


def test_a_masked_key_changes_nothing_and_the_causal_mask_hides_the_future():
    """Catches masked positions still weighted (a small bias instead of Keras's -1e9, or the mask
    read as 'masked where 1'), and a causal mask that is upper triangular or off by one."""
    r = np.random.default_rng(0)
    layer = mha_built(MultiHeadAttention(2, 3), [(4, 5), (6, 5)], mask=(4, 6))
    p = params_of(layer, r)
    q, v = r.standard_normal((2, 4, 5)), r.standard_normal((2, 6, 5))
    mask = np.ones((2, 4, 6))
    mask[:, :, 4:] = 0
    out = run(layer, p, [q, v, mask])[0]
    v2 = v.copy()
    v2[:, 4:] = 100 * r.standard_normal((2, 2, 5))
    np.testing.assert_allclose(run(layer, p, [q, v2, mask])[0], out, rtol=1e-12, atol=1e-12)
    assert not np.allclose(run(layer, p, [q, v2, np.ones_like(mask)])[0], out)
    keys = mha_built(MultiHeadAttention(2, 3), [(4, 5), (6, 5)], mask=(1, 6))     # one row for every query
    np.testing.assert_allclose(run(keys, p, [q, v, mask[:, :1]])[0], out, rtol=1e-12, atol=1e-12)

    causal = mha_built(MultiHeadAttention(2, 3), [(5, 4), (5, 4)], use_causal_mask=True)
    p = params_of(causal, r)
    x = r.standard_normal((1, 5, 4))
    later = x.copy()
    later[:, 3:] += 5.0                                  # steps 3 and 4 change
    a, b = run(causal, p, [x, x])[0], run(causal, p, [later, later])[0]
    np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=1e-12, atol=1e-12)
    assert not np.allclose(a[:, 3], b[:, 3])
    np.testing.assert_allclose(a, attention_twin(p, x, x, causal=True, key_dim=3), rtol=1e-9, atol=1e-9)
    assert_fd(causal, p, [x, x])


@pytest.mark.parametrize("form", ["self", "own key and mask", "causal"])
def test_a_model_with_attention_is_saved_and_loaded_with_its_call(tmp_path, form):
    """Catches a saved graph that cannot call the layer again (load_model said "is called on
    query and value": the replay gives the inputs as one list) or that calls it in another form:
    a lost key, mask or causal mask changes the loaded model's predictions."""
    r = np.random.default_rng(3)
    q_in, v_in = keras.Input((5, 8)), keras.Input((6, 8))
    mha = layers.MultiHeadAttention(2, 4)
    if form == "self":
        inputs, h, data = [q_in], mha(q_in, q_in), [r.standard_normal((4, 5, 8))]
    elif form == "causal":
        inputs, h, data = [q_in], mha(q_in, q_in, use_causal_mask=True), [r.standard_normal((4, 5, 8))]
    else:
        k_in, m_in = keras.Input((6, 8)), keras.Input((5, 6))
        inputs, h = [q_in, v_in, k_in, m_in], mha(q_in, v_in, key=k_in, attention_mask=m_in)
        data = [r.standard_normal((4, 5, 8)), r.standard_normal((4, 6, 8)), r.standard_normal((4, 6, 8)),
                (r.random((4, 5, 6)) > 0.3).astype(np.float32)]
    model = keras.Model(inputs, layers.Dense(3)(layers.Flatten()(h)))
    model.compile(loss="sparse_categorical_crossentropy")
    data = [d.astype(np.float32) for d in data]
    x = data[0] if len(data) == 1 else data
    before = model.predict(x, verbose=0)
    model.save(tmp_path / "m.npz")
    again = keras.models.load_model(tmp_path / "m.npz")
    np.testing.assert_array_equal(again.predict(x, verbose=0), before)


@pytest.mark.parametrize("rate,masked,causal", [(0.0, False, False), (0.4, True, False), (0.3, False, True)])
def test_return_attention_scores_gives_keras_s_weights_and_their_gradient(rate, masked, causal):
    """Catches scores taken after dropout (Keras returns the softmax's weights before it), heads
    or steps out of place in the packed output, and a gradient that ignores the scores' use (a
    loss that reads them): the layer's backward against central differences of a random
    functional of both outputs."""
    r = np.random.default_rng(int(10 * rate) + masked)
    layer = mha_built(MultiHeadAttention(3, 2, dropout=rate), [(4, 5), (6, 5)],
                      mask=(4, 6) if masked else None, use_causal_mask=causal, return_attention_scores=True)
    assert layer.output_shape == (4, 5 + 3 * 6)
    p = params_of(layer, r)
    x = [r.standard_normal((2, 4, 5)), r.standard_normal((2, 6, 5))]
    mask = (r.random((2, 4, 6)) > 0.3).astype(np.float64)
    if masked:
        x.append(mask)
    out, s = run(layer, p, x)
    want, weights = attention_twin(p, x[0], x[1], mask=mask if masked else None, causal=causal, key_dim=2,
                                   dropped=s.get("mask"), with_weights=True)
    np.testing.assert_allclose(out[:, :, :5], want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out[:, :, 5:].reshape(2, 4, 3, 6).transpose(0, 2, 1, 3), weights,
                               rtol=1e-9, atol=1e-12)
    assert_fd(layer, p, x, floats=[0, 1])


def test_return_attention_scores_in_a_model_trains_saves_and_refuses_another_form(tmp_path):
    """The call gives [output (steps, dim), scores (heads, steps, key steps)] as Keras's; a model
    whose loss reads both trains, and loads with its graph (the packed tensor and its slices)."""
    inp = keras.Input((5, 8))
    mha = layers.MultiHeadAttention(2, 4)
    out, scores = mha(inp, inp, return_attention_scores=True)
    assert (out.shape, scores.shape) == ((None, 5, 8), (None, 2, 5, 5))
    h = layers.concatenate([layers.Flatten()(out), layers.Flatten()(scores)])
    model = keras.Model(inp, layers.Dense(3, activation="softmax")(h))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    r = np.random.default_rng(0)
    x, y = r.standard_normal((64, 5, 8)).astype(np.float32), r.integers(0, 3, 64)
    before = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    moved = {t.name: not np.array_equal(a, b) for t, a, b in zip(model._core.layout.tensors, before,
                                                                   model.get_weights())}
    assert moved["multi_head_attention/query/kernel"] and moved["multi_head_attention/key/kernel"]
    model.save(tmp_path / "m.npz")
    np.testing.assert_array_equal(keras.models.load_model(tmp_path / "m.npz").predict(x, verbose=0),
                                  model.predict(x, verbose=0))
    probe = keras.Model(inp, scores)                   # a model that outputs the scores alone
    np.testing.assert_allclose(probe.predict(x[:3], verbose=0).sum(axis=-1), 1, rtol=1e-5)
    with pytest.raises(ConfigError, match="return_attention_scores") as e:
        mha(inp, inp)
    assert "\n" not in str(e.value)


def test_multi_head_attention_weights_summary_config_and_refusals():
    """Keras's weight names, shapes and count (MultiHeadAttention(2, 16) on 16 features: 2,160
    parameters, as Keras's summary), a config that rebuilds the layer, and arguments pserver
    cannot honour refused in one line rather than accepted silently."""
    inputs = keras.Input((6, 16))
    out = layers.MultiHeadAttention(num_heads=2, key_dim=16)(inputs, inputs)
    model = keras.Model(inputs, layers.Dense(2, activation="softmax")(layers.GlobalAveragePooling1D()(out)))
    shapes = {t.name: t.shape for t in model._core.layout.tensors}
    assert shapes["multi_head_attention/query/kernel"] == (16, 2, 16)
    assert shapes["multi_head_attention/value/bias"] == (2, 16)
    assert shapes["multi_head_attention/attention_output/kernel"] == (2, 16, 16)
    assert shapes["multi_head_attention/attention_output/bias"] == (16,)
    assert "Total params: 2,194" in model._core.summary_text()          # 2,160 + Dense's 34
    layer = model._core.layers[0]
    again = MultiHeadAttention.from_config(layer.get_config())
    assert (again.num_heads, again.key_dim, again.value_dim, again.use_bias) == (2, 16, 16, True)
    for bad, match in ((lambda: MultiHeadAttention(2, 4, dropout=1.0), r"dropout must be in \[0, 1\)"),
                       (lambda: MultiHeadAttention(2, 4, attention_axes=(1, 2)), "attention_axes"),
                       (lambda: layers.MultiHeadAttention(2, 4)(*[keras.Input((2, 3, 4))] * 2),
                        "attention_axes")):
        with pytest.raises(ConfigError, match=match) as e:
            bad()
        assert "\n" not in str(e.value)


def test_cuda_refuses_the_new_layers_in_one_line():
    """Catches a layer without CUDA kernels sent to the GPU. (Dense on a sequence runs there:
    tests/cuda_sim/check_graph_cuda.py.)"""
    from pserver.models import cuda_support
    cases = [((6, 4), lambda x: MultiHeadAttention(2, 2)(x, x), "MultiHeadAttention"),
             ((4, 4, 4), lambda x: GroupNormalization(2)(x), "GroupNormalization"),
             ((5, 5, 2), lambda x: SeparableConv2D(2, 3)(x), "SeparableConv2D"),
             ((4, 4, 4), lambda x: LayerNormalization(axis=[1, 2])(x),
              r"LayerNormalization\) over the axes \[-3, -2\] has no CUDA kernels \(over the last has\)")]
    for shape, make, match in cases:
        inputs = Symbolic((None, *shape))
        h = make(inputs)
        h = Dense(3)(h)
        model = Functional(inputs, Dense(2)(Flatten()(h))).build()
        with pytest.raises(ConfigError, match=match) as e:
            cuda_support.check(model)
        assert "\n" not in str(e.value)


# -- GroupNormalization, SeparableConv2D, Dense on sequences --------------------------------------

@FAST
@given(n=st.integers(1, 3), spatial=st.lists(st.integers(1, 3), max_size=2), groups=st.integers(1, 3),
       per=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_group_normalization_against_numpy_and_finite_differences(n, spatial, groups, per, seed):
    """Catches moments over the whole sample (LayerNormalization) or over one channel, groups cut
    across channels in the wrong order (strided), and gamma applied per group instead of per channel."""
    r = np.random.default_rng(seed)
    shape = (*spatial, groups * per)
    layer = GroupNormalization(groups=groups)
    layer(Symbolic((None, *shape)))
    p = params_of(layer, r)
    x = 3 * r.standard_normal((n, *shape)) + 1
    xg = x.reshape(n, -1, groups, per)
    want = (xg - xg.mean(axis=(1, 3), keepdims=True)) / np.sqrt(xg.var(axis=(1, 3), keepdims=True) + 1e-3)
    want = want.reshape(x.shape) * p["gamma"] + p["beta"]
    np.testing.assert_allclose(run(layer, p, x)[0], want, rtol=1e-10, atol=1e-10)
    assert_fd(layer, p, x, seed=seed)


def separable_twin(p, x, strides, padding):
    """A direct separable convolution: every output pixel's window times the depthwise kernel,
    channel c's m-th output at c * m_count + m, then the pointwise matrix and the bias."""
    kh, kw, c, m = p["depthwise_kernel"].shape
    n, h, w, _ = x.shape
    if padding == "same":
        oh, ow = -(-h // strides), -(-w // strides)
        ph, pw = max((oh - 1) * strides + kh - h, 0), max((ow - 1) * strides + kw - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        oh, ow = (h - kh) // strides + 1, (w - kw) // strides + 1
    mid = np.zeros((n, oh, ow, c * m))
    for i in range(oh):
        for j in range(ow):
            window = x[:, i * strides:i * strides + kh, j * strides:j * strides + kw]
            mid[:, i, j] = np.einsum("nhwc,hwcm->ncm", window, p["depthwise_kernel"]).reshape(n, -1)
    return mid @ p["pointwise_kernel"][0, 0] + p.get("bias", 0)


@FAST
@given(n=st.integers(1, 2), hw=st.tuples(st.integers(3, 5), st.integers(3, 5)), c=st.integers(1, 3),
       m=st.integers(1, 2), filters=st.integers(1, 3), strides=st.integers(1, 2),
       padding=st.sampled_from(["valid", "same"]), use_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_separable_conv2d_against_numpy_and_finite_differences(n, hw, c, m, filters, strides, padding,
                                                               use_bias, seed):
    """Catches the depthwise output channels in the wrong order for the pointwise kernel, the bias
    added twice (in the depthwise step too) or lost, and either kernel's gradient not reaching it."""
    r = np.random.default_rng(seed)
    layer = SeparableConv2D(filters, (3, 2), strides=strides, padding=padding, depth_multiplier=m,
                            use_bias=use_bias)
    layer(Symbolic((None, *hw, c)))
    names = ["depthwise_kernel", "pointwise_kernel"] + (["bias"] * use_bias)
    assert [w.name for w in layer.weights()] == names
    assert layer.weights()[1].shape == (1, 1, c * m, filters)
    p = params_of(layer, r)
    x = r.standard_normal((n, *hw, c))
    out = np.empty((n, *layer.output_shape))
    s = layer.scratch(n, np.float64)
    layer.forward(reference, p, x, out, s, Pass(training=True))
    np.testing.assert_allclose(out, separable_twin(p, x, strides, padding), rtol=1e-9, atol=1e-9)
    G = r.standard_normal(out.shape)
    g, dx = {k: np.zeros_like(v) for k, v in p.items()}, np.empty_like(x)
    layer.backward(reference, p, g, x, out, G.copy(), dx, s)
    d = r.standard_normal(x.shape)

    def loss(p_, x_):
        return float(np.sum(separable_twin(p_, x_, strides, padding) * G))
    fd = (loss(p, x + EPS * d) - loss(p, x - EPS * d)) / (2 * EPS)
    assert abs(fd - np.sum(dx * d)) <= 1e-6 * (1 + abs(fd))
    for name in p:
        d = r.standard_normal(p[name].shape)
        fd = (loss({**p, name: p[name] + EPS * d}, x) - loss({**p, name: p[name] - EPS * d}, x)) / (2 * EPS)
        assert abs(fd - np.sum(g[name] * d)) <= 1e-6 * (1 + abs(fd)), name


def test_dense_on_a_sequence_applies_to_the_last_axis():
    """Catches Dense on (steps, features) mixing steps (a kernel over the flattened sample) or
    losing the steps' gradients (Keras's Dense works on the last axis)."""
    r = np.random.default_rng(1)
    layer = Dense(3, activation="relu")
    layer(Symbolic((None, 4, 5)))
    assert layer.output_shape == (4, 3) and layer.weights()[0].shape == (5, 3)
    p = params_of(layer, r)
    x = r.standard_normal((2, 4, 5))
    out, s = np.empty((2, 4, 3)), layer.scratch(2, np.float64)
    layer.forward(reference, p, x, out, s, Pass())
    np.testing.assert_allclose(out, np.maximum(x @ p["kernel"] + p["bias"], 0), rtol=1e-12)
    g, dx = {k: np.zeros_like(v) for k, v in p.items()}, np.empty_like(x)
    G = r.standard_normal(out.shape) * (out > 0)
    layer.backward(reference, p, g, x, out, G.copy(), dx, s)
    np.testing.assert_allclose(dx, G @ p["kernel"].T, rtol=1e-12)
    np.testing.assert_allclose(g["kernel"], np.einsum("ntf,ntu->fu", x, G), rtol=1e-12)


def test_keras_summary_counts_and_configs_of_group_normalization_and_separable_conv2d():
    """Keras's parameter counts (SeparableConv2D(8, 3) on 4 channels: 36 + 32 + 8 = 76;
    GroupNormalization on 8 channels: 16), configs that rebuild the layers, and the refusals."""
    inputs = keras.Input((6, 6, 4))
    h = layers.SeparableConv2D(8, 3, padding="same", activation="relu")(inputs)
    h = layers.GroupNormalization(groups=4)(h)
    model = keras.Model(inputs, layers.Dense(2, activation="softmax")(layers.GlobalAveragePooling2D()(h)))
    assert "Total params: 110" in model._core.summary_text()       # 76 + 16 + 18
    for layer in model._core.layers[:2]:
        again = type(layer).from_config(layer.get_config())
        assert again.get_config() == layer.get_config()
    for bad in (lambda: layers.GroupNormalization(groups=3)(keras.Input((4,))),
                lambda: GroupNormalization(axis=1), lambda: SeparableConv2D(2, 3, dilation_rate=2)):
        with pytest.raises(ConfigError):
            bad()


# -- ops.arange and a transformer classifier -----------------------------------------------------

def test_arange_as_keras():
    """Catches a stop-only call counting from 1, and Keras's dtypes (int32, float32 for a float)."""
    a = ops.arange(4)
    assert a.dtype == np.int32 and a.tolist() == [0, 1, 2, 3]
    b = ops.arange(start=1, stop=2, step=0.5)
    assert b.dtype == np.float32 and b.tolist() == [1.0, 1.5]


class TransformerBlock(layers.Layer):
    """Self-attention and a feed-forward network, each with dropout, a residual connection and a
    layer normalization (the block of keras.io's text_classification_with_transformer)."""

    def __init__(self, width, heads, hidden, rate=0.1):
        super().__init__()
        self.attention = layers.MultiHeadAttention(num_heads=heads, key_dim=width)
        self.feed_forward = keras.Sequential([layers.Dense(hidden, activation="relu"), layers.Dense(width)])
        self.norms = [layers.LayerNormalization(epsilon=1e-6) for _ in range(2)]
        self.drops = [layers.Dropout(rate) for _ in range(2)]

    def call(self, x):
        x = self.norms[0](x + self.drops[0](self.attention(x, x)))
        return self.norms[1](x + self.drops[1](self.feed_forward(x)))


class TokenAndPositionEmbedding(layers.Layer):
    """An id's embedding plus its position's (positions from ops.arange)."""

    def __init__(self, length, vocabulary, width):
        super().__init__()
        self.tokens = layers.Embedding(input_dim=vocabulary, output_dim=width)
        self.positions = layers.Embedding(input_dim=length, output_dim=width)

    def call(self, ids):
        return self.tokens(ids) + self.positions(ops.arange(start=0, stop=ops.shape(ids)[-1], step=1))


def test_a_transformer_text_classifier_trains():
    """keras.io's text_classification_with_transformer model (written here, sizes small, ids
    synthetic: the label is whether token 1 appears): catches the position Embedding on
    ops.arange's constant not trained or not broadcast over the batch, a Sequential inside a
    layer not applied, and attention that does not learn (the label needs a look at every step)."""
    vocab_size, maxlen, embed_dim, num_heads, ff_dim = 20, 10, 16, 2, 16
    r = np.random.default_rng(0)
    x_train = r.integers(2, vocab_size, (512, maxlen))
    y_train = (r.random(512) < 0.5).astype(np.int64)
    x_train[y_train == 1, r.integers(0, maxlen, int(y_train.sum()))] = 1
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    tables = sorted(t.shape for t in model._core.layout.tensors if t.name.endswith("/embeddings"))
    assert tables == [(maxlen, embed_dim), (vocab_size, embed_dim)]
    history = model.fit(x_train, y_train, batch_size=32, epochs=4, verbose=0)
    loss = history.history["loss"]
    assert loss[-1] < 0.5 * loss[0] and history.history["accuracy"][-1] > 0.9


def test_pad_sequences_as_keras():
    """Catches Keras's defaults reversed (it pads and cuts before the sequence), and maxlen=None
    not the longest sequence."""
    seqs = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    assert keras.utils.pad_sequences(seqs, maxlen=4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 4], [6, 7, 8, 9]]
    post = keras.utils.pad_sequences(seqs, maxlen=2, padding="post", truncating="post", value=-1)
    assert post.tolist() == [[1, 2], [4, -1], [5, 6]] and post.dtype == np.int32
    assert keras.utils.pad_sequences(seqs).shape == (3, 5)
