"""A model's parameters as named float32 tensors laid end to end in one flat vector.

The flat vector is what the shards hold and what travels on the wire; the layout is
how a model finds its tensors in it (as views, no copies) and how shards check that
every worker runs the same model (the signature).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # Not trained (Keras's non-trainable weights, a frozen layer's): the shards' optimizer leaves
    # it and its state as they are. Not part of the signature: freezing a layer does not make
    # another model (its checkpoints and files still fit).
    frozen: bool = False
    # A moving statistic (BatchNormalization's moving mean or variance, frozen too): the shards
    # update it from the workers' batch statistics with this momentum (statistics_pairs). Not
    # part of the signature either: checkpoints and files hold the values as any weight's.
    momentum: float | None = None

    @functools.cached_property
    def size(self) -> int:
        # Once per tensor: a model finds its tensors' views every step (np.prod's call overhead,
        # paid several times per tensor, once made that about 1 ms for wide_deep).
        return int(math.prod(self.shape))


@dataclass(frozen=True)
class Layout:
    """Dense tensors (the flat vector) and, for a model with sparse embeddings, its sparse
    tables (pserver.sparse.TableConfig): rows keyed by 64-bit ids, held apart from the flat
    vector and spread over the shards by id."""
    tensors: tuple[TensorSpec, ...]
    tables: tuple = ()
    # A digest of the model's lookup and text layers (their configs, vocabularies included:
    # pserver.layers.text), "" without any: rows learned for one vocabulary mean nothing under
    # another, so it is part of the signature, and a worker holding another one is refused.
    vocabularies: str = ""

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, tuple[int, ...]]], tables: Iterable = ()) -> "Layout":
        return cls(tuple(TensorSpec(n, tuple(int(d) for d in s)) for n, s in pairs), tuple(tables))

    def freezing(self, names) -> "Layout":
        """This layout with the tensors `names` frozen and the others trained."""
        names = set(names)
        return replace(self, tensors=tuple(replace(t, frozen=t.name in names) for t in self.tensors))

    def with_statistics(self, momenta: dict[str, float]) -> "Layout":
        """This layout with the tensors named in `momenta` marked moving statistics (and frozen:
        the optimizer leaves them), the others not."""
        return replace(self, tensors=tuple(replace(t, momentum=momenta.get(t.name), frozen=t.frozen or
                                                   t.name in momenta) for t in self.tensors))

    def with_tables(self, tables: Iterable) -> "Layout":
        """This layout with these sparse tables (the shards' configs of them)."""
        return replace(self, tables=tuple(tables))

    def statistics_pairs(self) -> tuple[tuple[int, int, int, float], ...]:
        """(mean start, variance start, size, momentum) in the flat vector for each pair of moving
        statistics: the statistics tensors in order, a mean then its variance (BatchNormalization's
        weights), each pair of one size and momentum; ValueError for any other sequence."""
        stats = [t for t in self.tensors if t.momentum is not None]
        offsets, pairs = self.offsets(), []
        for mean, var in zip(stats[::2], stats[1::2]):
            if mean.shape != var.shape or mean.momentum != var.momentum:
                raise ValueError(f"statistics {mean.name} and {var.name}: a mean and its variance need one "
                                 "shape and momentum")
            pairs.append((offsets[mean.name][0], offsets[var.name][0], mean.size, mean.momentum))
        if len(stats) % 2:
            raise ValueError(f"statistics {stats[-1].name}: a mean without its variance (they come in pairs)")
        return tuple(pairs)

    def frozen_ranges(self) -> tuple[tuple[int, int], ...]:
        """The [start, end) of each frozen tensor in the flat vector, in order."""
        return tuple(self.offsets()[t.name] for t in self.tensors if t.frozen and t.size)

    @functools.cached_property
    def total(self) -> int:
        """P: the number of float32 elements in the flat vector."""
        return sum(t.size for t in self.tensors)

    def offsets(self) -> dict[str, tuple[int, int]]:
        """name -> [start, end) in the flat vector."""
        return dict(self._offsets)

    @functools.cached_property
    def _offsets(self) -> dict[str, tuple[int, int]]:
        out, pos = {}, 0
        for t in self.tensors:
            out[t.name] = (pos, pos + t.size)
            pos += t.size
        return out

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """name -> a reshaped view into `flat` (writes go through to it)."""
        if flat.shape != (self.total,):
            raise ValueError(f"flat vector has shape {flat.shape}, layout needs ({self.total},)")
        return {t.name: flat[a:b].reshape(t.shape) for t, (a, b) in
                zip(self.tensors, self._offsets.values())}

    def signature(self) -> str:
        """A short hash of names and shapes: equal layouts, equal signatures."""
        text = ";".join(f"{t.name}:{'x'.join(map(str, t.shape))}" for t in self.tensors)
        if self.tables:         # dense-only layouts keep the signature they always had
            text += "|" + ";".join(t.signature() for t in self.tables)
        if self.vocabularies:
            text += "|vocabularies:" + self.vocabularies
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join([f"{t.name}{list(t.shape)}" for t in self.tensors]
                         + [f"{t.name}[ids x {t.dim}, sparse]" for t in self.tables])


def away_means(pairs, start: int, end: int) -> np.ndarray:
    """The flat-vector indices of the mean elements (of Layout.statistics_pairs) whose variance
    element lies in [start, end) while they do not: what a push to the shard of that range
    carries beside its slice (PushRequest.statistics), in this order."""
    found = [mean_at + k for mean_at, var_at, size, _ in pairs for k in range(size)
             if start <= var_at + k < end and not start <= mean_at + k < end]
    return np.asarray(found, dtype=np.int64)

