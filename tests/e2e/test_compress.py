"""Compressed pushes end to end: launch starts real shards and 2 worker processes, one codec
per consistency mode, and the model still learns."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import LOGREG, read_json, run

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("codec, mode, plane", [
    ("bf16", ["--mode", "sync"], "grpc"),
    ("fp16", ["--mode", "backup", "--backup-workers", "1"], "auto"),
    ("topk:0.1", ["--mode", "async"], "grpc"),
    ("sign", ["--mode", "ssp", "--staleness", "2"], "auto"),
])
def test_two_workers_converge_with_each_codec(tmp_path, codec, mode, plane):
    summary = tmp_path / "s.json"
    r = run("launch", "--ps", "2", "--workers", "2", *LOGREG, *mode, "--optimizer", "sgd", "--lr", "0.1",
            "--data-plane", plane, "--compress", codec, "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.9, s
    assert s["pushes_rejected"] == 0
    assert f"pushes compressed {codec} with error feedback" in r.stdout + r.stderr
    if plane == "auto":     # the data plane declines compressed pushes, and the worker says so
        assert "shared memory carries float32 only" in r.stdout + r.stderr


def test_a_bad_codec_is_one_line_naming_the_flag():
    r = run("worker", "--ps", "127.0.0.1:1", "--compress", "topk:2")
    assert r.returncode == 2 and "--compress: topk ratio '2'" in r.stderr and "Traceback" not in r.stderr
