"""The test suite's own machinery that CI relies on to say where a run went wrong."""

from __future__ import annotations

import pathlib
import re
import time

from tests.support.stuck import StuckWatch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_stuck_test_has_its_main_thread_written_to_the_trace(tmp_path, monkeypatch):
    """Catches a watch that names the wrong thread, or none: CI's faulthandler dump lists at most
    100 threads, newest first, and cut the main thread of the hang of 2026-11-29 (test_limits)."""
    monkeypatch.setattr(StuckWatch, "STUCK_AFTER", 0.3)
    monkeypatch.setattr(StuckWatch, "POLL", 0.05)
    trace = tmp_path / "trace"
    watch = StuckWatch()
    watch.started("tests/x.py::test_stuck", str(trace))

    def a_function_that_waits_here():
        deadline = time.monotonic() + 5
        while not trace.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)                                  # the rest of the stack is written

    a_function_that_waits_here()
    text = trace.read_text()
    assert "still in tests/x.py::test_stuck" in text
    assert "a_function_that_waits_here" in text          # the main thread's frame, not the watch's
    assert "_watch" not in text
    watch.started("tests/x.py::test_quick", str(trace))  # a new test: its own clock
    time.sleep(0.1)
    assert "test_quick" not in trace.read_text()


def test_the_watch_writes_before_pytest_ends_the_run():
    """Catches a STUCK_AFTER at or above faulthandler_timeout: pytest would end the run first."""
    ini = (ROOT / "pyproject.toml").read_text()
    limit = int(re.search(r"^faulthandler_timeout = (\d+)$", ini, re.M).group(1))
    assert StuckWatch.STUCK_AFTER + 2 * StuckWatch.POLL < limit
