"""A run's part of the shards' counters (metrics.run_part, combine_counters(since=...))."""

from __future__ import annotations

from pserver._proto import pserver_pb2 as pb
from pserver.observe.metrics import combine_counters, run_part


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
