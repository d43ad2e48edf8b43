"""`pserver run --ps N --workers M -- CMD ...`: a user's script once per worker, with the
cluster in its environment (as torchrun and horovodrun run theirs).

Each worker is CMD (a script.py alone: this Python runs it, as torchrun) with PSERVER_RUN_DIR,
PSERVER_RUN_RANK and PSERVER_RUN_WORKERS set
(pserver.keras.cluster reads them). The shards' processes start with the workers and wait
(so a fit does not wait for them to import pserver) until every worker has said, at its fit,
the optimizer it compiled (a file in the run's directory): the same for every worker, or the
run is refused naming the difference; they then run it, with the serve flags given here, as
launch's shards (pserver.launch.local). Every line a worker
prints comes with its rank's prefix ("[worker1] ...": only the chief's stdout is shown, every
worker's stderr). The exit code is the first failing worker's, named in the last line (a shard
that fails: launch's), 0 when every worker exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from pserver.config import ServerConfig
from pserver.errors import ConfigError, ProcessFailed
from pserver.launch.base import LaunchConfig, child_env
from pserver.launch.cores import UNBIND, bound_to, usable_cores, worker_cores
from pserver.launch.local import Proc, StoppedWorkers, configure_shards, prestart_shards, stop_all
from pserver.observe.progress import Relay
from pserver.signals import Stopped, stop_on_signals, with_parent_death

# The environment and the files of the run's directory: pserver.keras.cluster reads them.
RUN_DIR, RANK, WORKERS = "PSERVER_RUN_DIR", "PSERVER_RUN_RANK", "PSERVER_RUN_WORKERS"
SEED = "PSERVER_RUN_SEED"
CHECKPOINTS = "PSERVER_RUN_CHECKPOINT_DIR"     # the shards' --checkpoint-dir (Keras's BackupAndRestore)
SETTINGS, ADDRESSES, REFUSED = "settings-rank{}.json", "shards.json", "refused.txt"
SETTINGS_POLL_S = 0.005      # between looks for the workers' settings (a stat per worker)


class _Worker:
    """CMD as rank i; each line it prints is ours with its rank's prefix ("[worker1] ..."), as
    launch's (stdout on our stdout, stderr on our stderr). `core`: the one core it starts on
    (pserver.launch.cores), None: any."""

    def __init__(self, argv: list[str], env: dict, rank: int, core: int | None = None,
                 relays: tuple[Relay, Relay] | None = None):
        self.role, self.rank = f"worker{rank}", rank
        out, err = relays or (Relay(), Relay(out=sys.stderr))
        # Only the chief's output is shown (what fit, evaluate and the script print), as a
        # Keras user guards prints with the chief's rank; every worker's errors (stderr) are.
        with bound_to(core):
            self.popen = subprocess.Popen(argv, env=with_parent_death(env), start_new_session=True,
                                          stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                          errors="replace", stderr=subprocess.PIPE,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL)
        errors = threading.Thread(target=self._copy, args=(self.popen.stderr, err), daemon=True)
        errors.start()
        self.reader = threading.Thread(target=self._copy, args=(self.popen.stdout, out, errors), daemon=True)
        self.reader.start()

    def _copy(self, stream, relay: Relay, then: threading.Thread | None = None) -> None:
        for line in stream or ():
            relay.line(self.role, line)
        if then is not None:            # stop_all joins one reader: this one waits for the other
            then.join()


def worker_command(argv: list[str]) -> list[str]:
    """The command each worker runs: `argv`, or, where it starts with a Python script that is
    not a path to an executable (`pserver run --workers 2 train.py`, as torchrun takes it), that script
    under this Python. A command that cannot be found is refused before anything starts."""
    if not argv:
        raise ConfigError("run: give the command to run after --, e.g. pserver run --ps 2 --workers 4 -- "
                          "python train.py")
    first = argv[0]
    script = first.endswith(".py") and os.path.isfile(first)
    if script and (os.sep not in first or not os.access(first, os.X_OK)):
        return [sys.executable, *argv]
    if shutil.which(first) is None:
        where = "is not a file" if os.sep in first or first.endswith(".py") else "is not on PATH"
        raise ConfigError(f"run: the command {first!r} {where}, so no worker could start it "
                          f"(e.g. pserver run --ps 2 --workers 4 -- python train.py)")
    return argv


def run_command(num_shards: int, num_workers: int, argv: list[str], server: ServerConfig,
                seed: int | None = None, bind_cores: bool | None = None) -> int:
    """Run `argv` as each of `num_workers` workers beside `num_shards` shards; bind_cores: True
    binds worker i to a core, None (auto) when every worker has a core of its own, letting go
    of a busy one (pserver.launch.cores), False never; the exit code."""
    argv = worker_command(argv)
    for flag, count in (("--ps", num_shards), ("--workers", num_workers)):
        if count < 1:
            raise ConfigError(f"{flag}: run needs 1 or more, got {count}")
    from pserver.persist.checkpoint_dir import check_start
    first = check_start(server.checkpoint_dir, server.restore)   # another run's directory: refused
    if first:
        print(f"pserver run: {first}", flush=True)
    tmpdir = tempfile.mkdtemp(prefix="pserver-run-")
    env = child_env(num_workers) | {RUN_DIR: tmpdir, WORKERS: str(num_workers)}
    if seed is not None:
        env[SEED] = str(seed)
    if server.checkpoint_dir or server.restore:
        env[CHECKPOINTS] = server.checkpoint_dir or server.restore
    cfg = LaunchConfig(num_shards=num_shards, num_workers=num_workers)
    workers: list[_Worker] = []
    shards: list[Proc] = []
    relay, errors = Relay(), Relay(out=sys.stderr)
    with stop_on_signals():
        try:
            cores = worker_cores(num_workers, bind_cores)
            # auto-bound workers may let go of a busy core: they are told which cores they may take
            env.pop(UNBIND, None)
            if bind_cores is None and cores[0] is not None:
                env[UNBIND] = ",".join(map(str, usable_cores()))
            for i, core in enumerate(cores):
                workers.append(_Worker(argv, env | {RANK: str(i)}, i, core, (relay, errors)))
            # The shards' processes start now, beside the workers' scripts, and take their settings
            # at the workers' fit: the fit does not wait for them to import pserver.
            shards += prestart_shards(num_shards, env, tmpdir, relay)
            return _supervise(cfg, server, workers, shards, tmpdir)
        except Stopped as e:
            print(f"pserver run: stopped by {e}; stopping the workers", file=sys.stderr, flush=True)
            return e.exit_code
        finally:
            stop_all(workers)
            stop_all(shards)
            relay.close()
            errors.close()
            shutil.rmtree(tmpdir, ignore_errors=True)


def _supervise(cfg, server, workers, shards, tmpdir) -> int:
    """Configure the shards when every worker's settings are in; the first failing worker's code."""
    started = False
    stuck = StoppedWorkers(workers, lambda line: print(f"pserver run: {line}", file=sys.stderr, flush=True))
    while True:
        for i, p in enumerate(workers):
            code = p.popen.poll()
            if code not in (None, 0) and i not in stuck.ended:
                p.reader.join(2.0)            # its last lines first, then ours naming it
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                print(f"pserver run: worker {p.rank} (rank {p.rank}) {how}; stopping the other workers "
                      f"and the shards", file=sys.stderr, flush=True)
                return code
        for p in shards:
            if p.popen.poll() is not None:
                raise ProcessFailed(p.role, p.popen.returncode)
        stuck.look()
        if all(stuck.done(i) for i in range(len(workers))):
            return 0
        if not started:
            refused = os.path.join(tmpdir, REFUSED)
            settings = _settings(tmpdir, len(workers))
            if os.path.exists(refused):       # the workers stop at their fit; the run says why, once
                with open(refused) as f:
                    raise ConfigError(f.read().strip())
            if settings is not None:
                started = True
                try:
                    server = dataclasses.replace(server, **settings)
                except TypeError as e:
                    _refuse(tmpdir, f"the workers' shard settings: {e}")
                    continue
                configure_shards(shards, cfg, server, tmpdir)
                _write(os.path.join(tmpdir, ADDRESSES),
                       {"addresses": [f"127.0.0.1:{p.port}" for p in shards]})
        # every worker's fit waits for the shards: look for its settings often until they start
        time.sleep(0.05 if started else SETTINGS_POLL_S)


def _settings(tmpdir: str, num_workers: int) -> dict | None:
    """Every worker's shard settings once all are written: the chief's, if all agree; a
    difference is written for the workers to raise (and None returned)."""
    paths = [os.path.join(tmpdir, SETTINGS.format(i)) for i in range(num_workers)]
    if not all(os.path.exists(p) for p in paths):
        return None
    found = []
    for p in paths:
        with open(p) as f:
            found.append(json.load(f))
    for i, other in enumerate(found[1:], start=1):
        diff = sorted(k for k in set(found[0]) | set(other) if found[0].get(k) != other.get(k))
        if diff:
            k = diff[0]
            _refuse(tmpdir, f"worker {i} compiled {k}={other.get(k)!r}, the chief "
                            f"{k}={found[0].get(k)!r}: every worker must compile the same optimizer")
            return None
    return found[0]


def _refuse(tmpdir: str, line: str) -> None:
    with open(os.path.join(tmpdir, REFUSED), "w") as f:
        f.write(line + "\n")


def _write(path: str, value: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


__all__ = ["run_command"]
