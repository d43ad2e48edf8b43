"""`--max-memory-mb`: one bound on what a shard's state holds, sparse rows included
(docs/semantics.md, "Memory budget").

How the bound is split (`split`): an explicit --max-memory-mb keeps at most an eighth of itself for
the pushes in flight (--max-inflight-mb, lowered to fit) and a sixteenth for what is copied for a
moment (an index rehashed, a push's checks), the rest for the state; without it, the state may
take 90% of the memory the machine has available.

What it counts: the dense range (parameters, optimizer state and one gradient buffer, fixed at the
first Register, which `check_range` refuses before allocating when it cannot fit), shard 0's data
coordinator (what its plan may hold, checked before the plan is built: `admit`), and every sparse
table's bytes as SparseTable.stats() reports them: the rows written (each with its optimizer
slots, last update and step count), pending admission entries and the hash indexes. Pushed
gradients in flight are bounded apart, by --max-inflight-mb; a sync push's sparse rows, held after
their stream ends until the step applies and then merged with the others', are reserved here with
its new rows (`kept`).

A sparse push reserves room for the rows it may create when it arrives, before any mode sees
it (`reserve`): the ids its tables do not hold yet, their entries and the index growth they cause. When the
budget cannot take them, rows are evicted, least recently updated first, from the pushed tables
and then from the others, but only from tables whose rows may be evicted (they have an eviction
rule of their own: max_rows or ttl_steps). When that is not enough the push is refused whole,
RESOURCE_EXHAUSTED of kind OverBudget (which workers do not retry), naming the table, its new
rows and bytes and the budget, and nothing has changed. A reservation is held until the step
it belongs to has been applied (`settle`), so that pushes waiting for one sync step cannot
together overshoot the budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from pserver.errors import OverBudget, ResourceExhausted

MiB = 1 << 20


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), or 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(frozen=True)
class Split:
    state: int             # bytes for the shard's state: Budget's limit
    inflight: int          # bytes of pushes in flight: Limits' max_inflight_bytes
    inflight_flag: str     # what set `inflight`, for the refusals' text


def split(max_memory_mb: int, max_inflight_mb: int) -> Split:
    """--max-memory-mb between the state and the pushes in flight (the module's docstring)."""
    limit = max_memory_mb << 20 or int(0.9 * available_memory()) or (1 << 62)
    inflight, flag = max_inflight_mb << 20, "--max-inflight-mb"
    if max_memory_mb and inflight > limit // 8:
        inflight = limit // 8
        flag = (f"--max-inflight-mb {max_inflight_mb} lowered to an eighth of "
                f"--max-memory-mb {max_memory_mb}")
    return Split(limit - (inflight + limit // 16 if max_memory_mb else 0), inflight, flag)


class Budget:
    def __init__(self, limit: int, counters, size=lambda: 0, slots: int = 0,
                 flag: str = "--max-memory-mb", fixed=lambda: 0) -> None:
        self.limit, self.counters, self.flag = int(limit), counters, flag
        self.size = size                  # () -> the dense range's elements (0 before the first Register)
        # a dense element's bytes: its parameter, its gradient and `slots` optimizer values, float32
        self.element_bytes = 4 * (2 + slots)
        self.fixed = fixed                # () -> shard 0's data coordinator's bytes (its plan's, admit())
        self.reserved = 0                 # bytes of rows that pushes not applied yet may create
        self._holds: list[tuple[int, int, list]] = []   # (step, bytes, rows) of pushes not applied yet
        self._lock = threading.Lock()

    def used(self, tables: dict) -> int:
        return self.dense_bytes(self.size()) + self.fixed() + sum(t.nbytes for t in tables.values())

    def dense_bytes(self, size: int) -> int:
        """A dense range's bytes: parameters, optimizer state, one gradient (float32)."""
        return size * self.element_bytes

    def check_range(self, size: int, shard: int, optimizer: str) -> None:
        """RESOURCE_EXHAUSTED, before allocating, when shard's dense range cannot fit."""
        need, limit = self.dense_bytes(size), self.limit
        if need > limit:
            raise ResourceExhausted(
                f"layout: shard {shard}'s range of {size} elements needs {need >> 20} MiB "
                f"(parameters, {optimizer} state and one gradient, float32) and the limit "
                f"is {limit >> 20} MiB (--max-memory-mb; default 90% of available memory)")

    def admit(self, tables: dict, plan, replaced: int) -> None:
        """Room for shard 0's data plan (Plan.nbytes) in place of the one it replaces (`replaced`
        bytes), checked before any of it is built; OverBudget naming its sizes when it does not
        fit beside what is used and reserved. Nothing is held: once built, the plan counts in
        used() (`fixed`)."""
        nbytes = plan.nbytes
        what = (f"data: num_batches {plan.num_batches:,} in chunks of chunk_batches "
                f"{plan.chunk_batches:,} ({plan.num_chunks:,} chunks)")
        with self._lock:
            used = self.used(tables) - replaced + self.reserved
            if used + nbytes > self.limit:
                raise OverBudget(f"{self.flag}: {what} would take {nbytes / MiB:,.1f} MiB, and the shard "
                                 f"holds {used / MiB:,.1f} MiB of its {self.limit / MiB:,.0f} MiB budget; "
                                 f"nothing changed")

    def report(self, tables: dict) -> dict:
        """For Status: the budget, what is used, and what waiting pushes have reserved."""
        with self._lock:
            return {"budget": self.limit, "used": self.used(tables), "reserved": self.reserved}

    def reserve(self, tables: dict, rows, kept: int = 0) -> int:
        """Room for the rows a push's sparse parts may create (`rows`: RowGrads with checked,
        distinct ids), and for `kept` bytes of them held until its step applies (a sync step's
        pending rows and their merge: Policy.held_row_bytes); evicts what it may, or raises
        ResourceExhausted. Returns the bytes held."""
        parts = [(p.table, tables[p.table], p.ids) for p in rows if p.ids.shape[0]]
        if not parts:
            return 0
        with self._lock:
            used = self.used(tables) + self.reserved
            # Every id counted as new first: a push that fits so needs no probe of the index.
            need = kept + sum(t.growth_bytes(ids.shape[0]) for _, t, ids in parts)
            if used + need > self.limit:
                new = {name: t.absent(ids) for name, t, ids in parts}
                need = kept + sum(t.growth_bytes(new[name]) for name, t, _ in parts)
                short = used + need - self.limit
                if short > 0:
                    # Never the rows this push or a waiting one will update: they would come back
                    # outside any reservation. Refused before anything is evicted when even every
                    # other row of every table that allows it would not make room.
                    keep = self._kept(rows)
                    if short > sum(t.evictable_bytes(keep.get(n, ())) for n, t in tables.items()):
                        self._refuse(tables, parts, new, need, used, kept)
                    short = self._evict(tables, [name for name, _, _ in parts if new[name]], short, keep)
                if short > 0:
                    self._refuse(tables, parts, new, need, used, kept)
            self.reserved += need
            return need

    def _kept(self, rows) -> dict:
        """{table: [id arrays]} of this push and of the pushes waiting for their step."""
        keep: dict = {}
        for part in [*rows, *(p for _, _, held in self._holds for p in held)]:
            keep.setdefault(part.table, []).append(part.ids)
        return keep

    def _evict(self, tables: dict, pushed: list[str], short: int, keep: dict) -> int:
        """Evict from the pushed tables, then the others, while bytes are short; what is still short."""
        for name in pushed + [n for n in tables if n not in pushed]:
            t = tables[name]
            if short <= 0:
                break
            if not t.evictable:
                continue
            before = t.nbytes
            self.counters.add("rows_evicted_for_memory", t.evict_for(short, keep.get(name, ())))
            short -= before - t.nbytes
        return short

    def _refuse(self, tables, parts, new, need, used, kept=0) -> None:
        name, t, _ = max(parts, key=lambda p: p[1].growth_bytes(new[p[0]]))
        self.counters.add("pushes_refused_for_memory")
        why = ("and no table may evict rows (give a table max_rows or ttl_steps to let its least "
               "recently updated rows go)" if not any(x.evictable for x in tables.values()) else
               "after evicting every row the tables allow")
        raise OverBudget(
            f"{self.flag}: table '{name}' would create {new[name]:,} new rows "
            f"({t.growth_bytes(new[name]) / MiB:.1f} MiB; the whole push {need / MiB:.1f} MiB"
            f"{f', {kept / MiB:.1f} MiB of it its rows held for its step and their merge' if kept else ''}), "
            f"and the shard holds {used / MiB:.1f} MiB of its {self.limit / MiB:.0f} MiB budget {why}; "
            f"the push changed nothing")

    def hold(self, step: int, nbytes: int, rows=()) -> None:
        """Keep a push's reservation, and its rows from eviction, until its step has been applied."""
        if nbytes or rows:
            with self._lock:
                self._holds.append((step, nbytes, list(rows)))

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose push was refused."""
        if nbytes:
            with self._lock:
                self.reserved -= nbytes

    def settle(self, version: int) -> None:
        """Give back the reservations of pushes for steps before `version`: applied, or dropped."""
        with self._lock:
            if not self._holds:
                return
            self.reserved -= int(np.sum([b for s, b, _ in self._holds if s < version], dtype=np.int64))
            self._holds = [h for h in self._holds if h[0] >= version]
