"""The graph's CUDA kernels (pserver.kernels.cuda_graph) against their NumPy twins, and graph
models (a toy ResNet, two branches concatenated, a traced layer of ops) on the CUDA model
against the CPU model.

Run by tests/test_kernels_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (see there why).
Shapes are small (the simulator runs a Python thread per CUDA thread) but cross a block of
256 threads where it matters (elementwise, sum_to) so a ragged last block is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from pserver.kernels import GRAPH_KERNELS, cpu, reference
from pserver.kernels import cuda as K
from pserver.kernels import cuda_graph as G
from pserver.ops import core
from tests.cuda_sim import simfix  # a device or the simulator; fixes the latter

RTOL, ATOL = 1e-5, 1e-6


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nans(*shape, dtype=np.float32):
    """A device buffer of NaN (or -1): an element a kernel forgets to write fails."""
    return cuda.to_device(np.full(shape, np.nan if dtype == np.float32 else -1, dtype))


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_every_backend_has_the_graph_kernels():
    for name in GRAPH_KERNELS:
        assert getattr(cpu, name) is getattr(reference, name)     # memory-bound: NumPy's
        assert getattr(K, name) is getattr(G, name)


# -- element-wise, with broadcasting, and the VJPs -----------------------------------------------

# Broadcast on both sides (105 elements), and along the batch over two blocks (300 elements).
SHAPES = [((3, 1, 5), (1, 7, 1)), ((3, 4, 25), (25,))]


@pytest.mark.parametrize("kind", reference.ELEMENTWISE)
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_elementwise_and_its_vjp_equal_the_ops(kind, sa, sb):
    # Catches a wrong broadcast stride (a row of b read where its column should be), a
    # gradient not summed back to a broadcast input's shape, or the tie rule of max and min.
    rng = np.random.default_rng(len(sa) + len(sb))
    a, b = f32(rng, *sa), f32(rng, *sb)
    if kind == "divide":
        b = np.abs(b) + 0.5
    if kind in ("maximum", "minimum"):
        b.reshape(-1)[:2] = a.reshape(-1)[0]       # ties: the gradient goes to a
        a.reshape(-1)[0] = b.reshape(-1)[0]
    op = core.OPS[kind]
    want = op.forward(a, b)
    da, db, out = cuda.to_device(a), cuda.to_device(b), nans(*want.shape)
    K.elementwise(kind, da, db, out)
    close(out.copy_to_host(), want)
    g = f32(rng, *want.shape)
    wants = op.vjp(g, want, a, b)
    for which, w in enumerate(wants):
        dx = nans(*w.shape)
        G.elementwise_grad(kind, which, cuda.to_device(g), da, db, out, dx)
        close(dx.copy_to_host(), w)


def test_elementwise_in_place_and_scale_by():
    rng = np.random.default_rng(1)
    a, b = f32(rng, 4, 70), f32(rng, 4, 70)
    da = cuda.to_device(a)
    K.elementwise("add", da, cuda.to_device(b), da)         # out is a: Add's running sum
    close(da.copy_to_host(), a + b)
    out = nans(4, 70)
    K.scale_by(da, -0.5, out)
    close(out.copy_to_host(), (a + b) * np.float32(-0.5))


@pytest.mark.parametrize("shape,target,scale", [((3, 130), (1, 130), 1.0), ((3, 4, 5), (3, 1, 5), 0.25),
                                                 ((2, 3, 4), (4,), 1.0), ((5, 6), (5, 6), 2.0)])
def test_sum_to_and_broadcast_to_equal_numpy(shape, target, scale):
    # Catches a sum over the wrong axes, or a summed axis decoded in the wrong order.
    rng = np.random.default_rng(2)
    g = f32(rng, *shape)
    out = nans(*target)
    G.sum_to(cuda.to_device(g), out, scale)
    close(out.copy_to_host(), core.unbroadcast(g, target) * np.float32(scale))
    x = f32(rng, *target)
    back = nans(*shape)
    G.broadcast_to(cuda.to_device(x), back, scale)
    close(back.copy_to_host(), np.broadcast_to(x * np.float32(scale), shape))


# -- the merge layers' max/min, concatenation, global pooling ---------------------------------

@pytest.mark.parametrize("kind", ["max", "min"])
def test_extreme_forward_and_select_grad_equal_the_twins(kind):
    rng = np.random.default_rng(3)
    xs = [f32(rng, 3, 5, 4) for _ in range(3)]
    xs[2][0, 0] = xs[0][0, 0]                       # a tie: the first input keeps it
    want_out, want_which = np.empty_like(xs[0]), np.empty(xs[0].shape, np.int32)
    reference.extreme_forward(kind, xs, want_out, want_which)
    out, which = nans(3, 5, 4), nans(3, 5, 4, dtype=np.int32)
    K.extreme_forward(kind, [cuda.to_device(x) for x in xs], out, which)
    close(out.copy_to_host(), want_out)
    np.testing.assert_array_equal(which.copy_to_host(), want_which)
    dy = f32(rng, 3, 5, 4)
    for i in range(3):
        want, dx = np.empty_like(dy), nans(3, 5, 4)
        reference.select_grad(dy, want_which, i, want)
        K.select_grad(cuda.to_device(dy), which, i, dx)
        close(dx.copy_to_host(), want)


def test_columns_into_and_from_equal_the_twins():
    # Catches an offset applied to the wrong array, or rows and columns swapped.
    rng = np.random.default_rng(4)
    parts = [f32(rng, 5, w) for w in (3, 1, 4)]
    want = np.concatenate(parts, axis=1)
    whole, start = nans(5, 8), 0
    for p in parts:
        K.columns_into(cuda.to_device(p), whole, start)
        start += p.shape[1]
    close(whole.copy_to_host(), want)
    piece = nans(5, 4)
    K.columns_from(whole, 4, piece)
    twin = np.empty((5, 4), np.float32)
    reference.columns_from(want, 4, twin)
    close(piece.copy_to_host(), twin)


def test_global_pooling_equals_the_twins():
    rng = np.random.default_rng(5)
    x, dy = f32(rng, 3, 7, 4), f32(rng, 3, 4)
    x[1, 5, 2] = x[1, 2, 2] = x[1].max() + 1       # a tie: the first position takes the gradient
    want = {n: np.empty(s, np.float32) for n, s in (("avg", (3, 4)), ("max", (3, 4)), ("davg", x.shape),
                                                      ("dmax", x.shape))}
    arg = np.empty((3, 4), np.int32)
    reference.global_avgpool_forward(x, want["avg"])
    reference.global_maxpool_forward(x, want["max"], arg)
    reference.global_avgpool_backward(dy, want["davg"])
    reference.global_maxpool_backward(dy, arg, want["dmax"])
    dx, ddy = cuda.to_device(x), cuda.to_device(dy)
    avg, mx, darg = nans(3, 4), nans(3, 4), nans(3, 4, dtype=np.int32)
    davg, dmax = nans(*x.shape), nans(*x.shape)
    K.global_avgpool_forward(dx, avg)
    K.global_maxpool_forward(dx, mx, darg)
    K.global_avgpool_backward(ddy, davg)
    K.global_maxpool_backward(ddy, darg, dmax)
    for name, got in (("avg", avg), ("max", mx), ("davg", davg), ("dmax", dmax)):
        close(got.copy_to_host(), want[name])
    np.testing.assert_array_equal(darg.copy_to_host(), arg)


# -- graph models: the CUDA model equals the CPU model ------------------------------------------

def toy_resnet():
    """keras.io's toy ResNet (bench/keras_io/toy_resnet.py), narrower, on 6x6 images and with one
    residual block (each product costs seconds in the simulator): a convolution's output that
    fans out to the next and to the add, global average pooling, dropout."""
    from pserver.keras import Input, layers
    inputs = Input(shape=(6, 6, 1))
    x = layers.Conv2D(2, 3, activation="relu")(inputs)
    block_1 = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(2, 3, activation="relu", padding="same")(block_1)
    block_2 = layers.add([x, block_1])
    x = layers.GlobalAveragePooling2D()(block_2)
    x = layers.Dropout(0.5)(x)
    return inputs, layers.Dense(3)(x)


def two_branches():
    """Two branches (a user's layer of ops with its own weights, keras.io's Linear, and an
    activation of it) concatenated, with every other merge, and a second input: max pooling
    over a sequence and a Lambda of ops (broadcast arithmetic, a reduction, a constant). One
    Dense layer: each product costs seconds in the simulator."""
    from pserver.keras import Input, layers, ops

    class Linear(layers.Layer):           # keras.io's "Making new layers and models via subclassing"
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], 5), initializer="random_normal")
            self.b = self.add_weight(shape=(5,), initializer="random_normal")

        def call(self, inputs):
            return ops.tanh(ops.matmul(inputs, self.w) + self.b)

    grid, seq = Input(shape=(3, 4)), Input(shape=(4, 3))
    a = Linear()(layers.Reshape((12,))(grid))
    b = layers.Activation("sigmoid")(a)
    merged = layers.Concatenate()([a, b, layers.Subtract()([a, b])])
    extremes = layers.concatenate([layers.Maximum()([a, b]), layers.Minimum()([a, b]),
                                   layers.Average()([a, b]), layers.Multiply()([a, b])])
    pooled = layers.GlobalMaxPooling1D()(seq)
    side = layers.Lambda(lambda t: ops.relu(t - ops.mean(t, axis=-1, keepdims=True)))(pooled)
    x = layers.concatenate([merged, extremes, layers.Activation("tanh")(side) * 2.0])
    return [grid, seq], layers.Dense(3)(x)


@pytest.mark.parametrize("build,shapes", [(toy_resnet, [(6, 6, 1)]), (two_branches, [(3, 4), (4, 3)])],
                         ids=["toy_resnet", "two_branches"])
def test_a_graph_on_cuda_equals_the_cpu_model(build, shapes):
    # Catches any kernel or VJP of the graph's layers and ops that differs from the CPU's, a
    # fan-out whose gradients are not summed, a constant never uploaded, or inputs unpacked
    # from the wrong columns.
    from pserver.models import on_device
    from pserver.models.cuda import CudaModel
    from pserver.models.functional import Functional
    cpu_m = Functional(*build()).build()
    gpu_m = on_device(Functional(*build()), "cuda")
    assert isinstance(gpu_m, CudaModel) and gpu_m.layout == cpu_m.layout
    rng = np.random.default_rng(6)
    w = (rng.standard_normal(cpu_m.layout.total) * 0.5).astype(np.float32)
    xs, y = [f32(rng, 3, *shape) for shape in shapes], rng.integers(0, 3, 3).astype(np.int32)
    x = xs[0] if len(xs) == 1 else xs
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    if len(xs) > 1:
        # A step on other data first: the compared step then runs in the ops' reused buffers
        # (pserver.models.cuda_ops.DeviceOps.begin), so a buffer reused out of turn shows.
        gpu_m.loss_and_grad(w, [x[::-1] for x in xs], y, g_g, seed=3)
    loss_c = cpu_m.loss_and_grad(w, x, y, g_c, seed=3)
    loss_g = gpu_m.loss_and_grad(w, x, y, g_g, seed=3)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(g_g) > w.size // 2
    if len(xs) > 1 and not simfix.SIMULATOR:
        # On a GPU that second step was captured as the batch size's step graph and launched
        # (pserver.models.cuda.StepGraph: the Lambda's broadcast gradient allocates scratch while
        # capturing, which the graph keeps); a third step on other data replays it.
        from pserver.models.cuda import StepGraph
        assert isinstance(gpu_m._state()._batches[3].step_graph, StepGraph)
        x3 = [f32(rng, 3, *shape) for shape in shapes]
        loss_c = cpu_m.loss_and_grad(w, x3, y, g_c, seed=4)
        loss_g = gpu_m.loss_and_grad(w, x3, y, g_g, seed=4)
        assert loss_g == pytest.approx(loss_c, rel=1e-5)
        np.testing.assert_allclose(g_g, g_c, rtol=1e-5, atol=1e-6)
