"""Merge layers, Keras's: several tensors in, one out (Add, Concatenate, Dot, ...), and their
functions (layers.add([a, b]), ...).

A merge layer is called on a list (`takes_list`): its forward gets the list of inputs, its
backward a list of dx buffers (None where nothing before needs the gradient). The math is the
kernel module's GRAPH_KERNELS (pserver.kernels): NumPy on the host (memory-bound element-wise
work that a compiled kernel would not speed up), numba.cuda on the GPU. Dot's is NumPy's only.
"""

from __future__ import annotations

import math

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer, ones_over_steps
from pserver.ops import math as ops_math
from pserver.ops import shape as ops_shape


class _Merge(Layer):
    takes_list = True
    arity: int | None = None       # exactly this many inputs (Subtract: 2), else at least 2

    def build(self, input_shape):
        shapes = [tuple(s) for s in input_shape]
        few = len(shapes) < 2 if self.arity is None else len(shapes) != self.arity
        if few:
            need = "at least 2" if self.arity is None else f"exactly {self.arity}"
            raise ConfigError(f"{self.label}: takes {need} inputs, got {len(shapes)}")
        self.input_shape = shapes
        self.output_shape = self.output_shape_for(shapes)
        return self.output_shape

    def output_mask(self, xs):
        """Keras's merge: the steps every masked input keeps (the product of their masks)."""
        masks = [x.mask for x in xs if x.mask is not None]
        out = masks[0] if masks else None
        for m in masks[1:]:
            out = ops_math.multiply(out, m)
        return out

    def mismatch(self, shapes, why: str) -> ConfigError:
        return ConfigError(f"{self.label}: inputs of shapes {', '.join(map(str, shapes))} do not merge: "
                           f"{why}")


class _Elementwise(_Merge):
    """Inputs of one shape, combined element by element."""

    def output_shape_for(self, input_shape):
        if len(set(input_shape)) != 1:
            raise self.mismatch(input_shape, "they must have the same shape")
        return input_shape[0]


class Add(_Elementwise):
    kind = "add"

    def forward(self, k, p, x, out, s, run):
        k.copy(x[0], out)
        for xi in x[1:]:
            k.elementwise("add", out, xi, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        for d in dx:
            if d is not None:
                k.copy(dout, d)


class Subtract(_Elementwise):
    kind = "subtract"
    arity = 2

    def forward(self, k, p, x, out, s, run):
        k.elementwise("subtract", x[0], x[1], out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx[0] is not None:
            k.copy(dout, dx[0])
        if dx[1] is not None:
            k.scale_by(dout, -1.0, dx[1])


class Average(_Elementwise):
    kind = "average"

    def forward(self, k, p, x, out, s, run):
        Add.forward(self, k, p, x, out, s, run)
        k.scale_by(out, 1.0 / len(x), out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        for d in dx:
            if d is not None:
                k.scale_by(dout, 1.0 / len(x), d)


class Multiply(_Elementwise):
    kind = "multiply"

    def forward(self, k, p, x, out, s, run):
        k.copy(x[0], out)
        for xi in x[1:]:
            k.elementwise("multiply", out, xi, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        for i, d in enumerate(dx):
            if d is None:
                continue
            k.copy(dout, d)             # the product of the others: no division by x[i] (zeros)
            for j, xj in enumerate(x):
                if j != i:
                    k.elementwise("multiply", d, xj, d)


class _Extreme(_Elementwise):
    """Maximum / Minimum: the gradient goes to the first input holding the extreme."""
    extreme = "max"

    def scratch(self, n, dtype):
        return {"which": np.empty((n, *self.output_shape), np.int32)}   # the input holding it

    def forward(self, k, p, x, out, s, run):
        k.extreme_forward(self.extreme, x, out, s["which"])

    def backward(self, k, p, g, x, out, dout, dx, s):
        for i, d in enumerate(dx):
            if d is not None:
                k.select_grad(dout, s["which"], i, d)


class Maximum(_Extreme):
    kind = "maximum"
    extreme = "max"


class Minimum(_Extreme):
    kind = "minimum"
    extreme = "min"


class Concatenate(_Merge):
    """Concatenate(axis=-1): along `axis` (of the batched tensor, as Keras's; not the batch)."""
    kind = "concatenate"

    def output_mask(self, xs):
        """Keras's: along the features, a step counts where any input's does (an input without a
        mask counts everywhere: no mask); along the steps of sequences, the masks concatenated."""
        if all(x.mask is None for x in xs):
            return None
        rank = len(xs[0].shape)
        axis = self.axis % rank
        if axis == rank - 1:
            if any(x.mask is None for x in xs):
                return None
            out = xs[0].mask
            for x in xs[1:]:
                out = ops_math.maximum(out, x.mask)
            return out
        if axis == 1 and rank == 3:
            return ops_shape.concatenate([ones_over_steps(x) if x.mask is None else x.mask for x in xs],
                                         axis=1)
        return None

    def __init__(self, axis: int = -1, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(axis, int) or isinstance(axis, bool) or axis == 0:
            raise ConfigError(f"Concatenate: axis must be a non-zero integer (0 is the batch), got {axis!r}")
        self.axis = axis

    def output_shape_for(self, input_shape):
        ranks = {len(s) for s in input_shape}
        a = self.axis - 1 if self.axis > 0 else self.axis + len(input_shape[0])
        if len(ranks) != 1 or not 0 <= a < len(input_shape[0]):
            raise self.mismatch(input_shape, f"axis {self.axis} needs inputs of one rank that has it")
        rest = {s[:a] + s[a + 1:] for s in input_shape}
        if len(rest) != 1:
            raise self.mismatch(input_shape, f"they must agree on every axis but {self.axis}")
        self.sizes = [s[a] for s in input_shape]
        return (*input_shape[0][:a], sum(self.sizes), *input_shape[0][a + 1:])

    @property
    def _batched_axis(self) -> int:
        return self.axis if self.axis > 0 else self.axis + len(self.output_shape) + 1

    def _as_columns(self, a):
        """a as (everything before the axis, the axis and everything after): each input is then
        a block of columns of the output's."""
        rows = math.prod(a.shape[:self._batched_axis])
        return a.reshape(rows, a.size // rows)

    def forward(self, k, p, x, out, s, run):
        whole, start = self._as_columns(out), 0
        for xi in x:
            part = self._as_columns(xi)
            k.columns_into(part, whole, start)
            start += part.shape[1]

    def backward(self, k, p, g, x, out, dout, dx, s):
        whole, start = self._as_columns(dout), 0
        for xi, d in zip(x, dx):
            width = xi.size // whole.shape[0]
            if d is not None:
                k.columns_from(whole, start, self._as_columns(d))
            start += width


class Dot(_Merge):
    """Dot(axes): the batched dot product of two tensors along `axes` (an int, or one axis per
    input; the batch is axis 0, as Keras's), for inputs of rank 2 or 3 with the batch:
    (n, d)·(n, d) -> (n, 1); (n, m, d)·(n, k, d) with axes=2 -> (n, m, k) (DLRM's interaction)."""

    def output_mask(self, xs):
        return None                      # Keras's Dot: no mask
    kind = "dot"
    arity = 2

    def __init__(self, axes, normalize: bool = False, **kwargs):
        super().__init__(**kwargs)
        pair = (axes, axes) if isinstance(axes, int) else tuple(axes)
        if len(pair) != 2 or not all(isinstance(a, int) and not isinstance(a, bool) and a != 0 for a in pair):
            raise ConfigError(f"Dot: axes must be a non-zero integer or a pair of them (0 is the batch), "
                              f"got {axes!r}")
        if normalize:
            raise ConfigError("Dot: normalize=True is not supported (docs/guide/keras.md)")
        self.axes, self.normalize = axes, normalize

    def output_shape_for(self, input_shape):
        a, b = input_shape
        if len(a) not in (1, 2) or len(b) != len(a):
            raise self.mismatch(input_shape, "Dot takes two inputs of rank 2 or 3 (with the batch)")
        pair = (self.axes, self.axes) if isinstance(self.axes, int) else tuple(self.axes)
        self.ax = [p - 1 if p > 0 else p + len(s) for p, s in zip(pair, input_shape)]
        if not all(0 <= ax < len(s) for ax, s in zip(self.ax, input_shape)) or \
                a[self.ax[0]] != b[self.ax[1]]:
            raise self.mismatch(input_shape, f"axes {self.axes} must have one size in both")
        if len(a) == 1:
            return (1,)
        return (a[1 - self.ax[0]], b[1 - self.ax[1]])

    def _operands(self, x):
        """The product as op(a) @ op(b) of (batch, rows, cols) operands: (a, b, whether a is
        transposed, whether b is) so that op(a) is (n, m, d) and op(b) (n, d, k), the contracted
        axes last and first. Reshapes only (device arrays too): the backend's batched_matmul
        reads the transposes."""
        a, b = x
        n = a.shape[0]
        if len(a.shape) == 2:
            return a.reshape(n, 1, a.shape[1]), b.reshape(n, b.shape[1], 1), False, False
        return a, b, self.ax[0] != 1, self.ax[1] != 0

    def forward(self, k, p, x, out, s, run):
        a, b, ta, tb = self._operands(x)
        m, kk = a.shape[1 if not ta else 2], b.shape[2 if not tb else 1]
        k.batched_matmul(a, b, out.reshape(a.shape[0], m, kk), ta, tb)

    def backward(self, k, p, g, x, out, dout, dx, s):
        a, b, ta, tb = self._operands(x)
        d = dout.reshape(a.shape[0], a.shape[1 if not ta else 2], b.shape[2 if not tb else 1])
        if dx[0] is not None:          # d op(a) = d @ op(b)^T, transposed back where a was
            args = (b, d, tb, True) if ta else (d, b, False, not tb)
            k.batched_matmul(*args[:2], dx[0].reshape(a.shape), *args[2:])
        if dx[1] is not None:          # d op(b) = op(a)^T @ d, transposed back where b was
            args = (d, a, True, ta) if tb else (a, d, not ta, False)
            k.batched_matmul(*args[:2], dx[1].reshape(b.shape), *args[2:])


def _merge_function(cls):
    def merge(inputs, *args, **kwargs):
        return cls(*args, **kwargs)(list(inputs))
    merge.__name__ = cls.kind
    merge.__doc__ = f"layers.{cls.kind}([a, b, ...]): {cls.__name__}()([a, b, ...]), as Keras's."
    return merge


add, subtract, multiply, average, maximum, minimum, concatenate, dot = (
    _merge_function(c) for c in (Add, Subtract, Multiply, Average, Maximum, Minimum, Concatenate, Dot))

__all__ = ["Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate", "Dot",
           "add", "subtract", "multiply", "average", "maximum", "minimum", "concatenate", "dot"]
