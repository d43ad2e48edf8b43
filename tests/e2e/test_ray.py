"""`pserver launch --backend ray` on a real local Ray that the launcher starts (no dashboard,
an 80 MB object store): the same accuracy as the local backend, a SIGTERM that leaves no
process behind, and one line when Ray is not installed. Ray is the `ray` extra; .ci/run
installs it, and with CI=true a missing Ray fails these tests instead of skipping them."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from pserver.errors import EXIT_TRANSIENT
from tests.support.processes import LOGREG, alive, children, env_with, missing, read_json, run, wait_until

pytestmark = pytest.mark.e2e
CLUSTER = ["--ps", "2", "--workers", "2", "--mode", "sync", "--seed", "3"]


@pytest.fixture
def ray_installed():
    if importlib.util.find_spec("ray") is None:
        missing("the Ray test", "Ray is not installed (pip install -e '.[test,ray]')")


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_ray_backend_reaches_the_local_backends_accuracy(ray_installed, tmp_path):
    summaries = {}
    for backend in ("local", "ray"):
        path = tmp_path / f"{backend}.json"
        # Slices: each worker's batches are fixed, so the runs are equal to the last bit; with
        # leases which worker trains which chunk, and so a step's pair of batches, is timing's.
        r = run("launch", "--backend", backend, *CLUSTER, *LOGREG, "--data-assignment", "slices",
                "--summary-json", str(path), timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summaries[backend] = read_json(path)
        assert "[worker0] epoch 2/2 done" in r.stdout and "[worker1] epoch 2/2 step" in r.stdout
        assert "[ps1] pserver serve: shard 1/2 mode=sync" in r.stdout
        assert "pserver launch: 2 shard(s) at 127.0.0.1:" in r.stdout
    local, ray = summaries["local"], summaries["ray"]
    # Sync with two workers is deterministic: a step is the mean of the same two gradients,
    # and a + b == b + a in floating point, so the order the pushes arrive in cannot matter.
    # Equal to the last bit, then: any difference is a difference in what was run.
    for key in ("test_accuracy", "test_loss", "steps", "pushes_applied", "pushes_rejected"):
        assert ray[key] == local[key], (key, ray[key], local[key])
    assert local["test_accuracy"] > 0.9
    assert [w["rank"] for w in ray["workers"]] == [0, 1]           # every worker's stats came back
    assert ray["launch_wall_seconds"] > 0


def test_sigterm_to_the_ray_launcher_removes_every_actor(ray_installed, procs):
    launcher = procs("launch", "--backend", "ray", *CLUSTER, *LOGREG, "--epochs", "1000",
                     "--delay", "fixed:0.01")
    assert wait_until(lambda: all(f"[worker{r}] epoch 1/1000 step" in launcher.output for r in (0, 1)),
                      300), launcher.output[-3000:]
    tree = descendants(launcher.popen.pid)           # Ray's own processes and its actors
    actors = [pid for pid in tree if "RoleHost" in command_line(pid)]
    try:
        assert len(actors) == 4, [command_line(p) for p in tree]
        launcher.popen.send_signal(signal.SIGTERM)
        assert launcher.wait(120) == 128 + signal.SIGTERM, launcher.output[-3000:]
        assert "pserver launch: stopped by SIGTERM; stopping the cluster" in launcher.output
        assert wait_until(lambda: not any(alive(pid) for pid in tree), 60), \
            [command_line(pid) for pid in tree if alive(pid)]
        # nor any actor that left the launcher's process tree
        assert [pid for pid in all_pids() if "RoleHost" in command_line(pid)] == []
    finally:
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_without_ray_the_ray_backend_is_one_line_and_exit_2(tmp_path):
    # A Python in which `import ray` fails as it does where Ray is not installed.
    code = ("import sys; sys.modules['ray'] = None\n"
            "from pserver.cli import main\n"
            f"sys.exit(main({['launch', '--backend', 'ray', *LOGREG]!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with(None),
                       timeout=120, cwd=os.getcwd())
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["pserver launch: error: --backend: ray needs Ray, which is not "
                                     "installed: pip install -e '.[ray]'"]
    assert r.stdout == ""


def test_address_needs_the_ray_backend():
    r = run("launch", "--address", "auto", *LOGREG, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["pserver launch: error: --address: 'auto' is a Ray cluster's address; "
                                     "give it with --backend ray"]


@pytest.mark.parametrize("address, code, line", [
    ("127.0.0.1:1", EXIT_TRANSIENT,
     "--address: no Ray cluster answers at 127.0.0.1:1 (Connection refused); start one "
     "with `ray start --head`"),
    ("headnode", 2, "--address: 'headnode' is not auto or HOST:PORT (a Ray head's GCS address)"),
])
def test_a_ray_address_without_a_cluster_is_one_line(ray_installed, address, code, line):
    r = run("launch", "--backend", "ray", "--address", address, *LOGREG, timeout=60)
    assert (r.returncode, r.stderr.splitlines()) == (code, [f"pserver launch: error: {line}"])


def test_launch_cluster_runs_launch_from_python():
    import pserver
    summary = pserver.launch_cluster(ps=2, workers=2, backend="local", model="logreg", samples=6000,
                                     features=40, batch_size=32, epochs=2, mode="sync", seed=3)
    assert (summary["num_shards"], summary["num_workers"], summary["mode"]) == (2, 2, "sync")
    assert summary["test_accuracy"] > 0.9 and len(summary["workers"]) == 2
    with pytest.raises(pserver.ConfigError, match="^bogus: not a launch option"):
        pserver.launch_cluster(bogus=1)


def test_the_python_cluster_object_on_ray_adds_a_worker_actor_that_trains(ray_installed):
    """start_cluster(backend="ray").add_workers(1) on a real local Ray: the Ray is started by the
    cluster object, launch runs on it (--address), and the added worker is an actor there that
    shard 0 gives rank 1 and whose pushes are taken in. Fails if add_workers starts nothing on Ray
    (no [joiner0] lines), if the actor cannot reach the shards or lacks the token (its exit code),
    or if launch's Ray and the joiners' are two (no CPU left for the actor: it never starts)."""
    import pserver
    cluster = pserver.start_cluster(ps=1, workers=1, max_workers=2, backend="ray", model="logreg",
                                    samples=2880, features=20, epochs=2, delay="fixed:0.03",
                                    data_assignment="leases")
    try:
        pids = cluster.add_workers(1)
        s = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    out = "".join(cluster.lines)
    assert len(pids) == 1 and "Ray" in out, out[-3000:]
    assert "[joiner0] worker: shard 0 assigned rank 1 (--rank auto)" in out, out[-3000:]
    assert "[joiner0] worker 1: first push after joining taken in" in out, out[-3000:]
    assert [e["epoch"] for e in s["per_epoch"]] == [1, 2]
