"""--max-memory-mb over sparse rows (pserver.server.budget): a push reserves room for the rows
it may create before anything is applied; it evicts the least recently updated rows of tables
that allow it, or is refused whole and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from pserver import sparse
from pserver.errors import OverBudget, ResourceExhausted
from pserver.models.layout import Layout
from pserver.server.budget import Budget, available_memory, split
from pserver.server.store import Counters, RowGrads
from pserver.sparse import TableConfig, TableLookup
from pserver.worker.client import PSClient


def table(name, index=0, **kw):
    return sparse.SparseTable(sparse.TableConfig(name, 8, "adagrad", **kw), index)


def part(name, ids):
    ids = np.asarray(ids, np.uint64)
    return RowGrads(name, ids, np.ones((ids.size, 8), np.float32))


def apply(tables, rows, step):
    for p in rows:
        tables[p.table].apply(p.ids, p.grads, step)


def test_a_push_that_fits_is_reserved_until_its_step_is_applied():
    tables = {"a": table("a")}
    b = Budget(64 << 20, Counters())
    rows = [part("a", range(1000))]
    assert b.reserve(tables, []) == 0 and b.reserve(tables, [part("a", [])]) == 0 and b.reserved == 0
    held = b.reserve(tables, rows)
    assert held == tables["a"].growth_bytes(1000) and b.reserved == held
    b.hold(3, held)
    b.settle(3)                          # step 3 not applied yet: still held
    assert b.reserved == held
    apply(tables, rows, 3)
    b.settle(4)
    assert b.reserved == 0
    assert b.report(tables)["used"] == tables["a"].stats()["bytes"]


def test_rows_a_table_holds_already_need_no_room():
    tables = {"a": table("a")}
    apply(tables, [part("a", range(5000))], 0)
    b = Budget(tables["a"].stats()["bytes"] + tables["a"].growth_bytes(100), Counters())
    assert b.reserve(tables, [part("a", range(4000, 5050))]) == tables["a"].growth_bytes(50)
    with pytest.raises(ResourceExhausted):
        b.reserve(tables, [part("a", range(6000, 6051))])     # 51 more: 101 in all


def test_a_push_that_cannot_fit_is_refused_whole_and_changes_nothing():
    tables = {"a": table("a"), "b": table("b", 1)}
    apply(tables, [part("a", range(2000)), part("b", range(2000))], 0)
    counters = Counters()
    held = sum(t.stats()["bytes"] for t in tables.values())
    b = Budget(held + (1 << 16), counters)
    before = {n: t.state().arrays() for n, t in tables.items()}
    with pytest.raises(ResourceExhausted, match=r"--max-memory-mb: table 'b' would create 3,000 new rows .* "
                                                r"no table may evict rows .*the push changed nothing"):
        b.reserve(tables, [part("a", range(2000, 2010)), part("b", range(10_000, 13_000))])
    assert b.reserved == 0 and b.used(tables) == held
    for n, t in tables.items():
        assert all(np.array_equal(t.state().arrays()[k], before[n][k]) for k in before[n])
    assert counters.snapshot()["pushes_refused_for_memory"] == 1


def test_room_is_made_from_the_least_recently_updated_rows_of_tables_that_allow_eviction():
    tables = {"fixed": table("fixed"), "lru": table("lru", 1, max_rows=10**9)}
    for step in range(4):                  # lru's rows 0-999 at step 0, ..., 3000-3999 at step 3
        apply(tables, [part("lru", range(1000 * step, 1000 * (step + 1)))], step)
    apply(tables, [part("fixed", range(500))], 4)
    counters = Counters()
    b = Budget(sum(t.stats()["bytes"] for t in tables.values()), counters)   # full now
    held = b.reserve(tables, [part("fixed", range(500, 1100))])   # 600 new rows of a table that cannot evict
    assert held == tables["fixed"].growth_bytes(600)
    evicted = counters.snapshot()["rows_evicted_for_memory"]
    assert 600 <= evicted <= 1000 and tables["lru"].stats()["rows"] == 4000 - evicted
    kept = tables["lru"].state().ids
    assert set(kept.tolist()) == set(range(evicted, 4000))      # the oldest went, by last update
    apply(tables, [part("fixed", range(500, 1100))], 5)
    b.hold(5, held)
    b.settle(6)
    assert b.used(tables) <= b.limit


def test_a_refused_push_evicts_nothing_and_eviction_spares_the_rows_a_push_will_update():
    """Room is made only when it can be made, and never from the rows this push (or one waiting
    for its step) will update: those would come back outside any reservation."""
    tables = {"fixed": table("fixed"), "lru": table("lru", 1, max_rows=10**9)}
    apply(tables, [part("lru", range(3000))], 0)      # all at step 0: ties go by id, smallest first
    apply(tables, [part("fixed", range(1000))], 1)
    counters = Counters()
    b = Budget(sum(t.stats()["bytes"] for t in tables.values()), counters)    # full
    before = tables["lru"].state().arrays()
    with pytest.raises(ResourceExhausted, match="the push changed nothing"):
        b.reserve(tables, [part("fixed", range(1000, 101_000))])   # needs far more than lru holds
    assert counters.snapshot()["rows_evicted_for_memory"] == 0
    assert all(np.array_equal(tables["lru"].state().arrays()[k], before[k]) for k in before)

    waiting = [part("lru", range(0, 300))]                        # the oldest rows, in a waiting push
    b.hold(7, 0, waiting)
    mine = [part("lru", range(300, 600)), part("fixed", range(5000, 5400))]
    held = b.reserve(tables, mine)
    kept = set(tables["lru"].state().ids.tolist())
    assert set(range(600)) <= kept                                # neither push's rows went,
    assert not set(range(600, 1000)) <= kept                      # though they were the oldest
    assert counters.snapshot()["rows_evicted_for_memory"] >= 400
    apply(tables, waiting + mine, 7)
    b.hold(7, held, mine)
    b.settle(8)
    assert b.used(tables) <= b.limit and b.reserved == 0


def test_an_index_being_built_is_counted_once(monkeypatch):
    """While a table's next index is built beside the pushes, the budget counts its bytes
    (nbytes) and a push that crosses the load bound does not pay for it again: a full budget with
    evictable rows makes room instead of refusing (a loaded CI machine, where builds take
    longer, refused such pushes)."""
    import threading

    from pserver.sparse import index as index_module
    from pserver.sparse import table as table_module
    monkeypatch.setattr(table_module, "BACKGROUND_MIN_BITS", 10)
    release, real = threading.Event(), index_module.rehash

    def slow(keys, count, bits):
        if threading.current_thread().name.startswith("pserver-index"):
            release.wait(10)
        return real(keys, count, bits)

    monkeypatch.setattr(index_module, "rehash", slow)
    t = table("lru", 0, max_rows=10**9)
    apply({"lru": t}, [part("lru", range(900))], 0)           # 2**11 slots
    apply({"lru": t}, [part("lru", range(900, 901))], 1)      # past 0.4 of them: a build starts
    assert t._rows.next is not None and not t._rows.next[0].done()
    tables = {"lru": t}
    b = Budget(t.nbytes, Counters())                           # full, the successor counted
    try:
        held = b.reserve(tables, [part("lru", range(10_000, 10_200))])   # crosses 1024: the bound
        assert held == 200 * t._rows.entry_bytes
    finally:
        release.set()


def test_a_sync_steps_held_rows_and_their_merge_count_in_the_budget(shard_server):
    """46.7: a sync push's rows wait for the step (pending_rows) and are then merged with the
    other ranks': --max-memory-mb 16 keeps 13 MiB for the state, two ranks' 25,000 fresh rows of
    dim 16 take 3.9 MB of table each, but with their held gradients (1.8 MB) and their merge
    (6 MB) 11.6 MB each. The second push is refused at arrival, before it is aggregated, naming
    what is held; nothing is applied. On main both were aggregated (7.7 MB of rows counted) and
    the shard's RSS passed its budget (tests/e2e/test_budget.py measures it)."""
    addr, shard = shard_server(max_memory_mb=16, num_workers=2, mode="sync", optimizer="sgd")
    table, n = TableConfig("emb", 16, "adagrad"), 25_000
    clients = [PSClient([addr], rank=r, num_workers=2, rpc_deadline=10, data_plane="grpc") for r in (0, 1)]
    try:
        for c in clients:
            c.connect(10)
            c.register(Layout.of([("b", (1,))], [table]))
        w = np.zeros(1, np.float32)
        clients[0].init(w)
        for c in clients:
            c.pull(w)

        def push(c, first):
            ids = np.arange(first, first + n, dtype=np.uint64)
            grads = np.full((n, 16), 0.01, np.float32)
            c.push(np.zeros(1, np.float32), n, tables=[table.name],
                   lookups=[TableLookup(ids, np.arange(n), np.empty_like(grads), grads)])

        push(clients[0], 0)
        st = clients[0].status()[0]
        assert st.counters.pushes_aggregated == 1 and st.memory.reserved > 2.5 * n * (8 + 4 * 16), st.memory
        with pytest.raises(OverBudget, match=r"table 'emb' would create 25,000 new rows .* MiB of it its "
                                             r"rows held for its step and their merge.* the push changed "
                                             r"nothing"):
            push(clients[1], n)
        st = clients[0].status()[0]
        assert st.counters.pushes_aggregated == 1 and st.counters.pushes_refused_for_memory == 1
        assert st.version == 0 and st.tables[0].rows == 0          # the step waits: nothing applied
        assert st.memory.used + st.memory.reserved <= st.memory.budget
    finally:
        for c in clients:
            c.close()


def test_max_memory_mb_is_split_between_the_state_and_the_pushes_in_flight():
    """--max-memory-mb 64 keeps an eighth (8 MiB) for pushes in flight, lowering --max-inflight-mb
    32 and saying so in the flag the refusals name, and a sixteenth (4 MiB) for copies: 52 MiB of
    state. An in-flight bound already within the eighth stays, named plainly; without
    --max-memory-mb the state takes 90% of what the machine has available and in flight is not
    taken from it. Catches a split that lowers nothing, takes the sixteenth twice or not at
    all, or names the wrong flag."""
    MiB = 1 << 20
    lowered = split(64, 32)
    assert (lowered.state, lowered.inflight) == (52 * MiB, 8 * MiB)
    assert lowered.inflight_flag == "--max-inflight-mb 32 lowered to an eighth of --max-memory-mb 64"
    kept = split(64, 2)
    assert (kept.state, kept.inflight, kept.inflight_flag) == (64 * MiB - 2 * MiB - 4 * MiB, 2 * MiB,
                                                               "--max-inflight-mb")
    unbounded = split(0, 32)
    assert unbounded.inflight == 32 * MiB and unbounded.inflight_flag == "--max-inflight-mb"
    assert unbounded.state == (int(0.9 * available_memory()) or 1 << 62)


def test_a_dense_range_that_cannot_fit_is_refused_before_it_is_allocated():
    """The dense range counts its parameter, gradient and optimizer slots (adam: 2) per element,
    float32: 16 bytes x 1 MiB elements = 16 MiB, refused in a 15 MiB budget and not in a 16 MiB
    one, naming the shard, the optimizer and both sizes."""
    MiB = 1 << 20
    Budget(16 * MiB, Counters(), slots=2).check_range(MiB, 0, "adam")
    with pytest.raises(ResourceExhausted, match=r"layout: shard 3's range of 1048576 elements needs 16 MiB "
                                                r"\(parameters, adam state and one gradient, float32\) and "
                                                r"the limit is 15 MiB"):
        Budget(15 * MiB, Counters(), slots=2).check_range(MiB, 3, "adam")
    assert Budget(16 * MiB, Counters(), size=lambda: MiB, slots=2).used({}) == 16 * MiB
