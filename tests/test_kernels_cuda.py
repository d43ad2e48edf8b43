"""The CUDA kernels, the CUDA model and the --device helpers, with no GPU needed.

The CUDA tests run in numba's CUDA simulator, in a subprocess. numba reads
NUMBA_ENABLE_CUDASIM once, when it is first imported, and by the time this module runs
tests/conftest.py has long imported numba (the shards' optimizers): setting the variable here
would change nothing, and reloading numba's config inside a live process would leave it half
simulator, half driver. So the simulator tests live in tests/cuda_sim/check_*.py (names the
default run does not collect), and each test below runs one of those modules in a fresh
`python -m pytest` with NUMBA_ENABLE_CUDASIM=1, and its test below (marked `cuda_sim`) reads its
JUnit report: it must have run tests, and every one must have passed (none skipped). The modules
start, niced, when the session's collection ends and run beside the suite; their tests run last
(tests/conftest.py, tests/support/simulator.py). `-m "not e2e and not cuda_sim"` leaves them out.

The same modules run against a real GPU when started by hand without the variable:
`python -m pytest tests/cuda_sim/check_kernels_cuda.py tests/cuda_sim/check_model_cuda.py`;
tests/cuda_sim/check_ptx.py compiles every kernel to PTX (it needs numba-cuda's NVVM).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pserver.errors import ConfigError
from pserver.kernels.device import Device, blas_note, describe, parse_device, round_robin, select
from tests.support import ROOT, simulator

# Seconds a simulator module may still take once the suite reaches its test: the modules started
# with the session (tests/support/simulator.py). Below pytest's faulthandler_timeout, which ends the
# whole run (at 900 s it did, in .ci/run at 9178ad6).
INNER_TIMEOUT = 540


def _env(**changes) -> dict:
    env = dict(os.environ)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@pytest.mark.cuda_sim
@pytest.mark.parametrize("name", simulator.MODULES)
def test_in_cuda_simulator(simulator_runs, name):
    run = simulator_runs[name]
    try:
        out, counts = run.wait(INNER_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} ran past {INNER_TIMEOUT} s after the suite reached it")
    assert counts is not None, f"{name} wrote no report (exit {run.proc.returncode}):\n{out[-4000:]}"
    why = f"{name}: {counts}\n{out[-6000:]}"
    assert run.proc.returncode == 0 and counts["tests"] > 0, why
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, why


def test_a_simulator_wait_ends_before_pytest_ends_the_run():
    # Catches the 9178ad6 failure: a wait longer than faulthandler_timeout (with
    # faulthandler_exit_on_timeout) ends the whole test run instead of failing one test.
    ini = (ROOT / "pyproject.toml").read_text()      # tomllib is 3.11+; pserver runs on 3.10
    assert re.search(r"^faulthandler_exit_on_timeout = true$", ini, re.M)
    limit = int(re.search(r"^faulthandler_timeout = (\d+)$", ini, re.M).group(1))
    assert INNER_TIMEOUT < limit


# -- the --device flag: parsing needs no numba.cuda --------------------------------------

@pytest.mark.parametrize("spec,want", [
    ("cpu", Device("cpu")), ("cuda", Device("cuda")), ("cuda:0", Device("cuda", 0)),
    ("cuda:3", Device("cuda", 3)), (" CUDA:1 ", Device("cuda", 1)),
])
def test_parse_device(spec, want):
    got = parse_device(spec)
    assert got == want and got.backend == want.kind
    assert str(got) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "", "cuda:", "cuda:-1", "cuda:x", "cuda0", "cuda:1:2",
                                  "cpu:0", "tpu"])
def test_parse_device_rejects(spec):
    with pytest.raises(ConfigError, match=r"^--device: unknown device .*; use cpu, cuda or cuda:I"):
        parse_device(spec)


def test_cpu_and_pinned_devices_need_no_gpu(monkeypatch):
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    assert select(Device("cpu")) == Device("cpu") and describe(Device("cpu")) == "cpu"
    assert blas_note(Device("cpu")) is None
    # A core type named in the environment overrides OpenBLAS's choice for this CPU: the chief
    # says so (a machine that sets Haswell's runs AVX2 on an AVX-512 core), on the CPU only.
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert describe(Device("cpu")) == "cpu"
    assert blas_note(Device("cpu")).startswith("CPU matrix products: OpenBLAS's Haswell kernels, as "
                                               "OPENBLAS_CORETYPE says")
    assert blas_note(Device("cuda", 0)) is None
    assert round_robin(3, "cpu") == ["cpu"] * 3
    assert round_robin(2, "cuda:1") == ["cuda:1"] * 2   # pinned: the worker checks it
    assert "numba.cuda" not in sys.modules


# -- subprocesses: what a process imports, and the no-GPU error --------------------------

def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=_env(**env))


def test_cpu_install_never_imports_numba_cuda():
    code = """
import sys
import pserver, pserver.kernels, pserver.models, pserver.kernels.device, pserver.worker.loop, pserver.cli
from pserver.kernels import get_backend
from pserver.models import make_model
from pserver.kernels.device import parse_device, select
get_backend("cpu")
select(parse_device("cpu"))
parse_device("cuda:1")
make_model("mlp", 4, 2, hidden=(3,), backend="cpu")
assert "numba.cuda" not in sys.modules, sorted(m for m in sys.modules if m.startswith("numba.cuda"))
print("ok")
"""
    r = _python(code, NUMBA_ENABLE_CUDASIM=None)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


NO_GPU = ("--device {spec}: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES=\"\"); use --device cpu, "
          "or set NUMBA_ENABLE_CUDASIM=1 to run the CUDA kernels in numba's simulator")


@pytest.mark.parametrize("call,spec", [
    ("select(parse_device(SPEC))", "cuda"), ("select(parse_device(SPEC))", "cuda:1"),
    ("round_robin(2, SPEC)", "cuda"),
    ("make_model('logreg', 4, 2, backend='cuda')", "cuda"),
])
def test_no_gpu_is_one_clear_line(call, spec):
    # No simulator, and no device visible even where there is one: the error is certain.
    code = f"""
from pserver.kernels.device import parse_device, round_robin, select
from pserver.errors import ConfigError
from pserver.models import make_model
SPEC = {spec!r}
try:
    {call}
except ConfigError as e:
    print(e)
"""
    r = _python(code, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [NO_GPU.format(spec=spec)]


def test_cuda_kernels_import_without_a_gpu():
    # They compile at their first launch, so importing the module needs no driver.
    r = _python("import pserver.kernels.cuda as k; print(k.TILE)",
                NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and r.stdout.strip() == "16", r.stderr[-3000:]


def test_a_numpy_numba_cuda_cannot_compile_with_is_one_clear_line():
    """numpy 2.5 removed np.row_stack, which numba-cuda 0.30.4 reads when it first compiles: seen
    on an H100 as a traceback in a worker's first step. Removed here in a fresh process after
    pserver's import (scipy, which it loads, reads every name numpy lists: a `del` before it
    breaks scipy, which real numpy 2.5 does not; run 12 found this test failing so on an H200)
    and before numba.cuda's. No GPU needed: the check compiles PTX, which fails first."""
    code = ("import numpy as np\n"
            "from pserver.kernels.device import Device, check_compiler\n"
            "del np.row_stack\ncheck_compiler(Device('cuda', 0))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=_env(NUMBA_ENABLE_CUDASIM=None))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pserver.errors.ConfigError: --device cuda:0: numba-cuda "), r.stderr[-2000:]
    assert "cannot compile kernels with numpy" in last and "install numpy<2.5" in last
