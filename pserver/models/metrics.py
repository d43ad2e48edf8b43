"""Evaluation metrics over a whole test set: accuracy, ROC AUC (binary), r2 (regression); the
Keras names compile takes for them."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError


def accuracy(out: np.ndarray, y: np.ndarray) -> int:
    """The number of correct predictions: argmax of the logits, or logit > 0 for one output."""
    pred = out.argmax(axis=1) if out.shape[1] > 1 else (out[:, 0] > 0)
    return int(np.count_nonzero(pred == y))


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


def check_metrics(metrics) -> list[str]:
    """Keras's metric names that evaluation reports (accuracy under its aliases, auc, r2)."""
    if metrics is None:
        return []
    if isinstance(metrics, str) or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"compile: metrics={metrics!r}: give a list of names "
                          f"({', '.join(METRICS)})")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError(f"compile: metrics: {unknown[0]!r} is not supported; evaluation reports "
                          "accuracy (and auc for binary_crossentropy) or r2 (mse)")
    return [METRICS[m] for m in metrics]


__all__ = ["accuracy", "auc", "r2", "METRICS", "check_metrics"]
