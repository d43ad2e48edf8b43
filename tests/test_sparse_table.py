"""SparseTable against a plain-dict model (a hypothesis state machine), its checkpoints, its
errors, its thread safety and its memory per row (measured as RSS in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pserver.errors import ConfigError, InvalidArgument
from pserver.sparse import ROW_OPTIMIZERS, RowState, SparseTable, TableConfig, hashing, initial_rows, optim
from pserver.sparse import table as table_module

POOL = [0, 1, 2, 3, 5, 8, 13, 2**32, 2**63, 2**64 - 1, 12345678901234567890, 777]


class DictTable:
    """The semantics of SparseTable in plain Python: dicts keyed by id, the NumPy optimizer twins."""

    def __init__(self, config: TableConfig, table_index: int):
        self.c, self.table_index, self.dim = config, table_index, config.dim
        self.opt = optim.RowOptimizer(config.optimizer, config.lr, dict(config.params), "numpy")
        self.rows, self.last, self.steps, self.pending = {}, {}, {}, {}
        self.counters = dict.fromkeys(table_module.COUNTERS, 0)

    def initial(self, id_: int) -> np.ndarray:
        out = np.empty((1, self.dim), np.float32)
        hashing.initial_rows_numpy(np.array([id_], np.uint64), self.dim, self.c.seed,
                                   self.table_index, self.c.init_scale, out)
        return out[0]

    def lookup(self, ids) -> np.ndarray:
        return np.array([self.rows[i][:self.dim] if i in self.rows else self.initial(i)
                         for i in ids], np.float32).reshape(len(ids), self.dim)

    def _admitted(self, id_: int) -> bool:
        if self.c.min_count <= 1:
            return True
        self.pending[id_] = self.pending.get(id_, 0) + 1
        if self.pending[id_] < self.c.min_count:
            return False
        del self.pending[id_]
        self.counters["admissions"] += 1
        return True

    def apply(self, ids, grads, step, scale) -> None:
        touched = []
        for i, id_ in enumerate(ids):
            if id_ not in self.rows:
                if not self._admitted(id_):
                    continue
                slots = np.repeat(np.array(self.opt.initial, np.float32), self.dim)
                self.rows[id_] = np.concatenate([self.initial(id_), slots])
                self.steps[id_] = 0
                self.counters["creations"] += 1
            touched.append((i, id_))
        if touched:
            data = np.stack([self.rows[id_] for _, id_ in touched])
            steps = np.array([self.steps[id_] for _, id_ in touched], np.int64)
            self.opt.step(data, steps, np.arange(len(touched)), grads[[i for i, _ in touched]], scale)
            for k, (_, id_) in enumerate(touched):
                self.rows[id_], self.steps[id_], self.last[id_] = data[k], int(steps[k]), step
        self._evict(step)

    def _evict(self, step: int) -> None:
        k = max(len(self.rows) - self.c.max_rows, 0) if self.c.max_rows else 0
        if self.c.ttl_steps:
            k = max(k, sum(last < step - self.c.ttl_steps for last in self.last.values()))
        for id_ in sorted(self.rows, key=lambda i: (self.last[i], i))[:k]:
            del self.rows[id_], self.last[id_], self.steps[id_]
        self.counters["evictions"] += k


def as_model(state: RowState, dim: int, opt) -> dict:
    """A state() as dicts keyed by id (row order is the table's business)."""
    state = state.arrays()
    ids = state["ids"].tolist()
    data = np.concatenate([state["rows"]] + [state[f"slot_{s}"] for s in opt.slots], axis=1)
    return {"rows": dict(zip(ids, data)), "last": dict(zip(ids, state["last_update"].tolist())),
            "steps": dict(zip(ids, state["steps"].tolist())) if "steps" in state else None,
            "pending": dict(zip(state["pending_ids"].tolist(), state["pending_counts"].tolist())),
            "counters": dict(zip(table_module.COUNTERS, state["counters"].tolist()))}


configs = st.builds(
    lambda opt, dim, min_count, max_rows, ttl, scale, seed: TableConfig(
        "emb", dim, optimizer=opt, lr=0.1, init_scale=scale, seed=seed, min_count=min_count,
        max_rows=max_rows, ttl_steps=ttl),
    st.sampled_from(ROW_OPTIMIZERS), st.integers(1, 3), st.sampled_from([0, 1, 2, 3]),
    st.sampled_from([0, 3, 8]), st.sampled_from([0, 2, 4]), st.sampled_from([0.0, 0.1]),
    st.integers(0, 2**64 - 1))


class TableMachine(RuleBasedStateMachine):
    @initialize(config=configs, table_index=st.integers(0, 3))
    def start(self, config, table_index):
        self.table = SparseTable(config, table_index)
        self.model = DictTable(config, table_index)
        self.config, self.table_index, self.step = config, table_index, 0

    @rule(ids=st.lists(st.sampled_from(POOL), unique=True, max_size=8), advance=st.integers(0, 2),
          scale=st.sampled_from([1.0, 0.5]), seed=st.integers(0, 2**16))
    def apply(self, ids, advance, scale, seed):
        self.step += advance
        grads = np.random.default_rng(seed).standard_normal((len(ids), self.config.dim)).astype(np.float32)
        self.table.apply(np.array(ids, np.uint64), grads, self.step, scale)
        self.model.apply(ids, grads, self.step, scale)

    @rule(ids=st.lists(st.sampled_from(POOL), max_size=10))
    def lookup(self, ids):
        out = np.full((len(ids), self.config.dim), np.nan, np.float32)
        self.table.lookup(np.array(ids, np.uint64), out)
        np.testing.assert_allclose(out, self.model.lookup(ids), rtol=1e-4, atol=1e-6)

    @rule()
    def restart_from_state(self):
        fresh = SparseTable(self.config, self.table_index)
        fresh.load(self.table.state())
        self.table = fresh

    @invariant()
    def same_as_the_model(self):
        got = as_model(self.table.state(), self.config.dim, self.model.opt)
        m = self.model
        assert got["rows"].keys() == m.rows.keys()
        for id_, row in m.rows.items():
            np.testing.assert_allclose(got["rows"][id_], row, rtol=1e-4, atol=1e-6)
        assert got["last"] == m.last and got["pending"] == m.pending
        assert got["counters"] == m.counters
        if got["steps"] is not None:
            assert got["steps"] == m.steps
        stats = self.table.stats()
        assert (stats["rows"], stats["pending_ids"]) == (len(m.rows), len(m.pending))
        assert {k: stats[k] for k in m.counters} == m.counters
        if self.config.max_rows:
            assert len(m.rows) <= self.config.max_rows


TableMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_table_matches_a_dict_model = TableMachine.TestCase


# -- explicit cases ---------------------------------------------------------------------------

def ids_of(*values) -> np.ndarray:
    return np.array(values, np.uint64)


def ones(n: int, dim: int) -> np.ndarray:
    return np.ones((n, dim), np.float32)


def initial(ids, config, table_index=0) -> np.ndarray:
    out = np.empty((len(ids), config.dim), np.float32)
    initial_rows(ids, config.dim, config.seed, table_index, config.init_scale, out)
    return out


def read(table, ids) -> np.ndarray:
    out = np.empty((len(ids), table.dim), np.float32)
    table.lookup(ids, out)
    return out


def test_lookup_reads_initial_values_and_never_creates():
    c = TableConfig("emb", 4, optimizer="sgd", seed=9)
    t = SparseTable(c, 2)
    ids = ids_of(1, 2**64 - 1, 1)
    assert np.array_equal(read(t, ids), initial(ids, c, 2))
    assert t.stats()["rows"] == 0 and t.stats()["creations"] == 0


def test_admission_counts_pushes_then_creates_and_applies():
    c = TableConfig("emb", 2, optimizer="sgd", lr=1.0, init_scale=0.0, min_count=3)
    t = SparseTable(c, 0)
    for _ in range(2):
        t.apply(ids_of(7), ones(1, 2), step=1)
        assert read(t, ids_of(7)).tolist() == [[0.0, 0.0]]   # counted, not stored
    assert t.stats() | {"bytes": 0} == {"rows": 0, "bytes": 0, "pending_ids": 1, "admissions": 0,
                                        "creations": 0, "evictions": 0}
    t.apply(ids_of(7), ones(1, 2), step=2)                  # the third push is applied
    assert read(t, ids_of(7)).tolist() == [[-1.0, -1.0]]
    assert t.stats()["pending_ids"] == 0 and t.stats()["admissions"] == t.stats()["creations"] == 1


def test_max_rows_evicts_the_least_recently_updated_ties_by_id():
    t = SparseTable(TableConfig("emb", 1, optimizer="sgd", max_rows=3), 0)
    t.apply(ids_of(10, 11), ones(2, 1), step=1)
    t.apply(ids_of(12), ones(1, 1), step=2)
    t.apply(ids_of(10), ones(1, 1), step=3)       # 11 is now the oldest
    t.apply(ids_of(13), ones(1, 1), step=4)
    assert sorted(t.state().ids.tolist()) == [10, 12, 13]
    t.apply(ids_of(21, 20, 23, 22), ones(4, 1), step=5)   # 10, 12, 13 go; then 20 (ties by id)
    assert sorted(t.state().ids.tolist()) == [21, 22, 23]
    assert t.stats()["evictions"] == 5


def test_a_push_that_evicts_nothing_allocates_nothing_of_the_tables_size():
    """A push of 10 rows into a table of 400k rows with no eviction due takes memory for its 10
    rows, not a list of every row (catches the eviction check building its row list before
    seeing that nothing goes: 3.2 MB here, 76 MiB per push at 10M rows, which a checkpoint's
    memory measurement under pushes counted as the write's)."""
    import tracemalloc
    for config in (TableConfig("emb", 1, optimizer="sgd"),
                   TableConfig("emb", 1, optimizer="sgd", max_rows=10**6)):
        t = SparseTable(config, 0)
        t.apply(np.arange(1, 400_001, dtype=np.uint64), np.ones((400_000, 1), np.float32), step=1)
        tracemalloc.start()
        try:
            t.apply(ids_of(*range(7, 17)), ones(10, 1), step=2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 400_000, (config, peak)


def test_ttl_evicts_rows_not_updated_for_ttl_steps():
    t = SparseTable(TableConfig("emb", 1, optimizer="sgd", ttl_steps=3), 0)
    t.apply(ids_of(1), ones(1, 1), step=0)
    t.apply(ids_of(2), ones(1, 1), step=2)
    t.apply(ids_of(3), ones(1, 1), step=3)        # 0 >= 3 - 3: 1 stays
    assert t.stats()["rows"] == 3
    t.apply(ids_of(3), ones(1, 1), step=4)        # 0 < 4 - 3: 1 goes
    assert sorted(t.state().ids.tolist()) == [2, 3] and t.stats()["evictions"] == 1


def push_sequence(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for step in range(n):
        ids = np.unique(rng.integers(0, 400, 60)).astype(np.uint64)
        rng.shuffle(ids)
        yield ids, rng.standard_normal((ids.size, 3)).astype(np.float32), step


@pytest.mark.parametrize("opt", ROW_OPTIMIZERS)
def test_state_and_load_continue_exactly(opt):
    c = TableConfig("emb", 3, optimizer=opt, min_count=2, max_rows=150, ttl_steps=6, seed=5)
    a = SparseTable(c, 1)
    pushes = list(push_sequence(0, 30))
    for ids, grads, step in pushes[:15]:
        a.apply(ids, grads, step, scale=0.5)
    b = SparseTable(c, 1)
    b.load(a.state())
    for ids, grads, step in pushes[15:]:
        for t in (a, b):
            t.apply(ids, grads, step, scale=0.5)
    sa, sb = a.state().arrays(), b.state().arrays()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].tobytes() == sb[k].tobytes(), k
    sa, sb = a.stats(), b.stats()
    del sa["bytes"], sb["bytes"]    # capacity follows each table's own growth
    assert sa == sb and sa["evictions"] > 0 and sa["pending_ids"] > 0
    q = np.arange(400, dtype=np.uint64)
    assert read(a, q).tobytes() == read(b, q).tobytes()


@pytest.mark.parametrize("min_count, rows, value", [(0, [4, 9], -3.0), (2, [4], -2.0), (3, [], 0.0)])
def test_a_repeated_id_is_counted_and_stepped_per_occurrence(min_count, rows, value):
    t = SparseTable(TableConfig("emb", 1, optimizer="sgd", lr=1.0, init_scale=0.0,
                                min_count=min_count), 0)
    t.apply(ids_of(4, 9, 4), np.array([[1.0], [1.0], [2.0]], np.float32), step=1)
    assert sorted(t.state().ids.tolist()) == rows
    assert read(t, ids_of(4)).tolist() == [[value]]
    SparseTable(t.config, 0).load(t.state())    # still consistent: one row or count per id
    t.apply(ids_of(*range(100, 3000), 4, 4), ones(2902, 1), step=2)   # grows meanwhile
    assert t.stats()["rows"] == (2902 if min_count == 0 else 1)


def filled_table() -> SparseTable:
    t = SparseTable(TableConfig("emb", 3, optimizer="adam", min_count=2), 0)
    for ids, grads, step in push_sequence(1, 5):
        t.apply(ids, grads, step)
    return t


def same_state(a: RowState, b: RowState) -> bool:
    a, b = a.arrays(), b.arrays()
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize("ids, grads, step, match", [
    (ids_of(1, 2), np.array([[0, 1, 2], [np.nan, 0, 0]], np.float32), 1,
     r"the gradient of id 2 \(row 1 of the push\) is not finite"),
    (ids_of(1), np.array([[np.inf, 0, 0]], np.float32), 1,
     r"the gradient of id 1 .* not finite: \[inf, 0.0, 0.0\]"),
    (np.array([1, 2]), ones(2, 3), 1, "ids need a 1-D uint64 array, got int64"),
    (ids_of(1, 2), ones(2, 4), 1, r"grads need float32\[2, 3\], got float32\[2, 4\]"),
    (ids_of(1), np.ones((1, 3)), 1, r"grads need float32\[1, 3\], got float64"),
    (ids_of(1), ones(1, 3), -1, "step must be an integer >= 0"),
])
def test_a_bad_push_is_refused_and_changes_nothing(ids, grads, step, match):
    t = filled_table()
    before = t.state()
    with pytest.raises(InvalidArgument, match=f"table 'emb': {match}"):
        t.apply(ids, grads, step)
    assert same_state(t.state(), before)


def broken(state: dict, key: str, value) -> dict:
    return {**state, key: value} if value is not None else {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize("change, match", [
    (lambda s: broken(s, "steps", None), "has arrays .* keeps"),
    (lambda s: {**s, "extra": s["ids"]}, "has arrays .* keeps"),
    (lambda s: broken(s, "ids", s["ids"].astype(np.int64)), "ids is int64"),
    (lambda s: broken(s, "rows", s["rows"][:-1]), "rows has shape"),
    (lambda s: broken(s, "slot_m", s["slot_m"][:, :2]), "slot_m has shape"),
    (lambda s: broken(s, "ids", np.concatenate([s["ids"][:-1], s["ids"][:1]])), "an id appears twice"),
    (lambda s: broken(s, "pending_ids", np.concatenate([s["pending_ids"][:-1], s["ids"][:1]])),
     "an id appears twice"),
    (lambda s: broken(s, "slot_v", np.where(np.arange(s["slot_v"].size).reshape(s["slot_v"].shape) == 0,
                                            np.float32(np.nan), s["slot_v"])),
     "slot_v holds a value that is not finite"),
    (lambda s: broken(s, "last_update", s["last_update"] - 100), "last_update holds a negative value"),
    (lambda s: broken(s, "pending_counts", s["pending_counts"] + 1),
     r"pending_counts must lie in \[1, min_count=2\)"),
    (lambda s: broken(s, "counters", s["counters"][:2]), "counters has shape"),
])
def test_load_refuses_an_inconsistent_state_and_changes_nothing(change, match):
    t = filled_table()
    before = t.state()
    with pytest.raises(ConfigError, match=f"table 'emb' state: {match}"):
        t.load(RowState.of(change(t.state().arrays())))
    assert same_state(t.state(), before)


def test_rows_grow_in_place_never_copied_and_bytes_count_the_rows_written():
    t = SparseTable(TableConfig("emb", 4, optimizer="adagrad"), 0)
    r = t._rows
    assert r.growable, "this Linux refused to reserve address space"
    where = {k: a.ctypes.data for k, a in {"keys": r.keys, **r.arrays}.items()}
    rng = np.random.default_rng(0)
    for step in range(40):
        ids = np.unique(rng.integers(0, 2**64, 3000, dtype=np.uint64))
        t.apply(ids, ones(ids.size, 4), step)
    assert {k: a.ctypes.data for k, a in {"keys": r.keys, **r.arrays}.items()} == where   # never moved
    rows = t.stats()["rows"]
    assert rows > 100_000 and r.high == rows
    assert t.stats()["bytes"] == rows * (8 + 8 * 4 + 8) + r.slots.nbytes + t._pending.nbytes


def test_without_a_reservation_rows_grow_by_copying_with_at_most_ten_percent_slack(monkeypatch):
    monkeypatch.setattr(table_module, "reserved", lambda shape, dtype: None)
    t = SparseTable(TableConfig("emb", 4, optimizer="adagrad"), 0)
    rng = np.random.default_rng(0)
    for step in range(40):
        ids = np.unique(rng.integers(0, 2**64, 3000, dtype=np.uint64))
        t.apply(ids, ones(ids.size, 4), step)
        rows, cap = t.stats()["rows"], t._rows.keys.shape[0]
        assert rows <= cap <= max(1.1 * rows, rows + table_module.MIN_CHUNK) + 1
    r = t._rows
    assert not r.growable
    assert t.stats()["bytes"] == (r.keys.nbytes + r.slots.nbytes + r.arrays["data"].nbytes
                                  + r.arrays["last"].nbytes + t._pending.nbytes)
    assert r.arrays["data"].shape == (cap, 8)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_evicted_rows_give_their_pages_back():
    t = SparseTable(TableConfig("emb", 16, optimizer="adagrad", max_rows=0, ttl_steps=1), 0)
    ids = np.arange(400_000, dtype=np.uint64)
    t.apply(ids, ones(ids.size, 16), 0)
    table = 400_000 * (8 + 32 * 4 + 8)            # id, row and adagrad slot, last update
    before = rss()
    t.apply(ids[:1000], ones(1000, 16), 5)        # every other row idle past ttl_steps: evicted
    assert t.stats()["rows"] == 1000 and t._rows.high == 1000
    assert before - rss() >= 0.8 * table, (before, rss(), table)
    t.apply(ids[1000:3000], ones(2000, 16), 6)    # and the table grows again into the same space
    fresh = SparseTable(TableConfig("emb", 16, optimizer="adagrad", max_rows=0, ttl_steps=1), 0)
    fresh.apply(ids[1000:3000], ones(2000, 16), 6)
    got, want = np.empty((2000, 16), np.float32), np.empty((2000, 16), np.float32)
    t.lookup(ids[1000:3000], got)
    fresh.lookup(ids[1000:3000], want)
    assert t.stats()["rows"] == 3000 and got.tobytes() == want.tobytes()


def test_concurrent_pushes_and_lookups_equal_one_thread():
    """Threads push disjoint ids (the table grows and rehashes meanwhile) while others read."""
    c = TableConfig("emb", 4, optimizer="adagrad", max_rows=0)
    shared, alone = SparseTable(c, 0), SparseTable(c, 0)
    work = [list(push_sequence(seed, 20)) for seed in range(4)]
    for w, pushes in enumerate(work):     # worker w owns ids = w (mod 4)
        for k, (ids, grads, step) in enumerate(pushes):
            pushes[k] = (ids * np.uint64(4) + np.uint64(w), grads[:, :1].repeat(4, axis=1), step)
    errors = []

    def push(pushes):
        try:
            for ids, grads, step in pushes:
                shared.apply(ids, grads, step)
                read(shared, ids)
        except Exception as e:   # reported below, with the thread's failure
            errors.append(e)

    threads = [threading.Thread(target=push, args=(p,)) for p in work]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for pushes in work:
        for ids, grads, step in pushes:
            alone.apply(ids, grads, step)
    a, b = as_model(shared.state(), 4, shared.opt), as_model(alone.state(), 4, alone.opt)
    assert a["rows"].keys() == b["rows"].keys()
    assert all(np.array_equal(a["rows"][k], b["rows"][k]) for k in a["rows"])


# -- parts on several threads ----------------------------------------------------------------

@pytest.mark.parametrize("n,threads,parts", [(0, 4, 1), (5, 4, 1), (16, 2, 2), (17, 4, 4),
                                             (40, 3, 3), (40, 64, 10), (1000, 1, 1)])
def test_in_parts_covers_every_index_once_on_as_many_threads(monkeypatch, n, threads, parts):
    monkeypatch.setattr(table_module, "PARALLEL_MIN", 4)
    seen, where, barrier = np.zeros(n, np.int64), set(), threading.Barrier(parts, timeout=10)

    def fn(a, b):
        seen[a:b] += 1
        where.add(threading.get_ident())
        barrier.wait()      # every part runs at once, or this times out
        assert b - a >= (4 if parts > 1 else 0)

    assert table_module.in_parts(fn, n, threads) == parts
    assert (seen == 1).all() and len(where) == parts and threading.get_ident() in where


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_in_parts_raises_a_parts_error_after_every_part_has_finished(monkeypatch, failing):
    monkeypatch.setattr(table_module, "PARALLEL_MIN", 1)
    done = []

    def fn(a, b):
        if a == failing:
            raise ValueError(f"part at {a}")
        threading.Event().wait(0.3 if a == 2 else 0.1)   # the last part is the slowest
        done.append(a)

    with pytest.raises(ValueError, match=f"part at {failing}"):
        table_module.in_parts(fn, 3, 3)
    assert sorted(done) == sorted({0, 1, 2} - {failing})


def test_only_a_checked_push_is_split(monkeypatch):
    """An unchecked push may repeat an id (stepped once per occurrence): it runs in one part,
    or two threads could step one row at once. A lookup and a checked push are split."""
    monkeypatch.setattr(table_module, "PARALLEL_MIN", 2)
    calls, real = [], table_module.in_parts
    monkeypatch.setattr(table_module, "in_parts",
                        lambda fn, n, threads: calls.append(threads) or real(fn, n, threads))
    t = SparseTable(TableConfig("emb", 2, optimizer="sgd"), 0, threads=3)
    ids = ids_of(1, 2, 3, 4, 5, 6)
    t.apply(ids, ones(6, 2), step=1)
    assert calls == [1, 1]
    calls.clear()
    t.apply(ids, ones(6, 2), step=2, checked=True)
    read(t, ids)
    assert calls == [3, 3, 3]


@settings(max_examples=40, deadline=None)
@given(config=configs, table_index=st.integers(0, 3), threads=st.integers(2, 5),
       seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(0, 60), min_size=1, max_size=6))
def test_a_push_and_a_lookup_in_parts_equal_one_thread(config, table_index, threads, seed, sizes):
    """Distinct ids drawn from a small universe (rows created, admitted, updated and evicted
    in one push), split into parts of at least 4 ids: the same state, bit for bit."""
    rng = np.random.default_rng(seed)
    universe = rng.integers(0, 2**64, 150, dtype=np.uint64)
    one, many = SparseTable(config, table_index), SparseTable(config, table_index, threads=threads)
    before = table_module.PARALLEL_MIN, table_module.MIN_CHUNK
    # Parts of 4 ids, and arrays that grow (new arrays) in the middle of the run.
    table_module.PARALLEL_MIN, table_module.MIN_CHUNK = 4, 8
    try:
        for step, n in enumerate(sizes):
            ids = rng.choice(universe, n, replace=False)
            grads = rng.standard_normal((n, config.dim)).astype(np.float32)
            one.apply(ids, grads, step, scale=0.5)
            many.apply(ids, grads, step, scale=0.5, checked=True)
            a, b = one.state().arrays(), many.state().arrays()
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            probe = rng.choice(universe, 90, replace=False)
            assert np.array_equal(read(one, probe), read(many, probe))
    finally:
        table_module.PARALLEL_MIN, table_module.MIN_CHUNK = before


def test_threads_must_be_a_count():
    for bad in (0, -1, 65, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="threads must be an integer in"):
            SparseTable(TableConfig("emb", 2), 0, threads=bad)


# -- config -----------------------------------------------------------------------------------

def test_table_config_round_trips_and_signs_every_field():
    c = TableConfig("emb_deep", 8, optimizer="ftrl", params={"l1": 0.1, "beta": 2.0}, min_count=3)
    assert c.params == (("beta", 2.0), ("l1", 0.1))
    assert TableConfig.from_dict(c.to_dict()) == c
    assert TableConfig.from_dict({"name": "e", "dim": 2}) == TableConfig("e", 2)   # params may be left out
    assert c.signature() == TableConfig.from_dict(c.to_dict()).signature()
    for change in ({"dim": 9}, {"lr": 0.1}, {"seed": 1}, {"max_rows": 5}, {"params": {"l1": 0.2}}):
        assert TableConfig(**{**c.__dict__, **change}).signature() != c.signature()


@pytest.mark.parametrize("kw, match", [
    ({"name": ""}, "name must be a non-empty string"),
    ({"dim": 0}, "dim must be an integer >= 1, got 0"),
    ({"dim": 2.0}, "dim must be an integer >= 1, got 2.0"),
    ({"min_count": -1}, "min_count must be an integer >= 0"),
    ({"seed": 2**64}, "seed must be below 2\\*\\*64"),
    ({"init_scale": float("inf")}, "init_scale must be a finite number >= 0"),
    ({"optimizer": "rmsprop"}, "unknown row optimizer 'rmsprop'"),
    ({"lr": -1.0}, "adagrad lr must be a finite number > 0"),
    ({"params": (("l1", 1.0),)}, "adagrad takes no parameter 'l1'"),
    ({"params": (("eps", 1.0), ("beta1", 0.5))}, "params must be .* sorted"),
])
def test_table_config_names_the_bad_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        TableConfig(**{"name": "emb", "dim": 4, **kw})
    with pytest.raises(ConfigError, match="unknown field 'size'"):
        TableConfig.from_dict({"name": "emb", "dim": 4, "size": 3})


# -- memory -----------------------------------------------------------------------------------

RSS_SCRIPT = """
import os, numpy as np
from pserver.sparse import SparseTable, TableConfig

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

n, dim, batch = 1_000_000, 16, 65536
ids = np.random.default_rng(0).integers(0, 2**64, n, dtype=np.uint64)
grads = np.ones((batch, dim), np.float32)
warm = SparseTable(TableConfig("warm", dim), 0)          # compile every kernel first
warm.apply(ids[:10], grads[:10], 0)
warm.lookup(ids[:10], grads[:10].copy())
table = SparseTable(TableConfig("emb", dim, optimizer="adagrad"), 0)
idle = rss()
for start in range(0, n, batch):
    part = ids[start:start + batch]
    table.apply(part, grads[:part.size], start)
stats = table.stats()
print(stats["rows"], (rss() - idle) / stats["rows"], stats["bytes"] / stats["rows"])
"""


def test_memory_per_row_is_within_the_bound():
    """1M rows of dim 16 with adagrad: RSS growth over the idle process, per row, must stay within
    1.2 x (row + optimizer state) + 32 bytes."""
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True,
                         check=True, timeout=300)
    rows, rss_per_row, array_per_row = out.stdout.split()
    bound = 1.2 * (16 * 4 + 16 * 4) + 32
    print(f"memory per row: {float(rss_per_row):.1f} bytes RSS, {float(array_per_row):.1f} "
          f"bytes in the arrays (bound {bound:.1f})")
    assert int(rows) == 1_000_000
    assert float(rss_per_row) <= bound and float(array_per_row) <= bound


def test_a_growing_index_is_built_on_another_thread_and_taken_in_with_the_rows_added_since(monkeypatch):
    """Past SOFT_LOAD the next index is built beside the pushes; at the load bound it is taken
    with the entries added meanwhile, and no rehash runs under the table's lock. After an
    eviction the successor is void and the index is rehashed in place. Either way every id
    reads what a table that always rehashed in place reads."""
    import threading

    from pserver.sparse import index as index_module

    where = []
    real = index_module.rehash

    def counted(keys, count, bits):
        where.append((threading.current_thread().name.startswith("pserver-index"), bits))
        return real(keys, count, bits)

    monkeypatch.setattr(index_module, "rehash", counted)
    monkeypatch.setattr(table_module, "BACKGROUND_MIN_BITS", 12)
    c = TableConfig("emb", 4, optimizer="adagrad")
    t, plain = SparseTable(c, 0), SparseTable(c, 0)
    plain._rows.background = False
    rng = np.random.default_rng(3)
    for step in range(30):
        ids = np.unique(rng.integers(0, 2**64, 500, dtype=np.uint64))
        grads = rng.standard_normal((ids.size, 4)).astype(np.float32)
        for table in (t, plain):
            table.apply(ids, grads, step)
        if t._rows.next is not None:
            t._rows.next[0].result()          # let the builder finish, as a real push rate does
    grown = [bits for background, bits in where if background]
    inline = [bits for background, bits in where if not background and bits > 12]
    final = plain._rows.bits
    assert final == t._rows.bits == 15
    assert inline == [13, 14, 15], where          # plain's rehashes in place; none of t's
    assert grown == [13, 14, 15, 16], where       # t's successors (16: being built, past SOFT_LOAD)
    probe = np.concatenate([t.state().ids, rng.integers(0, 2**64, 100, dtype=np.uint64)])
    a, b = np.empty((probe.size, 4), np.float32), np.empty((probe.size, 4), np.float32)
    t.lookup(probe, a)
    plain.lookup(probe, b)
    assert a.tobytes() == b.tobytes()

    # an eviction while the successor is built: it is not used
    t.config = TableConfig("emb", 4, optimizer="adagrad", max_rows=6000)
    where.clear()
    ids = np.unique(rng.integers(0, 2**64, 900, dtype=np.uint64))
    t.apply(ids, np.ones((ids.size, 4), np.float32), 40)     # crosses SOFT_LOAD, then evicts
    assert t._rows.next is not None and t._rows.moves > 0
    t.config = c
    more = np.unique(rng.integers(0, 2**64, 11_000, dtype=np.uint64))
    t.apply(more, np.ones((more.size, 4), np.float32), 41)   # crosses the load bound
    assert any(not background and bits == 16 for background, bits in where), where
    got = np.empty((more.size, 4), np.float32)
    t.lookup(more, got)
    fresh = SparseTable(c, 0)
    fresh.apply(more, np.ones((more.size, 4), np.float32), 41)
    want = np.empty_like(got)
    fresh.lookup(more, want)
    assert got.tobytes() == want.tobytes()
