"""The two roles a process of a cluster plays, each one function of its config: a shard
(`run_shard`) and a worker (`run_training`). `pserver serve`, `pserver worker` and `pserver
slurm` call them from their flags; launch's children and Ray actors from the configs the
launcher made. `exit_code` turns what a role raises into one line and an exit code, the
same for every one of them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from typing import Callable

from pserver.config import ServerConfig, WorkerConfig
from pserver.errors import PServerError
from pserver.launch import allocator
from pserver.signals import Stopped, interrupt_as_usual, interrupt_handled, stop_on_signals


def run_shard(cfg: ServerConfig, log_level: str = "INFO") -> int:
    allocator.tune()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    from pserver.server.app import serve  # a worker's process never loads the server
    return serve(cfg)


def run_training(cfg: WorkerConfig) -> int:
    allocator.tune()
    from pserver.worker.loop import run_worker
    with stop_on_signals():           # SIGTERM, SIGHUP, Ctrl-C: Stopped, exit 128+signal
        run_worker(cfg)
    return 0


ROLES: dict[str, Callable[[ServerConfig | WorkerConfig], int]] = {"serve": run_shard, "worker": run_training}
# What each role imports as it starts: a process that waits for its config (pserver run's shards)
# imports it while it waits.
ROLE_MODULES = {"serve": "pserver.server.app", "worker": "pserver.worker.loop"}


def preload(role: str) -> None:
    """What a process that waits for its config can do before it: import its role's modules
    and set up numba (its first kernel call, then, loads in milliseconds)."""
    importlib.import_module(ROLE_MODULES[role])
    from pserver.kernels.cache import load_numba
    load_numba()


def run_role(role: str, cfg: ServerConfig | WorkerConfig) -> int:
    """Run a launched process's role on its config, whose token (never in a config file or an
    actor's arguments) comes from this process's environment; the role's exit code."""
    from pserver.wire.security import resolve_token
    cfg = dataclasses.replace(cfg, auth_token=resolve_token(None))
    return exit_code(role, lambda: ROLES[role](cfg))


def one_blas_thread() -> None:
    """One BLAS thread per worker unless told otherwise (before numpy/scipy load): several
    workers on one host with a thread per core each spin against each other (19x slower
    measured with 4 workers on 2 cores). launch does the same for its workers."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def exit_code(command: str, call: Callable[[], int]) -> int:
    """call()'s exit code; a user's mistake or a failure is one line on stderr, never a traceback.
    In the `pserver` command, SIGINT raises KeyboardInterrupt from here on (inside the try, so a
    Ctrl-C at any moment is one line: before, the loading handler's; from here, this one's)."""
    try:
        interrupt_as_usual()
        return call()
    except PServerError as e:                  # its exit_code: 2 usage, 1 failed, 138 transient
        print(f"pserver {command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        interrupt_handled()
        print(f"pserver {command}: interrupted", file=sys.stderr)
        return 130
    except Stopped as e:
        print(f"pserver {command}: stopped by {e}", file=sys.stderr)
        return e.exit_code
