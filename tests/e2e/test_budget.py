"""A flood of fresh sparse ids against `--max-memory-mb`: a real shard process refuses the pushes
that do not fit, or evicts the least recently updated rows of a table that allows it, and its
resident memory stays within its idle size + the budget + 10% (docs/semantics.md, "Memory
budget")."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pserver.errors import InvalidArgument, OverBudget, ResourceExhausted
from pserver.models.layout import Layout
from pserver.sparse import TableConfig, TableLookup
from pserver.worker.client import PSClient

pytestmark = pytest.mark.e2e

BUDGET_MB, DIM, BATCH = 128, 16, 100_000


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def flood(procs, table: TableConfig, batches: int):
    """A shard with the budget, one client pushing `batches` batches of fresh ids; returns
    (the shard's idle and largest RSS, the refusals' messages, its last Status)."""
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--max-memory-mb", str(BUDGET_MB),
                  "--optimizer", "sgd")
    client = PSClient([shard.address()], rpc_deadline=60)
    client.connect(60)
    try:
        client.register(Layout.of([("b", (1,))], [table]))
        w = np.zeros(1, np.float32)
        client.init(w)
        client.pull(w)

        def push(first: int) -> None:
            ids = np.arange(first, first + BATCH, dtype=np.uint64)
            grads = np.full((BATCH, DIM), 0.01, np.float32)
            client.push(np.zeros(1, np.float32), BATCH,
                        lookups=[TableLookup(ids, np.arange(BATCH), np.empty_like(grads), grads)],
                        tables=[table.name])
            client.pull(w)

        push(1 << 40)                  # the kernels compile: code, not table memory
        idle, peak, refused = rss(shard.popen.pid), 0, []
        for b in range(batches):
            try:
                push(b * BATCH)
            except ResourceExhausted as e:
                refused.append(str(e))
            peak = max(peak, rss(shard.popen.pid))
        return idle, peak, refused, client.status()[0]
    finally:
        client.close()


def test_a_table_that_may_not_evict_refuses_what_does_not_fit_and_memory_stays_bounded(procs):
    # 4M ids, ~580 MB of rows: most pushes are refused, and a refused push keeps nothing (the
    # data plane once held each one's arrays until a garbage collection: 215 MiB here)
    idle, peak, refused, st = flood(procs, TableConfig("emb", DIM, "adagrad"), 40)
    assert refused, "nothing was refused"
    assert "--max-memory-mb: table 'emb' would create 100,000 new rows" in refused[0]
    assert "no table may evict rows" in refused[0] and "the push changed nothing" in refused[0]
    assert st.counters.pushes_refused_for_memory == len(refused)       # each refused once, not retried
    rows = st.tables[0].rows
    assert rows == (1 + 40 - len(refused)) * BATCH      # whole pushes only (the warm-up's and those taken)
    assert st.memory.used <= st.memory.budget < BUDGET_MB << 20
    assert peak - idle <= 1.1 * (BUDGET_MB << 20), (idle, peak)


def test_a_table_that_may_evict_takes_every_push_and_memory_stays_bounded(procs):
    table = TableConfig("emb", DIM, "adagrad", max_rows=10**8)
    idle, peak, refused, st = flood(procs, table, 15)
    assert refused == []
    assert st.counters.rows_evicted_for_memory >= 15 * BATCH - st.tables[0].rows
    assert st.tables[0].evictions == st.counters.rows_evicted_for_memory
    assert st.memory.used <= st.memory.budget
    assert peak - idle <= 1.1 * (BUDGET_MB << 20), (idle, peak)


def test_a_push_larger_than_the_budget_lets_one_push_carry_is_refused_at_once_naming_both_flags(procs):
    """--max-memory-mb 128 keeps 16 MiB for the bytes in flight: 300,000 ids of dim 16 (21 MiB)
    are refused before a byte is received, at once (not retried for --rpc-deadline), and the
    line says which flags set the bound."""
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--max-memory-mb", str(BUDGET_MB),
                  "--optimizer", "sgd")
    client = PSClient([shard.address()], rpc_deadline=60, data_plane="grpc")
    client.connect(60)
    try:
        table = TableConfig("emb", DIM, "adagrad")
        client.register(Layout.of([("b", (1,))], [table]))
        w = np.zeros(1, np.float32)
        client.init(w)
        client.pull(w)
        n = 300_000
        grads = np.full((n, DIM), 0.01, np.float32)
        started = time.monotonic()
        with pytest.raises(OverBudget, match=r"one push may carry 16 MiB \(--max-inflight-mb 1024 lowered "
                                             r"to an eighth of --max-memory-mb 128\)"):
            ids = np.arange(n, dtype=np.uint64)
            client.push(np.zeros(1, np.float32), n, tables=[table.name],
                        lookups=[TableLookup(ids, np.arange(n), np.empty_like(grads), grads)])
        assert time.monotonic() - started < 30
        assert client.status()[0].tables[0].rows == 0
    finally:
        client.close()


def test_a_lease_request_whose_plan_does_not_fit_is_refused_at_once_and_changes_nothing(procs):
    """46.6: one LeaseData's plan sizes shard 0's coordinator state. 2**40 batches once left a
    half-made plan fixed (MemoryError), and 30,000,000 chunks of one batch took shard 0 from 176 to
    1,607 MB under --max-memory-mb 128, holding the lock Status waits for 22 s. Each is refused
    before anything is built, naming the field and value; Status answers, the shard's memory
    stays within its budget, and the job's real worker leases its data afterwards."""
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--max-memory-mb", str(BUDGET_MB),
                  "--optimizer", "sgd")
    rogue = PSClient([shard.address()], rank=1, num_workers=2, rpc_deadline=60)
    worker = PSClient([shard.address()], rank=0, num_workers=2, rpc_deadline=60)
    layout = Layout.of([("b", (1,))])
    try:
        for c in (rogue, worker):
            c.connect(60)
            c.register(layout)
        idle = rss(shard.popen.pid)
        for batches in (1 << 40, 30_000_000):
            started = time.monotonic()
            with pytest.raises(OverBudget, match=rf"--max-memory-mb: data: num_batches {batches:,} in chunks "
                                                 rf"of chunk_batches 1 .* MiB budget; nothing changed"):
                rogue.lease_data(batches, 1, 0, "fp", 1)
            assert time.monotonic() - started < 5, batches
            started = time.monotonic()
            st = worker.status()[0]
            assert time.monotonic() - started < 5 and st.memory.used <= st.memory.budget
        with pytest.raises(InvalidArgument, match="data: seed -1 must be at least 0"):
            rogue.lease_data(10, 1, -1, "fp", 1)          # once a ValueError from numpy, plan left fixed
        assert rss(shard.popen.pid) - idle <= 1.1 * (BUDGET_MB << 20)
        got = worker.lease_data(469, 16, 0, "fp", 1)       # the job's plan: nothing of the refused is left
        assert got.has_lease and got.epoch == 0 and got.end_batch - got.first_batch == 16, got
    finally:
        rogue.close()
        worker.close()
