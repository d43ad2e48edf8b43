"""Activations, softmax, one_hot and standardize: each op's forward (NumPy, its own twin) beside its
VJP. The VJPs are written in terms of the output where that is cheaper (sigmoid, tanh, softmax,
standardize). Standardizing is memory-bound (two passes over x), so NumPy is its kernel: the
normalization layers (pserver.layers.normalization) call `moments`, `standardized` and
`standardize_vjp` for their fused forward and backward."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.ops.core import Op, apply, ids, register


def _sigmoid(x):
    # exp of -|x| only, so that neither branch overflows (float32 exp overflows past 88)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x, axis=-1):
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


register(Op("relu", lambda x: np.maximum(x, 0), lambda g, out, x: (g * (x > 0),)))
register(Op("sigmoid", _sigmoid, lambda g, out, x: (g * out * (1 - out),)))
register(Op("tanh", np.tanh, lambda g, out, x: (g * (1 - out * out),)))
register(Op("softmax", _softmax,
            lambda g, out, x, axis=-1: (out * (g - (g * out).sum(axis=axis, keepdims=True)),)))
register(Op("log_softmax", _log_softmax,
            lambda g, out, x, axis=-1: (g - np.exp(out) * g.sum(axis=axis, keepdims=True),)))


def _one_hot(x, num_classes, axis=-1, dtype="float32"):
    """x's ids as one-hot vectors along a new `axis`; an id outside [0, num_classes) gives a
    row of zeros (as TensorFlow's one_hot)."""
    hot = (ids(x)[..., None] == np.arange(num_classes)).astype(dtype)
    return np.moveaxis(hot, -1, axis)


register(Op("one_hot", _one_hot, lambda g, out, x, **attrs: (None,), differentiable=(False,)))


def moments(x, axes: tuple[int, ...]):
    """x's mean and (biased, as Keras's) variance over `axes`, kept as size-1 dimensions."""
    mean = x.mean(axis=axes, keepdims=True)
    centred = x - mean
    return mean, np.mean(centred * centred, axis=axes, keepdims=True)


def standardized(x, mean, var, epsilon: float):
    """(x - mean) / sqrt(var + epsilon) in x's dtype, and the reciprocal it scaled by."""
    scale = (1 / np.sqrt(var + epsilon)).astype(x.dtype, copy=False)
    return ((x - mean) * scale).astype(x.dtype, copy=False), scale


def standardize_vjp(g, out, scale, axes: tuple[int, ...]):
    """d loss / d x of out = standardize(x) over `axes`, given g = d loss / d out: the mean and the
    variance depend on every x they are taken over, hence the two mean terms."""
    return scale * (g - g.mean(axis=axes, keepdims=True) - out * (g * out).mean(axis=axes, keepdims=True))


def _standardize(x, axes=(-1,), epsilon=1e-3):
    return standardized(x, *moments(x, axes), epsilon)[0]


def _standardize_grad(g, out, x, axes=(-1,), epsilon=1e-3):
    scale = standardized(x, *moments(x, axes), epsilon)[1]
    return (standardize_vjp(g, out, scale, axes).astype(x.dtype, copy=False),)


register(Op("standardize", _standardize, _standardize_grad))


def standardize(x, axes=(-1,), epsilon=1e-3):
    """(x - mean) / sqrt(variance + epsilon), the moments taken over `axes` (LayerNormalization's
    and BatchNormalization's core; not a Keras op, so not in pserver.ops's public names)."""
    return apply("standardize", x, axes=tuple(int(a) for a in axes), epsilon=float(epsilon))


def relu(x):
    return apply("relu", x)


def sigmoid(x):
    return apply("sigmoid", x)


def tanh(x):
    return apply("tanh", x)


def softmax(x, axis=-1):
    return apply("softmax", x, axis=axis)


def log_softmax(x, axis=-1):
    return apply("log_softmax", x, axis=axis)


def one_hot(x, num_classes, axis=-1, dtype=None, sparse=False):
    if sparse:
        raise ConfigError("ops.one_hot(sparse=True): pserver has no sparse tensors in a graph")
    return apply("one_hot", x, num_classes=int(num_classes), axis=axis,
                 dtype=np.dtype(dtype or "float32").name)


__all__ = ["relu", "sigmoid", "tanh", "softmax", "log_softmax", "one_hot"]
