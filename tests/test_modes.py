"""Consistency modes as properties of the Shard, driven in-process (no network).

The same Shard objects serve gRPC in production; tests/test_server.py checks the wire.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver.config import ServerConfig
from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.models import make_model
from pserver.models.layout import Layout
from pserver.modes import Outcome
from pserver.optim import make_optimizer
from pserver.server.shard import Shard

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fill_with(values):
    return lambda dest: dest.__setitem__(slice(None), values)


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


def pull_all(shards, total: int, rank: int = 0, clock: int = 0) -> tuple[np.ndarray, list[int]]:
    w, versions = np.empty(total, np.float32), []
    for j, s in enumerate(shards):
        v, params, _ = s.pull(rank, j, -1, clock, timeout=5)
        w[s.store.start:s.store.end] = params
        versions.append(v)
    return w, versions


def push_all(shards, rank, steps, g, num_samples=1, clock=0):
    return [s.push(rank, j, steps[j], s.store.size, "float32", num_samples, clock,
                   fill_with(g[s.store.start:s.store.end]))[0] for j, s in enumerate(shards)]


# --- sync -----------------------------------------------------------------------------

@SETTINGS
@given(data=st.data(), model_name=st.sampled_from(["logreg", "mlp", "linreg"]),
       optimizer=st.sampled_from(["sgd", "momentum", "adam"]),
       num_workers=st.integers(1, 4), num_shards=st.integers(1, 3), batch=st.integers(1, 6),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sync_equals_single_process_on_the_concatenated_batch(
        data, model_name, optimizer, num_workers, num_shards, batch, steps, seed):
    rng = np.random.default_rng(seed)
    features, classes = int(rng.integers(2, 7)), int(rng.integers(2, 5))
    model = make_model(model_name, features, classes, hidden=(5, 4))
    w0 = model.init_params(seed)
    lr = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}[optimizer]
    shards = make_cluster(model.layout, w0, num_shards, num_workers, optimizer=optimizer, lr=lr)
    reference, w_ref = make_optimizer(optimizer, w0.size, lr=lr, backend="numpy"), w0.copy()
    g, g_ref = np.empty_like(w0), np.empty_like(w0)
    for t in range(steps):
        xs = rng.standard_normal((num_workers, batch, features)).astype(np.float32)
        ys = (rng.standard_normal((num_workers, batch)).astype(np.float32) if model_name == "linreg"
              else rng.integers(0, classes, (num_workers, batch)).astype(np.int32))
        w, versions = pull_all(shards, w0.size)
        assert versions == [t] * num_shards
        order = data.draw(st.permutations(range(num_workers)))   # arrival order must not matter
        for r in order:
            model.loss_and_grad(w, xs[r], ys[r], g)
            assert push_all(shards, r, versions, g) == [Outcome.AGGREGATED] * num_shards
        model.loss_and_grad(w_ref, xs.reshape(-1, features), ys.reshape(-1), g_ref)
        reference.step(w_ref, g_ref, t)
    w, versions = pull_all(shards, w0.size)
    assert versions == [steps] * num_shards
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)


def state_bytes(shard: Shard) -> tuple:
    s = shard.store
    opt = tuple(sorted((k, v.tobytes()) for k, v in s.optimizer.state.items()))
    pending = tuple(sorted((r, g.tobytes()) for r, g in getattr(shard.policy, "pending", {}).items()))
    return s.params.tobytes(), opt, s.version, pending


BAD_PUSHES = {
    "wrong step": (dict(step=5), FailedPrecondition, "step"),
    "step from the past": (dict(step=-1), FailedPrecondition, "step"),
    "wrong size": (dict(num_elements=3), InvalidArgument, "num_elements"),
    "wrong dtype": (dict(dtype="float64"), InvalidArgument, "dtype"),
    "NaN": (dict(poison=np.nan), InvalidArgument, "non-finite"),
    "Inf": (dict(poison=np.inf), InvalidArgument, "non-finite"),
    "unregistered rank": (dict(rank=3), FailedPrecondition, "rank"),
    "negative rank": (dict(rank=-1), FailedPrecondition, "rank"),
    "duplicate push": (dict(rank=0), FailedPrecondition, "already pushed"),
    "wrong shard": (dict(shard=1), FailedPrecondition, "shard"),
}


@SETTINGS
@given(kind=st.sampled_from(sorted(BAD_PUSHES)), optimizer=st.sampled_from(["sgd", "momentum", "adam"]),
       size=st.integers(4, 50), seed=st.integers(0, 1000), position=st.integers(0, 10**6))
def test_rejected_push_leaves_the_shard_byte_identical(kind, optimizer, size, seed, position):
    rng = np.random.default_rng(seed)
    layout = Layout.of([("w", (size,))])
    shard = make_cluster(layout, rng.standard_normal(size).astype(np.float32), 1, 3,
                         optimizer=optimizer, lr=0.1)[0]
    for step in range(2):                                # some history in the optimizer state
        for r in range(3):
            push_all([shard], r, [step], rng.standard_normal(size).astype(np.float32))
    push_all([shard], 0, [2], rng.standard_normal(size).astype(np.float32))  # one pending
    before = state_bytes(shard)
    counters = shard.store.counters.snapshot()
    overrides, error, words = BAD_PUSHES[kind]
    g = rng.standard_normal(size).astype(np.float32)
    if "poison" in overrides:
        g[position % size] = overrides["poison"]
    args = dict(rank=1, shard=0, step=2, num_elements=size, dtype="float32") | overrides
    args.pop("poison", None)
    with pytest.raises(error, match=words):
        shard.push(args["rank"], args["shard"], args["step"], args["num_elements"], args["dtype"],
                   1, 0, fill_with(g))
    assert state_bytes(shard) == before
    after = shard.store.counters.snapshot()
    assert after["pushes_rejected"] == counters["pushes_rejected"] + 1
    assert after["updates_applied"] == counters["updates_applied"]


def test_pull_waits_for_the_next_version_in_sync():
    layout = Layout.of([("w", (4,))])
    shard = make_cluster(layout, np.zeros(4, np.float32), 1, 2, optimizer="sgd", lr=1.0)[0]
    push_all([shard], 0, [0], np.ones(4, np.float32))
    got = {}
    t = threading.Thread(target=lambda: got.update(v=shard.pull(0, 0, 0, 1, timeout=5)[0]))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the pull for version 1 returned before step 0 was complete"
    push_all([shard], 1, [0], np.ones(4, np.float32))
    t.join(5)
    assert got["v"] == 1
    np.testing.assert_array_equal(shard.store.params, -np.ones(4, np.float32))


def test_layout_mismatch_and_wrong_worker_count_are_refused():
    shard = make_cluster(Layout.of([("w", (4,))]), np.zeros(4, np.float32), 1, 2)[0]
    with pytest.raises(FailedPrecondition, match="layout"):
        shard.register(0, 2, 0, 1, Layout.of([("w", (5,))]))
    with pytest.raises(FailedPrecondition, match="num_workers"):
        shard.register(0, 3, 0, 1, Layout.of([("w", (4,))]))
    with pytest.raises(FailedPrecondition, match="shard"):
        shard.register(0, 2, 1, 2, Layout.of([("w", (4,))]))
