"""Every CUDA kernel against its NumPy twin (pserver.kernels.reference), on small shapes.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (see there why).
The simulator runs one Python thread per CUDA thread, about 0.1-0.3 s per block of 256, so the
shapes are small; they still cross the tile sizes (TILE = 16 for the products, 32 x 8 for the
elementwise and column kernels, 128 rows per block) so ragged edges are exercised.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from pserver.kernels import KERNELS, get_backend, reference
from pserver.kernels import cuda as K
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
    loss = K.softmax_xent(cuda.to_device(logits), cuda.to_device(y), got)
    assert loss == pytest.approx(reference.softmax_xent(logits, y, want), rel=RTOL, abs=ATOL)
    close(got.copy_to_host(), want)


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
    loss = K.mse(cuda.to_device(pred), cuda.to_device(y), got)
    assert loss == pytest.approx(reference.mse(pred, y, want), rel=RTOL)
    close(got.copy_to_host(), want)


def test_mse_needs_one_column():
    with pytest.raises(ValueError, match="one column"):
        K.mse(*(cuda.device_array(s, np.float32) for s in ((2, 2), (2,), (2, 2))))
