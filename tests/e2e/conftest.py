"""Real `pserver` processes for end-to-end tests: started on free ports, always reaped
(the helpers are in tests/support/processes.py)."""

from __future__ import annotations

import pytest

from tests.support.processes import Proc


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
