"""Load: 32 concurrent clients push and pull against 2 real shard processes.

No errors, no deadlock (every client thread ends within a bounded time), and on each
shard every push is accounted for: applied + aggregated + dropped + rejected == received,
which also equals the pushes the clients made. Half the clients use the shared-memory
data plane, half gRPC streams; all carry the auth token.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pserver.config import ServerConfig
from pserver.models.layout import Layout
from pserver.server.shard import Shard
from pserver.wire.security import TOKEN_ENV, ClientSecurity
from pserver.worker.client import PSClient
from tests.support.processes import Proc
from tests.support.pushes import push_request

CLIENTS = 32
LAYOUT = Layout.of([("w", (100, 100)), ("b", (100,))])   # 10,100 elements, 2 shards
TOKEN = "load-test-token"


@pytest.fixture
def shards():
    """shards(mode) starts two shard processes and returns their addresses; stopped after."""
    started: list[Proc] = []

    def start(mode: str) -> list[str]:
        for j in range(2):
            started.append(Proc("serve", "--port", "0", "--shard", str(j), "--num-shards", "2",
                                "--num-workers", str(CLIENTS), "--mode", mode, "--optimizer", "sgd",
                                "--lr", "0.01", env={TOKEN_ENV: TOKEN}))
        return [p.address() for p in started]

    yield start
    for p in started:
        p.stop()


def client_loop(addrs, rank, stop_at, pushes, errors) -> None:
    c = PSClient(addrs, rank=rank, num_workers=CLIENTS, rpc_deadline=60,
                 data_plane="auto" if rank % 2 else "grpc", security=ClientSecurity(TOKEN))
    rng = np.random.default_rng(rank)
    try:
        c.connect(30)
        c.register(LAYOUT)
        if rank == 0:
            c.init(np.zeros(LAYOUT.total, np.float32))
        w = np.empty(LAYOUT.total, np.float32)
        while time.monotonic() < stop_at:
            c.pull(w)
            c.push((rng.standard_normal(LAYOUT.total) * 1e-3).astype(np.float32), 1)
            pushes[rank] += 1
        c.leave()               # sync: the steps stop waiting for this worker
    except Exception as e:      # collected, reported by the test
        errors.append(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode, seconds", [("async", 20), ("sync", 8)])
def test_32_clients_two_shards_every_push_accounted_for(shards, mode, seconds):
    addrs = shards(mode)
    pushes, errors = [0] * CLIENTS, []
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=client_loop, args=(addrs, r, stop_at, pushes, errors), daemon=True)
               for r in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, stop_at + 90 - time.monotonic()))
    assert not [t for t in threads if t.is_alive()], "a client is stuck: deadlock?"
    assert not errors, errors[:5]
    probe = PSClient(addrs, security=ClientSecurity(TOKEN))
    statuses = probe.status()
    probe.close()
    for st in statuses:
        c = st.counters
        done = c.pushes_applied + c.pushes_aggregated + c.pushes_dropped_late + c.pushes_rejected
        assert done == c.pushes_received == sum(pushes), (st.shard, c, sum(pushes))
        assert c.pushes_rejected == 0
    print(f"{mode}: {sum(pushes)} pushes by {CLIENTS} clients in {seconds} s; "
          f"versions {[st.version for st in statuses]}")


def test_sync_step_waits_for_live_workers_when_one_that_pushed_leaves():
    """What the sync load run found: a worker that pushed and then left (its run was over)
    must not stand in for a live worker's missing push."""
    layout = Layout.of([("w", (4,))])
    s = Shard(ServerConfig(num_workers=3, optimizer="sgd", lr=1.0))
    for r in range(3):
        s.register(r, 3, 0, 1, layout)
    s.init(0, layout.signature(), 4, "float32", lambda d: d.__setitem__(slice(None), 0))

    def push(rank, value):
        return s.push(push_request(rank=rank, fill=lambda d: d.__setitem__(slice(None), value),
                                    size=4))[:2]

    push(0, 3.0)
    s.leave(0)
    assert push(1, 3.0)[1] == 0, "the step completed without worker 2"
    assert push(2, 0.0)[1] == 1
    np.testing.assert_array_equal(s.store.params, -2.0)     # mean of 3, 3 and 0, lr 1
