"""keras.utils: to_categorical."""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.keras._names import missing as _missing


def to_categorical(x, num_classes: int | None = None) -> np.ndarray:
    """Integer classes as one-hot float32 rows, as keras.utils.to_categorical: (n,) -> (n,
    num_classes); num_classes defaults to max + 1."""
    y = np.asarray(x)
    if y.ndim > 1 and y.shape[-1] == 1:
        y = y.reshape(y.shape[:-1])
    if y.size and (y.dtype.kind not in "iu" and not np.all(y == np.floor(y)) or y.min() < 0):
        raise ConfigError("to_categorical: takes non-negative integer classes")
    y = y.astype(np.int64)
    n = int(y.max()) + 1 if num_classes is None and y.size else int(num_classes or 0)
    if y.size and y.max() >= n:
        raise ConfigError(f"to_categorical: class {int(y.max())} >= num_classes={n}")
    out = np.zeros((y.size, n), dtype=np.float32)
    out[np.arange(y.size), y.ravel()] = 1
    return out.reshape((*y.shape, n))


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["to_categorical"]
