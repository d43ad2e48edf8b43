"""How a Keras script finds its cluster under `pserver run` (pserver.launch.run).

`pserver run` puts PSERVER_RUN_DIR, PSERVER_RUN_RANK and PSERVER_RUN_WORKERS in each worker's
environment. The shards are not started before the script runs: their optimizer is the one
the script compiles. Each worker's fit writes its shard settings (the compiled optimizer) to
the run's directory; `pserver run` checks that every worker's agree, starts the shards with
them and writes their addresses, which fit waits for. Run plainly, a script has no cluster:
fit starts its own shards in the process, as pserver.train(ps=N) does.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from pserver.errors import ConfigError, Unavailable
from pserver.launch.run import ADDRESSES, CHECKPOINTS, RANK, REFUSED, RUN_DIR, SEED, SETTINGS, WORKERS
from pserver.signals import follow_parent

WAIT_S = 600.0       # for the other workers to reach fit, and for the shards to start
POLL_S = 0.005       # between looks at the run's directory: each look is a stat, and a fit waits on it
FIT_MARK = "fit{}-rank{}"       # in the run's directory: this worker reached its fit number k
_fits: dict = {}                # fits this process completed, per cluster (its directory, or shard addresses)


@dataclass(frozen=True)
class Cluster:
    directory: str
    rank: int
    num_workers: int

    def begin_fit(self) -> int:
        """This fit's number in the script (1, 2, ...: fits completed before, plus one). From the
        second on, wait until every worker reached it too: then no worker is still in the fit
        before (its last ask of the data coordinator done), and this one can start the finished
        data over (no_resume)."""
        k = _fits.get(self.directory, 0) + 1
        if k > 1:
            _write(os.path.join(self.directory, FIT_MARK.format(k, self.rank)), {})
            marks = [os.path.join(self.directory, FIT_MARK.format(k, r)) for r in range(self.num_workers)]
            _until(lambda: all(os.path.exists(m) for m in marks) or None, POLL_S,
                   f"pserver run: fit number {k}: not every worker reached it within {WAIT_S:g} s (every "
                   f"worker must call fit as often)")
        return k

    def fit_done(self) -> None:
        _fits[self.directory] = _fits.get(self.directory, 0) + 1

    def shards(self, settings: dict, meanwhile=None) -> tuple[str, ...]:
        """Say this worker's shard settings; the shards' addresses once every worker said the
        same and `pserver run` started them (ConfigError naming a difference). `meanwhile()`
        runs after saying them, while the others reach fit and the shards start."""
        _write(os.path.join(self.directory, SETTINGS.format(self.rank)), settings)
        if meanwhile is not None:
            meanwhile()
        path, refused = os.path.join(self.directory, ADDRESSES), os.path.join(self.directory, REFUSED)

        def addresses() -> tuple[str, ...] | None:
            if os.path.exists(refused):       # `pserver run` says why, once, and exits 2
                raise SystemExit(2)
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return tuple(json.load(f)["addresses"])
        return _until(addresses, POLL_S,
                      f"pserver run: no shards after {WAIT_S:g} s (did every worker reach fit?)")


@dataclass(frozen=True)
class Running:
    """Shards already running, from TF_CONFIG (cluster.ps, and this task among the workers):
    fit joins them, after checking at Register that they run the optimizer it compiled."""
    addresses: tuple[str, ...]
    rank: int
    num_workers: int

    def begin_fit(self) -> int:
        """1 for the first fit; a second one is refused: the shards' data coordinator finished the
        first fit's epochs, and without pserver run's directory there is no way to know that every
        worker left that fit before starting the data over."""
        if _fits.get(self.addresses, 0):
            raise ConfigError("fit: a second fit against shards already running (TF_CONFIG) is not "
                              "supported (the shards finished the first fit's data); under pserver run, "
                              "or run plainly, fit can be called again")
        return 1

    def fit_done(self) -> None:
        _fits[self.addresses] = _fits.get(self.addresses, 0) + 1

    def shards(self, settings: dict, meanwhile=None) -> tuple[str, ...]:
        return self.addresses          # running already: nothing to wait for


def current() -> Cluster | Running | None:
    """This process's place: in a `pserver run` cluster, among shards already running
    (TF_CONFIG with a ps list), or None when the script runs plainly."""
    if RUN_DIR not in os.environ:
        from pserver.config import parse_tf_config
        tf = parse_tf_config(os.environ.get("TF_CONFIG"))
        if tf is None or not tf.ps:
            return None
        return Running(tf.ps, tf.rank, max(1, len(tf.workers)))
    follow_parent()                 # `pserver run` gone (even SIGKILLed): this worker stops too
    return Cluster(os.environ[RUN_DIR], int(os.environ[RANK]), int(os.environ[WORKERS]))


def seed() -> int:
    """keras.utils.set_random_seed's seed, else `pserver run --seed`, else 0 (the same variable)."""
    return int(os.environ.get(SEED, "0"))


def _until(check, poll: float, failure: str):
    """check()'s first value that is not None, asked every `poll` seconds for up to WAIT_S;
    Unavailable(failure) after that."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = check()
        if got is not None:
            return got
        time.sleep(poll)
    raise Unavailable(failure)


def _write(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)



def checkpoint_dir() -> str | None:
    """The shards' checkpoint directory under `pserver run --checkpoint-dir` (None otherwise)."""
    return os.environ.get(CHECKPOINTS) or None

__all__ = ["Cluster", "current", "seed", "checkpoint_dir"]
