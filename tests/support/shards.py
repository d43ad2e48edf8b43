"""In-process shards, driven as the gRPC servicer drives them, with no network."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
from hypothesis import HealthCheck, settings

from pserver.config import ServerConfig
from pserver.models.layout import Layout
from pserver.server.shard import Shard
from tests.support.pushes import fill_with, push

# Property tests over shards: each example builds shards and runs steps, slower than hypothesis likes.
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make_cluster(layout: Layout, w0: np.ndarray, num_shards: int, num_workers: int, **cfg):
    """S in-process shards with N registered workers and the chief's initial values."""
    shards = [Shard(ServerConfig(shard=j, num_shards=num_shards, num_workers=num_workers, **cfg))
              for j in range(num_shards)]
    for j, s in enumerate(shards):
        for r in range(num_workers):
            s.register(r, num_workers, j, num_shards, layout)
        a, b = s.store.start, s.store.end
        s.init(0, layout.signature(), b - a, "float32", fill_with(w0[a:b]))
    return shards


def one_shard(size, num_workers, w0=None, **cfg):
    w0 = np.zeros(size, np.float32) if w0 is None else w0
    return make_cluster(Layout.of([("w", (size,))]), w0, 1, num_workers, **cfg)[0]


def load_kernels() -> None:
    """Load the numba kernels a push runs (the kernels_loaded fixture, tests/conftest.py)."""
    push(one_shard(4, 1, mode="sync", optimizer="sgd", lr=1.0), 0, 0, np.ones(4, np.float32))


@contextlib.contextmanager
def heartbeats(shard, rank, every=0.05):
    """A live worker's client heartbeats while it computes; this is that, for `rank`."""
    stop = threading.Event()
    t = threading.Thread(target=lambda: [shard.heartbeat(rank) for _ in iter(lambda: stop.wait(every), True)])
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def counters(shard) -> dict:
    return shard.status()["counters"]
