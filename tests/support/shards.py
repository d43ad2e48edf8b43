"""In-process shards, driven as the gRPC servicer drives them, with no network."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
from hypothesis import HealthCheck, settings

from pserver.config import ServerConfig
from pserver.models.layout import Layout
from pserver.server.shard import Shard
from tests.support.pushes import fill_with, push, push_all

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


CKPT_LAYOUT = Layout.of([("w", (50,))])


def trained_shard(tmp_path, steps=4, optimizer="adam", **cfg) -> Shard:
    """A shard of one (CKPT_LAYOUT) that two workers pushed `steps` seeded steps into, writing
    its checkpoints in tmp_path."""
    shard = make_cluster(CKPT_LAYOUT, np.linspace(-1, 1, 50, dtype=np.float32), 1, 2,
                         optimizer=optimizer, lr=0.01, checkpoint_dir=str(tmp_path), **cfg)[0]
    rng = np.random.default_rng(0)
    for t in range(steps):
        for r in range(2):
            push_all([shard], r, [t], rng.standard_normal(50).astype(np.float32))
    return shard


def shard_state(shard) -> tuple:
    """A shard's version, weights and optimizer state, as bytes: equal only if bit for bit."""
    s = shard.store
    return s.version, s.params.tobytes(), {k: v.tobytes() for k, v in s.optimizer.state.items()}

