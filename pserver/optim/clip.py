"""Keras's clipnorm and global_clipnorm over a flat gradient, in place.

A tensor's, or the whole gradient's, elements lie on several shards, so no shard sees a norm:
a worker clips its own gradient before the push (docs/semantics.md). Keras's formulas
(keras/src/optimizers/base_optimizer.py): g * c / max(norm, c), per tensor for clipnorm
(a zero gradient stays zero); g * c * min(1 / norm, 1 / c) over all of them for global_clipnorm
(a non-finite global norm makes the gradient NaN, as Keras's). clipvalue is element-wise and
the shards apply it to the step's gradient (pserver.optim.Optimizer.step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Ranges = Sequence[tuple[int, int]]   # each trained tensor's [start, end) in the flat vector


def clip_by_norm(g: np.ndarray, ranges: Ranges, clipnorm: float) -> None:
    """Each tensor of g scaled to an L2 norm of at most clipnorm."""
    for a, b in ranges:
        norm = float(np.sqrt(np.dot(g[a:b].astype(np.float64), g[a:b])))
        if norm > clipnorm:
            g[a:b] *= np.float32(clipnorm / norm)


def clip_by_global_norm(g: np.ndarray, ranges: Ranges, clipnorm: float) -> None:
    """All the tensors of g scaled together to a global L2 norm of at most clipnorm."""
    squares = sum(float(np.dot(g[a:b].astype(np.float64), g[a:b])) for a, b in ranges)
    norm = np.sqrt(squares)
    scale = clipnorm * min(1.0 / norm, 1.0 / clipnorm) if norm else 1.0
    if not np.isfinite(norm):
        scale = np.nan
    if scale != 1.0:
        for a, b in ranges:
            g[a:b] *= np.float32(scale)


def gradient_clip(ranges: Ranges, clipnorm: float = 0.0,
                  global_clipnorm: float = 0.0) -> Callable[[np.ndarray], None] | None:
    """The in-place clip a worker applies to its gradient, or None for none (0: not set)."""
    if clipnorm and global_clipnorm:
        raise ValueError("clipnorm and global_clipnorm: give one (Keras's rule)")
    if clipnorm:
        return lambda g: clip_by_norm(g, ranges, clipnorm)
    if global_clipnorm:
        return lambda g: clip_by_global_norm(g, ranges, global_clipnorm)
    return None


__all__ = ["clip_by_norm", "clip_by_global_norm", "gradient_clip"]
