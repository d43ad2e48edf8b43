"""`pserver launch --backend ray`: the shards and workers of `pserver launch` as Ray actors.

Each actor is one process that runs a shard or a worker (pserver.launch.roles), on the
config the local backend gives its child processes (launch.base.shard_config, worker_config).
The actors are spread over the nodes by a placement group (strategy
SPREAD), one bundle of 1 CPU each, on a Ray started here (no --address) or on a running
cluster. Their output comes back through a Ray queue and is printed with the same role
prefixes as the local backend; the summary JSON, the progress lines and the exit codes are
launch's own. A stop signal ray.kill()s every actor (workers first) and removes the placement
group. Ray is imported only here, and only when asked for: pserver works without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from pserver.config import ServerConfig, WorkerConfig, parse_address
from pserver.errors import ConfigError, ProcessFailed, PServerError, Unavailable
from pserver.launch.base import (
    LISTENING,
    STARTUP_TIMEOUT,
    STOP_GRACE,
    LaunchConfig,
    announce,
    child_env,
    report,
    shard_config,
    stats_path,
    stopped,
    worker_config,
)
from pserver.signals import Stopped, stop_on_signals
from pserver.wire.security import TOKEN_ENV

OBJECT_STORE_BYTES = 80 * 1024**2      # a Ray started here: pserver's data never goes through it
REACH_TIMEOUT = 10.0                   # seconds to connect to --address
FORWARDED_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend: ray needs Ray, which is not installed: "
                          "pip install -e '.[ray]'") from None
    return ray


class RoleHost:
    """The body of one actor: a shard or a worker, run by pserver.launch.roles in the actor's
    main thread (so that its SIGTERM handling works as in a process of its own)."""

    def __init__(self, role: str, lines) -> None:
        self.role = role
        self.lines = lines              # a ray.util.queue.Queue of (role, line)

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def run(self, role: str, config, outputs: list[str]) -> tuple[int, dict[str, str]]:
        """The role's exit code on `config`, and the text of the `outputs` files it wrote: they
        are on this actor's node, which need not be the launcher's."""
        from pserver.launch.roles import run_role
        made = sorted({os.path.dirname(p) for p in outputs if not os.path.isdir(os.path.dirname(p))})
        for d in made:
            os.makedirs(d, exist_ok=True)
        with lines_to(self.lines, self.role):
            code = run_role(role, config)
        files = {}
        for path in outputs:
            if os.path.exists(path):
                with open(path) as f:
                    files[path] = f.read()
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
        return code, files


def check_reachable(address: str) -> None:
    """A cluster address that nothing answers at is one line now, not Ray's minutes of retries."""
    if address == "auto":               # Ray looks for this machine's cluster itself
        return
    if ":" not in address:
        raise ConfigError(f"--address: '{address}' is not auto or HOST:PORT (a Ray head's GCS address)")
    host, _, port = parse_address(address, "--address").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT).close()
    except OSError as e:
        raise Unavailable(f"--address: no Ray cluster answers at {address} ({e.strerror or e}); "
                          "start one with `ray start --head`") from None


def ended(role: str, code: int | None, what: str = "; stopping the cluster") -> PServerError:
    """The error for an actor that ended: its code read as launch reads a child's (1 for 1-127,
    138 for 128 and above); an actor that died without one (killed, its node lost) is transient."""
    if code is None:
        return Unavailable(f"{role}'s actor died{what}")
    return ProcessFailed(role, code, what)


@contextlib.contextmanager
def lines_to(queue, role: str):
    """Inside: whatever this process writes to stdout or stderr (print, logging, C code) goes
    line by line to `queue` as (role, line)."""
    read_end, write_end = os.pipe()
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, errors="replace") as lines:
            for line in lines:
                queue.put((role, line))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)            # the pipe's last write end closes: the pump ends
            os.close(old)
        thread.join(10.0)


class RayCluster:
    """The actors of one launch, the placement group they live in and the queue of their
    output; stop() removes whatever of it exists."""

    def __init__(self, ray, cfg: LaunchConfig) -> None:
        self.ray, self.cfg = ray, cfg
        self.own_connection = False
        self.pg = self.lines = None
        self.actors: dict[str, object] = {}        # role -> actor, in start order
        self.runs: dict[object, str] = {}          # run() ref -> role
        self.ports: dict[str, str] = {}            # shard role -> host:port it listens on
        self.printer: threading.Thread | None = None
        self.printing = threading.Event()
        self.printed = threading.Lock()             # held while a line is taken and printed

    def connect(self) -> bool:
        """Join or start Ray; whether it has more than one node."""
        ray, cfg = self.ray, self.cfg
        if not ray.is_initialized():
            # The actors' output comes through our queue, with launch's prefixes: not Ray's log stream.
            common = dict(log_to_driver=False, logging_level="WARNING")
            if cfg.address:
                check_reachable(cfg.address)
                try:
                    ray.init(address=cfg.address, **common)
                except ConnectionError as e:
                    raise Unavailable(f"--address: {e}") from None
            else:                                  # one actor per logical CPU, however few cores
                start_local_ray(ray, cfg.num_shards + cfg.num_workers, common)
            self.own_connection = True
        nodes = [n for n in ray.nodes() if n["Alive"]]
        print(f"pserver launch: Ray {ray.__version__} with {len(nodes)} node(s), "
              f"{ray.cluster_resources().get('CPU', 0):g} CPU(s)", flush=True)
        return len(nodes) > 1

    def place(self) -> None:
        from ray.util.placement_group import placement_group
        size = self.cfg.num_shards + self.cfg.num_workers
        self.pg = placement_group([{"CPU": 1}] * size, strategy="SPREAD")
        try:
            self.ray.get(self.pg.ready(), timeout=STARTUP_TIMEOUT)
        except self.ray.exceptions.GetTimeoutError:
            raise Unavailable(f"Ray could not place {size} actors of 1 CPU each within {STARTUP_TIMEOUT:g} s "
                              f"(the cluster has {self.ray.cluster_resources().get('CPU', 0):g} CPUs); "
                              "lower --ps/--workers or add nodes") from None
        from ray.util.queue import Queue
        self.lines = Queue(actor_options={"num_cpus": 0})      # outside the placement group's CPUs
        self.printer = threading.Thread(target=self._print, daemon=True)
        self.printer.start()

    def _print(self) -> None:
        """Copy the actors' lines to our stdout with their role prefix, noting where shards listen."""
        from ray.util.queue import Empty
        while not self.printing.is_set():
            with self.printed:
                try:
                    role, line = self.lines.get(timeout=0.2)
                except Empty:
                    continue
                except Exception:         # the queue's actor is gone: the cluster is stopping
                    return
                m = LISTENING.search(line)
                if m and role not in self.ports:
                    self.ports[role] = f"{m.group(1)}:{m.group(2)}"
                sys.stdout.write(f"[{role}] {line}")
                sys.stdout.flush()

    def drain(self) -> None:
        """Return once every line queued so far is printed (an actor's run() returns only
        after its last line is in the queue)."""
        with contextlib.suppress(Exception):     # a queue already gone has nothing to print
            while not self.lines.empty():
                time.sleep(0.05)
        with self.printed:
            pass

    def add(self, role: str, index: int) -> None:
        """An actor for `role` in bundle `index` of the placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        env = {k: v for k, v in child_env(self.cfg.num_workers).items() if k in FORWARDED_ENV}
        if self.cfg.auth_token:
            env[TOKEN_ENV] = self.cfg.auth_token   # never in argv, as with the local backend
        actor = self.ray.remote(RoleHost).options(
            num_cpus=1, max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
        ).remote(role, self.lines)
        self.actors[role] = actor

    def submit(self, role: str, kind: str, config, outputs: list[str]) -> None:
        """Start `kind` ("serve" or "worker") on `config` in the actor for `role`."""
        self.runs[self.actors[role].run.remote(kind, config, outputs)] = role

    def shard_host(self, role: str, multi_node: bool) -> str:
        """Where a shard binds: the workers must reach it. On one node that is loopback only;
        across nodes, the node's own IP (as Ray reports it), not every interface."""
        return self.ray.get(self.actors[role].node_ip.remote()) if multi_node else "127.0.0.1"

    def wait_listening(self, roles: list[str]) -> list[str]:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not all(r in self.ports for r in roles):
            for role in roles:
                ref = next(ref for ref, r in self.runs.items() if r == role)
                done, _ = self.ray.wait([ref], timeout=0)
                if done and role not in self.ports:
                    time.sleep(0.5)        # its last lines are still on their way
                    raise ended(role, self.result(ref)[0], " before listening (its error is above)")
            if time.monotonic() > deadline:
                raise Unavailable(f"a shard did not start listening within {STARTUP_TIMEOUT:g} s")
            time.sleep(0.1)
        return [self.ports[r] for r in roles]

    def result(self, ref) -> tuple[int | None, dict[str, str]]:
        """An ended run's exit code and files; no code when its actor died without one."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return None, {}

    def supervise(self, workers: list[str]) -> dict[str, str]:
        """Wait until every worker exited 0 and return the files they wrote; raise naming the
        first actor that failed. A shard exits 0 only when the chief ended the run."""
        pending, files = dict(self.runs), {}
        while any(r in workers for r in pending.values()):
            done, _ = self.ray.wait(list(pending), num_returns=1, timeout=0.1)
            for ref in done:
                role = pending.pop(ref)
                code, written = self.result(ref)
                if code != 0:
                    raise ended(role, code)
                files.update(written)
        # the chief ended the shards
        self.ray.wait(list(pending), num_returns=len(pending), timeout=STOP_GRACE)
        return files

    def stop(self) -> None:
        workers_first = sorted(self.actors, key=lambda role: not role.startswith("worker"))
        for role in workers_first:
            with contextlib.suppress(Exception):
                self.ray.kill(self.actors[role], no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
        if self.printer is not None:
            self.drain()
            self.printing.set()
            self.printer.join(2.0)
        if self.lines is not None:
            self.lines.shutdown()
        if self.own_connection:
            self.ray.shutdown()


def launch(cfg: LaunchConfig, server: ServerConfig, worker: WorkerConfig) -> int:
    """`pserver launch` with every shard and worker a Ray actor; the local backend's exit code."""
    ray = import_ray()
    if cfg.device != "cpu":
        raise ConfigError(f"--device: '{cfg.device}' is not supported with --backend ray (its workers "
                          "compute on the CPU); use --backend local for GPUs")
    started = time.monotonic()
    tmpdir = tempfile.mkdtemp(prefix="pserver-launch-")
    chief_summary = os.path.join(tmpdir, "chief-summary.json")
    cluster = RayCluster(ray, cfg)
    # Ray installs its own SIGTERM handler when it starts: ours go in after it.
    try:
        multi_node = cluster.connect()
        with stop_on_signals():
            try:
                with stop_through_ray():
                    run(cluster, multi_node, server, worker, chief_summary)
                report(cfg, chief_summary, started)
                return 0
            except Stopped as e:
                return stopped(e)
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.contextmanager
def stop_through_ray():
    """A stop signal that lands while Ray's compiled code runs comes out of it as a
    SystemError whose cause is our Stopped: raise the Stopped itself."""
    try:
        yield
    except SystemError as e:
        if isinstance(e.__cause__, Stopped):
            raise e.__cause__ from None
        raise


def run(cluster: RayCluster, multi_node: bool, server: ServerConfig, worker: WorkerConfig,
        chief_summary: str) -> None:
    cfg = cluster.cfg
    cluster.place()
    shards = [f"ps{j}" for j in range(cfg.num_shards)]
    workers = [f"worker{i}" for i in range(cfg.num_workers)]
    for index, role in enumerate(shards + workers):
        cluster.add(role, index)     # all at once: their processes start while the shards do
    for j, role in enumerate(shards):  # on several nodes a shard's host is where Ray put it
        cluster.submit(role, "serve", shard_config(cfg, server, j, cluster.shard_host(role, multi_node)), [])
    addresses = tuple(cluster.wait_listening(shards))
    announce(cfg, ",".join(addresses))
    for i, role in enumerate(workers):
        config = worker_config(cfg, worker, i, addresses, chief_summary, "cpu")
        config = dataclasses.replace(config, stop_shards=i == 0)   # the shards end, with a last checkpoint
        outputs = [chief_summary] if i == 0 else []
        cluster.submit(role, "worker", config, outputs + [stats_path(chief_summary, i)])
    files = cluster.supervise(workers)
    cluster.drain()                  # the workers' last lines before launch's own
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)


def start_local_ray(ray, cpus: int, common: dict) -> None:
    """A local Ray with `cpus` logical CPUs, tried twice: Ray gives its raylet a fixed 30 s to
    register with the GCS, which a loaded machine can miss (CI at load 40: "The current node
    timed out during startup"); a second start after shutdown is what a user would do."""
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, **common)
            return
        except Exception as e:             # Ray raises a bare Exception for this timeout
            if attempt == 2:
                raise
            print(f"pserver: Ray's start timed out ({e}); starting it once more", file=sys.stderr, flush=True)
            ray.shutdown()


class RayJoiners:
    """`add_workers(k)` for a cluster on Ray (pserver.start_cluster(backend="ray")): the Ray that
    the cluster's `pserver launch --backend ray` runs on, joined or started here (with a CPU for
    each of --max-workers) so that launch is given its address, and in it one actor per added
    worker, `pserver worker --rank auto` on the cluster's shards. Their lines go to `say` with
    the prefix [joinerK]."""

    def __init__(self, address: str | None, cpus: int, say) -> None:
        ray = self.ray = import_ray()
        common = dict(log_to_driver=False, logging_level="WARNING")
        self.own_connection = not ray.is_initialized()
        if self.own_connection:
            if address:
                check_reachable(address)
                ray.init(address=address, **common)
            else:
                start_local_ray(ray, cpus, common)
        self.address = ray.get_runtime_context().gcs_address
        from ray.util.queue import Empty, Queue
        self.lines = Queue(actor_options={"num_cpus": 0})
        self.actors: list = []
        self.runs: list = []
        self.stopping = threading.Event()

        def pump() -> None:
            while not self.stopping.is_set():
                try:
                    role, line = self.lines.get(timeout=0.2)
                except Empty:
                    continue
                except Exception:              # the queue's actor is gone: stopping
                    return
                say(f"[{role}] {line}")

        self.printer = threading.Thread(target=pump, daemon=True)
        self.printer.start()

    def add(self, config: WorkerConfig, token: str | None) -> int:
        """One more worker actor (1 CPU) on `config` (rank auto, the cluster's shards); its pid."""
        role = f"joiner{len(self.actors)}"
        env = {k: v for k, v in child_env(1).items() if k in FORWARDED_ENV}
        if token:
            env[TOKEN_ENV] = token                  # never in the actor's arguments
        actor = self.ray.remote(RoleHost).options(num_cpus=1, max_restarts=0,
                                                  runtime_env={"env_vars": env}).remote(role, self.lines)
        self.actors.append(actor)
        pid = self.ray.get(actor.pid.remote())
        self.runs.append(actor.run.remote("worker", config, []))
        return pid

    def wait(self, timeout: float | None = None) -> list[int | None]:
        """The added workers' exit codes (None: an actor that died without one)."""
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        codes = []
        for ref in self.runs:
            try:
                codes.append(self.ray.get(ref)[0] if ref in done else None)
            except self.ray.exceptions.RayError:
                codes.append(None)
        return codes

    def stop(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        time.sleep(0.3)                             # the last lines on their way
        self.stopping.set()
        self.printer.join(2.0)
        with contextlib.suppress(Exception):
            self.lines.shutdown()
        if self.own_connection:
            self.ray.shutdown()
