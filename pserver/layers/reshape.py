"""Layers that move values without arithmetic: Flatten and Reshape (views in both directions:
no kernel, no copy), Permute, RepeatVector."""

from __future__ import annotations

import math

from pserver.errors import ConfigError
from pserver.layers.base import Layer, positive_int


class Flatten(Layer):
    kind = "flatten"
    reshapes_only = True

    def output_shape_for(self, input_shape):
        return (math.prod(input_shape),)

    # Sequential passes views through a layer that only reshapes (reshapes_only) and never
    # calls these; they say what the layer computes, for a caller that gives it buffers.
    def forward(self, k, p, x, out, s, run) -> None:
        out[...] = x.reshape(out.shape)

    def backward(self, k, p, g, x, out, dout, dx, s) -> None:
        if dx is not None:
            dx[...] = dout.reshape(dx.shape)


class Reshape(Layer):
    """Reshape(target_shape): each sample to `target_shape` (one dimension may be -1), a view."""
    kind = "reshape"
    reshapes_only = True

    def __init__(self, target_shape, **kwargs):
        super().__init__(**kwargs)
        dims = tuple(target_shape) if isinstance(target_shape, (tuple, list)) else None
        if not dims or not all(isinstance(d, int) and (d > 0 or d == -1) for d in dims) or dims.count(-1) > 1:
            raise ConfigError(f"Reshape: target_shape must be a tuple of positive integers (one may be -1), "
                              f"got {target_shape!r}")
        self.target_shape = dims

    def output_shape_for(self, input_shape):
        size, known = math.prod(input_shape), math.prod(d for d in self.target_shape if d != -1)
        shape = tuple(size // known if d == -1 else d for d in self.target_shape)
        if math.prod(shape) != size:
            raise ConfigError(f"{self.label}: cannot reshape {input_shape} ({size} values) to "
                              f"{self.target_shape}")
        return shape

    forward, backward = Flatten.forward, Flatten.backward


class Permute(Layer):
    """Permute(dims): the sample's axes reordered; dims numbers them from 1, as Keras's."""
    kind = "permute"

    def __init__(self, dims, **kwargs):
        super().__init__(**kwargs)
        dims = tuple(dims) if isinstance(dims, (tuple, list)) else ()
        if sorted(dims) != list(range(1, len(dims) + 1)):
            raise ConfigError(f"Permute: dims must be a permutation of 1..rank, got {dims!r}")
        self.dims = dims

    def output_shape_for(self, input_shape):
        if len(input_shape) != len(self.dims):
            raise ConfigError(f"{self.label}: dims {self.dims} for an input of shape {input_shape}")
        return tuple(input_shape[d - 1] for d in self.dims)

    def forward(self, k, p, x, out, s, run):
        k.transpose(x, (0, *self.dims), out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            inverse = sorted(range(len(self.dims)), key=self.dims.__getitem__)
            k.transpose(dout, (0, *(1 + i for i in inverse)), dx)


class RepeatVector(Layer):
    """RepeatVector(n): (features,) -> (n, features)."""
    kind = "repeat_vector"

    def __init__(self, n: int, **kwargs):
        super().__init__(**kwargs)
        self.n = positive_int("RepeatVector", "n", n)

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 1, "a flat (features,)")
        return (self.n, input_shape[0])

    def forward(self, k, p, x, out, s, run):
        k.broadcast_to(x.reshape(x.shape[0], 1, x.shape[1]), out)     # reshapes: device arrays too

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.sum_to(dout, dx.reshape(dx.shape[0], 1, dx.shape[1]))
