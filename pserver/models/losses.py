"""Losses with Keras's names, computed from the model's raw outputs (logits).

Each writes d loss / d output into a buffer of the output's shape and returns the mean loss
over the batch (and, when asked, each row's loss: sample weights need them). `task` says
what labels it takes: integer classes, or float targets.

A cross-entropy takes probabilities (from_logits=False) when the last layer ends in
activation="softmax" (or "sigmoid" for binary_crossentropy), as in Keras: Sequential then runs
that layer without its activation and the loss computes softmax + cross-entropy in one stable
step from the logits (the same value, the same gradient, no log of a rounded-off zero).
from_logits=None (the default here) follows the last layer; a value that contradicts it is
refused, since it would compute a wrong loss silently.
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

    # The activation a last layer may end in for this loss to take probabilities, fused.
    fuses: str | None = None

    def label_dtype(self, dtype) -> np.dtype:
        return np.dtype(np.int32)

    def labels(self, y, rank: int = 1) -> np.ndarray:
        """y as the kernels take it (integer classes, or targets): one-hot rows become classes.
        `rank`: the output's without the batch; an output with steps (rank > 1, as
        (steps, units)) takes a label per step, with or without a last axis of 1."""
        y = np.asarray(y)
        return _squeezed(y, rank) if rank > 1 else y

    def check_activation(self, activation: str, where: str) -> bool:
        """Whether the last layer's `activation` is fused into this loss (a softmax before a
        cross-entropy); ConfigError if this loss cannot follow it."""
        if activation == "softmax":
            raise ConfigError(f"{where}: activation='softmax' on the last layer needs a categorical "
                              f"cross-entropy loss, not {self.name}")
        return False

    def get_config(self) -> dict:
        return {"name": self.name}

    @abc.abstractmethod
    def __call__(self, k, out: np.ndarray, y: np.ndarray, dout: np.ndarray, row_loss=None) -> float:
        """Mean loss of `out` against `y` over the batch; its gradient into `dout` (kernels `k`);
        each row's loss into `row_loss` (n,) float64 when given."""


def _squeezed(y: np.ndarray, rank: int) -> np.ndarray:
    """Labels of the output's shape with its last axis of 1 (a logit, a target) without it."""
    return y[..., 0] if y.ndim == rank + 1 and y.shape[-1] == 1 else y


class _FromLogits(Loss):
    def __init__(self, from_logits: bool | None = None, **unsupported):
        if unsupported:
            raise ConfigError(f"{type(self).__name__}: {sorted(unsupported)[0]}= is not supported "
                              "(docs/guide/keras.md lists what is)")
        if from_logits not in (None, True, False):
            raise ConfigError(f"{type(self).__name__}: from_logits must be True or False, "
                              f"got {from_logits!r}")
        self.from_logits = from_logits

    def check_activation(self, activation, where):
        if activation == self.fuses:
            if self.from_logits is True:
                raise ConfigError(f"{where}: {self.name} with from_logits=True after "
                                  f"activation='{activation}' would apply it twice; drop one")
            return True
        if activation != "linear" and activation == "softmax":
            return super().check_activation(activation, where)
        if self.from_logits is False:
            raise ConfigError(f"{where}: {self.name} with from_logits=False takes probabilities: end "
                              f"the last layer with activation='{self.fuses}'")
        return False

    def get_config(self):
        return {"name": self.name, "from_logits": self.from_logits}


class SparseCategoricalCrossentropy(_FromLogits):
    """Softmax cross-entropy of integer labels in [0, units)."""
    name = "sparse_categorical_crossentropy"
    fuses = "softmax"

    def check_outputs(self, units, where):
        if units < 2:
            raise ConfigError(f"{where}: {self.name} needs at least 2 outputs (one per class), "
                              f"the last layer has {units}")

    def __call__(self, k, out, y, dout, row_loss=None):
        return k.softmax_xent(out, y, dout, row_loss)


class BinaryCrossentropy(_FromLogits):
    """Sigmoid cross-entropy of 0/1 labels, from one logit per sample."""
    name = "binary_crossentropy"
    fuses = "sigmoid"

    def labels(self, y, rank=1):
        return _squeezed(np.asarray(y), rank)

    def check_outputs(self, units, where):
        if units != 1:
            raise ConfigError(f"{where}: {self.name} needs 1 output (a logit), the last layer "
                              f"has {units}")

    def label_dtype(self, dtype):
        return np.dtype(dtype)

    def __call__(self, k, out, y, dout, row_loss=None):
        return k.sigmoid_bce(out, y, dout, row_loss)


class CategoricalCrossentropy(SparseCategoricalCrossentropy):
    """Softmax cross-entropy of one-hot labels (n, ..., units), as Keras's: each row is read as
    its class (rows that are not one-hot, soft labels, are refused: the kernels take classes).
    Integer classes (n, ...) pass as they are: the rows' classes once decoded."""
    name = "categorical_crossentropy"

    def labels(self, y, rank=1):
        y = np.asarray(y)
        if y.ndim != rank + 1 and y.dtype.kind in "iu":     # classes already (a fit decoded them)
            return y
        if y.ndim != rank + 1:
            raise ValueError(f"y has shape {y.shape}; {self.name} takes one-hot rows (n, ..., classes) "
                             "(keras.utils.to_categorical(y)); integer classes take "
                             "sparse_categorical_crossentropy")
        rows = y.reshape(-1, y.shape[-1])
        classes = rows.argmax(axis=1) if rows.shape[0] else np.zeros(0, np.int64)
        ones = rows[np.arange(len(rows)), classes]
        bad = (ones != 1) | (np.count_nonzero(rows, axis=1) != 1)
        if bad.any():
            at = ", ".join(str(int(i)) for i in np.unravel_index(int(np.argmax(bad)), y.shape[:-1]))
            raise ValueError(f"y[{at}] is not a one-hot row ({rows[np.argmax(bad)].tolist()}); {self.name} "
                             "takes one-hot labels (soft labels are not supported)")
        return classes.reshape(y.shape[:-1]).astype(np.int32)


class MeanSquaredError(Loss):
    """mean((pred - y)^2), as Keras's MSE, on one output per sample."""
    name = "mean_squared_error"
    task = "regression"

    def check_outputs(self, units, where):
        if units != 1:
            raise ConfigError(f"{where}: {self.name} needs 1 output, the last layer has {units}")

    def label_dtype(self, dtype):
        return np.dtype(dtype)

    def __call__(self, k, out, y, dout, row_loss=None):
        # The kernel computes half the squared error (gradient (pred - y) / n); Keras's MSE is
        # twice that, and so is its gradient.
        loss = k.mse(out, y, dout, row_loss)
        dout *= dout.dtype.type(2)
        if row_loss is not None:
            row_loss *= 2.0
        return 2.0 * loss

    def labels(self, y, rank=1):
        return _squeezed(np.asarray(y), rank)


def weighted(loss: Loss, k, out: np.ndarray, y: np.ndarray, dout: np.ndarray,
             sample_weight: np.ndarray | None = None) -> float:
    """`loss` with Keras's sample weights (sample_weight, class_weight) and its default
    "sum_over_batch_size" reduction: sum(w_i * l_i) / n, each row's gradient times w_i; without
    weights, `loss` as it is. An output with steps (n, ..., units), y (n, steps): the mean over
    its n * steps elements, as Keras's (pserver.keras refuses sample weights for it). One kernel
    call: it writes each row's loss l_i beside the mean. One weight for the whole batch is just a
    scale of the mean (weights of 1 change no bit)."""
    if out.ndim > 2:        # an output with steps: each element a row, all averaged (Keras's)
        out, dout, y = out.reshape(-1, out.shape[-1]), dout.reshape(-1, dout.shape[-1]), y.reshape(-1)
    if sample_weight is None:
        return loss(k, out, y, dout)
    sw = np.asarray(sample_weight, dtype=dout.dtype)
    same = len(sw) and bool(np.all(sw == sw[0]))
    rows = None if same else np.empty(len(sw), np.float64)
    value = loss(k, out, y, dout, rows)
    dout *= sw.reshape(-1, *[1] * (dout.ndim - 1))
    if same:
        return value if sw[0] == 1 else float(sw[0]) * value
    return float(np.dot(sw.astype(np.float64), rows) / len(sw)) if len(sw) else 0.0


class Pending(Loss):
    """A Keras model's loss until compile gives one (Keras builds, summarizes and predicts
    before compile): any output fits it, and a softmax or sigmoid last layer computes logits
    with its activation applied after, as before a cross-entropy (predict's outputs are the
    same); training or evaluating with it is refused."""
    name = "pending"

    def check_activation(self, activation, where):
        return activation in ("softmax", "sigmoid")

    def __call__(self, k, out, y, dout, row_loss=None):
        raise ConfigError("the model has no loss yet: compile it first (model.compile(optimizer=..., "
                          "loss=...))")


_NAMES = {"sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
          "categorical_crossentropy": CategoricalCrossentropy,
          "binary_crossentropy": BinaryCrossentropy,
          "mean_squared_error": MeanSquaredError, "mse": MeanSquaredError}


def get(spec) -> Loss:
    """A Loss from a Keras name (from logits) or a Loss object."""
    if isinstance(spec, Loss):
        return spec
    if isinstance(spec, str) and spec in _NAMES:
        return _NAMES[spec]()
    if isinstance(spec, dict) and spec.get("name") == Pending.name:     # a model saved before compile
        return Pending()
    if isinstance(spec, dict) and spec.get("name") in _NAMES:        # a get_config()
        return _NAMES[spec["name"]](**{k: v for k, v in spec.items() if k != "name"})
    raise ConfigError(f"loss: unknown loss {spec!r}; choose one of {', '.join(_NAMES)}")


__all__ = ["Loss", "Pending", "SparseCategoricalCrossentropy", "CategoricalCrossentropy",
           "BinaryCrossentropy", "MeanSquaredError", "get", "weighted"]
