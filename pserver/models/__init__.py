"""Models: a layout of named float32 tensors, and loss and gradient on a flat vector.

    linreg   one dense layer to 1 output, 0.5 * mean squared error   (regression)
    logreg   one dense layer to k logits, softmax cross-entropy      (classification)
    mlp      dense + ReLU layers, default 784-256-256-10, softmax cross-entropy

`make_model` is how the CLI and the tests build one; `backend` picks the kernel module
("cpu" numba kernels, or the "reference" NumPy twins), or "cuda": the same model kept on a GPU
(`pserver.models.cuda`, imported only then, as it imports numba.cuda).
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.models.base import DenseModel, Model
from pserver.models.layout import Layout, TensorSpec
from pserver.models.linreg import LinReg
from pserver.models.logreg import LogReg
from pserver.models.mlp import MLP

MODELS = ("mlp", "logreg", "linreg")


def make_model(name: str, in_features: int, num_classes: int, *,
               hidden: tuple[int, ...] = (256, 256), backend: str = "cpu") -> Model:
    """Build a model by name; bad names and sizes raise ConfigError naming the flag."""
    if backend == "cuda":
        # Checked and laid out as on the host (the NumPy twins compile nothing), then moved.
        host = _make_host_model(name, in_features, num_classes, hidden, "reference")
        get_backend("cuda")  # numba.cuda missing: a ConfigError naming --device, not a traceback
        from pserver.models.cuda import CudaDenseModel
        return CudaDenseModel.like(host)
    return _make_host_model(name, in_features, num_classes, hidden, backend)


def _make_host_model(name, in_features, num_classes, hidden, backend) -> DenseModel:
    if name not in MODELS:
        raise ConfigError(f"--model: unknown model {name!r}; choose one of {', '.join(MODELS)}")
    _check_positive("input features", in_features)
    if name == "linreg":
        return LinReg(in_features, backend=backend)
    _check_positive("number of classes", num_classes)
    if num_classes < 2:
        raise ConfigError(f"{name} needs at least 2 classes, got {num_classes}")
    if name == "logreg":
        return LogReg(in_features, num_classes, backend=backend)
    hidden = tuple(hidden)
    if not hidden or not all(_is_positive_int(h) for h in hidden):
        raise ConfigError(f"--hidden: layer widths must be positive integers, got "
                          f"{','.join(map(str, hidden)) or 'nothing'}")
    return MLP(in_features, num_classes, hidden=tuple(int(h) for h in hidden), backend=backend)


def _is_positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


def _check_positive(what: str, v) -> None:
    # These come from the dataset, not a flag, so the message names the quantity.
    if not _is_positive_int(v):
        raise ConfigError(f"{what} must be a positive integer, got {v!r}")


__all__ = ["MODELS", "make_model", "Model", "DenseModel", "LinReg", "LogReg", "MLP",
           "Layout", "TensorSpec"]
