"""Start the simulator modules when the session starts; their tests collect them at its end.

numba reads NUMBA_ENABLE_CUDASIM once, at import, and the test process imported numba long
before (the shards' optimizers), so each module in this folder runs in a `python -m pytest` of
its own with the variable set (see tests/test_kernels_cuda.py). They run niced, beside the rest
of the suite (tests/conftest.py starts them when collection ends and runs their `cuda_sim` tests
last), so their minutes overlap the suite's instead of adding to them.

Each module's output, JUnit report and exit code go to files in one directory, so that the
process that waits for a module need not be the one that started it: with pytest-xdist
(`-n 2`, as .ci/run runs the suite) the worker gw0 starts them, in a directory named after the
run (PYTEST_XDIST_TESTRUNUID, which every worker of a run shares), and the `cuda_sim` tests,
whichever worker runs them, read it.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from tests.support import ROOT

MODULES = ("check_kernels_cuda", "check_gemm_cuda", "check_model_cuda", "check_graph_cuda")
NICE = 10      # the suite's timing-sensitive tests come first
# Seconds a module may still take once the suite reaches its test. Below pytest's
# faulthandler_timeout, which ends the whole run (at 900 s it did, in .ci/run at 9178ad6).
WAIT_S = 540


@dataclass
class Run:
    """One simulator module: its files in `directory` (NAME.out, NAME.xml, NAME.rc once it ended)
    and, in the process that started it, its process."""
    name: str
    directory: pathlib.Path
    proc: subprocess.Popen | None = None

    def path(self, suffix: str) -> pathlib.Path:
        return self.directory / f"{self.name}.{suffix}"

    @property
    def returncode(self) -> int | None:
        rc = self.path("rc")
        return int(rc.read_text()) if rc.exists() else None

    def wait(self, timeout: float) -> tuple[str, dict | None]:
        """Its output and its report's counts (None: no report), or TimeoutExpired (the module
        stopped, where this process started it)."""
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            if time.monotonic() > deadline:
                self.stop()
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.5)
        out = self.path("out").read_text(errors="replace") if self.path("out").exists() else ""
        report = self.path("xml")
        if not report.exists():
            return out, None
        suite = ET.parse(report).getroot().find("testsuite")
        return out, {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def directory() -> pathlib.Path:
    """Where this session's modules write: the run's own under pytest-xdist, else a new one."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="pserver-cuda-sim-"))
    path = pathlib.Path(tempfile.gettempdir()) / f"pserver-cuda-sim-{uid}"
    path.mkdir(exist_ok=True)
    return path


def starts_them() -> bool:
    """Whether this process starts the modules: the only one, or pytest-xdist's first worker."""
    return os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"


def start(where: pathlib.Path) -> dict[str, Run]:
    """Every module at once, each niced, in the simulator, writing into `where`."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("PSERVER_TEST_TRACE", None)        # the trace names the suite's tests, not these
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)                    # each module is a plain pytest run of its own
    runs = {}
    for name in MODULES:
        run = Run(name, where)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                f"--junitxml={run.path('xml')}", f"tests/cuda_sim/{name}.py"]
        # the exit code written last, renamed into place: its file says the module has ended
        rc, tmp = shlex.quote(str(run.path("rc"))), shlex.quote(str(run.path("rc.tmp")))
        out = shlex.quote(str(run.path("out")))
        script = f"{shlex.join(argv)} > {out} 2>&1; echo $? > {tmp}; mv {tmp} {rc}"
        run.proc = subprocess.Popen(["/bin/sh", "-c", script], cwd=ROOT, env=env,
                                    preexec_fn=lambda: os.nice(NICE))
        runs[name] = run
    return runs


def found(where: pathlib.Path) -> dict[str, Run]:
    """The modules another process of this run started in `where` (pytest-xdist's gw0)."""
    return {name: Run(name, where) for name in MODULES}
