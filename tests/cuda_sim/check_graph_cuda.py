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


# -- the ops' device forms (pserver.models.cuda_ops) against the ops (pserver.ops) ------------------

def _op_cases():
    """(op, its inputs, attrs, which inputs are tensors on the device): a ragged last block
    (3 x 4 x 25 = 300 elements), ties for max and min, zeros for abs and sign, a clip with
    elements on both sides and on a bound, where with a broadcast condition and a constant."""
    rng = np.random.default_rng(11)
    x = f32(rng, 3, 4, 25)
    x.reshape(-1)[:3] = 0.0
    pos = np.abs(x) + 0.5
    tied = np.round(x, 0)                          # many ties in each reduced group
    clipped = x.copy()
    clipped.reshape(-1)[5] = 0.4
    cond = (f32(rng, 3, 1, 25) > 0)
    cases = [(kind, [x], {}) for kind in ("exp", "square", "abs")]
    cases += [("log", [pos], {}), ("sqrt", [pos], {})]
    cases += [("clip", [clipped, np.array(-0.3, np.float32), np.array(0.4, np.float32)], {})]
    cases += [("where", [cond, x, f32(rng, 4, 25)], {}), ("where", [cond, x, np.array(0.0, np.float32)], {}),
              ("where", [x > 0, np.array(0.5, np.float32), f32(rng, 25)], {})]   # the condition widest
    cases += [(kind, [x], {}) for kind in ("softmax", "log_softmax")]
    cases += [("transpose", [x], {"axes": (0, 2, 1)}), ("transpose", [x], {"axes": None})]
    cases += [("max", [tied], {"axis": (1, 2)}), ("min", [tied], {"axis": -1}),
              ("max", [tied], {"axis": 1, "keepdims": True})]
    cases += [("cast", [x], {"dtype": "float32"})]
    # ops that move elements (a gather by an index map): slices, a repeated index, tile, repeat
    cases += [("getitem", [x], {"key": core._plain_key((slice(None), slice(1, None), slice(None, None, 3)))}),
              ("getitem", [x], {"key": core._plain_key((Ellipsis, 7))}),
              ("getitem", [x], {"key": core._plain_key((slice(None), [2, 0, 2]))}),
              ("take", [x, np.array([[3, 1], [3, 0]])], {"axis": 1}),
              ("take", [x, np.array([24, 0, 24])], {"axis": -1}),
              ("tile", [x], {"repeats": (1, 2, 1)}), ("repeat", [x], {"repeats": 3, "axis": 2}),
              ("repeat", [x], {"repeats": (2, 0, 1, 3), "axis": 1})]
    cases += [("stack", [x, f32(rng, 3, 4, 25), x], {"axis": 2}), ("stack", [x, x], {"axis": -1})]
    cases += [("power", [pos, f32(rng, 4, 1)], {}), ("power", [x, np.array(2.0, np.float32)], {}),
              ("power", [np.array(2.0, np.float32), x], {})]
    cases += [("softmax", [x], {"axis": 1}), ("log_softmax", [x], {"axis": -2})]
    ids = np.array([[0, 3, 2, 7], [-1, 1, 1, 4], [2, 2, 0, 3]], np.float32)    # 7, -1: rows of zeros
    cases += [("one_hot", [ids], {"num_classes": 5, "axis": -1, "dtype": "float32"})]
    return [pytest.param(name, xs, attrs, id=f"{name}-{i}") for i, (name, xs, attrs) in enumerate(cases)]


def _on_device(x):
    """A tensor (here: any float or boolean input of a dimension) on the device as the graph
    hands it to an op, float32 (a mask as 1.0/0.0); a constant (a number, take's integer
    indices) as the graph keeps it, in NumPy."""
    return x if x.ndim == 0 or x.dtype.kind in "iu" else cuda.to_device(x.astype(np.float32))


@pytest.mark.parametrize("name,xs,attrs", _op_cases())
def test_every_ops_device_form_and_its_vjp_equal_the_op(name, xs, attrs):
    # Catches a kernel or VJP that differs from the NumPy op's: exp's derivative taken from x
    # rather than out, abs's sign at 0, clip's gradient at a bound, where's gradient summed to
    # the wrong input or sent to a constant, softmax along the wrong axis, a transpose's
    # inverse, the tie rule of max and min, a reduction over the wrong axes.
    from pserver.models.cuda_ops import DeviceOps
    ops, op = DeviceOps(0), core.OPS[name]
    want = op.forward(*xs, **attrs)
    dev = [_on_device(x) for x in xs]
    got = ops[name].forward(*dev, **attrs)
    close(got.copy_to_host(), want)
    g = f32(np.random.default_rng(12), *want.shape)
    wants = core.backward(op, g, want, xs, attrs)
    gots = core.backward(ops[name], cuda.to_device(g), got, dev, attrs)
    for x, w, d in zip(xs, wants, gots, strict=True):
        if x.ndim == 0 or x.dtype.kind in "iu" or w is None:   # a constant, where's condition: none
            assert d is None
        else:
            close(d.copy_to_host(), w)


@pytest.mark.parametrize("kind", ["greater", "greater_equal", "less", "less_equal", "equal", "not_equal"])
def test_comparisons_give_one_where_numpy_gives_true(kind):
    # Catches a comparison numbered as another, or a broadcast operand read in the wrong order.
    from pserver.models.cuda_ops import DeviceOps
    rng = np.random.default_rng(13)
    a, b = np.round(f32(rng, 3, 4, 25)), np.round(f32(rng, 25))     # rounded: many equal pairs
    got = DeviceOps(0)[kind].forward(cuda.to_device(a), cuda.to_device(b))
    np.testing.assert_array_equal(got.copy_to_host(), core.OPS[kind].forward(a, b).astype(np.float32))


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


def attention_of_ops():
    """A user's layer written in keras.ops as keras.io's custom layers are: self-attention over a
    sequence (softmax of broadcast products), then a transpose, max and min over axes, and the
    unary math, clip, where, a comparison cast to a mask, and log_softmax of what is left."""
    from pserver.keras import Input, layers, ops

    class Attend(layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]), initializer="random_normal")

        def call(self, x):
            q = ops.matmul(x, self.w)                                          # (n, 4, 3)
            scores = ops.sum(ops.expand_dims(q, 2) * ops.expand_dims(x, 1), axis=-1)
            attended = ops.sum(ops.expand_dims(ops.softmax(scores), -1) * ops.expand_dims(x, 1), axis=2)
            t = ops.transpose(attended, (0, 2, 1))                             # (n, 3, 4)
            top, low = ops.max(t, axis=-1), ops.min(t, axis=1)                 # (n, 3), (n, 4)
            smooth = ops.log(ops.exp(ops.clip(top, -1.0, 1.0)) + 1.0)
            mask = ops.cast(ops.greater(low, 0.0), "float32")
            return ops.concatenate([smooth, ops.sqrt(ops.square(low) + 1.0), ops.abs(low),
                                    ops.where(low > 0, low, 0.1 * low), mask * low, ops.log_softmax(top)],
                                   axis=-1)

    inputs = Input(shape=(4, 3))
    return inputs, layers.Dense(3)(Attend()(inputs))


def moves_of_ops():
    """A user's layer of the ops that move elements (slices, take, stack, tile, repeat), power,
    softmax along a middle axis, and one_hot of a second input's ids (truncated floats, some
    negative: rows of zeros), as on the CPU."""
    from pserver.keras import Input, layers, ops

    class Moves(layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[0][-1], 4), initializer="random_normal")

        def call(self, inputs):
            x, ids = inputs
            h = ops.matmul(x, self.w)                                          # (n, 5, 4)
            first, rest = h[:, 0], h[:, 1:]                                    # (n, 4), (n, 4, 4)
            picked = ops.take(h, np.array([4, 0, 4]), axis=1)                  # (n, 3, 4)
            pair = ops.stack([first, ops.max(rest, axis=1)], axis=1)           # (n, 2, 4)
            att = ops.softmax(ops.tile(pair, (1, 2, 1)) * rest, axis=1)        # (n, 4, 4)
            hot = ops.one_hot(ids * 2.0, 4)                                    # (n, 2, 4)
            powered = ops.power(ops.abs(picked) + 1.0, 1.5)
            return ops.concatenate([ops.reshape(att, (-1, 16)), ops.reshape(powered, (-1, 12)),
                                    ops.repeat(first, 2, axis=1) ** 2, ops.reshape(hot * h[:, 2:4], (-1, 8))],
                                   axis=-1)

    x, ids = Input(shape=(5, 3)), Input(shape=(2,))
    return [x, ids], layers.Dense(3)(Moves()([x, ids]))


def permuted_and_repeated():
    """Permute of a (4, 3, 2) feature map and RepeatVector of a flat vector, merged."""
    from pserver.keras import Input, layers
    x = Input(shape=(2, 4, 3))
    p = layers.Permute((3, 1, 2))(layers.Dense(2)(x))                        # (2, 2, 4)
    r = layers.RepeatVector(2)(layers.Dense(4)(layers.Flatten()(x)))         # (2, 4)
    return x, layers.Flatten()(layers.Add()([p, layers.Reshape((2, 2, 4))(layers.Concatenate()([r, r]))]))


def dots():
    """Dot on flat vectors (a cosine's numerator) and on sequences along each pair of axes
    (DLRM's interaction is axes=2: features by features)."""
    from pserver.keras import Input, layers
    a, b = Input(shape=(3, 4)), Input(shape=(4, 3))
    flat = layers.Dot(axes=1)([layers.Flatten()(a), layers.Flatten()(layers.Permute((2, 1))(b))])   # (1,)
    outs = [layers.Flatten()(layers.Dot(axes=pair)([x, y])) for pair, x, y in
            (((2, 1), a, b), ((1, 2), a, b), (2, a, a), (1, b, b))]         # (3,3), (4,4), (3,3), (3,3)
    return [a, b], layers.Dense(3)(layers.Concatenate()([flat, *outs]))


def margins():
    """Rescaling (per channel and by one value), Normalization (adapted, given with a variance of
    0, inverted), ZeroPadding, Cropping and UpSampling on images and on sequences, unequal sides,
    and Conv2DTranspose after them (valid and same, with and without a bias)."""
    from pserver.keras import Input, layers
    img, seq_in = Input(shape=(5, 4, 2)), Input(shape=(6, 3))
    img_in = layers.Rescaling([0.5, -2.0], offset=0.25)(img)                                # per channel
    seq = layers.Rescaling(1.0 / 3)(seq_in)
    adapted = layers.Normalization(axis=(1, 2))                # learned statistics: weights
    adapted.adapt(np.random.default_rng(3).normal(2.0, 3.0, (16, 6, 3)))
    seq = adapted(seq)
    i = layers.Conv2D(2, 3, padding="same")(layers.ZeroPadding2D(((1, 2), (0, 3)))(img_in))  # (8, 7, 2)
    i = layers.Normalization(mean=[1.0, -1.0], variance=[4.0, 0.0])(i)                     # given; a 0 floor
    i = layers.UpSampling2D((2, 3))(layers.Cropping2D(((2, 1), (1, 3)))(i))                # (10, 9, 2)
    q = layers.Rescaling(-1.5, offset=1.0)(layers.Dense(2)(layers.ZeroPadding1D((2, 1))(seq)))   # (9, 2)
    q = layers.Normalization(mean=0.5, variance=2.0, invert=True)(q)
    q = layers.UpSampling1D(3)(layers.Cropping1D((1, 4))(q))                               # (12, 2)
    t = layers.Cropping2D(((2, 1), (1, 1)))(img_in)                                        # (2, 2, 2)
    t = layers.Conv2DTranspose(2, (3, 2), strides=(2, 1), activation="relu")(t)             # (5, 3, 2)
    t = layers.Conv2DTranspose(1, 2, strides=2, padding="same", use_bias=False)(t)          # (10, 6, 1)
    flat = [layers.Flatten()(a) for a in (i, q, t)]
    return [img, seq_in], layers.Dense(3)(layers.Concatenate()(flat))


@pytest.mark.parametrize("build,shapes", [(toy_resnet, [(6, 6, 1)]), (two_branches, [(3, 4), (4, 3)]),
                                         (attention_of_ops, [(4, 3)]), (moves_of_ops, [(5, 3), (2,)]),
                                         (permuted_and_repeated, [(2, 4, 3)]), (dots, [(3, 4), (4, 3)]),
                                         (margins, [(5, 4, 2), (6, 3)])],
                         ids=["toy_resnet", "two_branches", "attention_of_ops", "moves_of_ops",
                              "permute_repeat_vector", "dot", "padding_cropping_upsampling"])
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
    positive_variances(cpu_m.layout, w)
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


def text_classifier():
    """keras.io's text classifiers' shape: ids, an Embedding with mask_zero, the masked
    GlobalAveragePooling1D (ops on the mask the Embedding carries), and a pooled lookup (a mean
    over each list, padding skipped) beside it."""
    from pserver.keras import Input, layers
    from pserver.layers import Embedding
    ids = Input(shape=(6,), dtype="int32")
    seq = layers.Embedding(20, 4, mask_zero=True)(ids)
    pooled = Embedding(20, 3, combiner="mean", mask_zero=True)(ids)
    return ids, layers.Dense(3)(layers.concatenate([layers.GlobalAveragePooling1D()(seq), pooled]))


def test_embeddings_on_cuda_equal_the_cpu_model():
    # Catches ids read from the float32 batch wrongly (truncated, padding not -1), a repeated id
    # whose rows' gradients are not summed (the atomic add), or the mask's ops (not_equal, cast,
    # the masked mean) differing on the device.
    from pserver.models import on_device
    from pserver.models.functional import Functional
    cpu_m, gpu_m = Functional(*text_classifier()).build(), on_device(Functional(*text_classifier()), "cuda")
    rng = np.random.default_rng(7)
    w = (rng.standard_normal(cpu_m.layout.total) * 0.5).astype(np.float32)
    x = rng.integers(0, 20, (4, 6)).astype(np.int32)
    x[:, 4:] = 0                                   # padding at the end of every list
    x[0, :3] = 7                                   # an id three times in one sample
    y = rng.integers(0, 3, 4).astype(np.int32)
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c = cpu_m.loss_and_grad(w, x, y, g_c, seed=1)
    loss_g = gpu_m.loss_and_grad(w, x, y, g_g, seed=1)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-5, atol=1e-6)
    views = cpu_m.layout.views(g_g)
    table = next(v for k, v in views.items() if k.startswith("embedding/"))
    assert np.count_nonzero(table[7]) and not np.count_nonzero(table[0])   # padding takes no gradient
    np.testing.assert_allclose(gpu_m.evaluate(w, x, y)["loss"], cpu_m.evaluate(w, x, y)["loss"], rtol=1e-5)
    # The device reads ids unchecked; the dataset's check before step 1 is the host model's.
    x[2, 1] = 20
    from pserver.errors import DataError
    with pytest.raises(DataError, match=r"train: .*embedding.*: id 20 at \(2, 1\) is not an integer in "
                                        r"\[0, input_dim=20\)"):
        gpu_m.check_data(x, y, "train")


# -- losses on the host: several outputs, other losses, metrics -------------------------------

def _heads(kind: str):
    """(model, labels): two outputs of a shared trunk, one fused softmax and one sigmoid head
    with Keras's losses; one output with a binary cross-entropy and a compiled metric; one
    output with steps (a label per step). None of these has its loss on the device."""
    from pserver.keras import Input, layers
    from pserver.models.functional import Functional
    rng = np.random.default_rng(8)
    x = Input(shape=(5,))
    trunk = layers.Dense(6, activation="tanh")(x)
    if kind == "two_heads":
        model = Functional(x, [layers.Dense(3, activation="softmax")(trunk),
                               layers.Dense(1, activation="sigmoid")(trunk)])
        model.compile(loss=["sparse_categorical_crossentropy", "binary_crossentropy"],
                      loss_weights=[0.3, 2.0], metrics=[["accuracy"], ["accuracy"]])
        labels = model.loss.labels([rng.integers(0, 3, 6), rng.integers(0, 2, 6)])
    elif kind == "bce_with_metric":
        model = Functional(x, layers.Dense(1, activation="sigmoid")(trunk))
        model.compile(loss="binary_crossentropy", metrics=["accuracy", "precision"])
        labels = rng.integers(0, 2, 6).astype(np.float32)
    else:
        model = Functional(x, layers.Reshape((2, 3))(layers.Dense(6)(trunk)))
        labels = rng.integers(0, 3, (6, 2)).astype(np.int32)
    return model, labels


@pytest.mark.parametrize("kind", ["two_heads", "bce_with_metric", "steps"])
def test_a_loss_on_the_host_trains_and_evaluates_as_the_cpu_model(kind):
    # Catches an output's d loss / d output not taken back to the device (or taken to the wrong
    # output's buffer), the loss weights lost, the batch's metrics not measured, or evaluation
    # scoring other outputs than the device computed.
    from pserver.models import cuda_support, on_device
    from pserver.models.cuda import CudaModel
    cpu_m, y = _heads(kind)
    gpu_m = on_device(_heads(kind)[0], "cuda")
    assert isinstance(gpu_m, CudaModel) and gpu_m.loss_on_host and not cuda_support.loss_on_device(cpu_m)
    rng = np.random.default_rng(9)
    w = (rng.standard_normal(cpu_m.build().layout.total) * 0.5).astype(np.float32)
    x = f32(rng, 6, 5)
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    for step in range(2):            # the second in the batch size's buffers, on other data
        xs = x if step else x[::-1].copy()
        loss_c = cpu_m.loss_and_grad(w, xs, y, g_c, seed=1)
        loss_g = gpu_m.loss_and_grad(w, xs, y, g_g, seed=1)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(g_g) > w.size // 2
    for name in ("batch_correct", "batch_metric_sums", "batch_sums"):
        want, got = getattr(cpu_m, name, None), getattr(gpu_m, name)
        if want is not None:
            np.testing.assert_allclose(np.asarray(list(got.values()) if isinstance(got, dict) else got),
                                       np.asarray(list(want.values()) if isinstance(want, dict) else want),
                                       rtol=1e-5)
    logs_c, logs_g = cpu_m.evaluate(w, x, y), gpu_m.evaluate(w, x, y, batch_size=4)
    assert logs_g.keys() == logs_c.keys()
    for k in logs_c:
        assert logs_g[k] == pytest.approx(logs_c[k], rel=1e-5, abs=1e-6), k


def test_a_loss_on_the_device_still_measures_the_batch_s_accuracy():
    # Catches the worker's pushed training accuracy left at 0 on the GPU (the step's output
    # never brought back) while the loss and its gradient run on the device.
    from pserver.models import on_device
    from pserver.models.functional import Functional
    cpu_m, gpu_m = Functional(*toy_resnet()).build(), on_device(Functional(*toy_resnet()), "cuda")
    assert not gpu_m.loss_on_host
    rng = np.random.default_rng(10)
    w = (rng.standard_normal(cpu_m.layout.total) * 0.5).astype(np.float32)
    x, y = f32(rng, 8, 6, 6, 1), rng.integers(0, 3, 8).astype(np.int32)
    g = np.empty_like(w)
    cpu_m.loss_and_grad(w, x, y, g, seed=2)
    gpu_m.loss_and_grad(w, x, y, g, seed=2)
    assert gpu_m.batch_correct == cpu_m.batch_correct and 0 < cpu_m.batch_correct


def text_cnn():
    """keras.io's text_classification_from_scratch, small: ids, an Embedding, Dropout, Conv1D
    ('valid' with strides 2, 'same', 'causal'), GlobalMaxPooling1D and a sigmoid output with a
    binary cross-entropy (a loss on the host)."""
    from pserver.keras import Input, layers
    from pserver.models.functional import Functional
    ids = Input(shape=(9,), dtype="int32")
    x = layers.Embedding(12, 3)(ids)
    x = layers.Conv1D(4, 3, strides=2, activation="relu")(x)
    x = layers.Conv1D(2, 2, padding="same")(x)
    x = layers.Conv1D(3, 3, padding="causal", activation="tanh")(x)
    model = Functional(ids, layers.Dense(1, activation="sigmoid")(layers.GlobalMaxPooling1D()(x)))
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model


def test_conv1d_on_cuda_equals_the_cpu_model():
    # Catches Conv1D's one-row views not taken on device arrays (which take no None index), a
    # causal or 'same' padding placed otherwise than on the CPU, or the strides lost.
    rng = np.random.default_rng(12)
    x, y = rng.integers(0, 12, (4, 9)).astype(np.int32), rng.integers(0, 2, 4).astype(np.float32)
    same_step_and_logs(text_cnn, x, y, rng)


def positive_variances(layout, w):
    """Random weights' variances (BatchNormalization's moving ones, Normalization's) made
    positive, as statistics are: a negative one's square root is NaN on the host and an error
    in the simulator."""
    for name, (start, end) in layout.offsets().items():
        if name.endswith("variance"):
            w[start:end] = np.abs(w[start:end]) + 0.5


def same_step_and_logs(build, x, y, rng):
    """The CUDA model of build() takes the CPU model's loss and gradient (most of it nonzero)
    for one step from random weights (variances positive), and evaluates to its logs."""
    from pserver.models import on_device
    cpu_m, gpu_m = build().build(), on_device(build(), "cuda")
    w = (rng.standard_normal(cpu_m.layout.total) * 0.5).astype(np.float32)
    positive_variances(cpu_m.layout, w)
    g_c, g_g = np.full_like(w, np.nan), np.full_like(w, np.nan)
    loss_c = cpu_m.loss_and_grad(w, x, y, g_c, seed=1)
    loss_g = gpu_m.loss_and_grad(w, x, y, g_g, seed=1)
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    np.testing.assert_allclose(g_g, g_c, rtol=1e-4, atol=1e-6)
    assert np.count_nonzero(g_g) > w.size // 2
    assert gpu_m.evaluate(w, x, y) == pytest.approx(cpu_m.evaluate(w, x, y), rel=1e-5)


def per_step_dense(loss: str):
    """Dense on a sequence (each step's features through one kernel: keras.io's text models'
    projections), pooled to one output, or left per step (an output with steps: a label per
    step, its loss on the host)."""
    from pserver.keras import Input, layers
    from pserver.models.functional import Functional
    x = Input(shape=(5, 3))
    h = layers.Dense(4, activation="relu")(x)
    if loss == "pooled":
        h = layers.GlobalAveragePooling1D()(layers.Dense(4, activation="tanh")(h))
    return Functional(x, layers.Dense(3)(h))


@pytest.mark.parametrize("loss", ["pooled", "per_step"])
def test_dense_on_a_sequence_on_cuda_equals_the_cpu_model(loss):
    # Catches the rows view of a device array (reshape(-1, features)) not taken, or a bias or
    # activation applied to the wrong axis of a sequence.
    rng = np.random.default_rng(13)
    y = rng.integers(0, 3, (4,) if loss == "pooled" else (4, 5)).astype(np.int32)
    same_step_and_logs(lambda: per_step_dense(loss), f32(rng, 4, 5, 3), y, rng)


@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False), (False, False)])
def test_layer_norm_kernels_equal_the_twin(center, scale):
    # Catches a variance not biased (Keras's), epsilon outside the root, gamma or beta read when
    # the layer has none, dgamma written when not asked for, or a VJP without its mean terms.
    rng = np.random.default_rng(14)
    x, dout = 3 * f32(rng, 300, 7) + 2, f32(rng, 300, 7)       # 300 rows: over one block
    gamma, beta = (f32(rng, 7) if scale else None), (f32(rng, 7) if center else None)
    want = {k: np.empty_like(x) for k in ("y", "out", "dx")}
    want_scale, want_g, want_b = np.empty((300, 1), np.float32), *np.empty((2, 7), np.float32)
    reference.layer_norm_forward(x, gamma, beta, 1e-3, want["y"], want_scale, want["out"])
    reference.layer_norm_backward(dout, want["y"], want_scale, gamma, want_g if scale else None,
                                  want_b if center else None, want["dx"])
    dev = {k: nans(300, 7) for k in ("y", "out", "dx")}
    scale_d, dg, db = nans(300, 1), nans(7), nans(7)

    def on(a):
        return None if a is None else cuda.to_device(a)

    K.layer_norm_forward(cuda.to_device(x), on(gamma), on(beta), 1e-3, dev["y"], scale_d, dev["out"])
    K.layer_norm_backward(cuda.to_device(dout), dev["y"], scale_d, on(gamma), dg if scale else None,
                          db if center else None, dev["dx"])
    for k in ("y", "out", "dx"):
        close(dev[k].copy_to_host(), want[k])
    close(scale_d.copy_to_host(), want_scale)
    if scale:
        close(dg.copy_to_host(), want_g)
    if center:
        close(db.copy_to_host(), want_b)


def layer_normed():
    """A transformer block's shape without its attention: Dense at each step, LayerNormalization
    over the features (with and without gamma and beta), a residual add, pooling."""
    from pserver.keras import Input, layers
    from pserver.models.functional import Functional
    x = Input(shape=(5, 3))
    h = layers.LayerNormalization(epsilon=1e-6)(layers.Dense(3, activation="relu")(x))
    h = layers.LayerNormalization(center=False, scale=False)(layers.add([x, h]))
    return Functional(x, layers.Dense(3)(layers.GlobalAveragePooling1D()(h)))


def test_layer_normalization_on_cuda_equals_the_cpu_model():
    rng = np.random.default_rng(15)
    same_step_and_logs(layer_normed, f32(rng, 4, 5, 3), rng.integers(0, 3, 4).astype(np.int32), rng)


@pytest.mark.parametrize("training", [True, False], ids=["training", "moving"])
@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False), (False, False)])
def test_batch_norm_kernels_equal_the_twin(center, scale, training):
    # Catches a variance not biased (Keras's), moments taken over the channels instead of the
    # rows, the moving statistics overwritten at inference, gamma or beta read when the layer
    # has none, a VJP without its mean terms (or with them at inference), and statistics slots
    # that are not mean - moving_mean and var + that squared.
    rng = np.random.default_rng(16)
    x, dout = 3 * f32(rng, 300, 7) + 2, f32(rng, 300, 7)       # 300 rows: over one block
    gamma, beta = (f32(rng, 7) if scale else None), (f32(rng, 7) if center else None)
    moving_mean, moving_var = f32(rng, 7), np.abs(f32(rng, 7)) + 0.5
    mean, var = (np.empty(7, np.float32), np.empty(7, np.float32)) if training else (moving_mean, moving_var)
    want = {k: np.empty_like(x) for k in ("y", "out", "dx")}
    want_scale, want_g, want_b, want_dm, want_dv = np.empty((5, 7), np.float32)
    reference.batch_norm_forward(x, gamma, beta, mean, var, training, 1e-3, want["y"], want_scale,
                                 want["out"])
    reference.batch_norm_backward(dout, want["y"], want_scale, gamma, training, want_g if scale else None,
                                  want_b if center else None, np.empty((2, 7), np.float32), want["dx"])
    reference.batch_norm_statistics(mean, var, moving_mean, want_dm, want_dv)
    dev = {k: nans(300, 7) for k in ("y", "out", "dx")}
    scale_d, dg, db, dm, dv = (nans(7) for _ in range(5))
    mean_d, var_d = (nans(7), nans(7)) if training else \
        (cuda.to_device(moving_mean), cuda.to_device(moving_var))

    def on(a):
        return None if a is None else cuda.to_device(a)

    K.batch_norm_forward(cuda.to_device(x), on(gamma), on(beta), mean_d, var_d, training, 1e-3, dev["y"],
                         scale_d, dev["out"])
    K.batch_norm_backward(cuda.to_device(dout), dev["y"], scale_d, on(gamma), training, dg if scale else None,
                          db if center else None, nans(2, 7), dev["dx"])
    K.batch_norm_statistics(mean_d, var_d, cuda.to_device(moving_mean), dm, dv)
    for k in ("y", "out", "dx"):
        close(dev[k].copy_to_host(), want[k])
    for got, w in ((scale_d, want_scale), (mean_d, mean), (var_d, var), (dm, want_dm), (dv, want_dv),
                   *(((dg, want_g),) if scale else ()), *(((db, want_b),) if center else ())):
        close(got.copy_to_host(), w)
    if not training:                    # the moving statistics are read, never written
        np.testing.assert_array_equal(mean_d.copy_to_host(), moving_mean)


def batch_normed(frozen: bool):
    """A convolution block with BatchNormalization over its channels, and one (without beta) on a
    flat layer: training takes the batch's moments, evaluation the moving ones. `frozen`: the
    first is not trainable, so it runs on its moving statistics in training too."""
    from pserver.keras import Input, layers
    from pserver.models.functional import Functional
    x = Input(shape=(6, 6, 2))
    bn = layers.BatchNormalization()
    bn.trainable = not frozen
    h = layers.Activation("relu")(bn(layers.Conv2D(4, 3, padding="same")(x)))
    h = layers.Dense(5)(layers.Flatten()(layers.MaxPooling2D()(h)))
    return Functional(x, layers.Dense(3)(layers.BatchNormalization(center=False, momentum=0.5)(h)))


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_batch_normalization_on_cuda_equals_the_cpu_model(frozen):
    # Catches the statistics slots (what the shards' moving statistics are made from) not written
    # or wrong on the GPU, the channels taken as rows, and evaluation with the batch's moments.
    rng = np.random.default_rng(17)
    y = rng.integers(0, 3, 4).astype(np.int32)
    same_step_and_logs(lambda: batch_normed(frozen), f32(rng, 4, 6, 6, 2), y, rng)


@pytest.mark.parametrize("tx,ty", [(False, False), (True, False), (False, True), (True, True)])
def test_batched_matmul_equals_the_twin(tx, ty):
    # Catches a transposed operand read untransposed, or the batch index mixed into the rows.
    rng = np.random.default_rng(18)
    x = f32(rng, 3, *((5, 2) if tx else (2, 5)))
    y = f32(rng, 3, *((4, 5) if ty else (5, 4)))
    want = np.empty((3, 2, 4), np.float32)
    reference.batched_matmul(x, y, want, tx, ty)
    got = nans(3, 2, 4)
    K.batched_matmul(cuda.to_device(x), cuda.to_device(y), got, tx, ty)
    close(got.copy_to_host(), want)
    close(want, np.matmul(np.swapaxes(x, 1, 2) if tx else x, np.swapaxes(y, 1, 2) if ty else y))
