"""`pserver launch`: S shards and N workers as separate processes on 127.0.0.1.

A convenience over `pserver serve` and `pserver worker`, not a different system: it
starts the shards on free ports, reads the ports they print, starts the workers, prefixes
every line with its role, and stops everything when the workers are done, when one
process fails (naming it, with its exit code) or on a stop signal (SIGTERM, SIGHUP,
Ctrl-C: exit 128+signal). Its children never outlive it, even when it is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from pserver.device import round_robin
from pserver.errors import ProcessFailed, Unavailable
from pserver.metrics import write_json
from pserver.security import TOKEN_ENV
from pserver.signals import Stopped, stop_on_signals, with_parent_death

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
    backend: str = "local"                 # local: child processes here; ray: Ray actors (ray_backend.py)
    address: str | None = None             # ray: a running cluster's (auto, HOST:PORT); None: start one here


class Proc:
    """A child process whose output is copied to ours with a role prefix."""

    def __init__(self, role: str, argv: list[str], env: dict) -> None:
        self.role = role
        self.port: int | None = None
        self.ready = threading.Event()
        # Its own session: our signal handling stops it. It gets SIGTERM if we die, even by
        # SIGKILL (signals.follow_parent, in the child: no preexec_fn, see with_parent_death).
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                      env=with_parent_death(env), start_new_session=True)
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        for line in self.popen.stdout:
            m = LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(2))
                self.ready.set()
            sys.stdout.write(f"[{self.role}] {line}")
            sys.stdout.flush()
        self.ready.set()



def stop_all(group: list[Proc], grace: float = STOP_GRACE) -> None:
    """SIGTERM to every process of the group at once, then wait; SIGKILL what is still there
    after `grace` seconds."""
    for p in group:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in group:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
    for p in group:
        p.reader.join(2.0)


def child_env(num_workers: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # N workers share this machine's cores: one BLAS thread each unless told otherwise,
    # so they do not oversubscribe the CPU fighting each other.
    per = max(1, (os.cpu_count() or 1) // max(num_workers, 1))
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(per))
    return env


def start_shards(cfg: LaunchConfig, server_argv: list[str], env: dict, procs: list[Proc]) -> list[Proc]:
    """Start the shards; each is added to `procs` at once, so a failure stops them all."""
    shards = []
    for j in range(cfg.num_shards):
        argv = [sys.executable, "-m", "pserver", *shard_args(cfg, j, "127.0.0.1", server_argv)]
        shards.append(Proc(f"ps{j}", argv, env))
        procs.append(shards[-1])
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for p in shards:
        p.ready.wait(max(0.0, deadline - time.monotonic()))
        if p.port is None:
            try:                              # its output closed: the exit code follows
                code = p.popen.wait(2)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise ProcessFailed(p.role, code, " before listening (its error is above)")
            raise Unavailable(f"{p.role} did not start listening within {STARTUP_TIMEOUT:g} s")
    return shards


def shard_args(cfg: LaunchConfig, j: int, host: str, server_argv: list[str]) -> list[str]:
    """`pserver` arguments of shard j, listening on `host` at a free port."""
    return ["serve", "--host", host, "--port", "0", "--shard", str(j), "--num-shards", str(cfg.num_shards),
            "--num-workers", str(cfg.num_workers), *metrics_argv(cfg, j), *server_argv]


def metrics_argv(cfg: LaunchConfig, process: int) -> list[str]:
    """Process i of the cluster (shards first) serves its metrics on --metrics-port + i
    (--metrics-port 0: each on a free port of its own)."""
    if cfg.metrics_port is None:
        return []
    return ["--metrics-port", str(cfg.metrics_port + process if cfg.metrics_port else 0)]


def worker_delay(cfg: LaunchConfig, rank: int) -> str | None:
    """The --delay of one worker: its own from --delay-for, else --delay if it applies."""
    own = dict(cfg.delay_for)
    if rank in own:
        return own[rank]
    if cfg.delay and (cfg.delay_ranks is None or rank in cfg.delay_ranks):
        return cfg.delay
    return None


def start_workers(cfg: LaunchConfig, addresses: str, worker_argv: list[str], env: dict,
                  chief_summary: str, devices: list[str]) -> list[Proc]:
    return [Proc(f"worker{i}", [sys.executable, "-m", "pserver",
                                *worker_args(cfg, i, addresses, worker_argv, chief_summary, devices[i])], env)
            for i in range(cfg.num_workers)]


def worker_args(cfg: LaunchConfig, i: int, addresses: str, worker_argv: list[str], chief_summary: str,
                device: str) -> list[str]:
    """`pserver` arguments of worker i; the chief writes its summary to `chief_summary`, and
    every worker its time breakdown to stats_path(chief_summary, i)."""
    argv = ["worker", "--ps", addresses, "--rank", str(i), "--num-workers", str(cfg.num_workers),
            "--device", device, *metrics_argv(cfg, cfg.num_shards + i), *worker_argv]
    delay = worker_delay(cfg, i)
    if delay:
        argv += ["--delay", delay]
    if i == 0:
        argv += ["--summary-json", chief_summary]
    return argv + ["--stats-json", stats_path(chief_summary, i)]


def stats_path(chief_summary: str, rank: int) -> str:
    return os.path.join(os.path.dirname(chief_summary), f"worker{rank}.json")


def supervise(shards: list[Proc], workers: list[Proc]) -> None:
    """Return when every worker exited 0; raise naming the first process that failed."""
    while True:
        for p in workers + shards:
            code = p.popen.poll()
            if code is not None and (code != 0 or p in shards):
                raise ProcessFailed(p.role, code)
        if all(w.popen.poll() == 0 for w in workers):
            return
        time.sleep(0.1)


def launch(cfg: LaunchConfig, server_argv: list[str], worker_argv: list[str]) -> int:
    if cfg.backend == "ray":
        from pserver.ray_backend import launch_ray
        return launch_ray(cfg, server_argv, worker_argv)
    env = child_env(cfg.num_workers)
    devices = round_robin(cfg.num_workers, cfg.device)   # no GPU for cuda: fail before starting
    if cfg.auth_token:
        env[TOKEN_ENV] = cfg.auth_token      # never in argv: any user can read a command line
    started = time.monotonic()
    procs: list[Proc] = []
    tmpdir = tempfile.mkdtemp(prefix="pserver-launch-")
    chief_summary = os.path.join(tmpdir, "chief-summary.json")
    with stop_on_signals():
        try:
            shards = start_shards(cfg, server_argv, env, procs)
            addresses = ",".join(f"127.0.0.1:{p.port}" for p in shards)
            announce(cfg, addresses)
            workers = start_workers(cfg, addresses, worker_argv, env, chief_summary, devices)
            procs += workers
            supervise(shards, workers)
            report(cfg, chief_summary, started)
            return 0
        except Stopped as e:
            return stopped(e)
        finally:
            stop_all([p for p in procs if p.role.startswith("worker")])   # workers first
            stop_all([p for p in procs if not p.role.startswith("worker")])
            shutil.rmtree(tmpdir, ignore_errors=True)


def stopped(e: Stopped) -> int:
    """The launcher's exit code when a signal stops it, once it said so."""
    print(f"pserver launch: stopped by {e}; stopping the cluster", file=sys.stderr, flush=True)
    return e.exit_code


def announce(cfg: LaunchConfig, addresses: str) -> None:
    print(f"pserver launch: {cfg.num_shards} shard(s) at {addresses}; starting {cfg.num_workers} worker(s)",
          flush=True)


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
