"""What a model is to a worker: the model protocol, and how data meets a model's input.

A model owns no parameters. It reads them from the flat vector `w` that the shards serve and
writes its gradient into a flat vector of the same layout, both through `Layout.views` (views,
no copies), so what the worker pushes is exactly what the kernels wrote. `Sequential` is the
one implementation pserver ships; any object with these members trains the same way.
"""

from __future__ import annotations

import abc
import math
import threading
from typing import Callable

import numpy as np

from pserver.models.layout import Layout

# Activation buffers are kept per (batch size, dtype); a run sees a training size, the last
# short batch of an epoch and an evaluation size, so a handful is plenty.
_MAX_CACHED_BATCH_SIZES = 4

# What the worker calls; a user's object needs these (see `protocol_gaps`).
PROTOCOL = ("layout", "init_params", "loss_and_grad", "evaluate")


class Model(abc.ABC):
    """A model's parameters (its layout) and its math on a flat parameter vector."""

    name: str
    layout: Layout
    task: str            # "classification" or "regression"
    num_classes: int     # 0 for regression

    @abc.abstractmethod
    def init_params(self, seed: int) -> np.ndarray:
        """A fresh flat float32 vector of length layout.total, the same for the same seed."""

    @abc.abstractmethod
    def loss_and_grad(self, w: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad_out: np.ndarray) -> float:
        """Mean loss over the batch; the flat gradient of it is written into grad_out."""

    @abc.abstractmethod
    def evaluate(self, w: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch_size: int = 4096) -> dict:
        """{"loss", "accuracy"} (classification; "auc" too for binary) or {"loss", "r2"}."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout.describe()})"


class BatchBuffers:
    """A model's preallocated arrays per (batch size, dtype), made by `make(n, dtype)` when
    first asked for, and kept per thread: a worker may evaluate in one thread while it trains
    in another."""

    def __init__(self, make: Callable[[int, np.dtype], object]):
        self._make, self._local = make, threading.local()

    def __call__(self, n: int, dtype):
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        key = (n, np.dtype(dtype))
        if key not in cache:
            if len(cache) >= _MAX_CACHED_BATCH_SIZES:
                cache.clear()
            cache[key] = self._make(n, np.dtype(dtype))
        return cache[key]


def protocol_gaps(obj) -> list[str]:
    """The protocol members `obj` lacks (empty: it can be trained)."""
    gaps = [m for m in PROTOCOL if not hasattr(obj, m)]
    if "layout" not in gaps and not isinstance(obj.layout, Layout):
        gaps.append("layout (a pserver.models.Layout)")
    return gaps


def fits(sample_shape: tuple[int, ...], input_shape: tuple[int, ...]) -> bool:
    """Whether samples of `sample_shape` are a model input of `input_shape` by a reshape.

    The same shape, or the same number of values where one side is flat (MNIST's (28, 28, 1)
    into a dense model's (784,), or flat rows into an image model), or shapes that differ only
    in dimensions of size 1. Anything else (a transposed image, a wrong size) does not fit.
    """
    if sample_shape == input_shape:
        return True
    if math.prod(sample_shape) != math.prod(input_shape):
        return False
    squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
    return len(sample_shape) == 1 or len(input_shape) == 1 or squeeze(sample_shape) == squeeze(input_shape)


def shaped_for(x: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray | None:
    """x as (n, *input_shape) (a view when x is contiguous), or None when it does not fit."""
    if not fits(tuple(x.shape[1:]), tuple(input_shape)):
        return None
    return x.reshape((x.shape[0], *input_shape))


__all__ = ["Model", "BatchBuffers", "PROTOCOL", "protocol_gaps", "fits", "shaped_for"]
