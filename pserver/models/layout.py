"""A model's parameters as named float32 tensors laid end to end in one flat vector.

The flat vector is what the shards hold and what travels on the wire; the layout is
how a model finds its tensors in it (as views, no copies) and how shards check that
every worker runs the same model (the signature).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
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

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, tuple[int, ...]]], tables: Iterable = ()) -> "Layout":
        return cls(tuple(TensorSpec(n, tuple(int(d) for d in s)) for n, s in pairs), tuple(tables))

    def freezing(self, names) -> "Layout":
        """This layout with the tensors `names` frozen and the others trained."""
        names = set(names)
        return Layout(tuple(TensorSpec(t.name, t.shape, t.name in names) for t in self.tensors), self.tables)

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
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join([f"{t.name}{list(t.shape)}" for t in self.tensors]
                         + [f"{t.name}[ids x {t.dim}, sparse]" for t in self.tables])
