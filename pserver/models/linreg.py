"""Linear regression: one dense layer to a single output, 0.5 * mean squared error."""

from __future__ import annotations

from pserver.models.base import DenseModel


class LinReg(DenseModel):
    """pred = x @ w0 + b0, w0 (in_features, 1); y is a float target per row."""

    def __init__(self, in_features: int, num_classes: int = 0, *, backend: str = "cpu"):
        # num_classes is accepted so every model has one constructor; regression has none.
        super().__init__("linreg", (in_features, 1), "regression", backend)
