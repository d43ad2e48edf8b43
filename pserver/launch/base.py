"""What every launch backend shares: the launch's own config, the config of each process it
starts (made from the cluster's ServerConfig and WorkerConfig, never from argv), and the
run's end (the summary, the exit code on a stop signal).

A backend is a function launch(cfg, server, worker) -> exit code; pserver.launch picks it
by name from BACKENDS and checks everything that can be checked before it starts one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

from pserver.config import ServerConfig, WorkerConfig, parse_delay
from pserver.errors import ConfigError
from pserver.observe.metrics import write_json
from pserver.registry import Registry
from pserver.signals import Stopped

BACKENDS = Registry("launch backend", "--backend")
BACKENDS.add("local", "child processes of this one (pserver.launch.local; the default)")
BACKENDS.add("ray", "Ray actors, one process each, spread over the nodes by a placement group "
             "(pserver.launch.ray)")
# Options of a launch that LaunchConfig holds and applies per process (shard_config, worker_config)
LAUNCH_OPTIONS = ("delay", "delay_ranks", "delay_for", "device", "metrics_port")
# Fields of the shards' and workers' configs that launch sets for each process itself
PER_PROCESS = frozenset({"host", "port", "shard", "num_shards", "num_workers", "ps", "rank", "summary_json",
                         "stats_json", "stop_shards"})
LISTENING = re.compile(r"listening on (\S+):(\d+)")
STARTUP_TIMEOUT = 60.0
STOP_GRACE = 10.0                 # seconds a child has to stop (a shard writes its last checkpoint)


@dataclass(frozen=True)
class LaunchConfig:
    num_shards: int = 1
    num_workers: int = 2
    summary_json: str | None = None
    delay: str | None = None               # straggler delay for the ranks in delay_ranks
    delay_ranks: tuple[int, ...] | None = None   # None: every worker
    delay_for: tuple[tuple[int, str], ...] = ()  # (rank, delay) overriding the above
    device: str = "cpu"                    # cpu, or cuda[:I]: workers spread over the GPUs
    metrics_port: int | None = None        # process i (shards first) serves Prometheus metrics on this + i
    auth_token: str | None = field(default=None, repr=False)  # to the children in their environment only
    token_file: str | None = None          # where the token is (--token-file, or the file launch wrote)
    status_flags: str = ""                 # what `pserver status` needs besides --ps (announce prints it)
    backend: str = "local"                 # local: child processes here; ray: Ray actors (launch/ray.py)
    address: str | None = None             # ray: a running cluster's (auto, HOST:PORT); None: start one here

    def __post_init__(self) -> None:
        for flag, count in (("--ps", self.num_shards), ("--workers", self.num_workers)):
            if count < 1:
                raise ConfigError(f"{flag}: launch needs 1 or more, got {count}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend: '{self.backend}' is not one of {', '.join(BACKENDS.names())}")
        if self.address is not None and self.backend != "ray":
            raise ConfigError(f"--address: '{self.address}' is a Ray cluster's address; give it with "
                              "--backend ray")


def shard_config(cfg: LaunchConfig, server: ServerConfig, j: int, host: str) -> ServerConfig:
    """Shard j's config: the cluster's, listening on `host` at a free port. No token: it
    reaches the process in its environment only (TOKEN_ENV), as from the command line."""
    return dataclasses.replace(server, host=host, port=0, shard=j, num_shards=cfg.num_shards,
                               num_workers=cfg.num_workers, metrics_port=metrics_port(cfg, j),
                               auth_token=None)


def worker_config(cfg: LaunchConfig, worker: WorkerConfig, i: int, addresses: tuple[str, ...],
                  chief_summary: str, device: str) -> WorkerConfig:
    """Worker i's config; the chief writes its summary to `chief_summary`, and every worker
    its time breakdown to stats_path(chief_summary, i). No token (see shard_config)."""
    return dataclasses.replace(worker, ps=tuple(addresses), rank=i, num_workers=cfg.num_workers,
                               device=device, metrics_port=metrics_port(cfg, cfg.num_shards + i),
                               delay=worker_delay(cfg, i), summary_json=chief_summary if i == 0 else None,
                               stats_json=stats_path(chief_summary, i), auth_token=None)


def metrics_port(cfg: LaunchConfig, process: int) -> int | None:
    """Process i of the cluster (shards first) serves its metrics on --metrics-port + i
    (--metrics-port 0: each on a free port of its own)."""
    if cfg.metrics_port is None:
        return None
    return cfg.metrics_port + process if cfg.metrics_port else 0


def worker_delay(cfg: LaunchConfig, rank: int) -> str | None:
    """The --delay of one worker: its own from --delay-for, else --delay if it applies."""
    own = dict(cfg.delay_for)
    if rank in own:
        return own[rank]
    if cfg.delay and (cfg.delay_ranks is None or rank in cfg.delay_ranks):
        return cfg.delay
    return None


def stats_path(chief_summary: str, rank: int) -> str:
    return os.path.join(os.path.dirname(chief_summary), f"worker{rank}.json")


def child_env(num_workers: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # N workers share this machine's cores: one BLAS thread each unless told otherwise,
    # so they do not oversubscribe the CPU fighting each other.
    per = max(1, (os.cpu_count() or 1) // max(num_workers, 1))
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(per))
    return env


def stopped(e: Stopped) -> int:
    """The launcher's exit code when a signal stops it, once it said so."""
    print(f"pserver launch: stopped by {e}; stopping the cluster", file=sys.stderr, flush=True)
    return e.exit_code


def announce(cfg: LaunchConfig, addresses: str) -> None:
    print(f"pserver launch: {cfg.num_shards} shard(s) at {addresses}; starting {cfg.num_workers} worker(s)",
          flush=True)
    print(f"pserver launch: watch it from another terminal with: pserver status --ps {addresses}"
          f"{cfg.status_flags}", flush=True)


def report(cfg: LaunchConfig, chief_summary: str, started: float) -> None:
    """The end of a run: the summary JSON written where asked, and the time it took."""
    summary = final_summary(chief_summary, time.monotonic() - started)
    if cfg.summary_json and summary is not None:
        write_json(cfg.summary_json, summary)
        print(f"pserver launch: summary written to {cfg.summary_json}", flush=True)
    print(f"pserver launch: done in {time.monotonic() - started:.1f} s", flush=True)


def final_summary(chief_path: str, launch_seconds: float) -> dict | None:
    """The chief's summary (its counters were read once every worker had left), with
    every worker's time breakdown."""
    if not os.path.exists(chief_path):
        return None
    with open(chief_path) as f:
        summary = json.load(f)
    workers = []
    for name in sorted(os.listdir(os.path.dirname(chief_path))):
        if name.startswith("worker") and name.endswith(".json"):
            with open(os.path.join(os.path.dirname(chief_path), name)) as f:
                workers.append(json.load(f))
    workers.sort(key=lambda w: w["rank"])
    summary["workers"] = workers
    if workers:
        summary["idle_fraction_mean"] = round(sum(w["idle_fraction"] for w in workers) / len(workers), 4)
    summary["launch_wall_seconds"] = round(launch_seconds, 3)
    return summary


def parse_delay_for(specs: list[str], num_workers: int) -> tuple[tuple[int, str], ...]:
    """['0,2=fixed:0.1', ...] -> ((0, 'fixed:0.1'), (2, 'fixed:0.1'), ...), checked."""
    out = []
    for spec in specs:
        ranks, sep, dist = spec.partition("=")
        try:
            numbers = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            numbers = []
        if not sep or not numbers:
            raise ConfigError(f"--delay-for: '{spec}' is not of the form I[,J]=DIST")
        bad = [r for r in numbers if not 0 <= r < num_workers]
        if bad:
            raise ConfigError(f"--delay-for: rank {bad[0]} is outside [0, --workers={num_workers})")
        parse_delay(dist)
        out += [(r, dist) for r in numbers]
    return tuple(out)
