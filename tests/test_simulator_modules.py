"""Each CUDA simulator module's result (tests/cuda_sim/check_*.py, started beside the suite by
tests/conftest.py; tests/support/simulator.py): it must have run tests, and every one must have
passed (none skipped). Marked `cuda_sim`, so the suite runs them last, and alone in this file,
so that pytest-xdist's `--dist loadfile` gives the file out last too (a scope goes out in the
order of its first test), when the modules have had the suite's minutes to run."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import simulator


@pytest.mark.cuda_sim
@pytest.mark.parametrize("name", simulator.MODULES)
def test_in_cuda_simulator(simulator_runs, name):
    run = simulator_runs[name]
    try:
        out, counts = run.wait(simulator.WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} ran past {simulator.WAIT_S} s after the suite reached it")
    assert counts is not None, f"{name} wrote no report (exit {run.returncode}):\n{out[-4000:]}"
    why = f"{name}: {counts}\n{out[-6000:]}"
    assert run.returncode == 0 and counts["tests"] > 0, why
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, why
