"""What a shard records for Prometheus as pushes arrive, and how its staleness counts
become a Prometheus histogram."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver.config import ServerConfig, WorkerConfig
from pserver.errors import ConfigError, FailedPrecondition, InvalidArgument
from pserver.observe.telemetry import staleness_histogram
from tests.support.pushes import push, push_request
from tests.support.shards import one_shard


def rejected(shard, reason: str) -> float:
    return shard.metrics.registry.get_sample_value("pserver_pushes_rejected_total", {"reason": reason}) or 0.0


def test_rejected_pushes_are_counted_by_the_status_code_sent_back():
    shard = one_shard(4, 2, mode="async", optimizer="sgd", lr=1.0)
    push(shard, 0, 0, np.ones(4, np.float32))
    with pytest.raises(InvalidArgument):
        shard.push(push_request(np.ones(4), dtype="float64"))
    with pytest.raises(FailedPrecondition):
        push(shard, 1, 99, np.ones(4, np.float32))              # a step from the future
    assert rejected(shard, "invalid_argument") == 1 and rejected(shard, "failed_precondition") == 1
    counters = shard.status()["counters"]
    assert counters["pushes_rejected"] == 2 and counters["pushes_applied"] == 1
    # one accepted float32 payload and the rejected one from the future; the wrong dtype is not read
    assert shard.metrics.registry.get_sample_value("pserver_received_bytes_total") == 2 * 4 * 4


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=12), st.floats(0, 5))
def test_the_staleness_histogram_is_cumulative_and_ends_with_every_push(counts, mean):
    family = staleness_histogram({"staleness_histogram": counts, "staleness_mean": mean})
    buckets = [s for s in family.samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == [f"{i}.0" for i in range(len(counts) - 1)] + ["+Inf"]
    assert [s.value for s in buckets] == list(np.cumsum(counts))
    count = next(s for s in family.samples if s.name.endswith("_count"))
    total = next(s for s in family.samples if s.name.endswith("_sum"))
    assert count.value == sum(counts) and total.value == pytest.approx(mean * sum(counts))


def test_bad_metrics_and_tensorboard_flags_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="--metrics-port: 70000 is not a TCP port"):
        ServerConfig(metrics_port=70000)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="--tensorboard: .*afile is a file"):
        WorkerConfig(tensorboard=str(tmp_path / "afile"))


def test_a_scrape_of_a_worker_sees_whole_steps():
    """Catches: a worker's step count, pull count and samples updated one by one, so that a scrape
    between two of the updates sees them disagree (tests/e2e/test_metrics.py asserts they agree
    in a scrape made mid-training, and once failed so on a loaded CI machine)."""
    import sys
    import threading
    import time

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pserver.observe.telemetry import WorkerMetrics
    metrics, done = WorkerMetrics(), threading.Event()

    def train():
        while not done.is_set():
            metrics.step(0.001, 0.0005, 32)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                   # threads switch often: the race shows quickly
    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        deadline, scrapes = time.monotonic() + 2, 0
        while time.monotonic() < deadline:
            text = generate_latest(metrics.registry).decode()
            got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            steps = got["pserver_worker_step_seconds_count"]
            assert got["pserver_worker_pull_seconds_count"] == steps
            assert got["pserver_worker_samples_total"] == 32 * steps
            scrapes += 1
    finally:
        done.set()
        trainer.join()
        sys.setswitchinterval(interval)
    assert scrapes > 10 and steps > 0
