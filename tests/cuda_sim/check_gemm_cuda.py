"""The implicit-GEMM convolutions and the blocked product's variants (pserver.kernels.cuda_gemm)
against the NumPy twins (pserver.kernels.reference), on small shapes.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1; run directly on
a machine with a GPU, on the device. Outputs start as NaN, so an element no thread writes fails.
The shapes cross the tiles' edges (64 and 128 rows, 32 and 64 columns) and the strips' (8, 16).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from pserver.kernels import conv_output, reference
from pserver.kernels import cuda as K
from pserver.kernels import cuda_gemm as G
from tests.cuda_sim import simfix  # (a device or the simulator; fixes the latter)
from tests.cuda_sim.check_kernels_cuda import image_geometry

FEW = settings(max_examples=5, deadline=None, derandomize=True, database=None)


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nans(*shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def close(got, want, tol=1e-4):
    np.testing.assert_allclose(got.copy_to_host(), want, rtol=tol, atol=tol)


def _case(g, seed):
    n, h, w, c, f, kh, kw, sh, sw, padding = g
    oh, pt = conv_output(h, kh, sh, padding)
    ow, pl = conv_output(w, kw, sw, padding)
    rng = np.random.default_rng(seed)
    arrays = f32(rng, n, h, w, c), f32(rng, kh, kw, c, f), f32(rng, f), f32(rng, n, oh, ow, f)
    return arrays, (sh, sw, pt, pl)


def _check_conv(g, seed, variant, relu=True, splits=None):
    (x, wt, b, dy), place = _case(g, seed)
    out = nans(*dy.shape)
    want = np.empty(dy.shape, np.float32)
    G.conv2d_forward(cuda.to_device(x), cuda.to_device(wt), cuda.to_device(b), out, *place, relu,
                     variant)
    reference.conv2d_forward(x, wt, b, want, *place, relu)
    close(out, want)
    dx, dw, db = nans(*x.shape), nans(*wt.shape), nans(*b.shape)
    wants = [np.empty_like(a) for a in (x, wt, b)]
    G.conv2d_weight_grad(cuda.to_device(x), cuda.to_device(dy), dw, db, *place, variant, splits=splits)
    G.conv2d_input_grad(cuda.to_device(wt), cuda.to_device(dy), dx, *place, variant)
    reference.conv2d_backward(x, wt, dy, *wants, *place)
    for got, want in zip((dx, dw, db), wants):
        close(got, want)


@FEW
@given(image_geometry(max_hw=7, max_channels=5), st.integers(0, 2**16), st.sampled_from(["g64k16", "g64k8d"]),
       st.booleans())
def test_convolutions_equal_their_twins(g, seed, variant, relu):
    # Forward (bias, ReLU), weight and bias gradient, input gradient, over random geometry:
    # strides that skip input pixels (the input gradient's inexact divisions), 'same' padding
    # before and after, kernels as large as the image, one strip or a ragged last one.
    _check_conv(g, seed, variant, relu)


WIDE = ["g64k16dc", "g128x64k8c", "g64k16dcr3", "g128x64k8cw", "g128x64k16cwr2", "g128x64k8cw+g128x64k16cwr2"]
# The simulator ignores register caps (g64k16dcr3 is g64k16dc there), and g128x64k8cw's forward
# and input gradient run in the X+Y case: a minute each saved from CI's run of this module.
WIDE_SIM = ["g64k16dc", "g128x64k8c", "g128x64k16cwr2", "g128x64k8cw+g128x64k16cwr2"]


@pytest.mark.parametrize("variant", WIDE_SIM if simfix.SIMULATOR else WIDE)
def test_wide_and_contiguous_variants(variant):
    # 33 filters and 33 channels: 64-wide tiles, in the runs-of-4 layout where the variant
    # has it (per warp with w); the weight gradient's 2 x 2 x 33 + 1 = 133 rows cross the 64
    # and 128 tiles. "X+Y": X for the forward and input gradient, Y for the weight gradient.
    _check_conv((1, 5, 5, 33, 33, 2, 2, 1, 1, "same"), 7, variant)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_weight_gradient_over_ragged_slices(splits):
    # 2 x 5 x 5 = 50 pixels in slices of whole 8-deep strips: 3 slices of 24, 24 and 2 (7 asks
    # for more slices than strips: 7 slices of 8 and one empty). The bias row comes out of
    # every slice and the slices add up in order.
    _check_conv((2, 5, 5, 3, 4, 3, 3, 1, 1, "same"), splits, "g64k8d", splits=splits)


def test_splits_stay_within_the_pixels():
    assert G.splits_for(tiles=5, pixels=43264, bk=16) == G._blocks(G.WGRAD_BLOCKS, 5)
    assert G.splits_for(tiles=5, pixels=200, bk=16) == 1        # too few strips to split
    assert G.splits_for(tiles=10_000, pixels=10**6, bk=16) == 1


def _distinct_in_simulator():
    """Every variant on a device; in the simulator, which ignores launch bounds, one per shape
    (a register cap changes nothing there but the time the test takes), and no split-K variant:
    a reduction of 37 is one slice, the base variant's product, and the split path has its own
    test (test_split_k_products)."""
    if not simfix.SIMULATOR:
        return sorted(G.VARIANTS)
    shapes = {}
    for name in sorted(G.VARIANTS, key=len):
        v = G.VARIANTS[name]
        shapes.setdefault((v.bm, v.bn, v.bk, v.dbuf, v.contig, v.warp), name)
    return sorted(shapes.values())


@pytest.mark.parametrize("variant", _distinct_in_simulator())
def test_each_product_variant(variant):
    rng = np.random.default_rng(len(variant))
    a, b = f32(rng, 130, 37), f32(rng, 37, 67)
    c = nans(130, 67)
    G.matmul(cuda.to_device(a), cuda.to_device(b), c, False, False, variant)
    close(c, a @ b, 1e-5)


SPLITS = [("g128k8cr2s4", None), ("g128k8cwr2s4", 3), ("g64k16cs2", 2), ("g128x64k8cws2", 5)]


# In the simulator (CI): the cases that split (s4's own choice here is one slice), and the
# transposed operands once; every case and orientation on a device.
@pytest.mark.parametrize("variant, splits", SPLITS[1:] if simfix.SIMULATOR else SPLITS)
def test_split_k_products(variant, splits):
    # K = 100 in slices of whole strips: s4's own choice is 1 slice (100 // 64: fewer than 8
    # strips of 8 each: no split); asked for 3 at bk 8, slices of 40, 40, 20; 2 at bk 16, 64
    # and 36; 5 at bk 8, four of 24 and one of 4. The slices add up in order in a second
    # kernel; transposed operands take the same path.
    rng = np.random.default_rng(11)
    a, b = f32(rng, 70, 100), f32(rng, 100, 131)
    both = not simfix.SIMULATOR or variant == "g64k16cs2"
    for ta, tb in ((False, False), (True, True)) if both else ((False, False),):
        c = nans(70, 131)
        G.matmul(cuda.to_device(a.T.copy() if ta else a), cuda.to_device(b.T.copy() if tb else b), c,
                 ta, tb, variant, splits=splits)
        close(c, a @ b, 1e-5)


def test_split_k_choice():
    v = G.VARIANTS["g128k8cr2sa"]
    assert v.splits(tiles=64, k=1024) == 4              # 64 tiles of 128 at n = 1024: 4 x 64 <= 264
    assert v.splits(tiles=128, k=2048) == 2
    assert v.splits(tiles=1024, k=4096) == 1            # enough tiles: no split
    assert v.splits(tiles=64, k=100) == 1               # under 8 strips per slice: no split
    assert G.VARIANTS["g128k8cr2s4"].splits(tiles=1024, k=4096) == 4


def test_matmul_takes_the_split_128_tile_under_one_wave_of_64s(monkeypatch):
    # tile_for as at n = 1024 on 132 multiprocessors, scaled down for the simulator: 2
    # multiprocessors, a 128 x 64 product (2 blocks of 64: under one wave of 2 per
    # multiprocessor) with a reduction of 128 >= SPLIT_MIN_K (lowered) takes the 128 tile,
    # which splits it in 2 (splits: 8 strips of 8 each); a shorter one takes the 64 tile.
    monkeypatch.setattr(K, "_SMS", [2])
    monkeypatch.setattr(G, "_SMS", [2])
    monkeypatch.setattr(K, "SPLIT_MIN_K", 128)
    tiles = []
    real = K.matmul_tiled
    monkeypatch.setattr(K, "matmul_tiled", lambda *a, **kw: tiles.append(a[5]) or real(*a, **kw))
    rng = np.random.default_rng(5)
    for k in (128, 100):
        a, b = f32(rng, 128, k), f32(rng, k, 64)
        c = nans(128, 64)
        K.matmul(cuda.to_device(a), cuda.to_device(b), c)
        close(c, a @ b, 1e-5)
    assert tiles == [128, 64]
    assert G.VARIANTS[K.BLOCKED_CHOICE[128]].splits(tiles=1, k=128) == 2


@pytest.mark.parametrize("trans_a, trans_b", [(True, False), (False, True), (True, True)])
def test_transposed_products(trans_a, trans_b):
    rng = np.random.default_rng(3)
    a, b = f32(rng, 70, 21), f32(rng, 21, 45)
    c = nans(70, 45)
    G.matmul(cuda.to_device(a.T.copy() if trans_a else a), cuda.to_device(b.T.copy() if trans_b else b),
             c, trans_a, trans_b, "g64k8d")
    close(c, a @ b, 1e-5)


def test_matmul_checks_shapes_before_launching():
    with pytest.raises(ValueError, match="matmul"):
        G.matmul(*(cuda.device_array(s, np.float32) for s in ((2, 3), (4, 2), (2, 2))))


def test_the_model_kernels_take_the_implicit_gemm_and_keep_the_direct_fallback(monkeypatch):
    assert K.CONV_KERNEL == "igemm"
    calls = []
    monkeypatch.setattr(G, "conv2d_forward", lambda *a, **k: calls.append("forward"))
    monkeypatch.setattr(G, "conv2d_backward", lambda *a, **k: calls.append("backward"))
    (x, wt, b, dy), place = _case((1, 3, 3, 1, 2, 2, 2, 1, 1, "valid"), 0)
    xd, wd, bd, dyd = (cuda.to_device(a) for a in (x, wt, b, dy))
    K.conv2d_forward(xd, wd, bd, nans(*dy.shape), *place, False)
    K.conv2d_backward(xd, wd, dyd, None, nans(*wt.shape), nans(2), *place)
    assert calls == ["forward", "backward"]
    monkeypatch.setattr(K, "CONV_KERNEL", "direct")
    out, want = nans(*dy.shape), np.empty(dy.shape, np.float32)
    K.conv2d_forward(xd, wd, bd, out, *place, False)
    reference.conv2d_forward(x, wt, b, want, *place, False)
    close(out, want)
    assert calls == ["forward", "backward"]


def test_conv_backward_checks_the_bias_gradient_shape():
    (x, wt, b, dy), place = _case((1, 3, 3, 1, 2, 2, 2, 1, 1, "valid"), 0)
    with pytest.raises(ValueError, match="db"):
        K.conv2d_backward(cuda.to_device(x), cuda.to_device(wt), cuda.to_device(dy), None,
                          nans(*wt.shape), nans(3), *place)


def test_a_workspace_per_stream():
    # The weight gradient's slices sit in a workspace that launches on one stream share (the
    # stream orders them); another stream must get its own, or two workers' steps could mix.
    s1, s2 = cuda.stream(), cuda.stream()
    w1, w2 = G._workspace((2, 3), s1), G._workspace((2, 3), s2)
    assert w1.shape == w2.shape == (2, 3)
    w1.copy_to_device(np.zeros((2, 3), np.float32))
    w2.copy_to_device(np.ones((2, 3), np.float32))
    assert not w1.copy_to_host().any()
    again = G._workspace((3, 2), s1)
    again.copy_to_device(np.full((3, 2), 5, np.float32))
    assert (G._workspace((2, 3), s1).copy_to_host() == 5).all()     # reused, not reallocated
    assert (w2.copy_to_host() == 1).all()
