"""Module paths of pserver before its packages: each old path still imports, warns
once (DeprecationWarning) and forwards every name to its new home, for one release."""

from __future__ import annotations

import importlib
import importlib.util
import warnings

# old module -> where its names live now (looked up in this order)
MOVED = {
    "pserver.allocator": ("pserver.launch.allocator",),
    "pserver.client": ("pserver.worker.client",),
    "pserver.codec": ("pserver.wire.codec",),
    "pserver.compress": ("pserver.wire.compress", "pserver.worker.compress", "pserver.server.compress"),
    "pserver.criteo": ("pserver.data.criteo",),
    "pserver.dataplane": ("pserver.wire.frames", "pserver.server.dataplane", "pserver.worker.dataplane"),
    "pserver.device": ("pserver.kernels.device",),
    "pserver.metrics": ("pserver.observe.metrics",),
    "pserver.model_file": ("pserver.persist.model_file", "pserver.api"),
    "pserver.progress": ("pserver.observe.progress",),
    "pserver.ray_backend": ("pserver.launch.ray",),
    "pserver.security": ("pserver.wire.security",),
    "pserver.sharding": ("pserver.wire.sharding",),
    "pserver.slurm": ("pserver.launch.slurm",),
    "pserver.status": ("pserver.observe.status",),
    "pserver.stragglers": ("pserver.worker.stragglers", "pserver.config"),
    "pserver.telemetry": ("pserver.observe.telemetry",),
    # packages now, whose old module-level names moved into one of their modules
    "pserver.worker": ("pserver.worker.loop",),
    "pserver.launch": ("pserver.launch.base", "pserver.launch.local"),
}


def warn(old: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {' and '.join(MOVED[old])}; the old path goes away in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def forward(old: str, warn_now: bool = True):
    """The module `__getattr__` of the old module `old`: a name is looked up in its new homes.
    warn_now: warn when the old module is imported; else (a package that is itself a new
    home) when one of its old names is looked up."""
    if warn_now:
        warn(old, stacklevel=4)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if not warn_now and importlib.util.find_spec(f"{old}.{name}") is not None:
            raise AttributeError(name)      # a module of the package: the import system loads it
        for new in MOVED[old]:
            module = importlib.import_module(new)
            if hasattr(module, name):
                if not warn_now:
                    warn(old, stacklevel=3)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    return __getattr__
