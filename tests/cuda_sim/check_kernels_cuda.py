"""Every CUDA kernel against its NumPy twin (pserver.kernels.reference), on small shapes.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (see there why).
The simulator runs one Python thread per CUDA thread, about 0.1-0.3 s per block of 256, so the
shapes are small; they still cross the tile sizes (TILE = 16 for the products, 32 x 8 for the
elementwise and column kernels, 128 rows per block) so ragged edges are exercised.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from pserver.kernels import KERNELS, conv_output, get_backend, reference
from pserver.kernels import cuda as K
from pserver.kernels import cuda_gemm as G
from tests.cuda_sim import simfix  # noqa: F401  (a device or the simulator; fixes the latter)

# Few examples: each costs about a second in the simulator. Derandomized, so a run is repeatable.
FEW = settings(max_examples=4, deadline=None, derandomize=True, database=None)
RTOL, ATOL = 1e-5, 1e-5


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nans(*shape):
    """A device buffer of NaN: an element a kernel forgets to write stays NaN and fails."""
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# -- one API --------------------------------------------------------------------------------

def test_backend_and_signatures():
    assert get_backend("cuda") is K
    for name in KERNELS:
        params = list(inspect.signature(getattr(K, name)).parameters.values())
        # The CPU signature, plus a keyword-only stream.
        assert params[-1].name == "stream" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
        twin = inspect.signature(getattr(reference, name)).parameters
        assert [p.name for p in params[:-1]] == list(twin)


def test_tile_sizes_are_what_the_tests_assume():
    assert K.TILE == 16 and (K.BLOCK_X, K.BLOCK_Y) == (32, 8) and K.ROW_THREADS == 128
    assert K.ELEMENT_THREADS == 256 and K.REDUCE_THREADS == 128


# -- syncthreads, as the simulator fix (simfix._Barrier) runs it -------------------------------

@cuda.jit
def _rotate_twice(out, stop_at):
    """Each thread writes its slot, waits, reads its neighbour's; twice. Threads at or past
    stop_at return before the first barrier (a ragged block's idle threads do so)."""
    shared = cuda.shared.array(64, np.float32)
    i = cuda.threadIdx.x
    if i >= stop_at:
        return
    shared[i] = i
    cuda.syncthreads()                  # every live slot written before any is read
    v = shared[(i + 1) % stop_at]
    cuda.syncthreads()                  # every read done before a slot is overwritten
    shared[i] = v * 2
    cuda.syncthreads()
    out[cuda.blockIdx.x, i] = shared[(i + 1) % stop_at]


@pytest.mark.parametrize("stop_at", [64, 37])
def test_syncthreads_orders_a_block_and_lets_returned_threads_go(stop_at):
    # Catches a barrier that releases early (a thread reads a slot not yet written: garbage or
    # the NaN left in `out`), or one that waits for returned threads (the launch hangs).
    out = nans(2, 64)
    _rotate_twice[2, 64](out, stop_at)
    got = out.copy_to_host()
    i = np.arange(stop_at)
    want = 2 * ((i + 2) % stop_at)
    np.testing.assert_array_equal(got[:, :stop_at], np.stack([want, want]).astype(np.float32))
    assert np.isnan(got[:, stop_at:]).all()


if simfix.SIMULATOR:     # on a device an out-of-bounds write is not an exception
    @cuda.jit
    def _one_thread_fails(out):
        i = cuda.threadIdx.x
        if i == 5:
            out[out.shape[0] + 10] = 1.0
        cuda.syncthreads()              # the others wait here for a thread that raised
        out[i] = i

    def test_a_thread_that_raises_fails_the_launch_with_its_own_error():
        # Catches a barrier that waits forever for a thread that raised, or a launch that
        # reports another thread's abort instead of the error that caused it.
        with pytest.raises(IndexError, match=r"^tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]: index 74 is out"):
            _one_thread_fails[1, 64](cuda.to_device(np.zeros(64, np.float32)))


# -- the tiled products ---------------------------------------------------------------------

FORMS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("trans_a,trans_b", FORMS, ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 5, 7), (17, 33, 18)])
def test_matmul(trans_a, trans_b, m, k, n):
    # (17, 33, 18): 2 x 2 blocks of 16 x 16, 3 tiles along K, every edge ragged.
    rng = np.random.default_rng(m * 100 + k)
    A = f32(rng, k, m) if trans_a else f32(rng, m, k)
    B = f32(rng, n, k) if trans_b else f32(rng, k, n)
    got, want = nans(m, n), np.full((m, n), np.nan, np.float32)
    K.matmul(cuda.to_device(A), cuda.to_device(B), got, trans_a, trans_b)
    reference.matmul(A, B, want, trans_a, trans_b)
    close(got.copy_to_host(), want)
    a64, b64 = (A.T if trans_a else A).astype(np.float64), (B.T if trans_b else B).astype(np.float64)
    np.testing.assert_allclose(want, a64 @ b64, rtol=1e-4, atol=1e-5)


# Per tile: a 2 x 2 grid of blocks with ragged last rows and columns, and K crossing a strip
# (16 deep) with a ragged last strip. The 128 tile gets 2 x 1 blocks and 2 strips: the
# simulator runs a block's 256 threads as Python threads, about 75 s per product at 2 x 2
# blocks and 3 strips on 2 cores.
TILE_SHAPES = {16: (17, 33, 18), 64: (70, 37, 66), 128: (130, 20, 70)}
# 128: the tile side as tile_for gives it, which names a cuda_gemm variant (BLOCKED_CHOICE).
PRODUCT_KERNELS = [16, 128, *K.BLOCKED_VARIANTS]


def _side(kernel):
    return kernel if isinstance(kernel, int) else K.BLOCKED_VARIANTS[kernel][0]


def test_the_128_tile_is_cuda_gemms():
    assert K._gemm_name(128) == K.BLOCKED_CHOICE[128] and K._gemm_name(128) in G.VARIANTS
    assert K._gemm_name(64) is None and K._gemm_name("b128k16pc") is None


@pytest.mark.parametrize("trans_a,trans_b", FORMS, ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("kernel", PRODUCT_KERNELS)
def test_matmul_each_kernel(kernel, trans_a, trans_b):
    m, k, n = TILE_SHAPES[_side(kernel)]
    rng = np.random.default_rng(_side(kernel) + 2 * trans_a + trans_b)
    A = f32(rng, k, m) if trans_a else f32(rng, m, k)
    B = f32(rng, n, k) if trans_b else f32(rng, k, n)
    got = nans(m, n)
    K.matmul_tiled(cuda.to_device(A), cuda.to_device(B), got, trans_a, trans_b, kernel)
    a64, b64 = (A.T if trans_a else A).astype(np.float64), (B.T if trans_b else B).astype(np.float64)
    np.testing.assert_allclose(got.copy_to_host(), a64 @ b64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", PRODUCT_KERNELS)
def test_dense_forward_each_kernel(kernel):
    n, i, o = TILE_SHAPES[_side(kernel)]
    rng = np.random.default_rng(_side(kernel))
    x, W, b = f32(rng, n, i), f32(rng, i, o), f32(rng, o)
    x[0, 0] = np.nan                       # row 0 stays NaN through the ReLU
    for relu in (False, True):
        got, want = nans(n, o), np.empty((n, o), np.float32)
        K.dense_forward_tiled(cuda.to_device(x), cuda.to_device(W), cuda.to_device(b), got, relu, kernel)
        reference.dense_forward(x, W, b, want, relu)
        np.testing.assert_allclose(got.copy_to_host(), want, rtol=1e-4, atol=1e-4)
        if relu:
            assert np.isnan(want[0]).all() and (want[1:] >= 0).all() and (want[1:] == 0).any()


def test_tile_for_fills_the_multiprocessors_in_the_fewest_waves():
    sms = K._multiprocessors()

    def waves(m, n, side):
        per_sm, unit = K.WAVES[side]
        return -(-K._blocks(m, side) * K._blocks(n, side) // (sms * per_sm)) * unit

    shapes = [(1, 1), (64, 256), (4096, 256), (4096, 4096), (784, 256), (4096, 784), (768, 704),
              (768, 640), (1024, 1024), (1280, 1280), (1536, 1536), (1792, 1792), (2048, 2048)]
    for m, n in shapes:
        for k in (0, K.SPLIT_MIN_K - 1, K.SPLIT_MIN_K, 4096):
            tile = K.tile_for(m, n, k)
            blocks64 = K._blocks(m, 64) * K._blocks(n, 64)
            if blocks64 < sms:
                assert tile == 16        # too few blocks of 64 to give every multiprocessor one
            elif blocks64 < sms * K.WAVES[64][0] and k >= K.SPLIT_MIN_K:
                assert tile == 128       # under one wave of 64s, a long reduction: split-K 128
            else:
                assert tile in (64, 128) and waves(m, n, tile) == min(waves(m, n, 64), waves(m, n, 128))
    if simfix.SIMULATOR:   # an H100's or H200's 132 multiprocessors
        # What the H200 measured (bench/results/gpu/run-6): the faster tile at each size.
        assert [K.tile_for(n, n) for n in (1024, 1280, 1536, 1792, 2048, 4096)] == [64, 128, 64, 64, 128, 128]
        assert K.tile_for(768, 704) == 64 and K.tile_for(768, 640) == 16
        assert K.tile_for(4096, 256) == 64 and K.tile_for(64, 256) == 16
        # Runs 8 and 9 (H100): a 1024 x 1024 product with a long reduction takes the split 128
        # tile; at K = 1024 (the split's host time above b64k16p's device time), or a dense
        # forward (no K: it does not split), the 64 tile.
        assert K.tile_for(1024, 1024, 2048) == 128 and K.tile_for(1024, 1024, 1024) == 64
        assert [K.tile_for(n, n, n) for n in (1280, 1536, 2048, 4096)] == [128, 64, 128, 128]
        assert K.tile_for(768, 704, 4096) == 128 and K.tile_for(768, 640, 4096) == 16


def test_tile_for_splits_only_with_a_splitting_128_tile(monkeypatch):
    monkeypatch.setitem(K.BLOCKED_CHOICE, 128, "g128k8cwr2")      # the same tile, unsplit
    assert K.tile_for(1024, 1024, 4096) == 64


def test_matmul_checks_shapes_before_launching():
    a, b = cuda.device_array((3, 4), np.float32), cuda.device_array((5, 2), np.float32)
    with pytest.raises(ValueError, match="matmul"):
        K.matmul(a, b, cuda.device_array((3, 2), np.float32))
    with pytest.raises(ValueError, match="matmul"):
        K.matmul(a, b, cuda.device_array((4, 2), np.float32), trans_a=True)


def test_matmul_on_a_stream():
    rng = np.random.default_rng(7)
    A, B = f32(rng, 6, 4), f32(rng, 6, 5)
    s = cuda.stream()
    got = cuda.device_array((4, 5), np.float32, stream=s)
    K.matmul(cuda.to_device(A, stream=s), cuda.to_device(B, stream=s), got, True, False, stream=s)
    out = got.copy_to_host(stream=s)
    s.synchronize()
    close(out, A.T @ B)


# -- dense layers ---------------------------------------------------------------------------

# (batch, fan_in, fan_out), crossing a tile in each dimension across the examples.
shapes = st.tuples(st.integers(1, 9), st.integers(1, 20), st.integers(1, 18))
seeds = st.integers(0, 2**32 - 1)


@FEW
@given(shapes, seeds, st.booleans())
def test_dense_forward(shape, seed, relu):
    n, i, o = shape
    rng = np.random.default_rng(seed)
    x, W, b = f32(rng, n, i), f32(rng, i, o), f32(rng, o)
    got, want = nans(n, o), np.full((n, o), np.nan, np.float32)
    K.dense_forward(cuda.to_device(x), cuda.to_device(W), cuda.to_device(b), got, relu)
    reference.dense_forward(x, W, b, want, relu)
    close(got.copy_to_host(), want)


def test_dense_forward_relu_keeps_nan():
    # A diverged run must stay visibly non-finite (the shard rejects it), not be masked to 0.
    out = cuda.device_array((1, 2), np.float32)
    K.dense_forward(cuda.to_device(np.array([[np.nan]], np.float32)),
                    cuda.to_device(np.ones((1, 2), np.float32)),
                    cuda.to_device(np.zeros(2, np.float32)), out, True)
    assert np.isnan(out.copy_to_host()).all()


@FEW
@given(shapes, seeds)
def test_dense_param_grads(shape, seed):
    n, i, o = shape
    rng = np.random.default_rng(seed)
    x, dz = f32(rng, n, i), f32(rng, n, o)
    got = [nans(i, o), nans(o)]
    want = [np.empty((i, o), np.float32), np.empty(o, np.float32)]
    K.dense_param_grads(cuda.to_device(x), cuda.to_device(dz), *got)
    reference.dense_param_grads(x, dz, *want)
    for g, w in zip(got, want):
        close(g.copy_to_host(), w)


@pytest.mark.parametrize("relu", [False, True])
def test_dense_backward(relu):
    n, i, o = 9, 17, 5
    rng = np.random.default_rng(int(relu))
    x, W, dz = f32(rng, n, i), f32(rng, i, o), f32(rng, n, o)
    if relu:
        x = np.maximum(x, 0)   # x is then a ReLU output, as the flag promises
    got = [nans(i, o), nans(o), nans(n, i)]
    want = [np.empty((i, o), np.float32), np.empty(o, np.float32), np.empty((n, i), np.float32)]
    K.dense_backward(cuda.to_device(x), cuda.to_device(W), cuda.to_device(dz), *got, relu)
    reference.dense_backward(x, W, dz, *want, relu)
    for g, w in zip(got, want):
        close(g.copy_to_host(), w)


# -- elementwise, column and row kernels ---------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 1), (9, 35)])
def test_relu_backward(n, k):
    # (9, 35): 2 x 2 blocks of 32 x 8 threads, both edges ragged.
    rng = np.random.default_rng(k)
    a, dx = f32(rng, n, k), f32(rng, n, k)
    a[0, 0] = 0.0   # the kink: a ReLU passes no gradient at 0
    a[-1, -1] = np.nan
    got, want = cuda.to_device(dx), dx.copy()
    K.relu_backward(got, cuda.to_device(a))
    reference.relu_backward(want, a)
    np.testing.assert_array_equal(got.copy_to_host(), want)


@pytest.mark.parametrize("n,k", [(1, 1), (19, 3), (9, 40)])
def test_column_sum(n, k):
    # (19, 3): more rows than BLOCK_Y, so each thread adds several; (9, 40): two column blocks.
    rng = np.random.default_rng(n + k)
    a = f32(rng, n, k)
    got, want = nans(k), np.empty(k, np.float32)
    K.column_sum(cuda.to_device(a), got)
    reference.column_sum(a, want)
    close(got.copy_to_host(), want)


@pytest.mark.parametrize("n", [1, 300])
def test_scaled_sum(n):
    # 300 > REDUCE_THREADS: threads add strided slices before the tree.
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    out = cuda.to_device(np.full(1, np.nan))
    K.scaled_sum(cuda.to_device(values), 0.25, out)
    assert out.copy_to_host()[0] == pytest.approx(reference.scaled_sum(values, 0.25), rel=1e-12)


@pytest.mark.parametrize("n,k,scale", [(1, 2, 1.0), (9, 11, 1.0), (9, 11, 30.0), (130, 3, 5.0)])
def test_softmax_xent(n, k, scale):
    # n = 130 > ROW_THREADS: two blocks of rows, the second ragged.
    rng = np.random.default_rng(n * k)
    logits = f32(rng, n, k) * np.float32(scale)
    y = rng.integers(0, k, n).astype(np.int32)
    got, want = nans(n, k), np.empty((n, k), np.float32)
    rows, rows_want = np.full(n, np.nan), np.empty(n)
    loss = K.softmax_xent(cuda.to_device(logits), cuda.to_device(y), got, rows)
    assert loss == pytest.approx(reference.softmax_xent(logits, y, want, rows_want), rel=RTOL, abs=ATOL)
    close(got.copy_to_host(), want)
    close(rows, rows_want)                        # each row's loss, on the host


def test_softmax_rows_and_reduction_separately():
    # The two kernels behind softmax_xent: per-row terms, then the device-side mean.
    rng = np.random.default_rng(3)
    logits, y = f32(rng, 5, 4), np.array([0, 3, 1, 1, 2], np.int32)
    d, rows, loss = nans(5, 4), nans(5), cuda.to_device(np.full(1, np.nan))
    K.softmax_xent_into(cuda.to_device(logits), cuda.to_device(y), d, rows, loss)
    z = logits.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    close(rows.copy_to_host(), -logp[np.arange(5), y])
    want = np.empty((5, 4), np.float32)
    assert loss.copy_to_host()[0] == pytest.approx(reference.softmax_xent(logits, y, want), rel=1e-6)


def test_softmax_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3, 5e3]], np.float32)
    d = nans(2, 3)
    loss = K.softmax_xent(cuda.to_device(logits), cuda.to_device(np.array([0, 2], np.int32)), d)
    assert loss == pytest.approx(np.log(3) / 2, rel=1e-6)   # row 0 costs 0, row 1 log 3
    np.testing.assert_allclose(d.copy_to_host().sum(axis=1), 0, atol=1e-7)


@pytest.mark.parametrize("label", [-1, 3])
def test_softmax_bad_label_writes_nothing_outside_its_row(label):
    # The kernel cannot raise; it keeps its writes in bounds and makes the loss NaN.
    buf = cuda.to_device(np.full((3, 3), 7.0, np.float32))  # rows 0, 1: dlogits; row 2: a guard
    logits = cuda.to_device(np.zeros((2, 3), np.float32))
    loss = K.softmax_xent(logits, cuda.to_device(np.array([0, label], np.int32)), buf[:2])
    host = buf.copy_to_host()
    assert np.isnan(loss)
    np.testing.assert_array_equal(host[2], 7.0)
    np.testing.assert_allclose(host[1], 1 / 6)   # softmax / n, no one-hot term


@pytest.mark.parametrize("n", [1, 9, 130])
def test_mse(n):
    rng = np.random.default_rng(n)
    pred, y = f32(rng, n, 1), f32(rng, n)
    got, want = nans(n, 1), np.empty((n, 1), np.float32)
    rows, rows_want = np.full(n, np.nan), np.empty(n)
    loss = K.mse(cuda.to_device(pred), cuda.to_device(y), got, rows)
    assert loss == pytest.approx(reference.mse(pred, y, want, rows_want), rel=RTOL)
    close(got.copy_to_host(), want)
    close(rows, rows_want)                        # half the squared error, as the twin's


def test_mse_needs_one_column():
    with pytest.raises(ValueError, match="one column"):
        K.mse(*(cuda.device_array(s, np.float32) for s in ((2, 2), (2,), (2, 2))))


# -- layer kernels: images (N, H, W, C) ----------------------------------------------------

# (n, h, w, c, f, kh, kw, stride_h, stride_w, padding): a plain 'valid' layer, 'same' with
# strides (a pad before), and a kernel as large as the input. Small: each element of dw is a
# block of REDUCE_THREADS simulated threads (about 2 s each on two busy cores).
GEOMETRIES = [(2, 5, 4, 1, 2, 2, 2, 1, 1, "valid"), (1, 5, 6, 2, 1, 2, 2, 2, 3, "same"),
              (2, 2, 3, 1, 2, 2, 3, 1, 1, "valid")]


def _placement(h, w, kh, kw, sh, sw, padding):
    oh, pt = conv_output(h, kh, sh, padding)
    ow, pl = conv_output(w, kw, sw, padding)
    return (oh, ow), (sh, sw, pt, pl)


@pytest.mark.parametrize("g", GEOMETRIES, ids=lambda g: g[-1])
def test_conv2d(g):
    n, h, w, c, f, kh, kw, sh, sw, padding = g
    (oh, ow), place = _placement(h, w, kh, kw, sh, sw, padding)
    rng = np.random.default_rng(h * w)
    x, wt, b, dy = f32(rng, n, h, w, c), f32(rng, kh, kw, c, f), f32(rng, f), f32(rng, n, oh, ow, f)
    got, want = nans(n, oh, ow, f), np.empty((n, oh, ow, f), np.float32)
    K.conv2d_forward(cuda.to_device(x), cuda.to_device(wt), cuda.to_device(b), got, *place, True)
    reference.conv2d_forward(x, wt, b, want, *place, True)
    close(got.copy_to_host(), want)
    first_layer = kh == h and kw == w   # the last geometry: no dx, as a first layer calls it
    grads = [None if first_layer else nans(*x.shape), nans(*wt.shape), nans(f)]
    wants = [np.empty_like(a) for a in (x, wt, b)]
    K.conv2d_backward(cuda.to_device(x), cuda.to_device(wt), cuda.to_device(dy), *grads, *place)
    reference.conv2d_backward(x, wt, dy, *wants, *place)
    for a, e in zip(grads, wants):
        if a is not None:
            np.testing.assert_allclose(a.copy_to_host(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("g", GEOMETRIES, ids=lambda g: g[-1])
def test_pooling(g):
    n, h, w, c, _, kh, kw, sh, sw, padding = g
    (oh, ow), place = _placement(h, w, kh, kw, sh, sw, padding)
    rng = np.random.default_rng(h + w)
    x, dy = f32(rng, n, h, w, c), f32(rng, n, oh, ow, c)
    x[0, 0, 0, 0] = x[0, -1, -1, 0]   # a tie
    dx_, dy_ = cuda.to_device(x), cuda.to_device(dy)
    out, arg = nans(n, oh, ow, c), cuda.to_device(np.full((n, oh, ow, c), -7, np.int32))
    want, want_arg = np.empty((n, oh, ow, c), np.float32), np.empty((n, oh, ow, c), np.int32)
    K.maxpool2d_forward(dx_, out, arg, kh, kw, *place)
    reference.maxpool2d_forward(x, want, want_arg, kh, kw, *place)
    np.testing.assert_array_equal(out.copy_to_host(), want)
    np.testing.assert_array_equal(arg.copy_to_host(), want_arg)
    got_dx, want_dx = nans(*x.shape), np.empty_like(x)
    K.maxpool2d_backward(dy_, arg, got_dx)
    reference.maxpool2d_backward(dy, want_arg, want_dx)
    close(got_dx.copy_to_host(), want_dx)
    K.avgpool2d_forward(dx_, out, kh, kw, *place)
    reference.avgpool2d_forward(x, want, kh, kw, *place)
    close(out.copy_to_host(), want)
    K.avgpool2d_backward(dy_, got_dx, kh, kw, *place)
    reference.avgpool2d_backward(dy, want_dx, kh, kw, *place)
    close(got_dx.copy_to_host(), want_dx)


@st.composite
def image_geometry(draw, max_hw: int = 6, max_channels: int = 3):
    """(n, h, w, c, f, kh, kw, stride_h, stride_w, padding) with kernels up to the input."""
    h, w = draw(st.integers(1, max_hw)), draw(st.integers(1, max_hw))
    channels = st.integers(1, max_channels)
    return (draw(st.integers(1, 2)), h, w, draw(channels), draw(channels),
            draw(st.integers(1, h)), draw(st.integers(1, w)), draw(st.integers(1, 3)),
            draw(st.integers(1, 3)), draw(st.sampled_from(["valid", "same"])))


@FEW
@given(image_geometry(), seeds)
def test_image_forwards_and_input_gradients(g, seed):
    # Over random geometry, the kernels with one thread per element (cheap to simulate); the
    # weight gradient's block reductions run in test_conv2d above.
    n, h, w, c, f, kh, kw, sh, sw, padding = g
    (oh, ow), place = _placement(h, w, kh, kw, sh, sw, padding)
    rng = np.random.default_rng(seed)
    x, wt, b = f32(rng, n, h, w, c), f32(rng, kh, kw, c, f), f32(rng, f)
    dy = f32(rng, n, oh, ow, f)
    got, want = nans(n, oh, ow, f), np.empty((n, oh, ow, f), np.float32)
    K.conv2d_forward(cuda.to_device(x), cuda.to_device(wt), cuda.to_device(b), got, *place, False)
    reference.conv2d_forward(x, wt, b, want, *place, False)
    close(got.copy_to_host(), want)
    got_dx, want_dx = nans(*x.shape), np.empty_like(x)
    K.conv2d_dx_kernel[K._blocks(x.size, K.ELEMENT_THREADS), K.ELEMENT_THREADS](
        cuda.to_device(wt), cuda.to_device(dy), got_dx, *place)
    reference.conv2d_backward(x, wt, dy, want_dx, np.empty_like(wt), np.empty_like(b), *place)
    np.testing.assert_allclose(got_dx.copy_to_host(), want_dx, rtol=1e-4, atol=1e-5)
    pooled, want_pool = nans(n, oh, ow, c), np.empty((n, oh, ow, c), np.float32)
    K.avgpool2d_forward(cuda.to_device(x), pooled, kh, kw, *place)
    reference.avgpool2d_forward(x, want_pool, kh, kw, *place)
    close(pooled.copy_to_host(), want_pool)


# -- layer kernels: elementwise, dropout, embedding, binary cross-entropy -------------------

@pytest.mark.parametrize("kind", ["relu", "sigmoid", "tanh", "linear"])
def test_activations(kind):
    # 3 x 10 x 10 = 300 elements: two blocks of ELEMENT_THREADS, the second ragged.
    rng = np.random.default_rng(len(kind))
    x, dy = f32(rng, 3, 10, 10) * 4, f32(rng, 3, 10, 10)
    got, want = nans(*x.shape), np.empty_like(x)
    K.activation_forward(kind, cuda.to_device(x), got)
    reference.activation_forward(kind, x, want)
    close(got.copy_to_host(), want)
    got_dx, want_dx = nans(*x.shape), np.empty_like(x)
    K.activation_backward(kind, cuda.to_device(want), cuda.to_device(dy), got_dx)
    reference.activation_backward(kind, want, dy, want_dx)
    close(got_dx.copy_to_host(), want_dx)


def test_unknown_activation_is_refused_before_launch():
    a = cuda.device_array(3, np.float32)
    with pytest.raises(ValueError, match="activation: unknown kind 'gelu'"):
        K.activation_forward("gelu", a, a)


# The simulator runs the kernel's uint64 arithmetic as NumPy scalars, which warn on the
# wraparound that splitmix64 is built on (a GPU wraps silently, as the CPU kernel does).
@pytest.mark.filterwarnings("ignore:overflow encountered in scalar:RuntimeWarning")
@pytest.mark.parametrize("rate,seed", [(0.0, 1), (0.3, 2**63 - 1), (0.75, 12345)])
def test_dropout_same_mask_as_every_backend(rate, seed):
    x, dy = f32(np.random.default_rng(seed % 97), 5, 61), f32(np.random.default_rng(1), 5, 61)
    out, mask = nans(5, 61), nans(5, 61)
    want_out, want_mask = np.empty_like(x), np.empty_like(x)
    K.dropout_forward(cuda.to_device(x), out, mask, rate, seed)
    reference.dropout_forward(x, want_out, want_mask, rate, seed)
    np.testing.assert_array_equal(mask.copy_to_host(), want_mask)
    np.testing.assert_array_equal(out.copy_to_host(), want_out)
    dx = nans(5, 61)
    K.dropout_backward(cuda.to_device(dy), mask, dx)
    np.testing.assert_array_equal(dx.copy_to_host(), dy * want_mask)


def test_dropout_checks_rate_and_seed_on_the_host():
    a = cuda.device_array(3, np.float32)
    with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\), got 1.0"):
        K.dropout_forward(a, a, a, 1.0, 0)
    with pytest.raises(ValueError, match=r"dropout: seed must be in \[0, 2\*\*63\), got -1"):
        K.dropout_forward(a, a, a, 0.5, -1)


def test_embedding():
    rng = np.random.default_rng(4)
    ids, table, dy = np.array([[0, 3, 3], [1, -1, 0]]), f32(rng, 5, 4), f32(rng, 2, 3, 4)   # -1: padding
    got, want = nans(2, 3, 4), np.empty((2, 3, 4), np.float32)
    K.embedding_forward(cuda.to_device(ids), cuda.to_device(table), got)
    reference.embedding_forward(ids, table, want)
    np.testing.assert_array_equal(got.copy_to_host(), want)
    assert not want[1, 1].any()                                              # padding: zeros
    got_d, want_d = nans(5, 4), np.empty_like(table)
    K.embedding_backward(cuda.to_device(ids), cuda.to_device(dy), got_d)   # repeated ids add
    reference.embedding_backward(ids, dy, want_d)
    close(got_d.copy_to_host(), want_d)


def test_embedding_bad_id_touches_nothing_outside_the_table():
    # The kernels cannot raise: a bad id reads a NaN row and its gradient is dropped.
    table, ids = np.ones((3, 2), np.float32), np.array([[0, 3]])
    out = nans(1, 2, 2)
    K.embedding_forward(cuda.to_device(ids), cuda.to_device(table), out)
    host = out.copy_to_host()
    assert (host[0, 0] == 1).all() and np.isnan(host[0, 1]).all()
    buf = cuda.to_device(np.full((4, 2), 7.0, np.float32))   # rows 0-2: dtable; row 3: a guard
    K.embedding_backward(cuda.to_device(ids), cuda.to_device(np.ones((1, 2, 2), np.float32)), buf[:3])
    np.testing.assert_array_equal(buf.copy_to_host(), [[1, 1], [0, 0], [0, 0], [7, 7]])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_embedding(combiner):
    """Every combiner, weighted, with padding (-1), an id repeated in a list and an empty list:
    the device's pooled lists and their gradient (atomic adds) equal the twin's."""
    rng = np.random.default_rng(6)
    ids = np.array([[0, 3, 3, -1], [-1, -1, -1, -1], [1, 2, 0, 4]])
    weights, table, dy = rng.uniform(0.2, 2, ids.shape).astype(np.float32), f32(rng, 5, 3), f32(rng, 3, 3)
    code = reference.COMBINERS[combiner]
    got, want = nans(3, 3), np.empty((3, 3), np.float32)
    K.pooled_embedding_forward(cuda.to_device(ids), cuda.to_device(weights), cuda.to_device(table), code, got)
    reference.pooled_embedding_forward(ids, weights, table, code, want)
    close(got.copy_to_host(), want)
    assert not want[1].any()
    got_d, want_d = nans(5, 3), np.empty_like(table)
    K.pooled_embedding_backward(cuda.to_device(ids), cuda.to_device(weights), cuda.to_device(dy), code, got_d)
    reference.pooled_embedding_backward(ids, weights, dy, code, want_d)
    close(got_d.copy_to_host(), want_d)


def test_pooled_embedding_bad_id_touches_nothing_outside_the_table():
    table, ids, w = np.ones((3, 2), np.float32), np.array([[0, 3]]), np.ones((1, 2), np.float32)
    out = nans(1, 2)
    K.pooled_embedding_forward(cuda.to_device(ids), cuda.to_device(w), cuda.to_device(table), 0, out)
    assert np.isnan(out.copy_to_host()).all()
    buf = cuda.to_device(np.full((4, 2), 7.0, np.float32))   # rows 0-2: dtable; row 3: a guard
    dy = cuda.to_device(np.ones((1, 2), np.float32))
    K.pooled_embedding_backward(cuda.to_device(ids), cuda.to_device(w), dy, 0, buf[:3])
    np.testing.assert_array_equal(buf.copy_to_host(), [[1, 1], [0, 0], [0, 0], [7, 7]])


@pytest.mark.parametrize("n,column", [(1, True), (130, True), (9, False)])
def test_sigmoid_bce(n, column):
    # n = 130 > ROW_THREADS: two blocks of rows; logits as (n, 1) and as (n,).
    rng = np.random.default_rng(n)
    z = f32(rng, n, 1) * 20
    z = z if column else z[:, 0].copy()
    y = (rng.random(n) < 0.5).astype(np.float32)
    got, want = nans(*z.shape), np.empty_like(z)
    rows, rows_want = np.full(n, np.nan), np.empty(n)
    loss = K.sigmoid_bce(cuda.to_device(z), cuda.to_device(y), got, rows)
    assert loss == pytest.approx(reference.sigmoid_bce(z, y, want, rows_want), rel=1e-5, abs=1e-6)
    close(got.copy_to_host(), want)
    np.testing.assert_allclose(rows, rows_want, rtol=1e-5, atol=1e-6)


def test_low_occupancy_warnings_stay_out_of_the_logs():
    # On a GPU, numba-cuda wraps this message in terminal bold codes; a filter that matched only
    # the plain text let every small launch print it into every worker's log.
    import warnings

    from numba.core.errors import NumbaPerformanceWarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")     # pytest records every warning: start from that
        K.quiet_low_occupancy()
        warnings.warn(NumbaPerformanceWarning("\x1b[1mGrid size 8 will likely result in GPU "
                                              "under-utilization due to low occupancy.\x1b[0m"))
        warnings.warn(NumbaPerformanceWarning("Grid size 1 will likely result in GPU under-utilization"))
        warnings.warn(NumbaPerformanceWarning("another performance warning"))
    # On a GPU numba-cuda wraps every message of the class in bold codes: compare the text.
    assert [re.sub(r"\x1b\[\d+m", "", str(w.message)) for w in seen] == ["another performance warning"]


def test_copy_device_to_device():
    x = f32(np.random.default_rng(4), 3, 5, 2)
    out = nans(3, 5, 2)
    K.copy(cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), x)
    with pytest.raises(ValueError, match="copy"):
        K.copy(cuda.to_device(x), nans(5, 3, 2))
