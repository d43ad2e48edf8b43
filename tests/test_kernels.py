"""The numba model kernels against their NumPy twins, and the twins against the math."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba.core.registry import CPUDispatcher

from pserver.errors import ConfigError
from pserver.kernels import BACKENDS, KERNELS, cpu, get_backend, reference

FAST = settings(max_examples=25, deadline=None)
RTOL, ATOL = 1e-5, 1e-5

# (batch, fan_in, fan_out): batch 1 and odd sizes included; small so the test stays quick.
shapes = st.tuples(st.integers(1, 9), st.integers(1, 13), st.integers(1, 11))
seeds = st.integers(0, 2**32 - 1)


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# -- the two modules are one API ----------------------------------------------------------

@pytest.mark.parametrize("name", KERNELS)
def test_same_api_and_compiled(name):
    compiled, twin = getattr(cpu, name), getattr(reference, name)
    assert isinstance(compiled, CPUDispatcher)
    assert inspect.signature(compiled.py_func) == inspect.signature(twin)
    opts = compiled.targetoptions
    assert opts.get("nogil") and not opts.get("parallel")
    assert type(compiled._cache).__name__ == "FunctionCache"   # cache=True


def test_get_backend():
    assert get_backend("cpu") is cpu and get_backend("reference") is reference
    assert set(BACKENDS) == {"cpu", "reference"}
    with pytest.raises(ConfigError, match="--device: unknown kernel backend 'gpu'"):
        get_backend("gpu")


# -- compiled == twin (the dispatcher itself is called, never py_func) ----------------------

@FAST
@given(shapes, seeds, st.booleans())
def test_dense_forward(shape, seed, relu):
    n, i, o = shape
    rng = np.random.default_rng(seed)
    x, W, b = f32(rng, n, i), f32(rng, i, o), f32(rng, o)
    out_c, out_r = np.full((n, o), np.nan, np.float32), np.full((n, o), np.nan, np.float32)
    cpu.dense_forward(x, W, b, out_c, relu)
    reference.dense_forward(x, W, b, out_r, relu)
    close(out_c, out_r)
    close(out_r, np.maximum(x @ W + b, 0) if relu else x @ W + b)
    assert cpu.dense_forward.signatures  # it really ran compiled


@FAST
@given(shapes, seeds)
def test_dense_param_grads(shape, seed):
    n, i, o = shape
    rng = np.random.default_rng(seed)
    x, dz = f32(rng, n, i), f32(rng, n, o)
    got = [np.full((i, o), np.nan, np.float32), np.full(o, np.nan, np.float32)]
    want = [np.full((i, o), np.nan, np.float32), np.full(o, np.nan, np.float32)]
    cpu.dense_param_grads(x, dz, *got)
    reference.dense_param_grads(x, dz, *want)
    for g, w in zip(got, want):
        close(g, w)
    close(want[0], x.T.astype(np.float64) @ dz)
    close(want[1], dz.sum(axis=0))


@FAST
@given(shapes, seeds, st.booleans())
def test_dense_backward(shape, seed, relu):
    n, i, o = shape
    rng = np.random.default_rng(seed)
    x, W, dz = f32(rng, n, i), f32(rng, i, o), f32(rng, n, o)
    if relu:
        x = np.maximum(x, 0)  # x is then a ReLU output, as the flag promises
    bufs = {k: [np.full(s, np.nan, np.float32) for s in ((i, o), (o,), (n, i))]
            for k in ("cpu", "ref")}
    cpu.dense_backward(x, W, dz, *bufs["cpu"], relu)
    reference.dense_backward(x, W, dz, *bufs["ref"], relu)
    for g, w in zip(bufs["cpu"], bufs["ref"]):
        close(g, w)
    dx = dz @ W.T
    close(bufs["ref"][2], dx * (x > 0) if relu else dx)


@FAST
@given(st.integers(1, 9), st.integers(1, 11), seeds)
def test_relu_backward(n, k, seed):
    rng = np.random.default_rng(seed)
    a, dx = f32(rng, n, k), f32(rng, n, k)
    a[0, 0] = 0.0  # the kink: a ReLU passes no gradient at 0
    got, want = dx.copy(), dx.copy()
    cpu.relu_backward(got, a)
    reference.relu_backward(want, a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want, np.where(a > 0, dx, 0))


@FAST
@given(st.integers(1, 9), st.integers(2, 11), seeds, st.sampled_from([1.0, 30.0]))
def test_softmax_xent(n, k, seed, scale):
    rng = np.random.default_rng(seed)
    logits = f32(rng, n, k) * np.float32(scale)
    y = rng.integers(0, k, n).astype(np.int32)
    d_c, d_r = np.full((n, k), np.nan, np.float32), np.full((n, k), np.nan, np.float32)
    rows_c, rows_r = np.full(n, np.nan), np.full(n, np.nan)
    loss_c = cpu.softmax_xent(logits, y, d_c, rows_c)
    loss_r = reference.softmax_xent(logits, y, d_r, rows_r)
    assert loss_c == pytest.approx(loss_r, rel=RTOL, abs=ATOL)
    close(d_c, d_r)
    close(rows_c, rows_r)                       # each row's loss, whose mean is the loss
    assert rows_c.mean() == pytest.approx(loss_c, rel=1e-12, abs=1e-12)
    # The twin against the textbook formula, in float64.
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert loss_r == pytest.approx(-np.mean(np.log(p[np.arange(n), y])), rel=1e-5, abs=1e-6)
    close(d_r, (p - np.eye(k)[y]) / n)


@FAST
@given(st.integers(1, 9), seeds)
def test_mse(n, seed):
    rng = np.random.default_rng(seed)
    pred, y = f32(rng, n, 1), f32(rng, n)
    d_c, d_r = np.full((n, 1), np.nan, np.float32), np.full((n, 1), np.nan, np.float32)
    rows_c, rows_r = np.full(n, np.nan), np.full(n, np.nan)
    loss_c, loss_r = cpu.mse(pred, y, d_c, rows_c), reference.mse(pred, y, d_r, rows_r)
    assert loss_c == pytest.approx(loss_r, rel=RTOL)
    close(d_c, d_r)
    close(rows_c, rows_r)
    assert rows_c.mean() == pytest.approx(loss_c, rel=1e-12, abs=1e-12)
    r = pred[:, 0].astype(np.float64) - y
    assert loss_r == pytest.approx(0.5 * np.mean(r ** 2), rel=1e-6)
    close(d_r[:, 0], r / n)


# -- edge cases -----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_softmax_is_stable_for_huge_logits(k):
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3, 5e3]], np.float32)
    y = np.array([0, 2], np.int32)
    d = np.empty_like(logits)
    loss = k.softmax_xent(logits, y, d)
    assert np.isfinite(loss) and np.isfinite(d).all()
    assert loss == pytest.approx(np.log(3) / 2, rel=1e-6)  # row 0 costs 0, row 1 log 3
    np.testing.assert_allclose(d.sum(axis=1), 0, atol=1e-7)  # softmax - onehot sums to 0


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("label", [-1, 3])
def test_softmax_rejects_labels_out_of_range(k, label):
    # The compiled kernel has no bounds checks of its own: this guard is what stops a write
    # outside dlogits.
    logits, d = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="label out of range"):
        k.softmax_xent(logits, np.array([0, label], np.int32), d)


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_mse_needs_one_column(k):
    with pytest.raises(ValueError, match="one column"):
        k.mse(np.zeros((2, 2), np.float32), np.zeros(2, np.float32), np.zeros((2, 2), np.float32))


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_relu_forward_keeps_nan(k):
    # A diverged run must stay visibly non-finite (the shard rejects it), not be masked to 0.
    out = np.empty((1, 2), np.float32)
    k.dense_forward(np.array([[np.nan]], np.float32), np.ones((1, 2), np.float32),
                    np.zeros(2, np.float32), out, True)
    assert np.isnan(out).all()


def test_products_at_mlp_size():
    # The transposed operands (x.T, W.T) at the real layer size, where gemm takes its
    # blocked paths rather than the small-matrix ones the hypothesis shapes hit.
    rng = np.random.default_rng(0)
    x, W, dz = f32(rng, 64, 784), f32(rng, 784, 256), f32(rng, 64, 256)
    got = [np.empty(s, np.float32) for s in ((784, 256), (256,), (64, 784))]
    cpu.dense_backward(x, W, dz, *got, False)
    x64, W64, dz64 = (a.astype(np.float64) for a in (x, W, dz))
    np.testing.assert_allclose(got[0], x64.T @ dz64, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got[2], dz64 @ W64.T, rtol=1e-4, atol=1e-3)


@FAST
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), seeds)
@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_copy_is_the_identity_of_any_shape(k, dims, seed):
    x = f32(np.random.default_rng(seed), *dims)
    x.reshape(-1)[0] = np.nan
    out = np.full_like(x, 7.0)
    k.copy(x, out)
    np.testing.assert_array_equal(out, x)   # NaN in the same place, every bit otherwise


@pytest.mark.parametrize("k", [cpu, reference], ids=["cpu", "reference"])
def test_copy_refuses_another_shape(k):
    out = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="copy: x and out differ in shape"):
        k.copy(np.ones((3, 2), np.float32), out)
    assert not out.any()
