"""Prometheus metrics scraped from a live shard and a live worker (parsed with
prometheus_client's own parser), and the chief's TensorBoard curves read back with
tensorboard's event reader."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.processes import LOGREG, free_port, read_json, wait_until

pytestmark = pytest.mark.e2e
METRICS_AT = re.compile(r"Prometheus metrics at (http://\S+/metrics)")


def scrape(url: str) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample at `url`."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metrics_url(proc) -> str:
    assert wait_until(lambda: METRICS_AT.search(proc.output), 60), proc.output
    return METRICS_AT.search(proc.output).group(1)


def test_a_live_shard_and_worker_expose_what_the_run_did_and_the_chief_writes_curves(procs, tmp_path):
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--mode", "async", "--optimizer", "sgd",
                  "--lr", "0.1", "--metrics-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"))
    addr = shard.address()
    board, summary = tmp_path / "tb", tmp_path / "summary.json"
    # slices: each worker trains its own half, 188 steps; with leases the chief could take most of it
    common = ("--ps", addr, "--num-workers", "2", "--data-assignment", "slices", *LOGREG)
    chief = procs("worker", *common, "--rank", "0", "--tensorboard", str(board),
                  "--summary-json", str(summary))
    slow = procs("worker", *common, "--rank", "1", "--delay", "fixed:0.05", "--metrics-port", "0")

    # Scraped while it trains: once it shows a step of its first epoch (94 steps of 0.05 s are
    # left), the shard is frozen (SIGSTOP), so the worker waits in its exchange, its metrics server
    # up, until the scrape is done. (Polled while it ran, a loaded CI machine's scrape came as the
    # worker finished: its server was gone mid-scrape.)
    worker_url = metrics_url(slow)
    assert wait_until(lambda: re.search(r"epoch 1/2 step \d+/94 loss", slow.output), 120), slow.output
    shard.popen.send_signal(signal.SIGSTOP)
    try:
        w = scrape(worker_url)
    finally:
        shard.popen.send_signal(signal.SIGCONT)
    steps = w[("pserver_worker_step_seconds_count", ())]
    assert steps >= 1 and w[("pserver_worker_pull_seconds_count", ())] == steps
    assert w[("pserver_worker_samples_total", ())] == 32 * steps
    assert w[("pserver_worker_step_seconds_sum", ())] >= 0.05 * steps     # the injected delay is inside

    assert chief.wait() == 0 and slow.wait() == 0, chief.output + slow.output
    s = read_json(summary)
    m = scrape(metrics_url(shard))
    pushes = {dict(k[1])["outcome"]: v for k, v in m.items() if k[0] == "pserver_pushes_total"}
    assert pushes == {"received": s["pushes_received"], "applied": s["pushes_received"], "aggregated": 0,
                      "dropped_late": 0, "rejected": 0}
    assert m[("pserver_updates_total", ())] == s["steps"] == m[("pserver_version", ())]
    assert m[("pserver_parameters", ())] == 40 * 10 + 10
    assert m[("pserver_received_bytes_total", ())] == s["pushes_received"] * 410 * 4
    assert m[("pserver_sent_bytes_total", ())] % (410 * 4) == 0 and m[("pserver_sent_bytes_total", ())] > 0
    assert m[("pserver_pull_wait_seconds_count", ())] == m[("pserver_sent_bytes_total", ())] / (410 * 4)
    assert m[("pserver_push_staleness_count", ())] == s["pushes_received"]      # async: every push
    assert m[("pserver_push_staleness_bucket", (("le", "+Inf"),))] == s["pushes_received"]
    assert m[("pserver_push_staleness_sum", ())] == pytest.approx(s["staleness_mean"] * s["pushes_received"])
    assert [m[("pserver_push_staleness_bucket", (("le", f"{i}.0"),))] for i in range(3)] == \
        [sum(s["staleness_histogram"][:i + 1]) for i in range(3)]
    assert m[("pserver_checkpoints_total", (("result", "written"),))] >= 2                  # every epoch
    assert m[("pserver_checkpoint_age_seconds", ())] >= 0
    assert m[("pserver_workers", (("state", "dead"),))] == 0

    curves = EventAccumulator(str(board))
    curves.Reload()
    accuracy = curves.Scalars("test/accuracy")
    # one point per epoch: the accuracy the chief printed and logged in the summary
    assert [e.value for e in accuracy] == pytest.approx([e["accuracy"] for e in s["per_epoch"]], abs=1e-6)
    assert accuracy[0].step < accuracy[1].step
    assert all(0 <= e.value <= s["staleness_max"] for e in curves.Scalars("train/staleness_mean"))
    assert curves.Scalars("train/loss")[-1].value < curves.Scalars("train/loss")[0].value
    assert all(e.value > 0 for e in curves.Scalars("train/samples_per_second"))
    assert {"test/loss"} <= set(curves.Tags()["scalars"])


def test_under_launch_process_i_serves_metrics_on_p_plus_i_shards_first(tmp_path):
    from tests.support.processes import run
    base = free_port(count=3)
    r = run("launch", "--ps", "2", "--workers", "1", *LOGREG, "--epochs", "1", "--metrics-port", str(base))
    assert r.returncode == 0, r.stdout + r.stderr
    said = dict(re.findall(r"\[(\w+)\] .*Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics", r.stdout))
    assert said == {"ps0": str(base), "ps1": str(base + 1), "worker0": str(base + 2)}, r.stdout
