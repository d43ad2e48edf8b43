"""Real `pserver` processes for tests: started, waited on, their output read and checked."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

# Small but real: logistic regression on a synthetic task, a few hundred steps.
LOGREG = ["--model", "logreg", "--dataset", "synthetic", "--samples", "6000", "--features", "40",
          "--batch-size", "32", "--epochs", "2", "--log-every", "0.5"]


def pserver_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pserver", *args]


def with_a_second_thread(body: str) -> subprocess.CompletedProcess:
    """`body` run by a fresh Python whose second thread, `t`, was started before it and waits
    until it is done (a policy or an affinity set by the body must reach threads that already
    run); os, sys and threading imported."""
    code = ("import os, sys, threading\n"
            "go = threading.Event(); t = threading.Thread(target=go.wait); t.start()\n"
            f"try:\n{''.join(f'    {line}' + chr(10) for line in body.splitlines())}"
            "finally:\n    go.set(); t.join()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


class Proc:
    """A pserver process whose output is collected in the background."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.popen = subprocess.Popen(pserver_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env_with(env), start_new_session=True)
        self.lines: list[str] = []
        self.port_seen = threading.Event()
        self.port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)
            m = re.search(r"listening on \S+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.port_seen.set()
        self.port_seen.set()

    def address(self, timeout: float = 60) -> str:
        assert self.port_seen.wait(timeout) and self.port, "".join(self.lines)
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout: float = 180) -> int:
        code = self.popen.wait(timeout)
        self._reader.join(5)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextmanager
def sigint_as_from_a_terminal():
    """Processes started inside see SIGINT as from a terminal: not ignored. A test run started in
    the background by a shell without job control (`cmd &`, as a CI step may be) ignores SIGINT,
    an ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt
    handler; a handled one (Python's, here) is reset to the default at exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def env_with(extra: dict | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
    env.pop("TF_CONFIG", None)
    env.update(extra or {})
    return env


def on_one_blas_thread(fn, *args):
    """fn(*args) with the BLAS on one thread, as every process the tests start runs it
    (env_with: OPENBLAS_NUM_THREADS=1). A product on two threads adds in another order on some
    CPUs (an AMD EPYC with OpenBLAS's Haswell kernels: 1 ulp in some answers), so a test that
    compares a served answer's bytes with this process's computes it so."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):
        return fn(*args)


def run(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(pserver_cmd(*args), capture_output=True, text=True, env=env_with(env),
                          timeout=timeout)


def missing(what: str, why: str) -> None:
    """A real component the test needs is not here: skip, except in CI (CI=true), which installs
    it (.ci/run) and where a skip would hide a test that never ran."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} cannot run in CI: {why}")
    pytest.skip(why)


def wait_until(condition, timeout: float = 60) -> bool:
    """Poll condition() until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.1)
    return condition()


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999                     # Linux's default


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports free now on 127.0.0.1, for a process that must be
    told its port in advance, picked below the kernel's ephemeral range: a port the kernel hands
    out (bind to 0) can be taken, the moment it is let go, as the source port of any outgoing
    connection on this host, and a loaded CI run saw that ('port ... is already in use')."""
    low, high = _ephemeral_range()
    bottom, top = (10000, low - count) if low > 12000 + count else (high + 1, 65536 - count)
    rnd = random.Random()
    for _ in range(200):
        first = rnd.randrange(bottom, top)
        held = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports outside the ephemeral range")


def stacks(pids: list[int]) -> str:
    """Each process's command line and every thread's Python stack (py-spy dump, from outside),
    for the message of a test that found processes alive that should be gone."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(bytes(1), b" ").decode(errors="replace")
            out.append(f"== pid {pid}: {command}")
            r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            out.append(r.stdout + r.stderr)
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"== pid {pid}: {e}")
    return "\n".join(out)


def children(pid: int) -> list[int]:
    """The pids of pid's child processes (Linux: /proc/PID/task/*/children)."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            found += [int(c) for c in f.read().split()]
    return found


def alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie (an orphan nobody reaped is dead too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for_steps(proc, n, timeout=60):
    """Wait until a worker's output shows n step lines (with their loss); else fail with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum("step" in ln and "loss" in ln for ln in proc.lines) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(proc.output)


def one_clear_line(r, *words):
    """A command that failed with one line on stderr, naming each of words, and no traceback."""
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
