"""Consistency modes as properties of the Shard, driven in-process (no network).

The same Shard objects serve gRPC in production; tests/test_server.py checks the wire.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.models import make_model
from pserver.models.layout import Layout
from pserver.modes import Outcome
from pserver.optim import make_optimizer
from pserver.records import PushRequest
from pserver.server.shard import Shard
from tests.support.pushes import fill_with, push_all
from tests.support.shards import SETTINGS, make_cluster


def pull_all(shards, total: int, rank: int = 0, clock: int = 0) -> tuple[np.ndarray, list[int]]:
    w, versions = np.empty(total, np.float32), []
    for j, s in enumerate(shards):
        v, params, _ = s.pull(rank, j, -1, clock, timeout=5)
        w[s.store.start:s.store.end] = params
        versions.append(v)
    return w, versions


# --- sync -----------------------------------------------------------------------------

@SETTINGS
@given(data=st.data(), model_name=st.sampled_from(["logreg", "mlp", "linreg"]),
       optimizer=st.sampled_from(["sgd", "momentum", "adam"]),
       num_workers=st.integers(1, 4), num_shards=st.integers(1, 3),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sync_equals_single_process_on_the_concatenated_batch(
        data, model_name, optimizer, num_workers, num_shards, steps, seed):
    """Workers on batches of different sizes (a last partial batch, different --batch-size),
    each pushing its batch's mean gradient and its size: the step is one process's on the
    concatenated batch. Fails for an unweighted mean of the workers' means."""
    rng = np.random.default_rng(seed)
    features, classes = int(rng.integers(2, 7)), int(rng.integers(2, 5))
    model = make_model(model_name, features, classes, hidden=(5, 4))
    w0 = model.init_params(seed)
    lr = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}[optimizer]
    shards = make_cluster(model.layout, w0, num_shards, num_workers, optimizer=optimizer, lr=lr)
    reference, w_ref = make_optimizer(optimizer, w0.size, lr=lr, backend="numpy"), w0.copy()
    g, g_ref = np.empty_like(w0), np.empty_like(w0)
    for t in range(steps):
        sizes = data.draw(st.lists(st.integers(1, 6), min_size=num_workers, max_size=num_workers))
        xs = [rng.standard_normal((n, features)).astype(np.float32) for n in sizes]
        ys = [rng.standard_normal(n).astype(np.float32) if model_name == "linreg"
              else rng.integers(0, classes, n).astype(np.int32) for n in sizes]
        w, versions = pull_all(shards, w0.size)
        assert versions == [t] * num_shards
        order = data.draw(st.permutations(range(num_workers)))   # arrival order must not matter
        for r in order:
            model.loss_and_grad(w, xs[r], ys[r], g)
            assert push_all(shards, r, versions, g, sizes[r]) == [Outcome.AGGREGATED] * num_shards
        model.loss_and_grad(w_ref, np.concatenate(xs), np.concatenate(ys), g_ref)
        reference.step(w_ref, g_ref, t)
    w, versions = pull_all(shards, w0.size)
    assert versions == [steps] * num_shards
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)


def one_step(grads, counts, order=None, **cfg) -> np.ndarray:
    """The mean one sync step applies, read off a shard that starts at 0 with sgd, lr 1
    (w = 0 - 1 * mean, exact); the pushes arrive in `order`, rank r with counts[r] samples."""
    n, size = len(grads), grads[0].size
    shard = make_cluster(Layout.of([("w", (size,))]), np.zeros(size, np.float32), 1, n,
                         optimizer="sgd", lr=1.0, **cfg)[0]
    for r in order or range(n):
        push_all([shard], r, [0], grads[r], counts[r])
    return -shard.store.params


def wide_gradients(draw_data, n: int, size: int) -> list[np.ndarray]:
    """Gradients of n workers with magnitudes from 1e-30 to 1e30, so roundings differ."""
    scale = draw_data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 7.0, 1e30]))
    rng = np.random.default_rng(draw_data.draw(st.integers(0, 2**16)))
    return [(rng.standard_normal(size) * scale * rng.uniform(0.5, 2)).astype(np.float32) for _ in range(n)]


@SETTINGS
@given(data=st.data(), n=st.integers(2, 5), size=st.integers(1, 64), samples=st.integers(1, 1000))
def test_equal_batches_are_the_rank_ordered_sum_times_one_over_n_bit_for_bit(data, n, size, samples):
    """Every push with the same samples: the arithmetic of the unweighted mean, bit for bit
    (summed in rank order whatever the arrival, then times float32(1/N)). Fails for the
    weighted formula on equal batches (times n, then 1/(N n)), or a sum out of rank order."""
    grads = wide_gradients(data, n, size)
    want = grads[0].copy()
    for g in grads[1:]:
        want += g
    want *= np.float32(1.0 / n)
    got = one_step(grads, [samples] * n, data.draw(st.permutations(range(n))))
    assert got.tobytes() == want.tobytes()


@SETTINGS
@given(data=st.data(), n=st.integers(2, 5), size=st.integers(1, 64))
def test_unequal_batches_are_the_rank_ordered_sum_of_n_g_times_one_over_the_samples(data, n, size):
    """sum(n_i g_i) in rank order, then times float32(1 / sum(n_i)), bit for bit. Fails for
    an unweighted mean, a weight per push other than its samples, or weights scaled first."""
    grads = wide_gradients(data, n, size)
    counts = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n)
                       .filter(lambda c: len(set(c)) > 1))
    want = grads[0] * np.float32(counts[0])
    for g, c in zip(grads[1:], counts[1:]):
        want += g * np.float32(c)
    want *= np.float32(1.0 / sum(counts))
    got = one_step(grads, counts, data.draw(st.permutations(range(n))))
    assert got.tobytes() == want.tobytes()


def test_a_batch_of_one_and_one_of_three_weigh_one_and_three():
    g0, g1 = np.array([4, 8, -2], np.float32), np.array([0, 4, 2], np.float32)
    np.testing.assert_array_equal(one_step([g0, g1], [1, 3]), [1, 5, 1])
    np.testing.assert_array_equal(one_step([g0, g1], [3, 1]), [3, 7, -1])
    np.testing.assert_array_equal(one_step([g0], [5]), g0)        # one worker: its own gradient


@pytest.mark.parametrize("counts", [[4, 4], [1, 3]])
def test_a_sum_that_overflows_is_scaled_first_and_stays_finite(counts):
    """Finite gradients near float32's largest value: their (weighted) sum overflows, the mean
    that is applied does not (each scaled by n_i / sum(n) first); elements that did not
    overflow get the same formula."""
    big = np.float32(3e38)
    g0, g1 = np.array([big, 1], np.float32), np.array([big, 3], np.float32)
    got = one_step([g0, g1], counts)
    assert np.isfinite(got).all()
    w0, w1 = (np.float32(c / sum(counts)) for c in counts)
    assert got.tolist() == [big * w0 + big * w1, np.float32(1) * w0 + np.float32(3) * w1]


def test_backup_weighs_the_first_n_minus_b_pushes_by_their_samples():
    """N=3, b=1: ranks 2 (2 samples) and 0 (6 samples) complete the step; rank 1's push is
    late. The update is (6 g0 + 2 g2) / 8, the late push's samples in neither sum."""
    grads = [np.array([1, 2], np.float32), np.array([100, 100], np.float32), np.array([5, -6], np.float32)]
    shard = make_cluster(Layout.of([("w", (2,))]), np.zeros(2, np.float32), 1, 3, mode="backup",
                         backup_workers=1, optimizer="sgd", lr=1.0)[0]
    assert push_all([shard], 2, [0], grads[2], 2) == [Outcome.AGGREGATED]
    assert push_all([shard], 0, [0], grads[0], 6) == [Outcome.AGGREGATED]
    assert push_all([shard], 1, [0], grads[1], 1) == [Outcome.DROPPED_LATE]
    np.testing.assert_array_equal(-shard.store.params, [(6 * 1 + 2 * 5) / 8, (6 * 2 - 2 * 6) / 8])
    assert shard.store.counters.snapshot()["samples_pushed"] == 8


@pytest.mark.parametrize("mode", ["sync", "backup", "async", "ssp"])
@pytest.mark.parametrize("samples", [-1, -3])
def test_a_push_of_no_samples_is_refused_in_every_mode_and_changes_nothing(mode, samples):
    """A gradient that says it came from fewer than no samples: INVALID_ARGUMENT naming num_samples and
    why, counted as rejected; params, version, optimizer state, the pending step and every
    other counter as before, and a rank marked dead is not revived by it."""
    extra = dict(backup_workers=1) if mode == "backup" else {}
    shard = make_cluster(Layout.of([("w", (3,))]), np.ones(3, np.float32), 1, 3, mode=mode,
                         optimizer="adam", lr=0.1, **extra)[0]
    push_all([shard], 0, [0], np.ones(3, np.float32), 2)
    with shard.store.cond:
        shard.members.mark_dead({2}, "a test")
    before, counters = state_bytes(shard), shard.store.counters.snapshot()
    for rank in (1, 2):
        with pytest.raises(InvalidArgument, match=f"num_samples: {samples} for a push; a gradient is the "
                                                  f"mean over its batch"):
            push_all([shard], rank, [shard.store.version], np.ones(3, np.float32), samples)
    assert state_bytes(shard) == before
    after = shard.store.counters.snapshot()
    assert after.pop("pushes_rejected") == counters.pop("pushes_rejected") + 2
    assert after.pop("pushes_received") == counters.pop("pushes_received") + 2
    assert after == counters
    assert shard.status()["dead_workers"] == [2]


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
    "negative samples": (dict(num_samples=-1), InvalidArgument, "num_samples: -1"),
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
    args = dict(rank=1, shard=0, step=2, num_elements=size, dtype="float32", num_samples=1) | overrides
    args.pop("poison", None)
    with pytest.raises(error, match=words):
        shard.push(PushRequest(**args, clock=0, fill=fill_with(g)))
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
