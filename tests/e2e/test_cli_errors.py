"""A user's mistake: one clear line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import LOGREG, run

pytestmark = pytest.mark.e2e


def one_clear_line(r, *words):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_unreachable_ps():
    r = run("worker", "--ps", "127.0.0.1:1", "--connect-timeout", "1", *LOGREG)
    one_clear_line(r, "127.0.0.1:1", "no answer")


def test_missing_data_dir(tmp_path):
    r = run("worker", "--ps", "127.0.0.1:1", "--dataset", "mnist", "--data-dir", str(tmp_path / "nope"),
            env={"PSERVER_MNIST_MIRRORS": ""})        # no download: the files are missing
    one_clear_line(r, "nope", "by hand")


def test_malformed_tf_config():
    r = run("worker", env={"TF_CONFIG": "{oops"})
    one_clear_line(r, "TF_CONFIG", "JSON")
    r = run("serve", "--port", "0", env={"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 4}}'})
    one_clear_line(r, "TF_CONFIG")


@pytest.mark.parametrize("args, words", [
    (["worker", "--ps", "127.0.0.1:2222", "--rank", "5", "--num-workers", "2"], "--rank"),
    (["worker", "--ps", "not an address"], "--ps"),
    (["serve", "--shard", "3", "--num-shards", "2"], "--shard"),
    (["launch", "--optimizer", "sgd", "--lr", "-1", "--workers", "1"], "--lr"),
    (["launch", "--delay", "gamma:1", "--workers", "1"], "--delay"),
])
def test_bad_flags(args, words):
    one_clear_line(run(*args), words)


def test_launch_names_the_failing_process(tmp_path):
    r = run("launch", "--ps", "1", "--workers", "2", "--dataset", "mnist", "--data-dir", str(tmp_path),
            timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr
    assert "exited with code" in r.stderr and "worker" in r.stderr, r.stderr


def test_help_explains_every_command():
    for cmd in ("serve", "worker", "launch", "status"):
        r = run(cmd, "--help")
        assert r.returncode == 0 and "Example" in r.stdout
    assert "Consistency modes" in run("--help").stdout


@pytest.mark.parametrize("spec, words", [("0fixed:1", "I[,J]=DIST"), ("5=fixed:1", "outside"),
                                         ("0=gamma:1", "--delay")])
def test_bad_delay_for(spec, words):
    one_clear_line(run("launch", "--workers", "2", "--delay-for", spec), words)


@pytest.mark.parametrize("args, words", [
    (["launch", "--workers", "1", "--summary-json", "/nonexistent/dir/s.json"], "--summary-json"),
    (["worker", "--ps", "127.0.0.1:1", "--chunk-bytes", "0"], "--chunk-bytes"),
    (["worker", "--ps", "127.0.0.1:1", "--rpc-deadline", "-1"], "--rpc-deadline"),
    (["worker", "--ps", "127.0.0.1:1", "--max-steps", "-1"], "--max-steps"),
    (["serve", "--chunk-bytes", "0"], "--chunk-bytes"),
])
def test_values_checked_before_anything_starts(args, words):
    one_clear_line(run(*args), words)


def test_launch_stops_every_shard_when_one_fails_to_start(tmp_path):
    import glob
    before = set(glob.glob("/tmp/pserver-launch-*"))
    (tmp_path / "shard1-of3-v000000000001.ckpt").write_text("x")   # another cluster shape
    r = run("launch", "--ps", "2", "--workers", "1", "--restore", str(tmp_path), timeout=120)
    assert r.returncode == 1 and "exited with code 2" in r.stderr, r.stderr
    assert set(glob.glob("/tmp/pserver-launch-*")) <= before      # its temp dir is gone too
    import subprocess
    left = subprocess.run(["pgrep", "-f", f"--restore {tmp_path}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a shard was left running"


def test_a_port_in_use_is_named_in_one_line():
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = run("serve", "--port", str(port))
    assert r.returncode == 2
    one_clear_line(r, f"--port: port {port} is already in use on 127.0.0.1")
    assert r.stdout == ""                  # and no log line of gRPC's before it
