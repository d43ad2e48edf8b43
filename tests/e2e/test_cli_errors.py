"""A user's mistake: one clear line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess

import pytest

from pserver.errors import EXIT_TRANSIENT
from tests.support.processes import LOGREG, one_clear_line, run

pytestmark = pytest.mark.e2e


def test_unreachable_ps():
    r = run("worker", "--ps", "127.0.0.1:1", "--connect-timeout", "1", *LOGREG)
    one_clear_line(r, "127.0.0.1:1", "no answer")
    assert r.returncode == EXIT_TRANSIENT      # the shard may come up: Kubeflow's ExitCode policy retries


def test_missing_data_dir(tmp_path):
    r = run("worker", "--ps", "127.0.0.1:1", "--dataset", "mnist", "--data-dir", str(tmp_path / "nope"),
            env={"PSERVER_MNIST_MIRRORS": ""})        # no download: the files are missing
    one_clear_line(r, "nope", "by hand")


def test_malformed_tf_config():
    r = run("worker", env={"TF_CONFIG": "{oops"})
    one_clear_line(r, "TF_CONFIG", "JSON")
    r = run("serve", "--port", "0",
            env={"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 4}}'})
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
    # A model that builds in launch's check but not in a launched worker: a failure at run time.
    (tmp_path / "bad.py").write_text("import sys\n"
                                     "from pserver.models import mlp\n"
                                     "def build(input_shape, num_classes):\n"
                                     "    if sys.argv[0].endswith('child.py'):\n"
                                     "        raise ValueError('no')\n"
                                     "    return mlp(input_shape, num_classes)\n")
    r = run("launch", "--ps", "1", "--workers", "2", "--model", f"{tmp_path / 'bad.py'}:build", timeout=120)
    assert r.returncode == 2          # the worker found a mistake of the user's: exit 2, passed on
    assert "Traceback" not in r.stdout + r.stderr
    assert "exited with code 2" in r.stderr and "worker" in r.stderr, r.stderr
    assert "build() raised ValueError: no" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--dataset", "mnits"], "--dataset: unknown dataset 'mnits'"),
    (["--dataset", "mnist", "--data-dir", "BAD.npz/mnist"], "cannot create --data-dir"),
    (["--dataset", "mnist", "--data-dir", "BAD.npz"], "BAD.npz is not a directory"),
    (["--dataset", "BAD.npz"], "not a readable .npz file"),
    (["--samples", "100", "--batch-size", "64"], "--batch-size: 64 is larger than each worker's slice of 50"),
])
def test_launch_checks_the_data_before_anything_starts(tmp_path, args, words):
    (tmp_path / "BAD.npz").write_text("not a zip")
    r = run("launch", "--ps", "1", "--workers", "2",
            *[str(tmp_path / a) if a.startswith("BAD.npz") else a for a in args])
    assert r.returncode == 2 and r.stdout == "", r.stdout          # no shard, no worker started
    one_clear_line(r, "pserver launch: error:", words)


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
    (tmp_path / "shard1-of3-v000000000001.ckpt").write_text("x")   # another cluster shape
    scratch = tmp_path / "tmp"                  # launch's temporary directory goes here (TMPDIR)
    scratch.mkdir()
    r = run("launch", "--ps", "2", "--workers", "1", "--restore", str(tmp_path), timeout=120,
            env={"TMPDIR": str(scratch)})
    assert r.returncode == 2 and "exited with code 2" in r.stderr, r.stderr      # its usage error: 2
    assert list(scratch.glob("pserver-launch-*")) == []           # its temp dir is gone too
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


@pytest.mark.parametrize("args, words", [
    (["launch", "--ps", "0"], "--ps: launch needs 1 or more, got 0"),
    (["launch", "--workers", "0"], "--workers: launch needs 1 or more, got 0"),
    (["launch", "--ps", "127.0.0.1:2222,127.0.0.1:2223"], "on launch, --ps is how many shards to start"),
    (["worker", "--ps", "2"], "--ps: '2' is a number: on worker, --ps takes shard addresses host:port"),
    (["status", "--ps", "2"], "--ps: '2' is a number: on status, --ps takes shard addresses host:port"),
])
def test_flag_names_in_messages_are_the_flags_the_user_typed(args, words):
    r = run(*args)
    assert r.returncode == 2
    one_clear_line(r, words)


@pytest.mark.parametrize("args, words", [
    (["launch", "--optimiser", "adam"], "unrecognized argument --optimiser; did you mean --optimizer?"),
    (["serve", "--num-shardz=2"], "unrecognized argument --num-shardz=2; did you mean --num-shards?"),
    (["worker", "--batchsize", "8"], "unrecognized argument --batchsize; did you mean --batch-size?"),
    (["status", "--jsn"], "unrecognized argument --jsn; did you mean --json?"),
])
def test_a_misspelled_flag_gets_one_line_with_a_suggestion(args, words):
    r = run(*args)
    assert r.returncode == 2
    one_clear_line(r, f"pserver {args[0]}: error: {words}")


def test_version():
    from pserver import __version__
    r = run("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"pserver {__version__}")


def test_a_worker_without_ps_says_which_address_it_dials():
    assert "127.0.0.1:2222" in " ".join(run("worker", "--help").stdout.split())
    r = run("worker", "--rank", "3")          # fails on --rank before it dials anything
    assert "pserver worker: no --ps and no TF_CONFIG: dialing 127.0.0.1:2222" in r.stdout
    one_clear_line(r, "--rank")


def test_a_tf_config_evaluator_task_is_refused():
    tf = ('{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, '
          '"task": {"type": "evaluator", "index": 0}}')
    for cmd in ("worker", "serve"):
        r = run(cmd, env={"TF_CONFIG": tf})
        assert r.returncode == 2
        one_clear_line(r, "TF_CONFIG: task.type 'evaluator' is not supported")


def test_shards_that_disagree_are_refused_by_the_worker_and_shown_by_status(procs):
    """Shard 0 sync/adam 0.001 and shard 1 async/sgd 0.5: the worker trained, exited 0 and said
    "sync, adam 0.001" everywhere."""
    a = procs("serve", "--port", "0", "--shard", "0", "--num-shards", "2", "--mode", "sync",
              "--optimizer", "adam", "--lr", "0.001")
    b = procs("serve", "--port", "0", "--shard", "1", "--num-shards", "2", "--mode", "sync",
              "--optimizer", "sgd", "--lr", "0.5")
    ps = f"{a.address()},{b.address()}"
    r = run("worker", "--ps", ps, "--num-workers", "1", *LOGREG)
    one_clear_line(r, "the shards disagree on --optimizer", f"shard 0 at {a.address()} has 'adam'",
                   f"shard 1 at {b.address()} has 'sgd'")
    assert r.returncode == 2 and "epoch" not in r.stdout
    shown = run("status", "--ps", ps)
    assert shown.returncode == 0, shown.stderr
    assert "settings differ: --optimizer: shard 0 'adam', shard 1 'sgd'" in shown.stdout
    assert "settings differ: --lr: shard 0 0.001, shard 1 0.5" in shown.stdout
    assert "--mode" not in shown.stdout and "optimizer differs by shard" in shown.stdout
    # The refusal left nothing behind: the worker's rank is free at once, nothing was trained.
    assert all(s.version < 1 for s in status_of(ps))


def status_of(ps: str):
    from pserver.worker.client import PSClient
    client = PSClient(ps.split(","))
    try:
        return client.status(5.0)
    finally:
        client.close()


def test_status_before_init_says_the_job_has_not_started(shard_server, capsys):
    """A shard no chief has initialized holds version -1: `pserver status` printed "cluster: -1
    steps" (3de5e7b); it says the job has not started, and the table "not initialized"."""
    from pserver import cli
    addr, _ = shard_server(num_workers=1)
    assert cli.main(["status", "--ps", addr, "--timeout", "5"]) == 0
    out = capsys.readouterr().out
    assert "cluster: not started (the shards wait for the chief's initial weights)" in out, out
    assert "-1" not in out and "not initialized" in out, out
