"""A run's part of the shards' counters (metrics.run_part, combine_counters(since=...)) and the shards
that restarted during it (shard_restarts)."""

from __future__ import annotations

from pserver._proto import pserver_pb2 as pb
from pserver.observe.metrics import combine_counters, describe_restart, run_part, shard_restarts


def status(instance: str, version: int, hist, mean: float, restored_from: str = "", **counters):
    return pb.StatusReply(instance=instance, version=version, restored_from=restored_from,
                          counters=pb.Counters(staleness_histogram=hist, staleness_mean=mean, **counters))


def test_the_same_shard_counts_what_happened_since_the_start():
    start = status("a", 100, [4, 0], 0.0, pushes_received=10, samples_pushed=320, staleness_max=3)
    now = status("a", 130, [4, 6], 0.6, pushes_received=40, samples_pushed=1280, staleness_max=3)
    part = run_part(now, start)
    assert (part.version, part.counters.pushes_received, part.counters.samples_pushed) == (30, 30, 960)
    assert list(part.counters.staleness_histogram) == [0, 6]
    assert abs(part.counters.staleness_mean - 1.0) < 1e-12      # (0.6 * 10 - 0) / 6
    assert part.counters.staleness_max == 3                      # a peak: kept as it is
    assert now.version == 130                                    # the input is left alone


def test_a_restarted_shard_counts_from_its_restart():
    start = status("a", 100, [4], 0.0, pushes_received=10)
    reseeded = status("b", 20, [2], 0.0, pushes_received=7)
    restored = status("b", 120, [2], 0.0, restored_from="ckpt", pushes_received=7)
    assert (run_part(reseeded, start).version, run_part(reseeded, start).counters.pushes_received) == (20, 7)
    assert run_part(restored, start).version == 20


def test_combine_counters_since_a_fresh_start():
    start = [status("a", -1, [0], 0.0), status("b", -1, [0], 0.0)]
    now = [status("a", 50, [0], 0.0, samples_pushed=1600, pushes_aggregated=100),
           status("b", 50, [0], 0.0, samples_pushed=1600, pushes_aggregated=100)]
    total = combine_counters(now, since=start)
    assert (total["steps"], total["samples_trained"], total["pushes_aggregated"]) == (50, 1600, 200)


def test_shard_restarts_names_each_restarted_shard_and_the_updates_it_holds_fewer():
    """Catches: a restart the chief rode out, or one it only sees as a new process, left out of
    the summary; the updates behind counted from the wrong shard; shard 0's (retrained) told as lost."""
    start = [status("a", 10, [0], 0.0), status("b", 10, [0], 0.0), status("c", 10, [0], 0.0)]
    ckpt = "/ck/shard1-of-3-v000062.ckpt"
    now = [status("a", 90, [0], 0.0), status("b2", 71, [0], 0.0, restored_from=ckpt),
           status("c", 90, [0], 0.0)]
    assert shard_restarts(now, start, [0, 0, 0]) == [
        {"shard": 1, "restarts": 1, "restored_from": ckpt, "version": 71, "updates_behind": 19}]
    # the chief counted two rejoins of shard 1, and one of shard 2 whose instance the start did not see
    got = shard_restarts(now, None, [0, 2, 1])
    assert [(r["shard"], r["restarts"], r["updates_behind"]) for r in got] == [(1, 2, 19), (2, 1, 0)]
    assert shard_restarts(start, start, [0, 0, 0]) == []
    line = describe_restart(got[0])
    assert line.startswith("shard 1 restarted at least 2 time(s) during the run (restored from "
                           "shard1-of-3-v000062.ckpt): it holds 19 update(s) fewer than the others")
    assert "lost on that shard only" in line
    zero = describe_restart({"shard": 0, "restarts": 1, "restored_from": "", "version": 5,
                             "updates_behind": 3})
    assert "back empty" in zero and "trained again" in zero and "lost on" not in zero
    said = describe_restart(got[1])
    assert said == ("shard 2 restarted at least 1 time(s) during the run (back empty, re-seeded from a "
                    "worker's weights): it holds 0 update(s) fewer than the others")
