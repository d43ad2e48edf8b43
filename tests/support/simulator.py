"""Start the simulator modules when the session starts; their tests collect them at its end.

numba reads NUMBA_ENABLE_CUDASIM once, at import, and the test process imported numba long
before (the shards' optimizers), so each module in this folder runs in a `python -m pytest` of
its own with the variable set (see tests/test_kernels_cuda.py). They run niced, beside the rest
of the suite (tests/conftest.py starts them when collection ends and runs their `cuda_sim` tests
last), so their minutes overlap the suite's instead of adding to them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from tests.support import ROOT

MODULES = ("check_kernels_cuda", "check_gemm_cuda", "check_model_cuda", "check_graph_cuda")
NICE = 10      # the suite's timing-sensitive tests come first


@dataclass
class Run:
    """One simulator module's process and the JUnit report it writes."""
    name: str
    proc: subprocess.Popen
    report: pathlib.Path

    def wait(self, timeout: float) -> tuple[str, dict | None]:
        """Its output and its report's counts (None: no report), or TimeoutExpired."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if not self.report.exists():
            return out, None
        suite = ET.parse(self.report).getroot().find("testsuite")
        return out, {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start() -> dict[str, Run]:
    """Every module at once, each niced, in the simulator."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pserver-cuda-sim-"))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("PSERVER_TEST_TRACE", None)        # the trace names the suite's tests, not these
    runs = {}
    for name in MODULES:
        report = tmp / f"{name}.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                f"--junitxml={report}", f"tests/cuda_sim/{name}.py"]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, preexec_fn=lambda: os.nice(NICE))
        runs[name] = Run(name, proc, report)
    return runs
