"""The layer kernels (conv, pooling, activations, dropout, embedding, binary cross-entropy):
the numba CPU kernels against their NumPy twins, the twins against finite differences and
independent definitions, and the window arithmetic (`conv_output`) against Keras's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.kernels import conv_output, cpu, reference
from tests.support.twins import splitmix64_python

FAST = settings(max_examples=30, deadline=None)
GRAD = settings(max_examples=10, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nans(shape, dtype=np.float32):
    """A buffer a kernel must overwrite: a forgotten element stays NaN (or -7) and fails."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# -- window geometry --------------------------------------------------------------------------

@st.composite
def geometry(draw, channels_out=True):
    """An image batch and a window placement: kernels 1-5 up to the input's size (equal
    included), strides 1-3, 'valid' or 'same'."""
    h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    g = {"n": draw(st.integers(1, 3)), "h": h, "w": w, "c": draw(st.integers(1, 4)),
         "f": draw(st.integers(1, 4)) if channels_out else None,
         "kh": draw(st.integers(1, min(5, h))), "kw": draw(st.integers(1, min(5, w))),
         "sh": draw(st.integers(1, 3)), "sw": draw(st.integers(1, 3)),
         "padding": draw(st.sampled_from(["valid", "same"]))}
    g["oh"], g["pt"] = conv_output(h, g["kh"], g["sh"], g["padding"])
    g["ow"], g["pl"] = conv_output(w, g["kw"], g["sw"], g["padding"])
    return g


def placement(g):
    """The kernels' (stride_h, stride_w, pad_top, pad_left)."""
    return g["sh"], g["sw"], g["pt"], g["pl"]


@pytest.mark.parametrize("size,kernel,stride,padding,want", [
    (28, 3, 1, "valid", (26, 0)), (26, 2, 2, "valid", (13, 0)), (28, 3, 1, "same", (28, 1)),
    (5, 2, 2, "same", (3, 0)),    # total pad 1: none before, one after (TF puts the extra after)
    (7, 4, 1, "same", (7, 1)),    # total pad 3: one before, two after
    (6, 3, 3, "same", (2, 0)), (4, 5, 1, "valid", (0, 0)), (4, 4, 1, "valid", (1, 0)),
    (1, 1, 3, "same", (1, 0)),
])
def test_conv_output_matches_keras(size, kernel, stride, padding, want):
    assert conv_output(size, kernel, stride, padding) == want


def test_conv_output_rejects_unknown_padding():
    with pytest.raises(ValueError, match="padding must be 'valid' or 'same', got 'full'"):
        conv_output(5, 3, 1, "full")


@given(st.integers(1, 40), st.integers(1, 7), st.integers(1, 4))
def test_same_padding_windows_cover_the_image(size, kernel, stride):
    out, before = conv_output(size, kernel, stride, "same")
    starts = np.arange(out) * stride - before
    assert out == -(-size // stride)
    assert (starts + kernel > 0).all() and (starts < size).all()   # no window wholly padding
    read = np.zeros(size + 2 * kernel, bool)
    for s in starts:
        read[s + kernel:s + 2 * kernel] = True   # shifted by kernel: padding indexes >= 0
    if stride <= kernel:   # windows that touch or overlap read every element
        assert read[kernel:kernel + size].all()


# -- compiled == twin -------------------------------------------------------------------------

@FAST
@given(geometry(), seeds, st.booleans())
def test_conv2d(g, seed, relu):
    rng = np.random.default_rng(seed)
    x, w, b = f32(rng, g["n"], g["h"], g["w"], g["c"]), f32(rng, g["kh"], g["kw"], g["c"], g["f"]), \
        f32(rng, g["f"])
    out_shape = (g["n"], g["oh"], g["ow"], g["f"])
    got, want = nans(out_shape), nans(out_shape)
    cpu.conv2d_forward(x, w, b, got, *placement(g), relu)
    reference.conv2d_forward(x, w, b, want, *placement(g), relu)
    close(got, want)
    dy = f32(rng, *out_shape)
    grads = {k: [nans(a.shape) for a in (x, w, b)] for k in ("cpu", "ref")}
    cpu.conv2d_backward(x, w, dy, *grads["cpu"], *placement(g))
    reference.conv2d_backward(x, w, dy, *grads["ref"], *placement(g))
    for a, e in zip(grads["cpu"], grads["ref"]):
        close(a, e, 1e-4)
    first_layer = [nans(w.shape), nans(b.shape)]   # no dx: the first layer's call
    cpu.conv2d_backward(x, w, dy, None, *first_layer, *placement(g))
    close(first_layer[0], grads["ref"][1], 1e-4)
    # A training step's pair: the forward pass keeps x's im2col matrix, the backward pass
    # starts from it (a wrong window order or padding in cols, or a stale one, fails here).
    taps = g["kh"] * g["kw"] * g["c"]
    for k in (cpu, reference):
        cols, kept = nans((g["n"] * g["oh"] * g["ow"], taps)), nans(out_shape)
        k.conv2d_forward_cols(x, w, b, kept, cols, *placement(g), relu)
        close(kept, want)
        if k is cpu:
            cpu_cols = cols.copy()
        else:
            close(cpu_cols, cols, 0)
        for with_dx in (True, False):
            got_b = [nans(x.shape) if with_dx else None, nans(w.shape), nans(b.shape)]
            k.conv2d_backward_cols(cols.copy(), w, dy, dy.copy(), *got_b, *placement(g), False)
            for a, e in zip(got_b, grads["ref"]):
                if a is not None:
                    close(a, e, 1e-4)
        # relu: dy is the gradient of the ReLU's output, masked by it in the kernel's own pass
        # (a mask by the wrong array, or db summed before the mask, fails).
        out = f32(rng, *out_shape)
        out[0, 0, 0, 0] = np.nan                        # NaN output: no gradient, as relu_backward
        masked = dy * (out > 0)
        want_r = [nans(x.shape), nans(w.shape), nans(b.shape)]
        reference.conv2d_backward(x, w, masked, *want_r, *placement(g))
        got_r, d = [nans(x.shape), nans(w.shape), nans(b.shape)], dy.copy()
        k.conv2d_backward_cols(cols.copy(), w, out, d, *got_r, *placement(g), True)
        close(d, masked, 0)
        for a, e in zip(got_r, want_r):
            close(a, e, 1e-4)
    with pytest.raises(ValueError, match="cols must be"):
        cpu.conv2d_backward_cols(np.zeros((1, taps + 1), np.float32), w, dy, dy, None, *first_layer,
                                 *placement(g), False)


@FAST
@given(geometry(channels_out=False), seeds)
def test_maxpool2d(g, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng, g["n"], g["h"], g["w"], g["c"])
    x[0, 0, 0, 0] = x[0, -1, -1, 0]   # a tie somewhere, sometimes inside one window
    shape = (g["n"], g["oh"], g["ow"], g["c"])
    got, want = (nans(shape), nans(shape, np.int32)), (nans(shape), nans(shape, np.int32))
    cpu.maxpool2d_forward(x, *got, g["kh"], g["kw"], *placement(g))
    reference.maxpool2d_forward(x, *want, g["kh"], g["kw"], *placement(g))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # Every chosen index is inside the image and holds the value chosen.
    assert (want[1] >= 0).all()
    flat = x.reshape(g["n"], -1, g["c"])
    np.testing.assert_array_equal(np.take_along_axis(flat, want[1].reshape(g["n"], -1, g["c"]), 1),
                                  want[0].reshape(g["n"], -1, g["c"]))
    dy = f32(rng, *shape)
    dx_c, dx_r = nans(x.shape), nans(x.shape)
    cpu.maxpool2d_backward(dy, got[1], dx_c)
    reference.maxpool2d_backward(dy, want[1], dx_r)
    close(dx_c, dx_r)
    assert dx_r.sum() == pytest.approx(dy.sum(), rel=1e-4, abs=1e-4)   # all of dy lands


@FAST
@given(geometry(channels_out=False), seeds)
def test_avgpool2d(g, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng, g["n"], g["h"], g["w"], g["c"])
    shape = (g["n"], g["oh"], g["ow"], g["c"])
    got, want = nans(shape), nans(shape)
    cpu.avgpool2d_forward(x, got, g["kh"], g["kw"], *placement(g))
    reference.avgpool2d_forward(x, want, g["kh"], g["kw"], *placement(g))
    close(got, want)
    dy = f32(rng, *shape)
    dx_c, dx_r = nans(x.shape), nans(x.shape)
    cpu.avgpool2d_backward(dy, dx_c, g["kh"], g["kw"], *placement(g))
    reference.avgpool2d_backward(dy, dx_r, g["kh"], g["kw"], *placement(g))
    close(dx_c, dx_r)


def test_conv_at_model_sizes():
    # The reference CNN's first layer (3x3x1) and a second layer (3x3x32), 'same' padded,
    # against the twin at their real sizes, where gemm takes its blocked paths rather than
    # the small-matrix ones the geometry tests above reach.
    rng = np.random.default_rng(0)
    for c, f, hw in ((1, 32, 28), (32, 16, 13)):
        x, w, b = f32(rng, 4, hw, hw, c), f32(rng, 3, 3, c, f) * 0.3, f32(rng, f)
        out = [np.empty((4, hw, hw, f), np.float32) for _ in range(2)]
        cpu.conv2d_forward(x, w, b, out[0], 1, 1, 1, 1, True)
        reference.conv2d_forward(x, w, b, out[1], 1, 1, 1, 1, True)
        close(out[0], out[1], 1e-4)
        dy = f32(rng, *out[0].shape)
        grads = [[np.empty_like(a) for a in (x, w, b)] for _ in range(2)]
        cpu.conv2d_backward(x, w, dy, *grads[0], 1, 1, 1, 1)
        reference.conv2d_backward(x, w, dy, *grads[1], 1, 1, 1, 1)
        for a, e in zip(*grads):
            np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("hw,stride,padding", [(13, 1, "same"), (20, 2, "same"), (13, 1, "valid")])
def test_conv_training_pair_in_blocks_of_images(hw, stride, padding):
    # Five images of 32 channels make more than one of the kernels' blocks (_images_per_block:
    # 2 to 4 images here), the last one short. A block's rows put at the wrong offset, the
    # short block skipped, dw kept from the last block only, or dx zeroed over an earlier
    # block's sums all give the twin's results elsewhere than here. (Stride 1 takes the
    # Winograd path, whose blocks test_winograd_in_blocks_of_images_at_the_toy_resnets_size
    # holds; stride 2 is im2col's.)
    rng = np.random.default_rng(hw + stride)
    (oh, top), (ow, left) = conv_output(hw, 3, stride, padding), conv_output(hw, 3, stride, padding)
    n, c, f = 5, 32, 16
    x, w, b = f32(rng, n, hw, hw, c), f32(rng, 3, 3, c, f) * 0.1, f32(rng, f)
    cols = nans((n * oh * ow, 9 * c))
    step = cpu._images_per_block(cols, f, oh * ow)
    assert 1 < -(-n // step) and n % step
    got, want = nans((n, oh, ow, f)), nans((n, oh, ow, f))
    cpu.conv2d_forward_cols(x, w, b, got, cols, stride, stride, top, left, True)
    reference.conv2d_forward(x, w, b, want, stride, stride, top, left, True)
    close(got, want, 1e-4)
    dy = f32(rng, *got.shape)
    want_g = [nans(a.shape) for a in (x, w, b)]
    reference.conv2d_backward(x, w, dy * (want > 0), *want_g, stride, stride, top, left)
    for dx in (nans(x.shape), None):                      # an inner layer's call, a first layer's
        got_g, d = [dx, nans(w.shape), nans(b.shape)], dy.copy()
        cpu.conv2d_backward_cols(cols.copy(), w, got, d, *got_g, stride, stride, top, left, True)
        for a, e in zip(got_g, want_g):
            if a is not None:
                np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-3)



# -- Winograd F(2x2, 3x3): a 3x3 kernel of stride 1 from 16 or more channels to 8 or more -------

@st.composite
def wide_geometry(draw):
    """geometry() with 15-17 channels in and 7-9 out: where a 3x3 kernel of stride 1 takes the
    Winograd path from 16 and 8 (other kernels and strides here check that no other one does)."""
    g = draw(geometry())
    g["c"], g["f"] = draw(st.integers(15, 17)), draw(st.integers(7, 9))
    return g


def conv_against_twin(g, rng, dtype, tol):
    """Every CPU conv2d entry point (forward, forward keeping cols, backward from x and from
    cols, with and without dx, ReLU fused or not) against the twin's direct convolution."""
    def draw(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x, w, b = draw(g["n"], g["h"], g["w"], g["c"]), draw(g["kh"], g["kw"], g["c"], g["f"]), draw(g["f"])
    shape = (g["n"], g["oh"], g["ow"], g["f"])
    got, want = nans(shape, dtype), nans(shape, dtype)
    cpu.conv2d_forward(x, w, b, got, *placement(g), True)
    reference.conv2d_forward(x, w, b, want, *placement(g), True)
    close(got, want, tol)
    dy = draw(*shape)
    want_g = [nans(a.shape, dtype) for a in (x, w, b)]
    reference.conv2d_backward(x, w, dy, *want_g, *placement(g))
    got_g = [nans(a.shape, dtype) for a in (x, w, b)]
    cpu.conv2d_backward(x, w, dy, *got_g, *placement(g))
    for a, e in zip(got_g, want_g):
        close(a, e, tol)
    for relu in (False, True):
        cols, kept = nans((g["n"] * g["oh"] * g["ow"], g["kh"] * g["kw"] * g["c"]), dtype), nans(shape, dtype)
        cpu.conv2d_forward_cols(x, w, b, kept, cols, *placement(g), relu)
        reference.conv2d_forward(x, w, b, want, *placement(g), relu)
        close(kept, want, tol)
        masked = dy * (want > 0) if relu else dy
        reference.conv2d_backward(x, w, masked, *want_g, *placement(g))
        for with_dx in (False, True):     # im2col's cols are overwritten with dx: used last
            got_g, d = [nans(x.shape, dtype) if with_dx else None, nans(w.shape, dtype),
                        nans(b.shape, dtype)], dy.copy()
            cpu.conv2d_backward_cols(cols if with_dx else cols.copy(), w, kept, d, *got_g, *placement(g),
                                     relu)
            close(d, masked, 0)
            for a, e in zip(got_g, want_g):
                if a is not None:
                    close(a, e, tol)


@FAST
@given(wide_geometry(), seeds)
def test_conv2d_with_many_channels(g, seed):
    # Winograd's transforms (a coefficient, a tile past the output's edge, a patch row or
    # column in the padding) and the choice of path (a 5x5 kernel or a stride of 2 sent
    # down it) all show here as values other than the twin's; 15 channels in or 7 out take
    # im2col, whose cols the same checks hold.
    conv_against_twin(g, np.random.default_rng(seed), np.float32, 1e-4)


@st.composite
def winograd_geometry(draw):
    """A 3x3 kernel of stride 1 on 3-9 pixels a side, 16-18 channels in and 8-10 out."""
    h, w, padding = draw(st.integers(3, 9)), draw(st.integers(3, 9)), draw(st.sampled_from(["valid", "same"]))
    (oh, pt), (ow, pl) = conv_output(h, 3, 1, padding), conv_output(w, 3, 1, padding)
    return {"n": draw(st.integers(1, 3)), "h": h, "w": w, "c": draw(st.integers(16, 18)),
            "f": draw(st.integers(8, 10)), "kh": 3, "kw": 3, "sh": 1, "sw": 1, "padding": padding,
            "oh": oh, "ow": ow, "pt": pt, "pl": pl}


@GRAD
@given(winograd_geometry(), seeds)
def test_winograd_is_exact_in_float64(g, seed):
    # The same arithmetic as the direct convolution up to rounding: in float64 the two agree
    # to 1e-10, where an approximation (or a wrong half in G) would not.
    w, out = np.zeros((3, 3, g["c"], g["f"])), np.zeros((g["n"], g["oh"], g["ow"], g["f"]))
    assert cpu._winograd(w, out, 1, 1) == (16 * -(-g["oh"] // 2) * -(-g["ow"] // 2) <= 9 * g["oh"] * g["ow"])
    conv_against_twin(g, np.random.default_rng(seed), np.float64, 1e-10)


def test_winograd_is_taken_where_it_pays_and_nowhere_else():
    def taken(kernel, c, f, oh, ow, stride=1):
        return cpu._winograd(np.zeros((*kernel, c, f), np.float32), np.zeros((1, oh, ow, f), np.float32),
                             stride, stride)
    assert taken((3, 3), 32, 64, 24, 24) and taken((3, 3), 16, 8, 2, 2) and taken((3, 3), 64, 64, 6, 6)
    assert taken((3, 3), 16, 8, 3, 3)                # 16 * 4 tiles' elements <= 9 * 9 pixels'
    assert not taken((3, 3), 1, 32, 26, 26)          # a first layer: im2col
    assert not taken((3, 3), 15, 64, 8, 8) and not taken((3, 3), 64, 7, 8, 8)
    assert not taken((3, 3), 32, 32, 8, 8, stride=2) and not taken((5, 5), 32, 32, 8, 8)
    assert not taken((1, 3), 32, 32, 1, 8)           # Conv1D's one-row image
    assert not taken((3, 3), 32, 32, 1, 7)           # 16 * 4 > 9 * 7: V would not fit in cols
    # Stride 1 down and 2 across: im2col, whose result is the twin's (Winograd's would not be).
    (oh, pt), (ow, pl) = conv_output(9, 3, 1, "same"), conv_output(9, 3, 2, "same")
    assert not cpu._winograd(np.zeros((3, 3, 16, 8), np.float32), np.zeros((2, oh, ow, 8), np.float32), 1, 2)
    conv_against_twin({"n": 2, "h": 9, "w": 9, "c": 16, "f": 8, "kh": 3, "kw": 3, "sh": 1, "sw": 2,
                       "padding": "same", "oh": oh, "ow": ow, "pt": pt, "pl": pl},
                      np.random.default_rng(5), np.float32, 1e-4)


def test_winograd_in_blocks_of_images_at_the_toy_resnets_size():
    # The toy ResNet's 26x26x32 -> 64 layer: one image a block (_wino_images), so three
    # images make three blocks. A block's tiles at the wrong offset in V, dU kept from the
    # last block only, or dx zeroed over an earlier block all fail here.
    rng = np.random.default_rng(3)
    assert cpu._wino_images(24, 24, 32, 64, 4) == 1
    g = {"n": 3, "h": 26, "w": 26, "c": 32, "f": 64, "kh": 3, "kw": 3, "sh": 1, "sw": 1,
         "padding": "valid", "oh": 24, "ow": 24, "pt": 0, "pl": 0}
    conv_against_twin(g, rng, np.float32, 1e-4)
    g.update(h=8, w=8, c=64, oh=8, ow=8, pt=1, pl=1, padding="same", n=21)   # 2 blocks, one short
    assert 1 < -(-21 // cpu._wino_images(8, 8, 64, 64, 4)) and 21 % cpu._wino_images(8, 8, 64, 64, 4)
    conv_against_twin(g, rng, np.float32, 1e-4)

@FAST
@given(st.integers(2, 7), st.integers(2, 7), st.integers(1, 2), st.sampled_from(["valid", "same"]), seeds)
def test_maxpool2d_2x2_ties_and_nans(h, w, stride, padding, seed):
    # The 2x2 pool's own pass (cpu._max_of_four): values from {0, 1, 2, NaN}, so most windows
    # hold ties and NaNs in every position; index and value must be the twin's (a wrong order
    # of the four, or a NaN that wins from behind, changes them). Windows cut by 'same'
    # padding or the edge take the general loop beside it.
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 4, (2, h, w, 3)).astype(np.float32)
    x[x == 3] = np.nan
    (oh, pt), (ow, pl) = conv_output(h, 2, stride, padding), conv_output(w, 2, stride, padding)
    got, want = (nans((2, oh, ow, 3)), nans((2, oh, ow, 3), np.int32)), \
        (nans((2, oh, ow, 3)), nans((2, oh, ow, 3), np.int32))
    cpu.maxpool2d_forward(x, *got, 2, 2, stride, stride, pt, pl)
    reference.maxpool2d_forward(x, *want, 2, 2, stride, stride, pt, pl)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_pooling_ties_and_nan(k):
    # Ties go to the first element in row-major order (as TF); a NaN that comes first stays.
    x = np.stack([np.array([[1, 3], [3, 2]], np.float32),
                  np.array([[np.nan, 1], [2, 0]], np.float32)], axis=-1)[None]
    out, arg = np.empty((1, 1, 1, 2), np.float32), np.empty((1, 1, 1, 2), np.int32)
    k.maxpool2d_forward(x, out, arg, 2, 2, 2, 2, 0, 0)
    assert out[0, 0, 0, 0] == 3 and arg[0, 0, 0, 0] == 1
    assert np.isnan(out[0, 0, 0, 1]) and arg[0, 0, 0, 1] == 0


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_conv_relu_keeps_nan(k):
    # A diverged run must stay visibly non-finite (the shard rejects it), not be masked to 0.
    x = np.full((1, 2, 2, 1), np.nan, np.float32)
    out = np.empty((1, 1, 1, 2), np.float32)
    k.conv2d_forward(x, np.ones((2, 2, 1, 2), np.float32), np.zeros(2, np.float32), out, 1, 1, 0, 0,
                     True)
    assert np.isnan(out).all()


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_windows_wholly_in_padding(k):
    # Only a caller's own padding can do this ('same' never does): 0 out, no gradient back.
    x = np.ones((1, 1, 1, 1), np.float32)
    out, arg = np.empty((1, 2, 1, 1), np.float32), np.empty((1, 2, 1, 1), np.int32)
    k.maxpool2d_forward(x, out, arg, 1, 1, 1, 1, 1, 0)   # row 0 of the output reads padding
    assert out.ravel().tolist() == [0, 1] and arg.ravel().tolist() == [-1, 0]
    k.avgpool2d_forward(x, out, 1, 1, 1, 1, 1, 0)
    assert out.ravel().tolist() == [0, 1]
    dx = np.empty_like(x)
    k.maxpool2d_backward(np.full((1, 2, 1, 1), 5, np.float32), arg, dx)
    assert dx.ravel().tolist() == [5]


KINDS = ["relu", "sigmoid", "tanh", "linear"]


@FAST
@given(st.sampled_from(KINDS), st.lists(st.integers(1, 5), min_size=1, max_size=4), seeds)
def test_activations(kind, shape, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng, *shape) * 4
    got, want = nans(x.shape), nans(x.shape)
    cpu.activation_forward(kind, x, got)
    reference.activation_forward(kind, x, want)
    close(got, want, 1e-6)
    x64 = x.astype(np.float64)
    textbook = {"relu": np.maximum(x64, 0), "sigmoid": 1 / (1 + np.exp(-x64)), "tanh": np.tanh(x64),
                "linear": x64}[kind]
    close(want, textbook, 1e-6)
    dy = f32(rng, *shape)
    dx_c, dx_r = nans(x.shape), nans(x.shape)
    cpu.activation_backward(kind, want, dy, dx_c)
    reference.activation_backward(kind, want, dy, dx_r)
    close(dx_c, dx_r, 1e-6)


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_sigmoid_saturates_without_overflow(k):
    x = np.array([-1e4, -100, 0, 100, 1e4], np.float32)
    out = np.empty_like(x)
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        k.activation_forward("sigmoid", x, out)
    assert out.tolist() == [0, pytest.approx(0, abs=1e-40), 0.5, 1, 1]


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_unknown_activation(k):
    x = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="activation: unknown kind"):
        k.activation_forward("gelu", x, x.copy())
    with pytest.raises(ValueError, match="activation: unknown kind"):
        k.activation_backward("gelu", x, x, x.copy())


@FAST
@given(st.integers(1, 9), seeds, st.sampled_from([1.0, 40.0]), st.booleans())
def test_sigmoid_bce(n, seed, scale, column):
    rng = np.random.default_rng(seed)
    z = f32(rng, n, 1) * np.float32(scale)
    y = (rng.random(n) < 0.5).astype(np.float32)
    if not column:
        z = z[:, 0].copy()
    got, want = nans(z.shape), nans(z.shape)
    rows_c, rows_r = np.full(n, np.nan), np.full(n, np.nan)
    loss_c, loss_r = cpu.sigmoid_bce(z, y, got, rows_c), reference.sigmoid_bce(z, y, want, rows_r)
    assert loss_c == pytest.approx(loss_r, rel=1e-5, abs=1e-6)
    close(got, want, 1e-6)
    close(rows_c, rows_r, 1e-6)                 # each row's loss, whose mean is the loss
    assert rows_c.mean() == pytest.approx(loss_c, rel=1e-12, abs=1e-12)
    z64 = z.reshape(-1).astype(np.float64)   # -log p(y) = log(1 + e^z) - y*z, in float64
    assert loss_r == pytest.approx(np.mean(np.logaddexp(0, z64) - y * z64), rel=1e-5, abs=1e-6)
    close(want.reshape(-1), (1 / (1 + np.exp(-z64)) - y) / n, 1e-6)


@FAST
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 6), st.integers(1, 3), seeds, st.booleans())
def test_embedding(n, length, vocab, dim, seed, padded):
    """-1 is padding: zeros out, no gradient (an unpooled list feature's shorter lists)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1 if padded else 0, vocab, (n, length))
    table = f32(rng, vocab, dim)
    got, want = nans((n, length, dim)), nans((n, length, dim))
    cpu.embedding_forward(ids, table, got)
    reference.embedding_forward(ids, table, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want, np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0))
    dy = f32(rng, n, length, dim)
    d_c, d_r = nans(table.shape), nans(table.shape)
    cpu.embedding_backward(ids, dy, d_c)
    reference.embedding_backward(ids, dy, d_r)
    close(d_c, d_r)
    onehot = np.eye(vocab + 1)[ids.reshape(-1)][:, :vocab]   # (N*L, V): the gradient as a product; -1: none
    close(d_r, onehot.T @ dy.reshape(-1, dim))


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("bad", [-2, 3])
def test_embedding_rejects_ids_out_of_range(k, bad):
    # numba does not bounds-check: this guard is what stops a read or write outside the table.
    ids, table = np.array([[0, bad]]), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"embedding: id out of range \[0, .*\(or -1, padding\)"):
        k.embedding_forward(ids, table, np.empty((1, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"embedding: id out of range \[0, .*\(or -1, padding\)"):
        k.embedding_backward(ids, np.zeros((1, 2, 2), np.float32), table)


# -- pooled embedding (list features) -----------------------------------------------------------

def _pooled_by_hand(ids, weights, table, combiner):
    """Each sample's list written out: its ids that are not padding, weighted, divided as named."""
    out = np.zeros((ids.shape[0], table.shape[1]))
    for n in range(ids.shape[0]):
        keep = ids[n] >= 0
        w, rows = weights[n][keep].astype(np.float64), table[ids[n][keep]].astype(np.float64)
        d = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[n] = (w[:, None] * rows).sum(0) / d if d != 0 else 0.0
    return out


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 7), st.integers(1, 4),
       st.sampled_from(["sum", "mean", "sqrtn"]), st.booleans(), seeds)
def test_pooled_embedding(n, length, vocab, dim, combiner, weighted, seed):
    """The compiled kernel equals its twin and both equal each list written out, for every
    combiner, weighted or not, with padding (-1), repeated ids inside a list and empty lists
    (a list all padding gives zeros and no gradient). Catches padding read as a row, counted in
    a mean, a divisor taken over the whole width, or repeated ids not adding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, vocab, (n, length))            # -1: padding, about one in vocab + 1
    ids[0] = -1                                          # an empty list
    weights = rng.uniform(0.1, 2.0, (n, length)).astype(np.float32) if weighted \
        else np.ones((n, length), np.float32)
    table, code = f32(rng, vocab, dim), reference.COMBINERS[combiner]
    got, want = nans((n, dim)), nans((n, dim))
    cpu.pooled_embedding_forward(ids, weights, table, code, got)
    reference.pooled_embedding_forward(ids, weights, table, code, want)
    close(got, want)
    close(want, _pooled_by_hand(ids, weights, table, combiner))
    assert not want[0].any()
    dy = f32(rng, n, dim)
    d_c, d_r = nans(table.shape), nans(table.shape)
    cpu.pooled_embedding_backward(ids, weights, dy, code, d_c)
    reference.pooled_embedding_backward(ids, weights, dy, code, d_r)
    close(d_c, d_r)
    unused = np.setdiff1d(np.arange(vocab), ids[ids >= 0])
    assert not d_r[unused].any()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_embedding_backward_is_the_gradient(combiner):
    rng = np.random.default_rng(7)
    ids = np.array([[0, 2, 2, -1], [1, -1, -1, -1], [-1, -1, -1, -1], [3, 0, 1, 2]])
    weights, table = rng.uniform(0.2, 1.5, ids.shape), rng.standard_normal((5, 3))
    out, code = np.empty((4, 3)), reference.COMBINERS[combiner]

    def forward():
        reference.pooled_embedding_forward(ids, weights, table, code, out)
        return out

    dy, dtable = rng.standard_normal(out.shape), np.empty_like(table)
    reference.pooled_embedding_backward(ids, weights, dy, code, dtable)
    np.testing.assert_allclose(dtable, numeric_grad(forward, [table], dy)[0], atol=1e-8)
    assert not dtable[4].any()   # row 4 was never looked up


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_a_pooled_list_whose_weights_sum_to_0_gives_zeros(k, combiner):
    """mean over weights 1 and -1 (sqrtn over zeros): no division by 0 (as Keras-RS's
    divide_no_nan); the list's vector and its gradient are 0, the other list's are not."""
    ids = np.array([[0, 1], [2, 2]])
    w = np.array([[1, -1], [1, 1]] if combiner == "mean" else [[0, 0], [1, 1]], np.float32)
    table, out = np.arange(6, dtype=np.float32).reshape(3, 2), np.full((2, 2), np.nan, np.float32)
    k.pooled_embedding_forward(ids, w, table, reference.COMBINERS[combiner], out)
    assert not out[0].any() and out[1].all()
    dtable = np.full((3, 2), np.nan, np.float32)
    k.pooled_embedding_backward(ids, w, np.ones((2, 2), np.float32), reference.COMBINERS[combiner], dtable)
    assert not dtable[:2].any() and dtable[2].all()


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_pooled_embedding_refuses_ids_past_the_table_and_a_weights_shape(k):
    ids, table, w = np.array([[0, 3]]), np.zeros((3, 2), np.float32), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"embedding: id out of range \[0, "):
        k.pooled_embedding_forward(ids, w, table, 0, np.empty((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"embedding: id out of range \[0, "):
        k.pooled_embedding_backward(ids, w, np.zeros((1, 2), np.float32), 0, table)
    with pytest.raises(ValueError, match="weights"):
        k.pooled_embedding_forward(np.array([[0, 1]]), np.ones((1, 3), np.float32), table, 0,
                                   np.empty((1, 2), np.float32))


# -- dropout ----------------------------------------------------------------------------------


def test_splitmix64_is_the_published_generator():
    # The published sequence for seed 1234567.
    assert splitmix64_python(1234567, 3) == [6457827717110365317, 3203168211198807973,
                                             9817491932198370423]
    got = reference.splitmix64(2**63 - 25, np.arange(50))
    assert got.tolist() == splitmix64_python(2**63 - 25, 50)


@FAST
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       st.integers(0, 2**63 - 1), seeds)
def test_dropout_same_mask_on_cpu_and_reference(shape, rate, seed, data_seed):
    x = f32(np.random.default_rng(data_seed), *shape)
    bufs = {k: [nans(x.shape), nans(x.shape)] for k in ("cpu", "ref")}
    cpu.dropout_forward(x, *bufs["cpu"], rate, seed)
    reference.dropout_forward(x, *bufs["ref"], rate, seed)
    out, mask = bufs["ref"]
    np.testing.assert_array_equal(bufs["cpu"][1], mask)
    np.testing.assert_array_equal(bufs["cpu"][0], out)
    assert set(np.unique(mask)) <= {0, np.float32(1 / (1 - rate))}
    np.testing.assert_array_equal(out, x * mask)
    dy = f32(np.random.default_rng(seed % 2**32), *shape)
    dx_c, dx_r = nans(x.shape), nans(x.shape)
    cpu.dropout_backward(dy, mask, dx_c)
    reference.dropout_backward(dy, mask, dx_r)
    np.testing.assert_array_equal(dx_c, dx_r)
    np.testing.assert_array_equal(dx_r, dy * mask)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_dropout_keeps_one_minus_rate_and_preserves_the_mean(rate):
    n = 200_000
    x = np.full(n, 3.0, np.float32)
    out, mask = np.empty_like(x), np.empty_like(x)
    cpu.dropout_forward(x, out, mask, rate, 42)
    kept = (mask > 0).mean()
    sd = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept - (1 - rate)) < 5 * sd
    assert abs(out.mean() - 3.0) < 5 * 3.0 * sd / (1 - rate)   # E[out] == x
    other = np.empty_like(mask)
    cpu.dropout_forward(x, out, other, rate, 43)
    both = (mask > 0).astype(float) @ (other > 0) / n
    assert abs(both - (1 - rate) ** 2) < 5 * sd   # two seeds' masks are independent


def test_dropout_rate_zero_keeps_everything():
    x = np.arange(5, dtype=np.float32)
    out, mask = np.empty_like(x), np.empty_like(x)
    cpu.dropout_forward(x, out, mask, 0.0, 7)
    assert mask.tolist() == [1] * 5 and out.tolist() == x.tolist()


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("rate,seed,match", [(1.0, 0, "rate must be in"), (-0.1, 0, "rate must be in"),
                                             (0.5, -1, "seed must be in")])
def test_dropout_rejects(k, rate, seed, match):
    x = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=f"dropout: {match}"):
        k.dropout_forward(x, x.copy(), x.copy(), rate, seed)


# -- the twins' gradients against central differences (float64, small shapes) ----------------

def numeric_grad(forward, arrays, dy, eps=1e-6):
    """d sum(forward() * dy) / d each array, by central differences (the arrays are perturbed
    in place, and restored)."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            keep = a[idx]
            a[idx] = keep + eps
            plus = np.sum(forward() * dy)
            a[idx] = keep - eps
            minus = np.sum(forward() * dy)
            a[idx] = keep
            g[idx] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


def small_geometry():
    return geometry().filter(lambda g: g["n"] * g["h"] * g["w"] * g["c"] <= 60 and g["oh"] > 0
                             and g["ow"] > 0)


@GRAD
@given(small_geometry(), seeds)
def test_conv2d_backward_is_the_gradient(g, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g["n"], g["h"], g["w"], g["c"]))
    w = rng.standard_normal((g["kh"], g["kw"], g["c"], g["f"]))
    b = rng.standard_normal(g["f"])
    out = np.empty((g["n"], g["oh"], g["ow"], g["f"]))

    def forward():
        reference.conv2d_forward(x, w, b, out, *placement(g), False)
        return out

    dy = rng.standard_normal(out.shape)
    got = [np.empty_like(a) for a in (x, w, b)]
    reference.conv2d_backward(x, w, dy, *got, *placement(g))
    for a, e in zip(got, numeric_grad(forward, [x, w, b], dy)):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


@GRAD
@given(small_geometry(), seeds, st.booleans())
def test_pooling_backward_is_the_gradient(g, seed, use_max):
    rng = np.random.default_rng(seed)
    # Distinct values, far apart next to eps: no tie, so max pooling is differentiable here.
    in_shape = (g["n"], g["h"], g["w"], g["c"])
    x = rng.permutation(np.prod(in_shape)).reshape(in_shape) * 0.1
    shape, pool = (g["n"], g["oh"], g["ow"], g["c"]), (g["kh"], g["kw"])
    out, arg = np.empty(shape), np.empty(shape, np.int32)

    def forward():
        if use_max:
            reference.maxpool2d_forward(x, out, arg, *pool, *placement(g))
        else:
            reference.avgpool2d_forward(x, out, *pool, *placement(g))
        return out

    forward()
    dy, dx = rng.standard_normal(shape), np.empty_like(x)
    if use_max:
        reference.maxpool2d_backward(dy, arg, dx)
    else:
        reference.avgpool2d_backward(dy, dx, *pool, *placement(g))
    np.testing.assert_allclose(dx, numeric_grad(forward, [x], dy)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_activation_backward_is_the_gradient(kind):
    rng = np.random.default_rng(len(kind))
    x = rng.uniform(0.1, 2, (3, 4)) * rng.choice([-1, 1], (3, 4))   # away from relu's kink
    out = np.empty_like(x)

    def forward():
        reference.activation_forward(kind, x, out)
        return out

    dy, dx = rng.standard_normal(x.shape), np.empty_like(x)
    reference.activation_backward(kind, forward().copy(), dy, dx)
    np.testing.assert_allclose(dx, numeric_grad(forward, [x], dy)[0], rtol=1e-6, atol=1e-8)


def test_embedding_and_bce_backward_are_the_gradient():
    rng = np.random.default_rng(5)
    ids, table = np.array([[0, 2, 2], [1, 2, 0]]), rng.standard_normal((4, 3))
    out = np.empty((2, 3, 3))

    def forward():
        reference.embedding_forward(ids, table, out)
        return out

    dy, dtable = rng.standard_normal(out.shape), np.empty_like(table)
    reference.embedding_backward(ids, dy, dtable)
    np.testing.assert_allclose(dtable, numeric_grad(forward, [table], dy)[0], atol=1e-8)
    assert not dtable[3].any()   # row 3 was never looked up
    z, y = rng.standard_normal((5, 1)) * 3, np.array([0, 1, 1, 0, 1], np.float64)
    dz = np.empty_like(z)
    reference.sigmoid_bce(z, y, dz)
    scratch = np.empty_like(z)
    want = numeric_grad(lambda: np.array(reference.sigmoid_bce(z, y, scratch)), [z], np.array(1.0))[0]
    np.testing.assert_allclose(dz, want, rtol=1e-6, atol=1e-9)


def test_dropout_backward_is_the_gradient():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 5))
    out, mask = np.empty_like(x), np.empty_like(x)

    def forward():
        reference.dropout_forward(x, out, mask, 0.3, 11)   # the same seed: the same mask
        return out

    forward()
    dy, dx = rng.standard_normal(x.shape), np.empty_like(x)
    reference.dropout_backward(dy, mask, dx)
    assert 0 < (mask > 0).sum() < x.size   # both kinds of element are there to check
    np.testing.assert_allclose(dx, numeric_grad(forward, [x], dy)[0], atol=1e-8)
