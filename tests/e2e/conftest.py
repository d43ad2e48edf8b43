"""Real `pserver` processes for end-to-end tests: started on free ports, always reaped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

# Small but real: logistic regression on a synthetic task, a few hundred steps.
LOGREG = ["--model", "logreg", "--dataset", "synthetic", "--samples", "6000", "--features", "40",
          "--batch-size", "32", "--epochs", "2", "--log-every", "0.5"]


def pserver_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pserver", *args]


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


def env_with(extra: dict | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
    env.pop("TF_CONFIG", None)
    env.update(extra or {})
    return env


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


@pytest.fixture
def procs():
    """Start pserver processes with procs(*args); all are stopped after the test."""
    started: list[Proc] = []

    def start(*args: str, env: dict | None = None) -> Proc:
        p = Proc(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()
