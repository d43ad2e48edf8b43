"""keras.metrics: Keras's metric classes by their names, for compile(metrics=[...]) and eagerly
(update_state, result, reset_state). Each keeps a state of sums over samples, so a cluster's
epoch logs are the metric over every worker's samples (pserver.models.metrics)."""

from pserver.keras._names import missing as _missing
from pserver.models.metrics import (
    AUC,
    FalseNegatives,
    FalsePositives,
    MeanAbsoluteError,
    MeanSquaredError,
    Metric,
    Precision,
    Recall,
    RootMeanSquaredError,
    SparseTopKCategoricalAccuracy,
    TopKCategoricalAccuracy,
    TrueNegatives,
    TruePositives,
)

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Metric", "AUC", "Precision", "Recall", "MeanSquaredError", "MeanAbsoluteError",
           "RootMeanSquaredError", "TopKCategoricalAccuracy", "SparseTopKCategoricalAccuracy",
           "TruePositives", "FalsePositives", "TrueNegatives", "FalseNegatives"]
