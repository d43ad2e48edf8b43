"""Multinomial logistic regression: one dense layer to num_classes logits, softmax cross-entropy."""

from __future__ import annotations

from pserver.models.base import DenseModel


class LogReg(DenseModel):
    """logits = x @ w0 + b0, w0 (in_features, num_classes); y is an int label per row."""

    def __init__(self, in_features: int, num_classes: int, *, backend: str = "cpu"):
        super().__init__("logreg", (in_features, num_classes), "classification", backend)
