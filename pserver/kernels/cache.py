"""Whether this process compiled numba kernels or loaded them from numba's cache.

Every kernel is compiled on its first call (`@njit(cache=True)`) and kept on disk: the first
run on a machine (or after pserver changed) spends seconds to tens of seconds compiling,
the next ones load. `CompileWatch` tells the two apart by numba's own count of cache misses,
and times the compiling by numba's compile events:

    with CompileWatch() as watch:             # or watch = CompileWatch().start() ... watch.stop()
        ...                                   # the first calls
    if watch.compiled:
        print(watch.describe())
"""

from __future__ import annotations

import os
import sys

from numba import njit
from numba.core import config, event
from numba.core.dispatcher import Dispatcher


def _misses() -> dict[Dispatcher, int]:
    """Signatures compiled so far (not loaded from the cache) by each cached kernel of pserver's
    modules (and of a user's model file, loaded as pserver_user_model_*)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("pserver") or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, Dispatcher) and obj.stats.cache_path:
                out[obj] = sum(obj.stats.cache_misses.values())
    return out


class CompileWatch:
    """The kernels compiled inside the `with`, and the seconds numba spent on them."""

    def __init__(self) -> None:
        self.timer = event.TimingListener()
        self.before: dict[Dispatcher, int] = {}
        self.compiled: list[Dispatcher] = []

    def start(self) -> CompileWatch:
        self.before = _misses()
        event.register("numba:compile", self.timer)
        return self

    def stop(self) -> CompileWatch:
        event.unregister("numba:compile", self.timer)
        self.compiled = [d for d, n in _misses().items() if n > self.before.get(d, 0)]
        return self

    def __enter__(self) -> CompileWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def seconds(self) -> float:
        return self.timer.duration if self.timer.done else 0.0

    def where(self) -> str:
        """Where numba keeps them: NUMBA_CACHE_DIR, or __pycache__ folders beside the modules."""
        if config.CACHE_DIR:
            return config.CACHE_DIR
        paths = sorted({d.stats.cache_path for d in self.compiled})
        return paths[0] if len(paths) == 1 else f"__pycache__ folders under {os.path.commonpath(paths)}"

    def describe(self) -> str:
        return (f"compiled {len(self.compiled)} numba kernel(s) in {self.seconds:.1f} s (a first run, or "
                f"pserver changed); cached in {self.where()} for the next runs")


@njit(cache=True, nogil=True)
def _first(x):
    return x + 1


def load_numba() -> None:
    """Set up numba's CPU target, as a process's first kernel call does (0.12 s on a 2-core
    Xeon: numba's typing and lowering registries; each kernel after it loads from the cache in
    milliseconds). A process that waits anyway calls this first: pserver run's shards while
    they wait for their settings, a Keras fit while it waits for its shards."""
    _first(1)


__all__ = ["CompileWatch", "load_numba"]
