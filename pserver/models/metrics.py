"""Evaluation metrics over a whole test set: accuracy, ROC AUC (binary), r2 (regression); the
Keras names compile takes for them."""

from __future__ import annotations

import abc

import numpy as np

from pserver.errors import ConfigError


def accuracy(out: np.ndarray, y: np.ndarray) -> float:
    """The samples predicted right: argmax of the logits, or logit > 0 for one output. An
    output with steps (n, ..., units), y (n, steps), counts each sample's fraction of steps
    right, so that (summed over batches and workers) over the samples it is the accuracy over
    every element, as Keras's: the epoch's sums (docs/semantics.md) keep counting samples."""
    rows = out.reshape(-1, out.shape[-1])
    pred = rows.argmax(axis=1) if rows.shape[1] > 1 else (rows[:, 0] > 0)
    right = int(np.count_nonzero(pred == y.reshape(-1)))
    return right if out.ndim == 2 else right * len(out) / max(len(rows), 1)


def auc(scores: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC from scores and 0/1 labels (Mann-Whitney U; ties count one half); NaN when
    only one class is present, where it is undefined."""
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    from scipy.stats import rankdata  # scipy.stats takes a while to import: only when asked
    ranks = rankdata(scores)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def r2(sse: float, y: np.ndarray) -> float:
    sst = float(np.sum((y.astype(np.float64) - y.mean(dtype=np.float64)) ** 2))
    # A constant target has no variance to explain: r2 is 1 for a perfect fit, else 0.
    return 1.0 - sse / sst if sst > 0 else float(sse == 0)


METRICS = {"accuracy": "accuracy", "acc": "accuracy", "sparse_categorical_accuracy": "accuracy",
           "categorical_accuracy": "accuracy", "binary_accuracy": "accuracy", "auc": "auc", "r2": "r2"}



# -- Keras's metric classes: a state of sums over samples --------------------------------------
#
# Each metric's state is a vector of sums over the samples it saw (counts of true and false
# positives, squared errors, the samples counted), so the state of several batches, or of
# several workers' batches, is the sum of theirs: shard 0 adds the vectors the pushes carry
# (TensorHeader.lease_metric_sums) and every worker's History gets the metric over all of the
# epoch's samples, exactly (docs/semantics.md). `sums(pred, y)` takes the predictions as the
# Keras model states them (probabilities after a softmax or sigmoid last layer).


class Metric(abc.ABC):
    """Keras's Metric over a vector of sums: `sums` of a batch, `value` of the summed state;
    update_state/result/reset_state as Keras's for eager use. A metric of one's own subclasses
    it and defines `sums` and `value` (and `size`, the length of its state, when not 2); one
    that defines Keras's update_state and result instead is refused at compile (check_metrics),
    since on a cluster its state must add over the workers' batches."""
    default_name = "metric"
    # Keras's _direction: "auto" monitoring maximizes it ("down": minimizes; None: neither)
    direction: str | None = "up"

    def __init__(self, name=None, dtype=None):
        self.name = name or self.default_name
        self._state: np.ndarray | None = None

    def size(self) -> int:
        """The length of the state (the vector `sums` returns)."""
        return 2

    def sums(self, pred: np.ndarray, y: np.ndarray) -> np.ndarray:
        """A batch's state: `size()` sums over its samples (float64). A subclass that does not
        define it (nor value) is refused, at compile or here when used eagerly."""
        raise ConfigError(_undefined(type(self)))

    def value(self, sums: np.ndarray) -> float:
        """The metric of a summed state."""
        raise ConfigError(_undefined(type(self)))

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        if sample_weight is not None:
            raise ConfigError(f"{type(self).__name__}.update_state: sample_weight is not supported by "
                              "pserver")
        pred = _columns(np.asarray(y_pred, np.float64))
        s = self.sums(pred, np.asarray(y_true))
        self._state = s if self._state is None else self._state + s

    def result(self) -> float:
        return self.value(self._state if self._state is not None else np.zeros(self.size()))

    def reset_state(self) -> None:
        self._state = None

    def get_config(self) -> dict:
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict) -> "Metric":
        return cls(**config)


def _undefined(own: type) -> str:
    return (f"metrics: {own.__name__} does not define sums(pred, y) and value(sums): pserver's metrics "
            f"keep a state of sums that shard 0 adds over the workers' batches, not Keras's update_state "
            f"and result (docs/guide/keras.md, \"A metric of your own\")")


def _columns(a: np.ndarray) -> np.ndarray:
    return a.reshape(len(a), -1) if a.ndim != 2 else a


def _truth(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y as 0/1 of pred's shape: class indices become one-hot rows (pserver's labels are
    indices; Keras's confusion metrics take one-hot rows)."""
    y = np.asarray(y)
    if pred.shape[1] > 1 and (y.ndim == 1 or y.shape[1] == 1):
        return np.eye(pred.shape[1], dtype=np.float64)[y.reshape(-1).astype(np.int64)]
    return y.reshape(pred.shape).astype(np.float64)


def _ratio(a: float, b: float) -> float:
    """Keras's divide_no_nan: 0 where the denominator is."""
    return float(a / b) if b else 0.0


class _Mean(Metric):
    """A mean over samples of each sample's error, averaged over its columns: (sum, samples)."""
    direction = "down"

    @abc.abstractmethod
    def error(self, pred: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Each sample's error per column (pred's shape)."""

    def sums(self, pred, y):
        y = np.asarray(y, np.float64).reshape(pred.shape)
        return np.array([self.error(pred, y).mean(axis=1).sum(), len(pred)], np.float64)

    def value(self, sums):
        return _ratio(sums[0], sums[1])


class MeanSquaredError(_Mean):
    default_name = "mean_squared_error"

    def error(self, pred, y):
        return (pred - y) ** 2


class MeanAbsoluteError(_Mean):
    default_name = "mean_absolute_error"

    def error(self, pred, y):
        return np.abs(pred - y)


class RootMeanSquaredError(MeanSquaredError):
    default_name = "root_mean_squared_error"

    def value(self, sums):
        return float(np.sqrt(_ratio(sums[0], sums[1])))


class SparseTopKCategoricalAccuracy(Metric):
    """Whether the true class is among the k highest predictions (ties at the k-th count as in,
    as TensorFlow's in_top_k): (samples in, samples)."""
    default_name = "sparse_top_k_categorical_accuracy"

    def __init__(self, k=5, name=None, dtype=None):
        super().__init__(name, dtype)
        self.k = int(k)

    def sums(self, pred, y):
        y = np.asarray(y)
        classes = y.argmax(axis=1) if y.ndim == 2 and y.shape[1] > 1 else y.reshape(-1).astype(np.int64)
        target = pred[np.arange(len(pred)), classes]
        above = np.count_nonzero(pred > target[:, None], axis=1)
        return np.array([np.count_nonzero(above < self.k), len(pred)], np.float64)

    def value(self, sums):
        return _ratio(sums[0], sums[1])

    def get_config(self):
        return {"name": self.name, "k": self.k}


class TopKCategoricalAccuracy(SparseTopKCategoricalAccuracy):
    """The same over one-hot labels (pserver's model takes them as class indices)."""
    default_name = "top_k_categorical_accuracy"


class _Confusion(Metric):
    """Precision and Recall: counts at one threshold (default 0.5) of pred > threshold, over
    every element (class_id: one column; top_k: only each row's k highest may count)."""

    def __init__(self, thresholds=None, top_k=None, class_id=None, name=None, dtype=None):
        super().__init__(name, dtype)
        if isinstance(thresholds, (list, tuple)):
            if len(thresholds) != 1:
                raise ConfigError(f"{type(self).__name__}: thresholds={thresholds!r}: pserver logs one "
                                  "number per metric: give one threshold")
            thresholds = thresholds[0]
        self.thresholds = 0.5 if thresholds is None and top_k is None else thresholds
        self.top_k, self.class_id = top_k, class_id

    def counts(self, pred, y) -> tuple[float, float, float, float]:
        """(true positives, false positives, true negatives, false negatives)."""
        truth = _truth(pred, y)
        if self.top_k is not None:
            kth = -np.sort(-pred, axis=1)[:, self.top_k - 1:self.top_k]
            pred = np.where(pred >= kth, pred, -np.inf)
        if self.class_id is not None:
            pred, truth = pred[:, [self.class_id]], truth[:, [self.class_id]]
        hit = pred > (self.thresholds if self.thresholds is not None else -np.inf)
        on = truth > 0.5
        return (float(np.sum(hit & on)), float(np.sum(hit & ~on)), float(np.sum(~hit & ~on)),
                float(np.sum(~hit & on)))

    def get_config(self):
        return {"name": self.name, "thresholds": self.thresholds, "top_k": self.top_k,
                "class_id": self.class_id}


class Precision(_Confusion):
    default_name = "precision"

    def sums(self, pred, y):
        tp, fp, _, _ = self.counts(pred, y)
        return np.array([tp, fp], np.float64)

    def value(self, sums):
        return _ratio(sums[0], sums[0] + sums[1])


class Recall(_Confusion):
    default_name = "recall"

    def sums(self, pred, y):
        tp, _, _, fn = self.counts(pred, y)
        return np.array([tp, fn], np.float64)

    def value(self, sums):
        return _ratio(sums[0], sums[0] + sums[1])


class _Count(_Confusion):
    """Keras's TruePositives, FalsePositives, TrueNegatives and FalseNegatives: one count over
    every element at one threshold (default 0.5), its state that count. Keras monitors them
    in neither direction ("auto" is refused: give mode)."""
    cell = 0                  # in counts(): tp, fp, tn, fn
    direction = None

    def __init__(self, thresholds=None, name=None, dtype=None):
        super().__init__(thresholds, name=name, dtype=dtype)

    def size(self):
        return 1

    def sums(self, pred, y):
        return np.array([self.counts(pred, y)[self.cell]], np.float64)

    def value(self, sums):
        return float(sums[0])

    def get_config(self):
        return {"name": self.name, "thresholds": self.thresholds}


class TruePositives(_Count):
    default_name, cell = "true_positives", 0


class FalsePositives(_Count):
    default_name, cell = "false_positives", 1


class TrueNegatives(_Count):
    default_name, cell = "true_negatives", 2


class FalseNegatives(_Count):
    default_name, cell = "false_negatives", 3


class AUC(Metric):
    """Keras's AUC: confusion counts at num_thresholds thresholds (evenly in (0, 1) plus one
    just below 0 and one just above 1), the curve's area by the trapezoid rule (ROC) or Davis
    and Goadrich's interpolation (PR), every element one sample (multi_label=False). Its state:
    true and false positives, true and false negatives per threshold."""
    default_name = "auc"

    def __init__(self, num_thresholds=200, curve="ROC", summation_method="interpolation", name=None,
                 dtype=None, thresholds=None, multi_label=False, num_labels=None, label_weights=None,
                 from_logits=False):
        super().__init__(name, dtype)
        if str(curve).upper() not in ("ROC", "PR") or summation_method != "interpolation":
            raise ConfigError(f"AUC: curve={curve!r}, summation_method={summation_method!r}: pserver "
                              "supports curve 'ROC' or 'PR' with summation_method='interpolation'")
        if multi_label or label_weights is not None:
            raise ConfigError("AUC: multi_label=True and label_weights are not supported by pserver")
        if thresholds is None and int(num_thresholds) <= 1:
            raise ConfigError(f"Argument `num_thresholds` must be an integer > 1. Received: "
                              f"num_thresholds={num_thresholds}")
        inner = sorted(thresholds) if thresholds is not None else \
            [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.num_thresholds = len(inner) + 2
        self.curve, self.from_logits, self._given = str(curve).upper(), bool(from_logits), thresholds
        self._thresholds = np.array([-EPSILON, *inner, 1.0 + EPSILON])

    def size(self):
        return 4 * self.num_thresholds

    def sums(self, pred, y):
        p = pred.reshape(-1)
        if self.from_logits:
            p = 1.0 / (1.0 + np.exp(-p))
        on = _truth(pred, y).reshape(-1) > 0.5
        pos, neg = np.sort(p[on]), np.sort(p[~on])
        # The elements > each threshold, by bisection: O((n + thresholds) log n), not their product.
        tp = pos.size - np.searchsorted(pos, self._thresholds, side="right")
        fp = neg.size - np.searchsorted(neg, self._thresholds, side="right")
        return np.concatenate([tp, fp, neg.size - fp, pos.size - tp]).astype(np.float64)   # tp fp tn fn

    def value(self, sums):
        tp, fp, tn, fn = sums.reshape(4, self.num_thresholds)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.curve == "PR":
                return _pr_area(tp, fp, fn)
            recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
            fpr = np.where(fp + tn > 0, fp / (fp + tn), 0.0)
            return float(np.sum((fpr[:-1] - fpr[1:]) * (recall[:-1] + recall[1:]) / 2))

    def get_config(self):
        return {"name": self.name, "num_thresholds": self.num_thresholds, "curve": self.curve,
                "thresholds": self._given, "from_logits": self.from_logits}


EPSILON = 1e-7      # Keras's backend.epsilon(): the end thresholds, just outside [0, 1]


def _pr_area(tp, fp, fn) -> float:
    """Keras's interpolate_pr_auc (Davis and Goadrich 2006, section 4), with divide_no_nan."""
    def div(a, b):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0.0)
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    slope = div(dtp, np.maximum(p[:-1] - p[1:], 0))
    intercept = tp[1:] - slope * p[1:]
    ratio = np.where((p[:-1] > 0) & (p[1:] > 0), div(p[:-1], np.maximum(p[1:], 0)), 1.0)
    return float(np.sum(div(slope * (dtp + intercept * np.log(ratio)), np.maximum(tp[1:] + fn[1:], 0))))


# Keras's string names for these (compile(metrics=["precision"])); the log takes the string.
BY_NAME = {"mse": MeanSquaredError, "mean_squared_error": MeanSquaredError, "mae": MeanAbsoluteError,
           "mean_absolute_error": MeanAbsoluteError, "root_mean_squared_error": RootMeanSquaredError,
           "precision": Precision, "recall": Recall, "top_k_categorical_accuracy": TopKCategoricalAccuracy,
           "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
           **{c.default_name: c for c in (TruePositives, FalsePositives, TrueNegatives, FalseNegatives)}}
CLASSES = {c.__name__: c for c in (MeanSquaredError, MeanAbsoluteError, RootMeanSquaredError, Precision,
                                   Recall, TopKCategoricalAccuracy, SparseTopKCategoricalAccuracy, AUC,
                                   TruePositives, FalsePositives, TrueNegatives, FalseNegatives)}


def metric_objects(metrics) -> list[Metric]:
    """The compiled metrics that keep a state of sums (Metric objects, and the string names in
    BY_NAME, named as given), in order; accuracy, auc and r2 by name are computed apart."""
    out = []
    for m in metrics or ():
        if isinstance(m, str) and m in BY_NAME:
            out.append(BY_NAME[m](name=m))
        elif isinstance(m, Metric):
            out.append(m)
    return out


def sums_of(objects: list[Metric], pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The objects' sums over a batch, one vector (the push carries it, shard 0 adds it)."""
    return np.concatenate([m.sums(pred, y) for m in objects]) if objects else np.zeros(0)


def values_of(objects: list[Metric], sums: np.ndarray) -> dict:
    """Each object's value from the summed vector, by its name."""
    out, at = {}, 0
    for m in objects:
        n = m.size()
        out[m.name] = m.value(np.asarray(sums[at:at + n], np.float64))
        at += n
    return out


def to_config(objects: list[Metric]) -> list[dict]:
    return [{"class_name": type(m).__name__, "config": m.get_config()} for m in objects]


def objects_config(objects: list[Metric]) -> dict:
    """What a model's config adds for its Metric objects (nothing without any: older files')."""
    return {"metric_objects": to_config(objects)} if objects else {}


def from_config(configs: list[dict]) -> list[Metric]:
    return [CLASSES[c["class_name"]].from_config(c["config"]) for c in configs or ()]


def check_metrics(metrics) -> list[str]:
    """The names compile's metrics log under: accuracy under its aliases, auc, r2, and the
    metrics with a state of sums (Metric objects by their name, Keras's string names as given)."""
    if metrics is None:
        return []
    if isinstance(metrics, (str, Metric)) or not all(isinstance(m, (str, Metric)) for m in metrics):
        raise ConfigError(f"compile: metrics={metrics!r}: give a list of names "
                          f"({', '.join([*METRICS, *BY_NAME])}) or keras.metrics objects")
    unknown = [m for m in metrics if isinstance(m, str) and m not in METRICS and m not in BY_NAME]
    if unknown:
        raise ConfigError(f"compile: metrics: {unknown[0]!r} is not supported; pserver reports accuracy "
                          f"(and auc for binary_crossentropy), r2 (mse), and {', '.join(BY_NAME)} "
                          f"(docs/guide/keras.md)")
    for m in metrics:
        own = type(m)
        if isinstance(m, Metric) and (own.sums is Metric.sums or own.value is Metric.value):
            raise ConfigError(f"compile: {_undefined(own)}")
    names = [m.name if isinstance(m, Metric) else METRICS.get(m, m) for m in metrics]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"compile: metrics: two metrics log as {twice[0]!r}: give one a name=")
    return names


def compiled(metrics) -> tuple[list[str], list]:
    """compile's metrics: (the names they log under, the Metric objects among them)."""
    return check_metrics(metrics), metric_objects(metrics)


def restored(config: dict) -> tuple[list[str], list]:
    """`compiled` of a model's saved config (its "metrics" names, "metric_objects" configs)."""
    by_name = {m.name: m for m in from_config(config.get("metric_objects"))}
    return compiled([by_name.get(n, n) for n in config.get("metrics") or []])


__all__ = ["accuracy", "auc", "r2", "METRICS", "check_metrics", "compiled", "restored", "Metric", "AUC",
           "Precision", "Recall", "MeanSquaredError", "MeanAbsoluteError", "RootMeanSquaredError",
           "TopKCategoricalAccuracy", "SparseTopKCategoricalAccuracy", "TruePositives", "FalsePositives",
           "TrueNegatives", "FalseNegatives", "metric_objects", "sums_of",
           "values_of", "to_config", "from_config",
           "objects_config"]
