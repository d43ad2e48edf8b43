"""Reductions over axes (sum, mean, max, min), NumPy's `axis` (None: all, an int or a tuple) and
`keepdims`; each VJP spreads g back over the reduced axes."""

from __future__ import annotations

import numpy as np

from pserver.ops.core import Op, apply, register


def _axes(axis, ndim: int) -> tuple[int, ...]:
    """`axis` as the non-negative axes it reduces (None: all)."""
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(int(a) % ndim for a in axes)   # forward already refused an axis out of range


def _kept(g, x, axis, keepdims):
    """g with the reduced axes back as size 1, so it broadcasts against x."""
    return g if keepdims else np.expand_dims(g, _axes(axis, x.ndim))


def _sum_vjp(g, out, x, axis=None, keepdims=False):
    return (np.broadcast_to(_kept(g, x, axis, keepdims), x.shape),)


def _mean_vjp(g, out, x, axis=None, keepdims=False):
    count = int(np.prod([x.shape[a] for a in _axes(axis, x.ndim)]))
    return (np.broadcast_to(_kept(g, x, axis, keepdims) / count, x.shape),)


def _extreme_vjp(g, out, x, axis=None, keepdims=False):
    """g to the elements equal to the max (min), shared equally among ties (as JAX's)."""
    hit = x == _kept(out, x, axis, keepdims)
    share = _kept(g, x, axis, keepdims) / hit.sum(axis=_axes(axis, x.ndim), keepdims=True, dtype=g.dtype)
    return (hit * share,)


register(Op("sum", lambda x, axis=None, keepdims=False: np.sum(x, axis=axis, keepdims=keepdims), _sum_vjp))
register(Op("mean", lambda x, axis=None, keepdims=False: np.mean(x, axis=axis, keepdims=keepdims),
            _mean_vjp))
register(Op("max", lambda x, axis=None, keepdims=False: np.max(x, axis=axis, keepdims=keepdims),
            _extreme_vjp))
register(Op("min", lambda x, axis=None, keepdims=False: np.min(x, axis=axis, keepdims=keepdims),
            _extreme_vjp))


def _axis(axis):
    """A node's attrs are plain values: a list of axes as a tuple."""
    return tuple(axis) if isinstance(axis, list) else axis


def sum(x, axis=None, keepdims=False):
    return apply("sum", x, axis=_axis(axis), keepdims=bool(keepdims))


def mean(x, axis=None, keepdims=False):
    return apply("mean", x, axis=_axis(axis), keepdims=bool(keepdims))


def max(x, axis=None, keepdims=False, initial=None):
    return _extreme("max", x, axis, keepdims, initial)


def min(x, axis=None, keepdims=False, initial=None):
    return _extreme("min", x, axis, keepdims, initial)


def _extreme(name, x, axis, keepdims, initial):
    """max/min; `initial` bounds the result (max(x, initial=0) is never below 0), as a maximum
    (minimum) with it after the reduction, so that its gradient goes where it belongs."""
    out = apply(name, x, axis=_axis(axis), keepdims=bool(keepdims))
    if initial is None:
        return out
    return apply("maximum" if name == "max" else "minimum", out, initial)


__all__ = ["sum", "mean", "max", "min"]
