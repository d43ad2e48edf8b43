"""Ops that move values without arithmetic: reshape, transpose, expand_dims, squeeze, concatenate,
stack, split, repeat, tile, slicing (getitem) and take; each VJP routes g back to where the
values came from. Also Keras's convert_to_tensor, shape and arange (values from no input)."""

from __future__ import annotations

import numpy as np

from pserver.ops.core import Op, Symbolic, apply, ids, key_of, register


def _like_input(g, out, x, **attrs):
    """The VJP of every op that only reshapes: g in x's shape."""
    return (g.reshape(x.shape),)


register(Op("reshape", lambda x, newshape: np.reshape(x, newshape), _like_input))
register(Op("expand_dims", lambda x, axis: np.expand_dims(x, axis), _like_input))
register(Op("squeeze", lambda x, axis=None: np.squeeze(x, axis), _like_input))


def _transpose_vjp(g, out, x, axes=None):
    if axes is None:
        return (np.transpose(g),)
    return (np.transpose(g, np.argsort([a % x.ndim for a in axes])),)


register(Op("transpose", lambda x, axes=None: np.transpose(x, axes), _transpose_vjp))


def _concatenate_vjp(g, out, *xs, axis=0):
    cuts = np.cumsum([x.shape[axis] for x in xs])[:-1]
    return tuple(np.split(g, cuts, axis=axis))


register(Op("concatenate", lambda *xs, axis=0: np.concatenate(xs, axis=axis), _concatenate_vjp))
register(Op("stack", lambda *xs, axis=0: np.stack(xs, axis=axis),
            lambda g, out, *xs, axis=0: tuple(np.take(g, i, axis=axis) for i in range(len(xs)))))


def _split_vjp(gs, outs, x, indices_or_sections, axis=0):
    """The pieces' cotangents side by side again; a piece nothing used contributes zeros."""
    parts = [np.zeros_like(o) if g is None else g for g, o in zip(gs, outs)]
    return (np.concatenate(parts, axis=axis),)


register(Op("split", lambda x, indices_or_sections, axis=0: np.split(x, indices_or_sections, axis=axis),
            _split_vjp, multi=True))


def _repeat_vjp(g, out, x, repeats, axis=None):
    """Each element's copies summed back onto it."""
    src = x.reshape(-1) if axis is None else x
    ax = 0 if axis is None else axis % x.ndim
    n = src.shape[ax]
    if isinstance(repeats, int):          # n runs of `repeats` copies: sum each run
        runs = g.reshape(src.shape[:ax] + (n, repeats) + src.shape[ax + 1:])
        return (runs.sum(axis=ax + 1).reshape(x.shape),)
    owner = np.repeat(np.arange(n), repeats)      # the element each copy came from
    gx = np.zeros_like(src)
    np.add.at(np.moveaxis(gx, ax, 0), owner, np.moveaxis(g, ax, 0))
    return (gx.reshape(x.shape),)


register(Op("repeat", lambda x, repeats, axis=None: np.repeat(x, repeats, axis=axis), _repeat_vjp))


def _tile_vjp(g, out, x, repeats):
    """The tiles summed: g seen as (r0, d0, r1, d1, ...) with the rank padded as np.tile pads it."""
    rank = max(len(repeats), x.ndim)
    reps = (1,) * (rank - len(repeats)) + tuple(repeats)
    dims = (1,) * (rank - x.ndim) + x.shape
    tiles = g.reshape([n for pair in zip(reps, dims) for n in pair])
    return (tiles.sum(axis=tuple(range(0, 2 * rank, 2))).reshape(x.shape),)


register(Op("tile", lambda x, repeats: np.tile(x, repeats), _tile_vjp))


def _basic(key) -> bool:
    """Whether indexing with `key` is NumPy's basic indexing (ints, slices, None, ...), which
    reaches each element at most once."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice, np.integer)) for k in parts)


def _getitem_vjp(g, out, x, key):
    k = key_of(key)
    gx = np.zeros_like(x)
    if _basic(k):
        gx[k] = g
    else:                         # an index array may repeat an element: accumulate
        np.add.at(gx, k, g)
    return (gx,)


register(Op("getitem", lambda x, key: x[key_of(key)], _getitem_vjp))


def _take_vjp(g, out, x, indices, axis=None):
    """Each taken element's gradient added back at its index (an index taken twice gets both)."""
    indices = ids(indices)
    gx = np.zeros_like(x)
    if axis is None:
        np.add.at(gx.reshape(-1), indices, g)
        return gx, None
    axis %= x.ndim
    # out's axes: x's before `axis`, then the indices', then x's after it
    moved = np.moveaxis(g, list(range(axis, axis + indices.ndim)), list(range(indices.ndim)))
    np.add.at(np.moveaxis(gx, axis, 0), indices, moved)
    return gx, None


register(Op("take", lambda x, indices, axis=None: np.take(x, ids(indices), axis=axis), _take_vjp,
            differentiable=(True, False)))


def reshape(x, newshape):
    return apply("reshape", x, newshape=tuple(-1 if d is None else int(d) for d in newshape))


def transpose(x, axes=None):
    return apply("transpose", x, axes=None if axes is None else tuple(int(a) for a in axes))


def expand_dims(x, axis):
    return apply("expand_dims", x, axis=tuple(axis) if isinstance(axis, list) else axis)


def squeeze(x, axis=None):
    return apply("squeeze", x, axis=tuple(axis) if isinstance(axis, list) else axis)


def concatenate(xs, axis=0):
    return apply("concatenate", *xs, axis=axis)


def stack(x, axis=0):
    return apply("stack", *x, axis=axis)


def split(x, indices_or_sections, axis=0):
    """A list of pieces; `indices_or_sections` as NumPy's (a count of equal pieces, or where
    to cut)."""
    sections = indices_or_sections
    return apply("split", x, indices_or_sections=sections if isinstance(sections, int) else tuple(sections),
                 axis=axis)


def repeat(x, repeats, axis=None):
    """Each element `repeats` times along `axis` (None: x flattened); `repeats` an int or one
    count per element, known when the graph is built."""
    counts = repeats if isinstance(repeats, int) else tuple(int(r) for r in np.ravel(repeats))
    return apply("repeat", x, repeats=counts, axis=axis)


def tile(x, repeats):
    reps = (int(repeats),) if np.ndim(repeats) == 0 else tuple(int(r) for r in repeats)
    return apply("tile", x, repeats=reps)


def take(x, indices, axis=None):
    return apply("take", x, indices, axis=axis)


def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
    """x as an array (a symbolic tensor stays one, cast when `dtype` differs). Python numbers
    become float32 and int32, as Keras's."""
    if isinstance(x, Symbolic):
        same = dtype is None or np.dtype(dtype) == x.dtype
        return x if same else apply("cast", x, dtype=np.dtype(dtype).name)
    if isinstance(x, np.ndarray) or dtype is not None:
        return np.asarray(x, dtype=dtype)
    a = np.asarray(x)
    if np.issubdtype(a.dtype, np.floating):
        return a.astype(np.float32)
    return a.astype(np.int32) if np.issubdtype(a.dtype, np.integer) else a


def arange(start, stop=None, step=1, dtype=None):
    """Keras's arange: start, start + step, ... below stop (arange(n) counts from 0); int32 for
    integer arguments, float32 for a float one, unless `dtype` says. Its arguments are numbers
    (ops.shape(x)[-1] is one), so it is no op of a graph: an array, a constant where a graph
    uses it (nothing to differentiate: it has no input)."""
    if stop is None:
        start, stop = 0, start
    floats = any(isinstance(v, float) for v in (start, stop, step))
    return np.arange(start, stop, step).astype(dtype or ("float32" if floats else "int32"))


def shape(x) -> tuple:
    """x's shape as a tuple (None for a symbolic tensor's batch)."""
    return tuple(x.shape)


__all__ = ["reshape", "transpose", "expand_dims", "squeeze", "concatenate", "stack", "split", "repeat",
           "tile", "take", "convert_to_tensor", "shape", "arange"]
