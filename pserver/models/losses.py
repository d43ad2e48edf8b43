"""Losses with Keras's names, computed from the model's raw outputs (logits).

Each writes d loss / d output into a buffer of the output's shape and returns the mean loss
over the batch. `task` says what labels it takes: integer classes, or float targets.
"""

from __future__ import annotations

import abc

import numpy as np

from pserver.errors import ConfigError


class Loss(abc.ABC):
    name = "loss"
    task = "classification"

    def check_outputs(self, units: int, where: str) -> None:
        """A model whose last layer cannot feed this loss fails at build, not at step 1."""

    def label_dtype(self, dtype) -> np.dtype:
        return np.dtype(np.int32)

    @abc.abstractmethod
    def __call__(self, k, out: np.ndarray, y: np.ndarray, dout: np.ndarray) -> float:
        """Mean loss of `out` against `y` over the batch; its gradient into `dout` (kernels `k`)."""


class _FromLogits(Loss):
    def __init__(self, from_logits: bool = True):
        # The models end in a linear layer; probabilities (from_logits=False) would need a
        # softmax layer pserver does not have.
        if from_logits is not True:
            raise ConfigError(f"{type(self).__name__}: only from_logits=True is supported "
                              "(end the model with a linear Dense layer)")


class SparseCategoricalCrossentropy(_FromLogits):
    """Softmax cross-entropy of integer labels in [0, units)."""
    name = "sparse_categorical_crossentropy"

    def check_outputs(self, units, where):
        if units < 2:
            raise ConfigError(f"{where}: {self.name} needs at least 2 outputs (one per class), "
                              f"the last layer has {units}")

    def __call__(self, k, out, y, dout):
        return k.softmax_xent(out, y, dout)


class BinaryCrossentropy(_FromLogits):
    """Sigmoid cross-entropy of 0/1 labels, from one logit per sample."""
    name = "binary_crossentropy"

    def check_outputs(self, units, where):
        if units != 1:
            raise ConfigError(f"{where}: {self.name} needs 1 output (a logit), the last layer "
                              f"has {units}")

    def label_dtype(self, dtype):
        return np.dtype(dtype)

    def __call__(self, k, out, y, dout):
        return k.sigmoid_bce(out, y, dout)


class MeanSquaredError(Loss):
    """mean((pred - y)^2), as Keras's MSE, on one output per sample."""
    name = "mean_squared_error"
    task = "regression"

    def check_outputs(self, units, where):
        if units != 1:
            raise ConfigError(f"{where}: {self.name} needs 1 output, the last layer has {units}")

    def label_dtype(self, dtype):
        return np.dtype(dtype)

    def __call__(self, k, out, y, dout):
        # The kernel computes half the squared error (gradient (pred - y) / n); Keras's MSE is
        # twice that, and so is its gradient.
        loss = k.mse(out, y, dout)
        dout *= dout.dtype.type(2)
        return 2.0 * loss


_NAMES = {"sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
          "binary_crossentropy": BinaryCrossentropy,
          "mean_squared_error": MeanSquaredError, "mse": MeanSquaredError}


def get(spec) -> Loss:
    """A Loss from a Keras name (from logits) or a Loss object."""
    if isinstance(spec, Loss):
        return spec
    if isinstance(spec, str) and spec in _NAMES:
        return _NAMES[spec]()
    raise ConfigError(f"loss: unknown loss {spec!r}; choose one of {', '.join(_NAMES)}")


__all__ = ["Loss", "SparseCategoricalCrossentropy", "BinaryCrossentropy", "MeanSquaredError", "get"]
