"""Compressed pushes end to end: launch starts real shards and 2 worker processes, one codec
per consistency mode, and the model still learns."""

from __future__ import annotations

import pytest

from tests.support.processes import LOGREG, read_json, run

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("codec, mode, plane, pulls", [
    ("bf16", ["--mode", "sync"], "grpc", "bf16"),
    ("fp16", ["--mode", "backup", "--backup-workers", "1"], "auto", "none"),
    ("topk:0.1", ["--mode", "async"], "grpc", "bf16"),
    ("sign", ["--mode", "ssp", "--staleness", "2"], "auto", "bf16"),
])
def test_two_workers_converge_with_each_codec(tmp_path, codec, mode, plane, pulls):
    summary = tmp_path / "s.json"
    r = run("launch", "--ps", "2", "--workers", "2", *LOGREG, *mode, "--optimizer", "sgd", "--lr", "0.1",
            "--data-plane", plane, "--compress", codec, "--pull-compress", pulls,
            "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.9, s
    assert s["pushes_rejected"] == 0
    out = r.stdout + r.stderr
    assert f"pushes compressed {codec} with error feedback" in out
    if plane == "auto":     # the data plane declines compressed pushes, and the worker says so
        assert "shared memory carries float32 only" in out
    if pulls == "bf16":     # pulls are compressed over gRPC only
        assert ("gRPC pulls in bf16" if plane == "grpc" else "pulls over shared memory stay float32") in out


def test_a_bad_codec_is_one_line_naming_the_flag():
    r = run("worker", "--ps", "127.0.0.1:1", "--compress", "topk:2")
    assert r.returncode == 2 and "--compress: topk ratio '2'" in r.stderr and "Traceback" not in r.stderr
    r = run("worker", "--ps", "127.0.0.1:1", "--pull-compress", "topk:0.1")
    assert r.returncode == 2 and "--pull-compress: 'topk:0.1'" in r.stderr and "Traceback" not in r.stderr
