"""The training loop's batch sources (pserver.worker.sources): a rank's own slices of each epoch,
and chunks leased from shard 0's coordinator, driven as pserver.worker.loop.train drives them (the
leased one through the loop's own step, on a real gRPC shard)."""

from __future__ import annotations

import numpy as np
import pytest

from pserver.config import WorkerConfig
from pserver.data import Dataset
from pserver.models.layout import Layout
from pserver.observe.progress import Progress
from pserver.observe.telemetry import TrainingReport
from pserver.records import Registration
from pserver.wire.codec import Position
from pserver.worker.client import PSClient
from pserver.worker.loop import NoCallbacks, Rows, exchange
from pserver.worker.run import Run
from pserver.worker.sources import Batch, EpochEnd, Leases, Slices
from pserver.worker.stragglers import Delay

FEATURES = 4


def dataset(samples: int) -> Dataset:
    """Samples numbered in their first feature, so a batch says which samples it holds."""
    x = np.zeros((samples, FEATURES), np.float32)
    x[:, 0] = np.arange(samples)
    return Dataset("numbered", x, np.zeros(samples, np.int32), x[:2].copy(), np.zeros(2, np.int32), 2)


class Heard(NoCallbacks):
    def __init__(self) -> None:
        self.begun: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)


def a_run(cfg: WorkerConfig, rank: int, ds, client: PSClient, source, mode: str = "async") -> Run:
    """A Run as loop.set_up builds one after Register; the gradient: a zero gradient, loss 0.5."""
    def gradient(w, x, y, g, clock, lookups):
        g.fill(0.0)
        return 0.5
    progress = Progress(cfg.epochs, source.steps, 60.0, "quiet", source.start)
    return Run(cfg, rank, ds, None, client, np.zeros(FEATURES, np.float32), Rows(None, client),
               TrainingReport(cfg), Heard(), mode, progress, gradient, Delay(None), start=source.start)


def drive_slices(run: Run, source: Slices) -> list:
    """What the loop sees: each batch's (epoch, step, first sample), and ("end", epoch); each
    batch a step of the clock, as the loop's exchange counts it."""
    seen = []
    for item in source.batches(run):
        if isinstance(item, EpochEnd):
            seen.append(("end", item.epoch))
            continue
        seen.append((item.epoch, item.step, int(item.x[0, 0])))
        run.clock += 1
    return seen


def test_a_joined_rank_trains_its_slice_rank_mod_n_and_the_config_keeps_its_rank():
    """A worker that joined as rank 3 of a job of 2 slices trains slice 1's batches, in order, an
    EpochEnd after each epoch's last. Fails if the rank is used as the slice (slice 3 of 2 is no
    slice: DataError), if the loop patches the rank into the config, or an epoch end is lost."""
    cfg = WorkerConfig(rank=-1, num_workers=2, batch_size=5, epochs=2, seed=7)
    ds = dataset(40)
    source = Slices(cfg, ds, 3, [])
    run = a_run(cfg, 3, ds, PSClient(["127.0.0.1:1"], num_workers=2), source)
    assert (run.rank, run.data_slice, cfg.rank) == (3, 1, -1)
    seen = drive_slices(run, source)
    expected = []
    for epoch in range(2):
        firsts = [int(x[0, 0]) for x, _ in ds.epoch(1, 2, 5, 7, epoch)]
        expected += [(epoch, step, first) for step, first in enumerate(firsts)] + [("end", epoch)]
    assert seen == expected and source.steps == 4
    assert run.callbacks.begun == [0, 1]


def test_a_resumed_rank_goes_on_from_its_step_and_stops_at_max_steps():
    """Resumed at step 6 (epochs of 4 steps) (the shards recorded it, in this data order): epoch 2 from its
    step 3, then --max-steps 9 ends the run after three steps, with that epoch's end. Fails if a
    resumed epoch starts over, or the run goes past --max-steps, or the partial epoch has no end."""
    cfg = WorkerConfig(num_workers=2, batch_size=5, epochs=3, seed=7, max_steps=9)
    ds = dataset(40)
    info = Registration("sync", 6, True, 0, FEATURES, FEATURES, "", "sgd", 0.1, "", "", "", 10.0,
                        position=Position(clock=6, data_seed=7, steps_per_epoch=4))
    source = Slices(cfg, ds, 0, [info])
    run = a_run(cfg, 0, ds, PSClient(["127.0.0.1:1"], num_workers=2), source)
    assert source.start == run.clock == 6
    seen = drive_slices(run, source)
    firsts = [int(x[0, 0]) for x, _ in ds.epoch(0, 2, 5, 7, 1)]
    assert seen == [(1, 2, firsts[2]), (1, 3, firsts[3]), ("end", 1), (2, 0, seen[3][2]), ("end", 2)]
    assert run.clock == 9 and run.callbacks.begun == [1, 2]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_leased_chunks_are_each_trained_once_an_epoch_and_a_refused_batch_again(shard_server, mode):
    """One worker on a real shard's coordinator, each batch through the loop's own step
    (loop.exchange): every batch of each epoch trained once, an EpochEnd per epoch carrying shard
    0's sums of what was pushed (every sample, loss 0.5 each), and a batch whose outcome is
    'rejected' yielded again at the same place. Fails if a chunk is skipped or trained twice, an
    epoch end is lost, the sums are not passed on, or a refused batch is not trained again."""
    addr, _ = shard_server(optimizer="sgd", lr=0.1, num_workers=1, mode=mode)
    cfg = WorkerConfig(ps=(addr,), num_workers=1, batch_size=4, epochs=2, seed=3, chunk_batches=3)
    ds = dataset(37)                           # 10 batches, the last of 1: chunks of 3, 3, 3, 1
    client = PSClient([addr], num_workers=1, rpc_deadline=10, data_plane="grpc")
    try:
        client.connect(5)
        client.register(Layout.of([("w", (FEATURES,))]), cfg.batch_size)
        client.init(np.zeros(FEATURES, np.float32))
        source = Leases(cfg, ds)
        run = a_run(cfg, 0, ds, client, source, mode)
        client.pull(run.w)
        trained, ends, refused = {0: [], 1: []}, [], None
        for item in source.batches(run):
            if isinstance(item, EpochEnd):
                ends.append((item.epoch, item.trained))
                continue
            assert isinstance(item, Batch) and item.lease is not None
            if refused is None and item.lease[2] == 4:   # refuse one, as a stale step would be
                refused, item.outcome = item.lease, "rejected"
                continue
            if refused is not None and refused != "again":
                assert item.lease == refused, "a refused batch is trained again, first"
                refused = "again"
            assert exchange(run, item) == "trained"
            trained[item.epoch].append((item.lease[2], int(item.x[0, 0])))
    finally:
        client.close()
    for epoch in (0, 1):
        assert sorted(b for b, _ in trained[epoch]) == list(range(10)), epoch
        expected = sorted(int(x[0, 0]) for x, _ in _leased(ds, cfg, epoch))
        assert sorted(first for _, first in trained[epoch]) == expected
    assert refused == "again"
    assert ends == [(e, {"loss_sum": 0.5 * 37, "correct": 0.0, "samples": 37,
                    "metric_sums": ()}) for e in (0, 1)]
    assert run.clock == 20 and run.callbacks.begun == [0, 1]


def _leased(ds, cfg, epoch):
    data = ds.leased_batches(cfg.batch_size, cfg.seed, cfg.chunk_batches)
    return [data.batch(epoch, b) for b in range(data.num_batches)]


def test_a_worker_pushes_empty_for_a_chief_untold_of_the_epochs_end_then_gets_its_logs(two_sync_workers):
    """Keras on a cluster, a worker other than the chief at an epoch's end (loop.chief_logs) on a
    real sync shard whose chief has not been told the epoch ended: the chief waits in a step for
    this worker's contribution, so the worker pushes an empty one (once), after which the chief
    gives its logs, which the worker returns. With `poll` at 30 s, only the quick first asks can
    end it in time: catches an empty push left until several full polls have gone by (the rule
    was three polls of 20 ms, 60 ms at each such epoch end), none at all, or one per ask."""
    import time

    from pserver.worker.loop import chief_logs

    _, chief, other = two_sync_workers()
    pushed = []

    def push_empty():
        pushed.append(time.monotonic())
        chief.epoch_logs(0, share=({"loss": 0.25}, False))    # freed from its step, the chief gives them

    started = time.monotonic()
    got = chief_logs(other, 1, 0, push_empty=push_empty, poll=30.0)
    assert got == {"shared": {"loss": 0.25}, "stop_training": False}
    assert len(pushed) == 1 and time.monotonic() - started < 10.0


def test_a_worker_sees_the_chiefs_epoch_logs_soon_after_they_are_given(two_sync_workers):
    """Without empty pushes (async: the chief waits for no one), the worker asks again after 1 ms,
    2 ms, 4 ms, ... up to `poll`: logs the chief gives 0.2 s in are seen long before a 30 s poll
    would. Catches asking again only every `poll` seconds (every epoch end of a fit rounded up to
    the poll: 20 ms each, 0.2 s of a 10-epoch fit measured on the DCN example)."""
    import threading
    import time

    from pserver.worker.loop import chief_logs

    _, chief, other = two_sync_workers()
    give = threading.Timer(0.2, lambda: chief.epoch_logs(0, share=({"loss": 0.5, "rmse": 0.75}, True)))
    started = time.monotonic()
    give.start()
    try:
        got = chief_logs(other, 1, 0, push_empty=None, poll=30.0)
    finally:
        give.join()
    assert got == {"shared": {"loss": 0.5, "rmse": 0.75}, "stop_training": True}
    assert time.monotonic() - started < 10.0
