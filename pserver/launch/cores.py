"""Which core each worker of `pserver run` runs on (`--bind-cores`), and a bound worker letting
go of its core when another process keeps that core busy.

- auto (the default): when the workers fit on the cores this process may use (one each), worker i
  is bound to the i-th of them, as `mpirun --bind-to core` binds, and lets go of its core (runs
  on any of them) once it waited for it more than BUSY_SHARE of the time in two windows of
  WINDOW_S in a row: another job keeping that core busy costs it two seconds, not the run.
  The shards are never bound: they run when the workers wait for them, on the cores those free.
- --bind-cores: bound, in turn over the cores when there are more workers, and never let go.
- --no-bind-cores: not bound.

Why bind: unbound, two workers on 2 cores sometimes land on one core for a few milliseconds (the
scheduler moves them while shards wake between them). bench/step_timeline.py on the DCN example
(`pserver run --ps 2 --workers 2`, the 2-core Xeon, seed 1): each worker's compute spent
0.29-0.40 s of the fit off its core unbound, 0.15-0.17 s bound; bench/keras_io/compare.py, five
seeds against Keras-RS on JAX: 1.02x bound, 0.94x unbound (bench/results/keras_rs/xeon-2026-12-03-bind/).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from pserver.errors import ConfigError
from pserver.signals import thread_ids

UNBIND = "PSERVER_RUN_UNBIND"    # a worker bound by auto: the cores it may take instead ("0,1")
WINDOW_S = 1.0                   # how often a bound worker looks at how long it waited for its core
BUSY_SHARE = 0.25                # waiting more than this share of two windows in a row: let go


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def worker_cores(num_workers: int, bind: bool | None) -> list[int | None]:
    """Worker i's core, or None (any): `bind` True binds in turn over the cores this process may
    use; None (auto) binds only when every worker has a core of its own (and the OS can); False
    never binds."""
    can = hasattr(os, "sched_setaffinity")
    if bind is True and not can:
        raise ConfigError("--bind-cores: this OS cannot bind a process to a core (Linux can)")
    if bind is False or not can:
        return [None] * num_workers
    cores = usable_cores()
    if bind is None and num_workers > len(cores):
        return [None] * num_workers
    return [cores[i % len(cores)] for i in range(num_workers)]


@contextlib.contextmanager
def bound_to(core: int | None):
    """This thread on `core` alone meanwhile, so that a child started now inherits that (Linux
    gives a new process its parent thread's affinity), then back to what it was: no window in
    which the child runs unbound, and no preexec_fn (see with_parent_death)."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def waited_s(tid: int) -> float:
    """Seconds thread `tid` of this process has spent runnable but waiting for a core
    (/proc/PID/task/TID/schedstat's second field, in nanoseconds)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


class CoreWatch:
    """A bound worker's watch over its core: every `window` seconds, how long its main thread
    waited for the core; over `share` of two windows in a row, every thread of the process may
    run on `cores` from then on, said once on the process's stderr. `waited` and `sleep` are the
    clock and the pause (tests give their own)."""

    def __init__(self, cores: set[int], window: float = WINDOW_S, share: float = BUSY_SHARE,
                 waited=None, sleep=None, tid: int | None = None) -> None:
        self.cores, self.window, self.share = cores, window, share
        self.tid = threading.main_thread().native_id if tid is None else tid
        self.waited = waited or (lambda: waited_s(self.tid))
        self.stop = threading.Event()
        self.sleep = sleep or self.stop.wait
        self.released: float | None = None      # the share of the window that let it go

    def run(self) -> None:
        try:
            self._watch()
        except OSError:       # no schedstat (a kernel without CONFIG_SCHED_INFO): nothing to watch
            pass

    def _watch(self) -> None:
        busy, last = 0, self.waited()
        while not self.stop.is_set():
            self.sleep(self.window)
            now = self.waited()
            share, last = (now - last) / self.window, now
            busy = busy + 1 if share > self.share else 0
            if busy >= 2:
                self.release(share)
                return

    def release(self, share: float) -> None:
        before = os.sched_getaffinity(self.tid)
        for tid in thread_ids():
            with contextlib.suppress(OSError):       # a thread that ended meanwhile
                os.sched_setaffinity(tid, self.cores)
        self.released = share
        names = [",".join(map(str, sorted(c))) for c in (before, self.cores)]
        print(f"pserver run: this worker waited {share:.0%} of the last {self.window:g} s for core "
              f"{names[0]}, which another process keeps busy: it runs on any of cores {names[1]} from "
              f"now on (--bind-cores keeps it bound, --no-bind-cores never binds)",
              file=sys.__stderr__, flush=True)          # a quiet fit silences sys.stderr: not this


_watch: CoreWatch | None = None


def watch_core() -> CoreWatch | None:
    """In a worker that `pserver run` bound by auto (UNBIND in its environment): start its
    CoreWatch once, in a daemon thread; None elsewhere. pserver.train (a Keras fit's too) calls it
    as training begins, once the worker's shards serve, so that their start (which takes the cores
    for a second) is not taken for a busy core; a script that trains otherwise may call it."""
    global _watch
    given = os.environ.get(UNBIND)
    if _watch is not None or not given or not os.path.exists("/proc/self/task"):
        return _watch
    _watch = CoreWatch({int(c) for c in given.split(",")})
    threading.Thread(target=_watch.run, name="pserver-core-watch", daemon=True).start()
    return _watch
