"""pserver.ops: every op's VJP against central finite differences in float64, eager results
against NumPy, recording on symbolic tensors (shapes with a None batch, dtypes), and bad input
refused with a ConfigError naming the op and the shapes.

Each op has a case below: a hypothesis strategy drawing its inputs (random shapes and, for the
element-wise ops, random broadcasts), the public call (pserver.ops.<name>, Keras's signature)
and an independent NumPy reference. The checks trace the public call on symbolic tensors to
find the op and attrs it records, so they also cover the path from the public signature to
the node a graph runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pserver.keras.ops as kops
from pserver import ops
from pserver.errors import ConfigError, NotInKeras
from pserver.ops.core import OPS, Symbolic, _plain_key, apply, backward

FAST = settings(max_examples=25, deadline=None)
EPS = 1e-6        # central differences in float64: truncation ~EPS^2, rounding ~1e-16 / EPS
TOL = 1e-6        # |<g, J dx> - <vjp(g), dx>| <= TOL * (1 + |<g, J dx>|)
MARGIN = 1e-3     # inputs stay this far from a kink (relu at 0, a tie of maximum), >> EPS * |dx|


@dataclass
class Case:
    call: Callable            # the public call on the inputs (arrays or symbolic tensors)
    args: list                # the inputs, float64 where float
    ref: Callable             # NumPy, written independently of the op's forward

    def __post_init__(self):   # NumPy's generators give a scalar, not an array, for shape ()
        self.args = [np.asarray(a) if isinstance(a, np.generic) else a for a in self.args]


# -- drawing inputs ---------------------------------------------------------------------

def shapes(lo=0, hi=3):
    return st.lists(st.integers(1, 4), min_size=lo, max_size=hi).map(tuple)


@st.composite
def broadcast(draw, n=2, lo=0):
    """n shapes that broadcast together: a base shape, each operand dropping some leading
    dimensions and setting some others to 1."""
    base = draw(shapes(lo))
    out = []
    for _ in range(n):
        tail = base[draw(st.integers(0, len(base))):]
        out.append(tuple(1 if draw(st.booleans()) else d for d in tail))
    return out


def rng(draw):
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def away_from_zero(r, shape):
    return r.choice([-1.0, 1.0], shape) * r.uniform(0.1, 2.0, shape)


def distinct(r, shape):
    """Values 0.1 apart at least: a max or min has no tie for a small step to break."""
    n = int(np.prod(shape))
    return (r.permutation(n).reshape(shape) * 0.1 + r.uniform(0, 0.01, shape)).astype(np.float64)


def axis_of(draw, ndim, extra=0):
    return draw(st.integers(-(ndim + extra), ndim + extra - 1))


# -- the cases, one strategy per op -----------------------------------------------------

def binary(fn, ref, make=lambda r, s: r.standard_normal(s), make2=None):
    @st.composite
    def case(draw):
        r, (s1, s2) = rng(draw), draw(broadcast())
        return Case(fn, [make(r, s1), (make2 or make)(r, s2)], ref)
    return case()


def unary(fn, ref, make=lambda r, s: r.standard_normal(s), lo=0):
    @st.composite
    def case(draw):
        return Case(fn, [make(rng(draw), draw(shapes(lo)))], ref)
    return case()


def positive(r, s):
    return r.uniform(0.5, 2.0, s)


@st.composite
def extreme_case(draw, fn):
    """maximum/minimum: broadcasting operands with no near-tie."""
    r, (s1, s2) = rng(draw), draw(broadcast())
    x1, x2 = r.standard_normal(s1), r.standard_normal(s2)
    assume(np.all(np.abs(x1 - x2) > MARGIN))
    ref = {ops.maximum: lambda a, b: np.where(a > b, a, b), ops.minimum: lambda a, b: np.where(a < b, a, b)}
    return Case(fn, [x1, x2], ref[fn])


@st.composite
def clip_case(draw):
    r, (s, s_lo, s_hi) = rng(draw), draw(broadcast(3))
    x = 2 * r.standard_normal(s)
    if draw(st.booleans()):
        lo, hi = -0.5, 0.5                      # Python numbers: constants of the node
    else:
        lo, hi = -0.5 - r.uniform(0, 1, s_lo), 0.5 + r.uniform(0, 1, s_hi)
    assume(np.all(np.abs(x - lo) > MARGIN) and np.all(np.abs(x - hi) > MARGIN))
    return Case(ops.clip, [x, lo, hi], lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi))


@st.composite
def where_case(draw):
    r, (sc, s1, s2) = rng(draw), draw(broadcast(3))
    c = r.random(sc) > 0.5
    return Case(ops.where, [c, r.standard_normal(s1), r.standard_normal(s2)],
                lambda c, a, b: c * a + ~c * b)


def product(a, b):
    """matmul as sums of products, with NumPy's rules for 1-D operands."""
    a2, b2 = (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)
    out = (a2[..., :, :, None] * b2[..., None, :, :]).sum(axis=-2)
    if b.ndim == 1:
        out = out[..., 0]
    if a.ndim == 1:
        out = out[..., 0, :] if b.ndim > 1 else out[..., 0]
    return out


@st.composite
def matmul_case(draw):
    r, m, k, n = rng(draw), *(draw(st.integers(1, 4)) for _ in range(3))
    batch1, batch2 = draw(broadcast(2))
    a = (k,) if draw(st.booleans()) else batch1 + (m, k)
    b = (k,) if draw(st.booleans()) else batch2 + (k, n)
    return Case(ops.matmul, [r.standard_normal(a), r.standard_normal(b)], product)


@st.composite
def cast_case(draw):
    r, s, dtype = rng(draw), draw(shapes()), draw(st.sampled_from(["float64", "int32"]))
    return Case(lambda x: ops.cast(x, dtype), [3 * r.standard_normal(s)], lambda x: np.array(x, dtype=dtype))


@st.composite
def softmax_case(draw, fn):
    r, s = rng(draw), draw(shapes(1))
    axis = axis_of(draw, len(s))
    ref = {ops.softmax: lambda x: np.exp(x) / np.exp(x).sum(axis, keepdims=True),
           ops.log_softmax: lambda x: x - np.log(np.exp(x).sum(axis, keepdims=True))}[fn]
    return Case(lambda x: fn(x, axis=axis), [r.standard_normal(s)], ref)


@st.composite
def one_hot_case(draw):
    r, s, classes = rng(draw), draw(shapes()), draw(st.integers(1, 5))
    axis = draw(st.sampled_from([-1, 0]))
    x = r.integers(-1, classes + 1, s)          # -1 and `classes` are outside: rows of zeros

    def ref(x):
        hot = np.eye(classes + 2)[x + 1][..., 1:classes + 1]
        return np.moveaxis(hot, -1, axis)
    return Case(lambda x: ops.one_hot(x, classes, axis=axis), [x], ref)


@st.composite
def reduce_case(draw, fn):
    r, s = rng(draw), draw(shapes(1))
    axes = draw(st.one_of(st.none(), st.integers(-len(s), len(s) - 1),
                          st.sets(st.integers(0, len(s) - 1), min_size=1).map(tuple)))
    keepdims = draw(st.booleans())
    ref = {ops.sum: np.add.reduce, ops.mean: lambda x, axis, keepdims: np.add.reduce(
        x, axis=axis, keepdims=keepdims) / (x.size / np.add.reduce(x, axis=axis, keepdims=keepdims).size),
        ops.max: np.maximum.reduce, ops.min: np.minimum.reduce}[fn]
    return Case(lambda x: fn(x, axis=axes, keepdims=keepdims), [distinct(r, s)],
                lambda x: ref(x, axis=axes, keepdims=keepdims))


@st.composite
def standardize_case(draw):
    r, s = rng(draw), draw(shapes(1))
    axes = tuple(sorted(draw(st.sets(st.integers(-len(s), -1), min_size=1))))
    epsilon = draw(st.sampled_from([1e-3, 0.5]))

    def ref(x):
        var = np.var(x, axis=axes, keepdims=True)
        return (x - np.average(x.reshape(x.shape), axis=axes, keepdims=True)) / (var + epsilon) ** 0.5
    return Case(lambda x: ops.nn.standardize(x, axes=axes, epsilon=epsilon),
                [2 * r.standard_normal(s) + 3], ref)


@st.composite
def reshape_case(draw):
    r, s = rng(draw), draw(shapes(1))
    new = draw(st.sampled_from([(-1,), s[::-1], (s[0], -1), (1,) + s + (1,)]))
    return Case(lambda x: ops.reshape(x, new), [r.standard_normal(s)],
                lambda x: x.ravel().reshape(new))


@st.composite
def transpose_case(draw):
    r, s = rng(draw), draw(shapes(1))
    perm = draw(st.permutations(range(len(s))))
    axes = None if draw(st.booleans()) else tuple(a - len(s) * draw(st.booleans()) for a in perm)
    order = list(range(len(s)))[::-1] if axes is None else [a % len(s) for a in axes]
    return Case(lambda x: ops.transpose(x, axes), [r.standard_normal(s)],
                lambda x: np.einsum(x, list(range(len(s))), order))


@st.composite
def expand_dims_case(draw):
    r, s = rng(draw), draw(shapes())
    axis = axis_of(draw, len(s), extra=1)
    at = axis % (len(s) + 1)
    return Case(lambda x: ops.expand_dims(x, axis), [r.standard_normal(s)],
                lambda x: x.reshape(s[:at] + (1,) + s[at:]))


@st.composite
def squeeze_case(draw):
    r, s = rng(draw), draw(st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple))
    ones = [i for i, d in enumerate(s) if d == 1]
    axis = draw(st.sampled_from([None] + ones))
    kept = tuple(d for i, d in enumerate(s) if (d != 1 if axis is None else i != axis))
    return Case(lambda x: ops.squeeze(x, axis), [r.standard_normal(s)], lambda x: x.reshape(kept))


@st.composite
def concatenate_case(draw):
    r, s = rng(draw), draw(shapes(1))
    axis, count = axis_of(draw, len(s)), draw(st.integers(1, 3))
    parts = []
    for _ in range(count):
        p = list(s)
        p[axis] = draw(st.integers(1, 3))
        parts.append(r.standard_normal(p))

    def ref(*xs):
        moved = [np.moveaxis(x, axis, 0) for x in xs]
        return np.moveaxis(np.array([row for m in moved for row in m]), 0, axis)
    return Case(lambda *xs: ops.concatenate(list(xs), axis=axis), parts, ref)


@st.composite
def stack_case(draw):
    r, s = rng(draw), draw(shapes())
    axis, count = axis_of(draw, len(s), extra=1), draw(st.integers(1, 3))
    return Case(lambda *xs: ops.stack(list(xs), axis=axis), [r.standard_normal(s) for _ in range(count)],
                lambda *xs: np.moveaxis(np.array(xs), 0, axis))


@st.composite
def split_case(draw):
    r, s = rng(draw), draw(shapes(1))
    axis = axis_of(draw, len(s))
    size = s[axis]
    if draw(st.booleans()):
        sections = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        cuts = list(range(size // sections, size, size // sections))
    else:
        sections = cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))

    def ref(x):
        bounds = [0, *cuts, size]
        rows = np.moveaxis(x, axis, 0)
        return [np.moveaxis(rows[a:max(a, b)], 0, axis) for a, b in zip(bounds, bounds[1:])]
    return Case(lambda x: ops.split(x, sections, axis=axis), [r.standard_normal(s)], ref)


@st.composite
def repeat_case(draw):
    r, s = rng(draw), draw(shapes(1))
    axis = draw(st.one_of(st.none(), st.integers(-len(s), len(s) - 1)))
    n = int(np.prod(s)) if axis is None else s[axis]
    repeats = draw(st.one_of(st.integers(1, 3), st.lists(st.integers(0, 3), min_size=n, max_size=n)))

    def ref(x):
        rows = x.ravel() if axis is None else np.moveaxis(x, axis, 0)
        counts = [repeats] * n if isinstance(repeats, int) else repeats
        out = np.array([row for row, c in zip(rows, counts) for _ in range(c)]).reshape(
            (-1,) + rows.shape[1:])
        return out if axis is None else np.moveaxis(out, 0, axis)
    return Case(lambda x: ops.repeat(x, repeats, axis=axis), [r.standard_normal(s)], ref)


@st.composite
def tile_case(draw):
    r, s = rng(draw), draw(shapes())
    reps = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)))

    def ref(x):
        rank = max(len(reps), x.ndim)
        full = (1,) * (rank - len(reps)) + reps
        x = x.reshape((1,) * (rank - x.ndim) + x.shape)
        for axis, k in enumerate(full):
            x = np.concatenate([x] * k, axis=axis)
        return x
    return Case(lambda x: ops.tile(x, reps), [r.standard_normal(s)], ref)


@st.composite
def getitem_case(draw):
    r, s = rng(draw), draw(shapes(2))
    i = draw(st.integers(-s[0], s[0] - 1))
    rows = draw(st.lists(st.integers(0, s[1] - 1), min_size=1, max_size=4))   # repeats allowed
    key = draw(st.sampled_from([i, slice(None, None, 2), (slice(1, None), rows), (None, Ellipsis, -1),
                                (Ellipsis, slice(None, 1))]))
    plain = _plain_key(key)
    return Case(lambda x: apply("getitem", x, key=plain), [r.standard_normal(s)], lambda x: x[key])


@st.composite
def take_case(draw):
    r, s = rng(draw), draw(shapes(1))
    axis = draw(st.one_of(st.none(), st.integers(-len(s), len(s) - 1)))
    n = int(np.prod(s)) if axis is None else s[axis]
    idx = r.integers(-n, n, draw(shapes(0, 2)))        # negative: from the end, as NumPy's

    def ref(x, i):
        if axis is None:
            return x.ravel()[i]
        return x[(slice(None),) * (axis % x.ndim) + (i,)]
    return Case(lambda x, i: ops.take(x, i, axis=axis), [r.standard_normal(s), idx], ref)


CASES = {
    "add": binary(ops.add, lambda a, b: a + b),
    "subtract": binary(ops.subtract, lambda a, b: a - b),
    "multiply": binary(ops.multiply, lambda a, b: a * b),
    "divide": binary(ops.divide, lambda a, b: a / b, make2=away_from_zero),
    "power": binary(ops.power, lambda a, b: np.exp(b * np.log(a)), make=positive,
                    make2=lambda r, s: r.standard_normal(s)),
    "maximum": extreme_case(ops.maximum),
    "minimum": extreme_case(ops.minimum),
    "greater": binary(ops.greater, lambda a, b: a - b > 0),
    "greater_equal": binary(ops.greater_equal, lambda a, b: ~(a - b < 0)),
    "less": binary(ops.less, lambda a, b: a - b < 0),
    "less_equal": binary(ops.less_equal, lambda a, b: ~(a - b > 0)),
    "equal": binary(ops.equal, lambda a, b: a - b == 0, make=lambda r, s: r.integers(0, 2, s) * 1.0),
    "not_equal": binary(ops.not_equal, lambda a, b: a - b != 0, make=lambda r, s: r.integers(0, 2, s) * 1.0),
    "negative": unary(ops.negative, lambda x: 0 - x),
    "exp": unary(ops.exp, lambda x: np.e ** x),
    "log": unary(ops.log, lambda x: np.log2(x) / np.log2(np.e), make=positive),
    "sqrt": unary(ops.sqrt, lambda x: x ** 0.5, make=positive),
    "square": unary(ops.square, lambda x: x * x),
    "abs": unary(ops.abs, lambda x: np.where(x < 0, -x, x), make=away_from_zero),
    "clip": clip_case(),
    "where": where_case(),
    "matmul": matmul_case(),
    "cast": cast_case(),
    "relu": unary(ops.relu, lambda x: x * (x > 0), make=away_from_zero),
    "sigmoid": unary(ops.sigmoid, lambda x: 1 / (1 + np.exp(-x)), make=lambda r, s: 5 * r.standard_normal(s)),
    "tanh": unary(ops.tanh, lambda x: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1)),
    "softmax": softmax_case(ops.softmax),
    "log_softmax": softmax_case(ops.log_softmax),
    "one_hot": one_hot_case(),
    "standardize": standardize_case(),
    "sum": reduce_case(ops.sum),
    "mean": reduce_case(ops.mean),
    "max": reduce_case(ops.max),
    "min": reduce_case(ops.min),
    "reshape": reshape_case(),
    "transpose": transpose_case(),
    "expand_dims": expand_dims_case(),
    "squeeze": squeeze_case(),
    "concatenate": concatenate_case(),
    "stack": stack_case(),
    "split": split_case(),
    "repeat": repeat_case(),
    "tile": tile_case(),
    "getitem": getitem_case(),
    "take": take_case(),
}


def test_every_registered_op_has_a_case():
    """Catches an op registered without a gradient check (or a case left for a removed op)."""
    assert sorted(CASES) == sorted(OPS)


# -- the checks -------------------------------------------------------------------------

def record(case: Case, args: list):
    """Trace the public call on symbolic tensors shaped as `args`: (node, its outputs, the
    symbolic inputs)."""
    syms = [Symbolic(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in args]
    out = case.call(*syms)
    outs = out if isinstance(out, list) else [out]
    return outs[0].node, outs, syms


def node_inputs(node, syms, args):
    """The node's inputs with each symbolic tensor replaced by its array."""
    by_id = {id(s): a for s, a in zip(syms, args)}
    return [by_id.get(id(i), i) for i in node.inputs]


def is_float(a):
    return isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating)


@pytest.mark.parametrize("name", sorted(CASES))
@FAST
@given(data=st.data())
def test_vjp_matches_finite_differences(name, data):
    """Catches a wrong VJP (a sign, a missing factor, a transposed matmul term), a gradient not
    summed back over broadcast dimensions (its shape differs from the input's), a softmax or
    max whose gradient goes to the wrong axis, a take/getitem that drops a repeated index's
    second contribution, and a gradient for an integer input (take's indices, one_hot, cast)."""
    case = data.draw(CASES[name])
    node, _, syms = record(case, case.args)
    assert node.op == name
    o, xs = OPS[name], node_inputs(node, syms, case.args)
    out = o.forward(*xs, **node.attrs)
    outs = out if o.multi else [out]
    r = np.random.default_rng(0)
    gs = [r.standard_normal(np.shape(t)) for t in outs]
    grads = backward(o, gs if o.multi else gs[0], out, xs, node.attrs)
    float_out = any(is_float(np.asarray(t)) for t in outs)
    for i, (x, gx) in enumerate(zip(xs, grads)):
        if not (is_float(x) and float_out):      # an index, a mask, a cast to an integer
            assert gx is None, f"input {i} of {name} is {np.asarray(x).dtype}: no gradient"
            continue
        assert gx.shape == x.shape
        dx = r.standard_normal(x.shape)
        plus, minus = list(xs), list(xs)
        plus[i], minus[i] = x + EPS * dx, x - EPS * dx
        fp, fm = o.forward(*plus, **node.attrs), o.forward(*minus, **node.attrs)
        fp, fm = (fp, fm) if o.multi else ([fp], [fm])
        jvp = sum(float(np.sum(g * (p - m))) for g, p, m in zip(gs, fp, fm)) / (2 * EPS)
        assert abs(jvp - float(np.sum(gx * dx))) <= TOL * (1 + abs(jvp)), (name, i)


@pytest.mark.parametrize("name", sorted(CASES))
@FAST
@given(data=st.data())
def test_eager_equals_numpy(name, data):
    """Catches a forward that is not the function Keras's op names: a softmax over the wrong
    axis, split's cut points read as counts, take's negative indices or axis=None mishandled,
    one_hot giving a 1 for an id out of range, a reshape that reorders values."""
    case = data.draw(CASES[name])
    got, want = case.call(*case.args), case.ref(*case.args)
    if isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    else:
        assert np.shape(got) == np.shape(want)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def float32(a):
    return a.astype(np.float32) if is_float(a) else a


@pytest.mark.parametrize("name", sorted(CASES))
@FAST
@given(data=st.data())
def test_recording_gives_what_running_gives(name, data):
    """Catches a node whose recorded shape or dtype differs from what running it gives (attrs
    lost on the way to the node, a split recorded as one output, a float32 input recorded as
    float64), and a VJP that turns float32 gradients into float64 (training runs float32)."""
    case = data.draw(CASES[name])
    args = [float32(a) for a in case.args]
    node, recorded, syms = record(case, args)
    ran = case.call(*args)
    ran = ran if isinstance(ran, list) else [ran]
    assert [(s.shape, s.dtype) for s in recorded] == [(np.shape(a), np.asarray(a).dtype) for a in ran]
    assert node.outputs == recorded and all(s.node is node for s in recorded)
    o, xs = OPS[name], node_inputs(node, syms, args)
    out = o.forward(*xs, **node.attrs)
    gs = [np.ones(np.shape(t), np.float32) for t in (out if o.multi else [out])]
    grads = backward(o, gs if o.multi else gs[0], out, xs, node.attrs)
    assert [g.dtype for g, x in zip(grads, xs) if g is not None] == \
        [np.dtype(np.float32) for g, x in zip(grads, xs) if g is not None]


def test_float_ids_are_cast_as_keras_does():
    """Catches one_hot or take refusing (or misreading) float32 ids, which a keras.Input gives
    by default: Keras casts them to integers."""
    ids = np.array([[2, 0], [1, 3]])
    np.testing.assert_array_equal(ops.one_hot(ids.astype(np.float32), 4), ops.one_hot(ids, 4))
    table = np.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(ops.take(table, ids.astype(np.float32), axis=0), table[ids])
    assert ops.one_hot(S(None, dtype="float32"), 5).shape == (None, 5)


def test_integer_inputs_take_no_gradient():
    """Catches a VJP that returns a gradient for take's indices, one_hot's ids or a cast to
    an integer (an optimizer would then step an id)."""
    x, idx = np.ones((4, 3)), np.array([1, 1, 3])
    assert OPS["take"].vjp(np.ones((3, 3)), None, x, idx, axis=0)[1] is None
    assert OPS["one_hot"].vjp(np.ones((3, 4)), None, idx, num_classes=4) == (None,)
    as_int = ops.cast(x, "int32")
    assert OPS["cast"].vjp(np.ones((4, 3)), as_int, x, dtype="int32") == (None,)
    assert OPS["cast"].vjp(np.ones(3), np.ones(3), idx, dtype="float32") == (None,)


# -- symbolic tensors with a batch ------------------------------------------------------

def S(*shape, dtype="float32"):
    return Symbolic(shape, dtype)


W = np.ones((4, 3), np.float32)
BATCH = [
    (lambda: ops.matmul(S(None, 4), W), [(None, 3)]),
    (lambda: ops.add(S(None, 3), np.ones(3, np.float32)), [(None, 3)]),
    (lambda: ops.concatenate([S(None, 2), S(None, 3)], axis=-1), [(None, 5)]),
    (lambda: ops.reshape(S(None, 6), (-1, 2, 3)), [(None, 2, 3)]),
    (lambda: ops.sum(S(None, 4, 5), axis=1), [(None, 5)]),
    (lambda: ops.mean(S(None, 4), axis=0, keepdims=True), [(1, 4)]),
    (lambda: ops.max(S(None, 4), axis=-1), [(None,)]),
    (lambda: ops.split(S(None, 6), 3, axis=1), [(None, 2)] * 3),
    (lambda: ops.split(S(None, 6), [1, 4], axis=-1), [(None, 1), (None, 3), (None, 2)]),
    (lambda: ops.take(np.ones((10, 4), np.float32), S(None, 5, dtype="int32"), axis=0), [(None, 5, 4)]),
    (lambda: ops.one_hot(S(None, dtype="int32"), 7), [(None, 7)]),
    (lambda: S(None, 4, 5)[:, 1:3], [(None, 2, 5)]),
    (lambda: ops.transpose(S(None, 4, 5), (0, 2, 1)), [(None, 5, 4)]),
    (lambda: ops.expand_dims(S(None, 4), -1), [(None, 4, 1)]),
    (lambda: ops.squeeze(S(None, 4, 1), -1), [(None, 4)]),
    (lambda: ops.stack([S(None, 3), S(None, 3)], axis=1), [(None, 2, 3)]),
    (lambda: ops.repeat(ops.expand_dims(S(None, 3), 1), 4, axis=1), [(None, 4, 3)]),
    (lambda: ops.tile(S(None, 3), (1, 2)), [(None, 6)]),
    (lambda: ops.softmax(S(None, 10)), [(None, 10)]),
    (lambda: ops.where(np.array([True, False]), S(None, 2), 0.0), [(None, 2)]),
    (lambda: ops.where(np.bool_(True), S(None, 2), 0.0), [(None, 2)]),
    (lambda: ops.clip(S(None, 2), 0, 1), [(None, 2)]),
    (lambda: (lambda x: ops.where(x > 0, x, 0.1 * x))(S(None, 3)), [(None, 3)]),   # a leaky relu
]


@pytest.mark.parametrize("build,shapes", BATCH)
def test_a_batch_dimension_stays_none(build, shapes):
    """Catches an op that fixes the batch to the size it was traced at (split, take, reshape
    with -1), or that makes a batch of a dimension that is not one (mean over the batch)."""
    out = build()
    out = out if isinstance(out, list) else [out]
    assert [s.shape for s in out] == shapes
    assert all(s.dtype == np.float32 for s in out)


@pytest.mark.parametrize("expr,op", [
    (lambda x: x + 2, "add"), (lambda x: 2 + x, "add"), (lambda x: x - 2, "subtract"),
    (lambda x: 2 - x, "subtract"), (lambda x: x * 3, "multiply"), (lambda x: 3 * x, "multiply"),
    (lambda x: x / 2, "divide"), (lambda x: 2 / x, "divide"), (lambda x: -x, "negative"),
    (lambda x: x ** 2, "power"), (lambda x: 2 ** x, "power"), (lambda x: abs(x), "abs"),
    (lambda x: x @ np.ones((3, 2), np.float32), "matmul"), (lambda x: x[:, ::-1], "getitem"),
    (lambda x: x > 2, "greater"), (lambda x: 2 > x, "less"), (lambda x: x <= 2, "less_equal"),
    (lambda x: 2 <= x, "greater_equal"),
])
def test_python_operators_record_the_op_they_compute(expr, op):
    """Catches a reflected operator that swaps its operands (2 - x recorded as x - 2), and a
    Python number that makes a float32 graph float64."""
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    out = expr(S(None, 3))
    want = expr(x)                  # NumPy on the float32 array: float32 (bool for a comparison)
    assert (out.node.op, out.dtype) == (op, want.dtype)
    inputs = [x if isinstance(i, Symbolic) else i for i in out.node.inputs]
    got = OPS[op].forward(*inputs, **out.node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == want.dtype


# -- bad input --------------------------------------------------------------------------

BAD = [
    ("add", lambda t: ops.add(t((2, 3)), t((4,))), ["(2, 3)", "(4,)"]),
    ("multiply", lambda t: ops.multiply(t((5, 2)), t((3, 1))), ["(5, 2)", "(3, 1)"]),
    ("matmul", lambda t: ops.matmul(t((2, 3)), t((4, 5))), ["(2, 3)", "(4, 5)"]),
    ("concatenate", lambda t: ops.concatenate([t((2, 3)), t((2, 4))], axis=0), ["(2, 3)", "(2, 4)"]),
    ("stack", lambda t: ops.stack([t((2, 3)), t((2, 4))]), ["(2, 3)", "(2, 4)"]),
    ("sum", lambda t: ops.sum(t((2, 3)), axis=2), ["(2, 3)", "axis=2"]),
    ("softmax", lambda t: ops.softmax(t((2, 3)), axis=-3), ["(2, 3)", "axis=-3"]),
    ("max", lambda t: ops.max(t((2, 3)), axis=(0, 5)), ["(2, 3)", "axis=(0, 5)"]),
    ("reshape", lambda t: ops.reshape(t((2, 3)), (4, -1)), ["(2, 3)", "newshape=(4, -1)"]),
    ("transpose", lambda t: ops.transpose(t((2, 3)), (0, 1, 2)), ["(2, 3)", "axes=(0, 1, 2)"]),
    ("split", lambda t: ops.split(t((2, 3)), 2, axis=1), ["(2, 3)", "indices_or_sections=2"]),
    ("squeeze", lambda t: ops.squeeze(t((2, 3)), axis=0), ["(2, 3)", "axis=0"]),
    ("expand_dims", lambda t: ops.expand_dims(t((2, 3)), 4), ["(2, 3)", "axis=4"]),
    ("where", lambda t: ops.where(np.ones(3, bool), t((2, 2)), 0.0), ["(3,)", "(2, 2)"]),
]


@pytest.mark.parametrize("symbolic", [False, True], ids=["eager", "symbolic"])
@pytest.mark.parametrize("name,call,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_op_and_the_shapes(name, call, needles, symbolic):
    """Catches NumPy's own error (a ValueError or AxisError without the op's name) reaching the
    user, eagerly or while a graph is traced, and a message that leaves out the shapes."""
    def tensor(shape):
        return Symbolic(shape) if symbolic else np.ones(shape, np.float32)
    with pytest.raises(ConfigError) as e:
        call(tensor)
    message = str(e.value)
    assert message.startswith(f"op {name}:") and all(n in message for n in needles), message


def test_refusals_outside_numpy():
    """Catches a where() without branches returning a value-dependent shape, a symbolic index,
    and an op on something that is not a tensor."""
    with pytest.raises(ConfigError, match="where needs x1 and x2"):
        ops.where(np.ones(3, bool))
    with pytest.raises(ConfigError, match="use pserver.ops.take"):
        S(None, 3)[S(None, dtype="int32")]
    with pytest.raises(ConfigError, match="is not a tensor"):
        ops.add(S(None, 3), "x")


# -- Keras's names ----------------------------------------------------------------------

def test_keras_ops_are_pserver_ops():
    """Catches a name in pserver.keras.ops's __all__ that it does not import, one that is not
    pserver.ops's function, and a missing Keras name answered by a bare AttributeError."""
    from pserver.keras import ops as keras_ops
    assert keras_ops is kops
    assert [n for n in kops.__all__ if getattr(kops, n) is not getattr(ops, n)] == []
    with pytest.raises(NotInKeras, match="keras.ops.einsum"):
        kops.einsum


def test_convert_to_tensor_and_shape():
    """Catches Python floats becoming float64 tensors (Keras gives float32), a symbolic tensor
    not cast to the dtype asked for, and shape() losing a symbolic batch's None."""
    assert ops.convert_to_tensor([1.0, 2.0]).dtype == np.float32
    assert ops.convert_to_tensor([1, 2]).dtype == np.int32
    assert ops.convert_to_tensor(np.ones(2), dtype="float16").dtype == np.float16
    x = S(None, 3)
    assert ops.convert_to_tensor(x) is x
    assert ops.convert_to_tensor(x, dtype="float64").dtype == np.float64
    assert ops.shape(x) == (None, 3) and ops.shape(np.ones((2, 5))) == (2, 5)
