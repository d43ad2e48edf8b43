"""Signals as schedulers send them: SIGTERM, SIGHUP, SIGKILL to real launcher, shard and
worker processes. Nothing outlives the launcher; every process exits 128+signal."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from pserver.errors import EXIT_TRANSIENT
from pserver.persist import checkpoint
from tests.support.processes import (
    LOGREG,
    alive,
    children,
    env_with,
    pserver_cmd,
    sigint_as_from_a_terminal,
    stacks,
    wait_until,
)

pytestmark = pytest.mark.e2e

ENDLESS = [*LOGREG, "--epochs", "1000", "--delay", "fixed:0.01"]   # still training when signalled


def training_cluster(procs):
    """A launcher with 2 shards and 2 workers, once both workers are past their first steps."""
    launcher = procs("launch", "--ps", "2", "--workers", "2", *ENDLESS)
    assert wait_until(lambda: all(f"[worker{r}] epoch 1/1000 step" in launcher.output for r in (0, 1)),
                      180), launcher.output[-3000:]
    kids = children(launcher.popen.pid)
    assert len(kids) == 4, kids
    return launcher, kids


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_launcher_stops_workers_then_shards_and_exits_128_plus_signal(procs, sig):
    launcher, kids = training_cluster(procs)
    try:
        launcher.popen.send_signal(sig)
        assert launcher.wait(60) == 128 + sig, launcher.output[-3000:]
        assert [pid for pid in kids if alive(pid)] == []
    finally:
        kill_leftovers(kids)
    out = launcher.output
    name = signal.Signals(sig).name
    assert f"pserver launch: stopped by {name}; stopping the cluster" in out
    last_worker = max(out.index(f"[worker{r}] pserver worker: stopped by SIGTERM") for r in (0, 1))
    first_shard = min(out.index(f"[ps{j}] pserver serve: shard {j} stopped by SIGTERM") for j in (0, 1))
    assert last_worker < first_shard, out[-3000:]          # workers first, then shards


def test_children_die_with_a_launcher_killed_by_sigkill(procs):
    launcher, kids = training_cluster(procs)
    try:
        launcher.popen.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert wait_until(lambda: not any(alive(pid) for pid in kids), 30), \
            stacks([pid for pid in kids if alive(pid)])
    finally:
        kill_leftovers(kids)


def test_sigterm_stops_a_worker_and_a_shard_that_keeps_its_last_state(procs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--optimizer", "sgd", "--lr", "0.1",
                  "--checkpoint-dir", str(ckpt))
    worker = procs("worker", "--ps", shard.address(), "--rank", "0", "--num-workers", "1", *ENDLESS)
    assert wait_until(lambda: "epoch 1/1000 step" in worker.output, 120), worker.output
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 143 and "pserver worker: stopped by SIGTERM" in worker.output, worker.output
    shard.popen.send_signal(signal.SIGTERM)
    assert shard.wait(60) == 143, shard.output
    version = int(re.search(r"stopped by SIGTERM at version (\d+)", shard.output).group(1))
    assert version > 0
    newest = checkpoint.load_latest(str(ckpt), 0, 1)      # what a restart with --restore takes
    assert newest is not None and newest.version == version, shard.output


# A second stop signal delivered while the first one's handler runs: a trace function calls the
# handler again at the first line the handler runs in threading.py (where a lock it took is held).
BURST = """
import signal, sys, threading
from pserver.signals import Stopped, stop_on_signals, stopping

def nested(frame, event, arg):
    if event == "line" and frame.f_code.co_filename == threading.__file__ and not fired:
        fired.append(frame.f_code.co_name)
        handler(signal.SIGHUP, None)
    return nested

fired = []
with stop_on_signals():
    handler = signal.getsignal(signal.SIGTERM)
    sys.settrace(lambda frame, event, arg: nested)
    try:
        handler(signal.SIGTERM, None)
    except Stopped as e:
        sys.settrace(None)
        print("stopped by", e.signum, "stopping", stopping(), "nested in", fired, flush=True)
"""


def test_a_burst_of_stop_signals_stops_once_and_never_hangs():
    """Catches a stop handler that takes a lock (it set a threading.Event): a second signal of a
    burst (a dead launcher's SIGTERM, a terminal's SIGHUP) ran the handler again inside the
    first's Event.set, whose lock was held, and the shard hung in its Event.wait until killed
    (a launched shard outlived its SIGKILLed launcher in CI; py-spy's stack showed it). The
    handler must raise Stopped once, for the first signal, and take no lock."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, timeout=30,
                          env=env_with(None))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"stopped by {int(signal.SIGTERM)} stopping True nested in []\n", done.stdout


def test_a_worker_killed_by_sigkill_makes_the_launcher_exit_transient(procs):
    """Kubeflow's ExitCode policy restarts a replica that exits >= 128: a child killed from
    outside (the OOM killer, a preempted node) is such a failure, unlike a refused request (1)."""
    launcher, kids = training_cluster(procs)
    try:
        worker = next(pid for pid in kids if b"worker1.config" in open(f"/proc/{pid}/cmdline", "rb").read())
        os.kill(worker, signal.SIGKILL)
        assert launcher.wait(60) == EXIT_TRANSIENT, launcher.output[-3000:]
        assert "pserver launch: error: worker1 exited with code 137; stopping the cluster" in launcher.output
        assert [pid for pid in kids if alive(pid)] == []
    finally:
        kill_leftovers(kids)


def test_a_child_whose_parent_is_already_gone_stops_at_once():
    """follow_parent: the pid in the environment is not our parent (it died before the child
    could ask for the signal), so the child sends itself SIGTERM rather than run orphaned."""
    import subprocess
    import sys

    from pserver.signals import PARENT_ENV, with_parent_death
    code = ("from pserver.signals import follow_parent; import os, time; follow_parent(); "
            f"print('{PARENT_ENV}' in os.environ, flush=True); time.sleep(30)")
    gone = subprocess.run([sys.executable, "-c", code], env={**os.environ, PARENT_ENV: "1"},
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == -signal.SIGTERM and gone.stdout == ""
    ok = subprocess.run([sys.executable, "-c", code.replace("time.sleep(30)", "pass")],
                        env=with_parent_death(dict(os.environ)), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == "False\n", ok.stderr   # and not passed on


def test_launch_starts_children_safely_from_a_process_that_uses_grpc():
    """launch_cluster can run in a process with gRPC channels and servers open (a notebook, the
    test suite). A preexec_fn made subprocess fork(), which runs gRPC's fork handlers in the
    child: some children died before their exec (8 of 300 in a measurement). Children now
    start with vfork and ask for their parent-death signal themselves."""
    from concurrent import futures

    import grpc

    from pserver.launch.local import Proc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        codes = []
        for _ in range(300):
            p = Proc("child", ["/bin/true"], dict(os.environ))
            codes.append(p.popen.wait(timeout=30))
        assert codes == [0] * 300, sorted(set(codes))
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("command", [["launch", "--ps", "1", "--workers", "1", *LOGREG],
                                     ["worker", "--ps", "127.0.0.1:1", *LOGREG],
                                     ["serve", "--port", "0"]], ids=["launch", "worker", "serve"])
def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(command):
    """Ctrl-C 0.5 s after the start (once numpy loads), while the package still loads: on 3de5e7b a
    30-line traceback from an import and death by SIGINT; now one line, exit 130, and no process
    left behind."""
    import subprocess
    import time
    with sigint_as_from_a_terminal():
        p = subprocess.Popen(pserver_cmd(*command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env_with({}))
    try:
        time.sleep(0.5)
        # Past Python's own start (a Ctrl-C in its `site` import is Python's to report): numpy
        # mapped, which only pserver's imports load, after its first line put the handler in.
        assert wait_until(lambda: "numpy" in open(f"/proc/{p.pid}/maps").read(), 60)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, (p.returncode, out, err)
    assert "Traceback" not in out + err and err == f"pserver {command[0]}: interrupted\n", (out, err)
    assert children(p.pid) == []


def test_a_program_that_calls_the_cli_in_process_keeps_its_own_signal_handlers(tmp_path):
    """Only the `pserver` command's own process ignores a second stop signal as it exits: a program
    (this test run) that calls pserver.cli.main keeps its handlers. Catches the command's mark set
    by main() itself, which left an in-process caller ignoring Ctrl-C and SIGTERM after a stop."""
    from pserver import cli, signals
    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    assert cli.main(["checkpoint", "inspect", str(tmp_path / "missing")]) == 2
    assert signals.exiting_after(130) == 130 and signals.exiting_after(143) == 143
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before


def test_an_interrupt_that_left_an_exec_of_a_string_still_exits_130(tmp_path):
    """A KeyboardInterrupt that leaves an exec() of a string (as dataclasses' generated methods run)
    and is then caught by exit_code: CPython marks the process to die by SIGINT at exit, and on
    2d7ccd2 it did (status -2 after "interrupted", as stop 57's CI and the CI at 2d7ccd2 saw, with
    a Ctrl-C while a module loaded). Run with -m as the `pserver` command is."""
    import subprocess
    import sys
    (tmp_path / "interrupted_in_exec.py").write_text(
        "import sys\n"
        "from pserver.launch.roles import exit_code\n"
        "sys.exit(exit_code('worker', lambda: exec('raise KeyboardInterrupt')))\n")
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-m", "interrupted_in_exec"], capture_output=True, text=True,
                       env=env_with({"PYTHONPATH": path}), cwd=tmp_path, timeout=120)
    assert (r.returncode, r.stderr) == (130, "pserver worker: interrupted\n"), (r.returncode, r.stderr)


def test_ctrl_c_while_the_flags_are_parsed_is_one_line_and_exit_130(tmp_path):
    """A Ctrl-C after the package loaded but before the command runs (argparse reading its
    translations through gettext): on 8b2eadc a KeyboardInterrupt traceback and death by SIGINT,
    as CI saw twice. A sitecustomize on PYTHONPATH holds the real command 1 s inside
    parse_known_args (and says so in a file) so that the signal lands there every time."""
    import subprocess
    import time
    ready = tmp_path / "parsing"
    (tmp_path / "sitecustomize.py").write_text(
        "import argparse, time\n"
        "_parse = argparse.ArgumentParser.parse_known_args\n"
        "def parse_known_args(self, *a, **k):\n"
        f"    open({str(ready)!r}, 'w').close()\n"
        "    time.sleep(1.0)\n"
        "    return _parse(self, *a, **k)\n"
        "argparse.ArgumentParser.parse_known_args = parse_known_args\n")
    env = env_with({"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    with sigint_as_from_a_terminal():
        p = subprocess.Popen(pserver_cmd("worker", "--ps", "127.0.0.1:1", *LOGREG), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_until(ready.exists, 60)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and err == "pserver worker: interrupted\n", (p.returncode, out, err)


@pytest.mark.parametrize("command", [["worker", "--ps", "127.0.0.1:1", "--connect-timeout", "120", *LOGREG],
                                     ["serve", "--port", "0"]], ids=["worker", "serve"])
def test_a_second_ctrl_c_while_the_process_exits_is_ignored_and_the_exit_is_130(command):
    """Ctrl-C twice, the second as the first one's line is printed: on e319dc7 the second killed
    the process as Python finalized (status -2, not 130; 9 of 10 worker tries with it 20 ms
    later), because Python gives SIGINT back to the system's default then; a shard's second
    Ctrl-C came while its server was still being closed (a KeyboardInterrupt traceback from
    gRPC's __del__). Four tries, each must exit 130 with no traceback."""
    import subprocess
    import time
    for delay in (0.0, 0.01, 0.02, 0.05):
        with sigint_as_from_a_terminal():
            p = subprocess.Popen(pserver_cmd(*command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env_with({}))
        try:
            # Past the imports (gRPC is loaded by the command itself), then a moment for it to start.
            assert wait_until(lambda: "cygrpc" in open(f"/proc/{p.pid}/maps").read(), 60)
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            lines = []
            while not lines or not re.search("stopped by SIGINT|: interrupted$", lines[-1]):  # its stop line
                lines.append(p.stdout.readline())
                assert lines[-1], lines
            line = "".join(lines)
            time.sleep(delay)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            rest = p.stdout.read()
            p.wait(timeout=60)
        finally:
            p.kill()
        assert p.returncode == 130, (delay, p.returncode, line, rest)
        assert "Traceback" not in line + rest, (line, rest)


def test_a_users_own_module_that_imports_pserver_keeps_python_s_ctrl_c(tmp_path):
    """The loading-time SIGINT handler is the `pserver` command's only: a user's `python -m
    theirs` whose package imports pserver keeps KeyboardInterrupt (and so its own clean-up).
    Catches a test on sys.argv[0] == '-m', which is true while any package run with -m loads."""
    import subprocess
    import sys
    pkg = tmp_path / "theirs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import signal\nimport pserver  # noqa: F401\n"
                                     "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    (pkg / "__main__.py").write_text("")
    with sigint_as_from_a_terminal():    # failed so in a .ci/run started with `&` (SIGINT ignored)
        r = subprocess.run([sys.executable, "-m", "theirs"], cwd=tmp_path, capture_output=True, text=True,
                           env=env_with({"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}),
                           timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr


def stop_worker1_and_wait(launcher, is_worker1) -> list[int]:
    """SIGSTOP the launcher's one child that `is_worker1`; the launcher must then exit 0 within
    120 s. Its children (every one killed at the end, whatever happened)."""
    kids = children(launcher.popen.pid)
    worker1 = [pid for pid in kids if is_worker1(pid)]
    assert len(worker1) == 1, kids
    try:
        os.kill(worker1[0], signal.SIGSTOP)
        assert launcher.wait(120) == 0, launcher.output[-3000:]
    finally:
        kill_leftovers(kids)
    return kids


def test_a_worker_stopped_by_sigstop_does_not_hold_the_launcher_after_the_chief_ends(procs):
    """Worker 1 stopped (SIGSTOP) mid-run: the shards mark it dead after --step-timeout and the
    chief trains on and ends; the launcher waited for the stopped worker for ever (an adversarial
    pass). It ends it a few seconds after the chief's end, says so, and exits 0."""
    launcher = procs("launch", "--ps", "1", "--workers", "2", *LOGREG, "--epochs", "2",
                     "--delay", "fixed:0.01", "--step-timeout", "2")
    assert wait_until(lambda: all(f"[worker{r}] epoch 1/2 step" in launcher.output for r in (0, 1)),
                      180), launcher.output[-3000:]
    kids = stop_worker1_and_wait(launcher,
                                 lambda pid: "worker1.config" in open(f"/proc/{pid}/cmdline").read())
    out = launcher.output
    assert "pserver launch: worker1 is stopped by a signal (SIGSTOP?) and the chief's run is over" in out
    assert out.index("== pserver run summary") < out.index("worker1 is stopped by a signal"), out[-3000:]
    assert [pid for pid in kids if alive(pid)] == []


RUN_SCRIPT = """
import numpy as np
import pserver.keras as keras
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 8)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=16, epochs=3, verbose=1)
print("fit done", flush=True)
"""


def test_pserver_run_ends_a_worker_stopped_by_sigstop_after_the_chiefs_fit(procs, tmp_path):
    """The same under `pserver run` (its own supervisor): worker 1 stopped mid-fit; the chief's
    fit ends without it and the run exits 0, worker 1 ended and named."""
    script = tmp_path / "fit.py"
    script.write_text(RUN_SCRIPT)
    launcher = procs("run", "--ps", "1", "--workers", "2", "--step-timeout", "2", "--",
                     sys.executable, str(script))
    assert wait_until(lambda: len(children(launcher.popen.pid)) >= 3 and "Epoch 1/3" in launcher.output,
                      180), launcher.output[-3000:]
    stop_worker1_and_wait(launcher, lambda pid: "PSERVER_RUN_RANK=1" in open(f"/proc/{pid}/environ").read())
    out = launcher.output
    assert "fit done" in out and "pserver run: worker1 is stopped by a signal (SIGSTOP?)" in out, out[-3000:]
