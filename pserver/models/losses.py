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
    # Whether a classification label may lie between the classes (a probability, as Keras's
    # binary cross-entropy takes it: a denoising autoencoder's pixels); else a whole class.
    soft_labels = False

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
    """Sigmoid cross-entropy of labels in [0, 1] (0/1 classes, or probabilities, as Keras's),
    from one logit per sample."""
    name = "binary_crossentropy"
    fuses = "sigmoid"
    soft_labels = True

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


class InBatchSoftmax(Loss):
    """A two-tower retrieval model's loss: softmax cross-entropy over the batch's own candidates
    (TFRS's Retrieval task; Keras-RS's examples write it in compute_loss). The output is each
    sample's query and candidate embeddings side by side, (n, 2 * dim); the logits are the (n, n)
    dot products of the batch's queries with its candidates, and query i's positive is candidate
    i, every other sample's candidate a negative. y: each sample's candidate id (the options read
    it). As Keras-RS's retrieval layers, in TFRS's order:

    candidate_sampling_probability  each candidate's probability, an array indexed by its id:
                                    logit - log(p), p clipped to [1e-6, 1] (logQ correction)
    remove_accidental_hits          a negative with the positive's id leaves the row's softmax
    num_hard_negatives              each row keeps its positive and its h highest negatives
    """
    name = "in_batch_softmax"
    # Its labels are ids, not classes of the output's units: checked against no range, and no
    # sample is right or wrong on its own (evaluation reports the loss).
    task = "retrieval"

    def __init__(self, remove_accidental_hits: bool = False, candidate_sampling_probability=None,
                 num_hard_negatives: int | None = None):
        where = "InBatchSoftmax"
        if remove_accidental_hits not in (True, False):
            raise ConfigError(f"{where}: remove_accidental_hits must be True or False, got "
                              f"{remove_accidental_hits!r}")
        h = num_hard_negatives
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ConfigError(f"{where}: num_hard_negatives must be an integer >= 1 or None, got {h!r}")
        p = candidate_sampling_probability
        if p is not None:
            p = np.asarray(p, dtype=np.float64)
            if p.ndim != 1 or not len(p) or not np.isfinite(p).all() or (p < 0).any():
                raise ConfigError(f"{where}: candidate_sampling_probability must be a 1-D array of "
                                  f"probabilities >= 0 indexed by candidate id, got shape {p.shape}")
        self.remove_accidental_hits, self.num_hard_negatives = remove_accidental_hits, h
        self.candidate_sampling_probability = p

    def check_outputs(self, units, where):
        if units < 2 or units % 2:
            raise ConfigError(f"{where}: {self.name} takes each sample's query and candidate embeddings "
                              f"side by side (n, 2 * dim): concatenate the towers' outputs; the output "
                              f"has {units} units")

    def label_dtype(self, dtype):
        return np.dtype(np.int64)

    def labels(self, y, rank=1):
        """y as it is; ids that the options read checked: integers in [0, 2**31) (the labels'
        int32) and below the probabilities' length."""
        y, p = _squeezed(np.asarray(y), rank), self.candidate_sampling_probability
        if not (self.remove_accidental_hits or p is not None) or not y.size:
            return y
        if y.dtype.kind not in "iuf" or (y.dtype.kind == "f" and not np.array_equal(y, np.floor(y))):
            raise ValueError(f"y has dtype {y.dtype}; {self.name} takes each sample's candidate id "
                             "(integers)")
        top = 1 << 31 if p is None else min(len(p), 1 << 31)
        if y.min() < 0 or y.max() >= top:
            bad = y.min() if y.min() < 0 else y.max()
            whose = "candidate_sampling_probability's length" if p is not None and top == len(p) else "int32"
            raise ValueError(f"y holds candidate id {bad}; {self.name} reads ids in [0, {top}) ({whose})")
        return y

    def get_config(self):
        p = self.candidate_sampling_probability
        return {"name": self.name, "remove_accidental_hits": self.remove_accidental_hits,
                "num_hard_negatives": self.num_hard_negatives,
                "candidate_sampling_probability": None if p is None else p.tolist()}

    def logits(self, q: np.ndarray, c: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The (n, n) logits q @ c.T, corrected, with every logit left out of a row at -inf (the
        positive, on the diagonal, never is)."""
        n, logits, y = len(q), q @ c.T, np.asarray(y).astype(np.int64, copy=False)
        p = self.candidate_sampling_probability
        if p is not None:
            logits -= np.log(np.clip(p[y], 1e-6, 1.0)).astype(logits.dtype)
        dropped = y[:, None] == y[None, :] if self.remove_accidental_hits else np.zeros((n, n), bool)
        np.fill_diagonal(dropped, False)
        h = self.num_hard_negatives
        if h is not None and h < n - 1:     # each row's h highest negatives that are left
            negatives = np.where(dropped, -np.inf, logits)
            np.fill_diagonal(negatives, -np.inf)
            keep = np.zeros((n, n), bool)
            np.put_along_axis(keep, np.argpartition(-negatives, h - 1, axis=1)[:, :h], True, axis=1)
            np.fill_diagonal(keep, True)
            dropped |= ~keep
        logits[dropped] = -np.inf
        return logits

    def __call__(self, k, out, y, dout, row_loss=None):
        if row_loss is not None:
            raise ConfigError(f"{self.name}: sample weights are not supported (a sample's candidate is "
                              "every other sample's negative: no loss is one sample's own)")
        n, d = out.shape[0], out.shape[1] // 2
        q, c = out[:, :d], out[:, d:]
        g = self.logits(q, c, y)
        diag = np.arange(n)
        top = g.max(axis=1, keepdims=True)             # finite: the positive is in every row
        positive = (g[diag, diag] - top[:, 0]).astype(np.float64)
        np.exp(np.subtract(g, top, out=g), out=g)      # -inf: 0, out of the softmax
        total = g.sum(axis=1, keepdims=True)
        loss = np.log(total[:, 0].astype(np.float64)) - positive
        g /= total * n                                  # d mean loss / d logits: (softmax - I) / n
        g[diag, diag] -= g.dtype.type(1.0 / n)
        np.matmul(g, c, out=dout[:, :d])
        np.matmul(g.T, q, out=dout[:, d:])
        return float(loss.mean())


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


class NoLoss(Loss):
    """An output compiled with loss None, among several (Keras's `loss=[..., None]`): predicted,
    never trained toward (its gradient is zero), its labels not needed. A softmax or sigmoid last
    layer computes logits with its activation applied after, as Pending's."""
    name = "none"
    task = "none"

    def check_activation(self, activation, where):
        return activation in ("softmax", "sigmoid")

    def label_dtype(self, dtype):
        return np.dtype(dtype)

    def __call__(self, k, out, y, dout, row_loss=None):
        dout[...] = 0
        if row_loss is not None:
            row_loss[:] = 0.0
        return 0.0


_NAMES = {"sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
          "categorical_crossentropy": CategoricalCrossentropy,
          "binary_crossentropy": BinaryCrossentropy,
          "mean_squared_error": MeanSquaredError, "mse": MeanSquaredError,
          "in_batch_softmax": InBatchSoftmax}


def get(spec) -> Loss:
    """A Loss from a Keras name (from logits) or a Loss object."""
    if isinstance(spec, Loss):
        return spec
    if isinstance(spec, str) and spec in _NAMES:
        return _NAMES[spec]()
    if isinstance(spec, dict) and spec.get("name") == Pending.name:     # a model saved before compile
        return Pending()
    if isinstance(spec, dict) and spec.get("name") == NoLoss.name:      # an output compiled with None
        return NoLoss()
    if isinstance(spec, dict) and spec.get("name") in _NAMES:        # a get_config()
        return _NAMES[spec["name"]](**{k: v for k, v in spec.items() if k != "name"})
    raise ConfigError(f"loss: unknown loss {spec!r}; choose one of {', '.join(_NAMES)}")


__all__ = ["Loss", "Pending", "NoLoss", "SparseCategoricalCrossentropy", "CategoricalCrossentropy",
           "BinaryCrossentropy", "MeanSquaredError", "InBatchSoftmax", "get", "weighted"]
