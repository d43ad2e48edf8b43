"""Activations, softmax and one_hot: each op's forward (NumPy, its own twin) beside its VJP. The
VJPs are written in terms of the output where that is cheaper (sigmoid, tanh, softmax)."""

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
