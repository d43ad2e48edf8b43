"""What a run prints while it trains and when it stops: one bar on a terminal (the chief's,
drawn by launch), a line every --log-every seconds in a log, a checkpoint logged once, an
epoch's own time, no "version -1", and no "unreachable" after a Ctrl-C: real processes."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.support.processes import env_with, free_port, pserver_cmd, run

pytestmark = pytest.mark.e2e

# About 1-2 s of training for 2 workers: 2 epochs of 100 steps each, slowed to 10 ms a step.
JOB = ["--model", "logreg", "--samples", "3200", "--test-samples", "200", "--features", "8", "--classes", "3",
       "--batch-size", "16", "--epochs", "2", "--delay", "fixed:0.01"]


def run_on_terminal(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run pserver with a pseudo-terminal (120 columns) as its stdin, stdout and stderr."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen(pserver_cmd(*args), stdin=slave, stdout=slave, stderr=slave, env=env_with(None),
                         start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:         # the other side closed: the process is gone
                    break
                out += data
            elif p.poll() is not None:
                break
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        os.close(master)
    return p.returncode, out.decode(errors="replace")


def test_on_a_terminal_launch_draws_one_bar_for_the_chief_and_no_periodic_lines():
    code, out = run_on_terminal("launch", "--ps", "1", "--workers", "2", *JOB)
    assert code == 0, out[-3000:]
    frames = [f for f in re.split(r"[\r\n]", out) if "%|" in f]
    assert frames, out[-3000:]
    last = frames[-1]
    assert re.match(r"epoch 2/2 step 100/100: 100%\|.*\| loss \d\.\d{4}, [\d,]+ samples/s, ETA 00:00",
                    last), last
    assert any(re.match(r"epoch 1/2 step \d+/100: +\d+%.*ETA \d\d:\d\d", f) for f in frames), frames
    # Neither worker prints a periodic line; the chief's epoch lines still come, under the bar.
    assert not re.search(r"\[worker\d\] epoch \d/2 step", out), out[-3000:]
    assert "[worker0] epoch 2/2 done in" in out and "pserver-progress" not in out


def test_in_a_log_the_workers_write_a_line_every_log_every_seconds_with_an_eta():
    r = run("launch", "--ps", "1", "--workers", "2", *JOB, "--log-every", "0.3", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "\r" not in r.stdout and "%|" not in r.stdout + r.stderr
    chief = re.findall(r"\[worker0\] epoch (\d)/2 step (\d+)/100 loss \d\.\d{4} [\d,]+ samples/s"
                       r"(, ETA \d\d:\d\d)?", r.stdout)
    # A line every 0.3 s of training, each epoch's last one forced; an ETA until the end. Bounded
    # by the time the run took (1-2 s on a quiet machine; a loaded one takes longer and writes
    # more: a fixed bound of 14 failed in CI), and far below one line per step (200).
    took = float(re.findall(r"\[worker0\] epoch 2/2 done in \d+\.\d s \((\d+\.\d) s in all\)", r.stdout)[0])
    assert 3 <= len(chief) <= min(took / 0.3 + 4, 60), (took, r.stdout)
    assert chief[0][2] and chief[-1][:2] == ("2", "100") and not chief[-1][2], chief
    assert re.search(r"\[worker1\] epoch 2/2 step 100/100", r.stdout), r.stdout


def test_a_checkpoint_is_logged_once_and_an_epoch_says_its_own_time(tmp_path):
    r = run("launch", "--ps", "2", "--workers", "2", *JOB, "--checkpoint-dir", str(tmp_path / "ckpt"),
            timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    written = re.findall(r"shard (\d): checkpoint at version (\d+) written", r.stdout)
    # After epoch 1 and epoch 2 (leased data: 100 steps an epoch and the few an epoch's end takes
    # with empty contributions); the shard's stop rewrites the last, or writes the one more step
    # that a worker's empty contribution still made while the chief finished.
    versions = sorted({int(v) for _, v in written})
    assert len(versions) in (2, 3) and 100 <= versions[0] < versions[1] <= versions[-1] <= versions[1] + 1 \
        and versions[1] >= 200, r.stdout
    assert sorted(written) == sorted((k, str(v)) for k in "01" for v in versions), r.stdout
    assert "checkpoint: shard" not in r.stdout                  # the worker no longer echoes them
    epochs = re.findall(r"epoch (\d)/2 done in (\d+\.\d) s \((\d+\.\d) s in all\)", r.stdout)
    assert [e[0] for e in epochs] == ["1", "2"], r.stdout
    (_, own1, all1), (_, own2, all2) = epochs
    # epoch 1's own clock starts a little after the run's (their tenths can differ by one: 1.2 and
    # 1.3 in a clean-clone CI); epoch 2's own time, not since start
    assert abs(float(own1) - float(all1)) <= 0.2 and float(own2) < float(all2), epochs
    assert abs(float(own1) + float(own2) - float(all2)) < 0.3, epochs


def test_a_shard_stopped_before_any_worker_came_says_not_initialized():
    shard = subprocess.Popen(pserver_cmd("serve", "--port", "0"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env_with(None), start_new_session=True)
    try:
        assert "listening on" in shard.stdout.readline()
        shard.send_signal(signal.SIGTERM)
        out = shard.communicate(timeout=30)[0]
    finally:
        if shard.poll() is None:
            shard.kill()
    assert "stopped by SIGTERM, not initialized (no Init came)" in out and "version -1" not in out, out


def test_ctrl_c_stops_shards_and_workers_without_an_unreachable_line(tmp_path):
    """A Ctrl-C reaches every process of a terminal's group at once (here: a shell running two
    shards and two workers): a worker whose shard stopped first says nothing of retrying."""
    py = f"{sys.executable} -m pserver"
    ports = [free_port(), free_port()]
    ps = ",".join(f"127.0.0.1:{p}" for p in ports)
    # No delay: the workers spend their time in pushes and pulls, where a shard's stop hits them.
    job = " ".join(JOB).replace("--epochs 2", "--epochs 1000").replace(" --delay fixed:0.01", "")
    shell = (f"{py} serve --port {ports[0]} --shard 0 --num-shards 2 --num-workers 2 & "
             f"{py} serve --port {ports[1]} --shard 1 --num-shards 2 --num-workers 2 & "
             f"for r in 0 1; do {py} worker --ps {ps} --rank $r --num-workers 2 --connect-timeout 60 "
             f"{job} --log-every 0.5 & done; wait")
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        group = subprocess.Popen(["bash", "-c", shell], stdout=f, stderr=subprocess.STDOUT,
                                 env=env_with(None), start_new_session=True)
    stops = ("pserver worker: stopped by SIGINT", "stopped by SIGINT at version")
    try:
        until(lambda: log.read_text().count("epoch 1/1000 step") >= 2, 90)
        time.sleep(1.0)
        os.killpg(group.pid, signal.SIGINT)
        until(lambda: all(log.read_text().count(s) == 2 for s in stops), 30)
        time.sleep(0.5)
    finally:
        try:
            os.killpg(group.pid, signal.SIGKILL)      # whatever is left of the group
        except ProcessLookupError:
            pass
        group.wait(10)
    out = log.read_text()
    assert all(out.count(s) == 2 for s in stops), out
    assert "unreachable" not in out and "Traceback" not in out, out


def until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.1)


