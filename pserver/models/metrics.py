"""Evaluation metrics over a whole test set: accuracy, ROC AUC (binary), r2 (regression)."""

from __future__ import annotations

import numpy as np


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


__all__ = ["accuracy", "auc", "r2"]
