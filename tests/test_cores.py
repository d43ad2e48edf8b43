"""pserver.launch.cores: which core each worker of `pserver run` gets, and a bound worker's watch
over its core, driven here by a clock the test gives (tests/test_keras.py runs the real ones)."""

from __future__ import annotations

import os

import pytest

from pserver.errors import ConfigError
from pserver.launch import cores
from pserver.launch.cores import CoreWatch, worker_cores
from tests.support.processes import with_a_second_thread


def test_auto_binds_only_when_every_worker_has_a_core_of_its_own(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: [2, 5, 7])
    assert worker_cores(3, None) == [2, 5, 7]
    assert worker_cores(1, None) == [2]
    assert worker_cores(4, None) == [None] * 4                # one would share: none bound
    assert worker_cores(4, True) == [2, 5, 7, 2]              # asked: in turn
    assert worker_cores(2, False) == [None, None]


def test_binding_asked_where_the_os_cannot_bind_is_refused_and_auto_binds_nothing(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    with pytest.raises(ConfigError, match="--bind-cores: this OS cannot bind"):
        worker_cores(2, True)
    assert worker_cores(2, None) == [None, None]


def watch(waits: list[float], window: float = 1.0, share: float = 0.25) -> tuple[CoreWatch, list]:
    """A watch over a clock that reads `waits` (seconds waited so far), one per window; the
    windows it slept through."""
    readings, slept = iter(waits), []
    w = CoreWatch({0, 1}, window=window, share=share, waited=lambda: next(readings),
                  sleep=slept.append)
    w.release = lambda s: setattr(w, "released", s)          # the affinity is test_keras's
    return w, slept


@pytest.mark.parametrize("waits,released,windows", [
    ([0, 0.3, 0.6], 0.3, 2),                 # two windows in a row over a quarter: let go
    ([0, 0.3, 0.35, 0.65, 0.95], 0.3, 4),   # one busy window, a quiet one, then two busy
    ([0, 0.5, 0.5, 1.0, 1.05, 1.55, 1.6], None, 7),   # never two in a row
    ([0, 0.25, 0.5, 0.75], None, 4),        # exactly a quarter is not over it
])
def test_the_watch_lets_go_after_two_busy_windows_in_a_row_only(waits, released, windows):
    w, slept = watch(waits)
    if released is None:
        with pytest.raises(StopIteration):   # it read every window and went on watching
            w.run()
    else:
        w.run()
    assert w.released == (None if released is None else pytest.approx(released))
    assert slept == [1.0] * windows       # a window slept before each reading after the first


def test_release_widens_every_thread_and_says_so_on_the_process_stderr_past_a_quiet_fit():
    """In a process bound to one core with a second thread: release puts both on the given
    cores, and its line reaches the real stderr while sys.stderr is silenced (a quiet fit)."""
    allowed = sorted(os.sched_getaffinity(0))
    out = with_a_second_thread("import io\n"
                               "from pserver.launch.cores import CoreWatch\n"
                               f"os.sched_setaffinity(0, {{{allowed[0]}}})\n"
                               f"w = CoreWatch({set(allowed)!r}, tid=threading.get_native_id())\n"
                               "sys.stderr = io.StringIO()\n"
                               "w.release(0.4)\n"
                               "print(sorted(os.sched_getaffinity(0)),"
                               " sorted(os.sched_getaffinity(t.native_id)))\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{allowed} {allowed}"
    assert out.stderr.strip() == (
        f"pserver run: this worker waited 40% of the last 1 s for core {allowed[0]}, which another process "
        f"keeps busy: it runs on any of cores {','.join(map(str, allowed))} from now on (--bind-cores "
        "keeps it bound, --no-bind-cores never binds)")


def test_watch_core_starts_only_in_a_worker_bound_by_auto_and_once(monkeypatch):
    monkeypatch.setattr(cores, "_watch", None)
    monkeypatch.delenv(cores.UNBIND, raising=False)
    assert cores.watch_core() is None                           # not told: not bound by auto
    monkeypatch.setenv(cores.UNBIND, "0")
    first = cores.watch_core()
    assert first is not None and first.cores == {0} and cores.watch_core() is first
    first.stop.set()


def test_a_kernel_without_schedstat_leaves_the_worker_bound_and_says_nothing(capsys):
    def missing():
        raise FileNotFoundError("/proc/self/task/1/schedstat")
    w = CoreWatch({0, 1}, waited=missing, sleep=lambda s: None)
    w.run()                                    # returns: no traceback from the watch's thread
    assert w.released is None and capsys.readouterr() == ("", "")
