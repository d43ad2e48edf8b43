"""Element-wise arithmetic and comparisons with NumPy's broadcasting, matmul and cast: each op's
forward (NumPy, which is also its twin: these are memory-bound, and matmul goes to NumPy's BLAS)
beside its VJP. A binary op's VJP sums each gradient back to its input's shape (unbroadcast)."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.ops.core import Op, apply, register, unbroadcast


def _binary(name: str, forward, d1, d2) -> None:
    """A broadcasting op whose partial derivatives d1(x1, x2, out), d2(...) are element-wise."""
    def vjp(g, out, x1, x2):
        return unbroadcast(g * d1(x1, x2, out), x1.shape), unbroadcast(g * d2(x1, x2, out), x2.shape)
    register(Op(name, forward, vjp))


def _unary(name: str, forward, d) -> None:
    """An element-wise op whose derivative is d(x, out)."""
    register(Op(name, forward, lambda g, out, x: (g * d(x, out),)))


register(Op("add", np.add, lambda g, out, x1, x2: (unbroadcast(g, x1.shape), unbroadcast(g, x2.shape))))
register(Op("subtract", np.subtract,
            lambda g, out, x1, x2: (unbroadcast(g, x1.shape), unbroadcast(-g, x2.shape))))
_binary("multiply", np.multiply, lambda x1, x2, out: x2, lambda x1, x2, out: x1)
_binary("divide", np.divide, lambda x1, x2, out: 1 / x2, lambda x1, x2, out: -out / x2)
# d/dx2 x1**x2 = out * log(x1), defined for x1 > 0 only: 0 elsewhere rather than nan
_binary("power", np.power, lambda x1, x2, out: x2 * np.power(x1, x2 - 1),
        lambda x1, x2, out: out * np.log(np.where(x1 > 0, x1, 1)))
# a tie (x1 == x2) sends the gradient to x1 only: a subgradient, as TensorFlow's
_binary("maximum", np.maximum, lambda x1, x2, out: x1 >= x2, lambda x1, x2, out: x1 < x2)
_binary("minimum", np.minimum, lambda x1, x2, out: x1 <= x2, lambda x1, x2, out: x1 > x2)


def _comparison(name: str, forward) -> None:
    """Booleans (for where and masks), through which no gradient flows."""
    register(Op(name, forward, lambda g, out, x1, x2: (None, None), differentiable=(False, False)))


_comparison("greater", np.greater)
_comparison("greater_equal", np.greater_equal)
_comparison("less", np.less)
_comparison("less_equal", np.less_equal)
_comparison("equal", np.equal)
_comparison("not_equal", np.not_equal)

register(Op("negative", np.negative, lambda g, out, x: (-g,)))
_unary("exp", np.exp, lambda x, out: out)
_unary("log", np.log, lambda x, out: 1 / x)
_unary("sqrt", np.sqrt, lambda x, out: 0.5 / out)
_unary("square", np.square, lambda x, out: 2 * x)
_unary("abs", np.abs, lambda x, out: np.sign(x))


def _clip_vjp(g, out, x, lo, hi):
    """Inside [lo, hi] the gradient goes to x; below to lo, above to hi (broadcast bounds)."""
    below, above = x < lo, x > hi
    inside = ~(below | above)
    return (unbroadcast(g * inside, x.shape), unbroadcast(g * below, lo.shape),
            unbroadcast(g * above, hi.shape))


register(Op("clip", np.clip, _clip_vjp))


def _where_vjp(g, out, condition, x1, x2):
    take = condition.astype(bool)
    return None, unbroadcast(g * take, x1.shape), unbroadcast(g * ~take, x2.shape)


register(Op("where", lambda c, x1, x2: np.where(c, x1, x2), _where_vjp, differentiable=(False, True, True)))


def _matmul_vjp(g, out, a, b):
    """np.matmul's VJP, with NumPy's rules: a 1-D operand is a row (a) or a column (b) that the
    product drops again, and the leading (batch) dimensions broadcast."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = np.expand_dims(g, -1) if b.ndim == 1 else g      # the column first: it was the last axis
    g2 = np.expand_dims(g2, -2) if a.ndim == 1 else g2
    ga = unbroadcast(g2 @ np.swapaxes(b2, -1, -2), a2.shape)
    gb = unbroadcast(np.swapaxes(a2, -1, -2) @ g2, b2.shape)
    return ga.reshape(a.shape), gb.reshape(b.shape)


register(Op("matmul", np.matmul, _matmul_vjp))


def _cast_vjp(g, out, x, dtype):
    """A cast between floats passes the gradient on (in x's dtype); to or from an integer none."""
    floats = np.issubdtype(x.dtype, np.floating) and np.issubdtype(out.dtype, np.floating)
    return (g.astype(x.dtype, copy=False) if floats else None,)


register(Op("cast", lambda x, dtype: x.astype(dtype), _cast_vjp))


def add(x1, x2):
    return apply("add", x1, x2)


def subtract(x1, x2):
    return apply("subtract", x1, x2)


def multiply(x1, x2):
    return apply("multiply", x1, x2)


def divide(x1, x2):
    return apply("divide", x1, x2)


def power(x1, x2):
    return apply("power", x1, x2)


def maximum(x1, x2):
    return apply("maximum", x1, x2)


def minimum(x1, x2):
    return apply("minimum", x1, x2)


def greater(x1, x2):
    return apply("greater", x1, x2)


def greater_equal(x1, x2):
    return apply("greater_equal", x1, x2)


def less(x1, x2):
    return apply("less", x1, x2)


def less_equal(x1, x2):
    return apply("less_equal", x1, x2)


def equal(x1, x2):
    return apply("equal", x1, x2)


def not_equal(x1, x2):
    return apply("not_equal", x1, x2)


def negative(x):
    return apply("negative", x)


def exp(x):
    return apply("exp", x)


def log(x):
    return apply("log", x)


def sqrt(x):
    return apply("sqrt", x)


def square(x):
    return apply("square", x)


def abs(x):
    return apply("abs", x)


absolute = abs


def clip(x, x_min, x_max):
    """x limited to [x_min, x_max]; the bounds may be numbers or tensors that broadcast with x."""
    return apply("clip", x, x_min, x_max)


def where(condition, x1=None, x2=None):
    """x1 where condition holds, x2 elsewhere. Keras's where(condition) alone (the indices where it
    holds) has a shape that depends on the values, which a graph cannot have."""
    if x1 is None or x2 is None:
        raise ConfigError("ops.where needs x1 and x2: where(condition) alone gives indices whose "
                          "number depends on the values (use it on NumPy arrays outside the model)")
    return apply("where", condition, x1, x2)


def matmul(x1, x2):
    return apply("matmul", x1, x2)


def cast(x, dtype):
    return apply("cast", x, dtype=np.dtype(dtype).name)


__all__ = ["add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "greater", "greater_equal",
           "less", "less_equal", "equal", "not_equal", "negative", "exp",
           "log", "sqrt", "square", "abs", "absolute", "clip", "where", "matmul", "cast"]
