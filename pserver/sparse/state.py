"""RowState: one sparse table's rows on one shard, everything needed to continue exactly. What
SparseTable.state() returns and SparseTable.load() takes, and what a checkpoint holds per table
(pserver.persist.checkpoint), a reshard moves between shards (pserver.persist.reshard) and an
export writes as a model file's table (pserver.persist.export): one record from the table to
the disk and back.

A checkpoint file names its arrays as `arrays()` does (ids, rows, last_update, steps, slot_*,
pending_ids, pending_counts, counters); `of` reads them back, whatever slots a file holds:
which slots a table keeps, in which form, is the table's to check (SparseTable.load)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


@dataclass(frozen=True, kw_only=True, eq=False)
class RowState:
    ids: np.ndarray               # uint64 (n,): the stored ids
    rows: np.ndarray              # (n, dim) in the table's row type
    last_update: np.ndarray       # int64 (n,): the step of each row's last update
    pending_ids: np.ndarray       # uint64 (p,): ids counted towards admission, not stored yet
    pending_counts: np.ndarray    # int64 (p,): their pushes so far
    counters: np.ndarray          # int64: the table's COUNTERS (admissions, creations, evictions)
    # optimizer slots by column name (pserver.sparse.compact.slot_key: slot_<name>, or
    # slot_<name>.sqrt holding sqrt(G)), each (n, dim)
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    steps: np.ndarray | None = None   # int64 (n,): each row's own step count (adam); None: not kept

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by the name a checkpoint file gives it."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("slots", "steps")}
        if self.steps is not None:
            out["steps"] = self.steps
        return {**out, **self.slots}

    @classmethod
    def of(cls, arrays: dict[str, np.ndarray]) -> RowState:
        """`arrays()`'s inverse: any name that is not a field of its own is a slot. KeyError
        naming the first field missing."""
        fixed = {f.name for f in fields(cls)} - {"slots", "steps"}
        missing = sorted(fixed - arrays.keys())
        if missing:
            raise KeyError(f"no {missing[0]} array")
        return cls(**{k: arrays[k] for k in fixed}, steps=arrays.get("steps"),
                   slots={k: v for k, v in arrays.items() if k not in fixed and k != "steps"})

    @property
    def size(self) -> int:
        """Rows held."""
        return int(self.ids.shape[0])

    def select(self, rows: np.ndarray, pending: np.ndarray, counters: np.ndarray) -> RowState:
        """The rows and pending ids that two masks (or index arrays) pick, with `counters`."""
        return RowState(ids=self.ids[rows], rows=self.rows[rows], last_update=self.last_update[rows],
                        pending_ids=self.pending_ids[pending], pending_counts=self.pending_counts[pending],
                        counters=counters, slots={k: v[rows] for k, v in self.slots.items()},
                        steps=None if self.steps is None else self.steps[rows])

    @classmethod
    def concat(cls, states: list[RowState]) -> RowState:
        """States of one table (on several shards) as one, counters summed."""
        each = [s.arrays() for s in states]
        arrays = {k: np.concatenate([a[k] for a in each]) for k in each[0] if k != "counters"}
        arrays["counters"] = np.sum([s.counters for s in states], axis=0).astype(np.int64)
        return cls.of(arrays)
