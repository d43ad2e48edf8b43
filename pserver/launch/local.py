"""`pserver launch`'s local backend: S shards and N workers as separate processes on 127.0.0.1.

A convenience over `pserver serve` and `pserver worker`, not a different system: each child
runs the same function as those commands (pserver.launch.roles) on its own config, which
it reads from a file only this user can open (pserver.launch.child). It
starts the shards on free ports, reads the ports they print, starts the workers, prefixes
every line with its role, and stops everything when the workers are done, when one
process fails (naming it, with its exit code) or on a stop signal (SIGTERM, SIGHUP,
Ctrl-C: exit 128+signal). Its children never outlive it, even when it is SIGKILLed.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from pserver.config import ServerConfig, WorkerConfig
from pserver.errors import ProcessFailed, Unavailable
from pserver.kernels.device import round_robin
from pserver.launch.base import (
    LISTENING,
    STARTUP_TIMEOUT,
    STOP_GRACE,
    LaunchConfig,
    announce,
    child_env,
    report,
    shard_config,
    stopped,
    worker_config,
)
from pserver.observe.progress import Relay
from pserver.signals import Stopped, stop_on_signals, with_parent_death
from pserver.wire.security import TOKEN_ENV


class Proc:
    """A child process whose output is copied to ours with a role prefix."""

    def __init__(self, role: str, argv: list[str], env: dict, relay: Relay | None = None) -> None:
        self.role, self.relay = role, relay or Relay()
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
            self.relay.line(self.role, line)
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


def child(role: str, name: str, config, tmpdir: str, env: dict, relay: Relay) -> Proc:
    """A child that runs `role` ("serve" or "worker") on `config`, written for it to a file in
    the launch's own directory (mode 0700: no other user reads it; no token in it either)."""
    path = _config_path(tmpdir, name)
    _write_config(path, config)
    return Proc(name, [sys.executable, "-m", "pserver.launch.child", role, path], env, relay)


def _config_path(tmpdir: str, name: str) -> str:
    return os.path.join(tmpdir, f"{name}.config")


def _write_config(path: str, config, atomic: bool = False) -> None:
    """Mode 0600, never over another file; `atomic`: under another name first, then renamed, for
    a child that waits for the path (it reads the whole config or nothing)."""
    first = f"{path}.part" if atomic else path
    with open(os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        pickle.dump(config, f)
    if atomic:
        os.rename(first, path)


def start_shards(cfg: LaunchConfig, server: ServerConfig, env: dict, procs: list[Proc],
                 tmpdir: str, relay: Relay) -> list[Proc]:
    """Start the shards; each is added to `procs` at once, so a failure stops them all."""
    shards = []
    for j in range(cfg.num_shards):
        shards.append(child("serve", f"ps{j}", shard_config(cfg, server, j, "127.0.0.1"), tmpdir, env, relay))
        procs.append(shards[-1])
    return listening(shards)


def prestart_shards(num_shards: int, env: dict, tmpdir: str, relay: Relay) -> list[Proc]:
    """The shards' processes before their settings are known (`pserver run`: a worker's fit says
    them): each imports pserver, then waits for its config file (configure_shards writes it), so
    that a fit does not wait for the imports."""
    return [Proc(f"ps{j}", [sys.executable, "-m", "pserver.launch.child", "serve",
                            _config_path(tmpdir, f"ps{j}"), "--wait"], env, relay) for j in range(num_shards)]


def configure_shards(shards: list[Proc], cfg: LaunchConfig, server: ServerConfig, tmpdir: str) -> list[Proc]:
    """Each prestarted shard's config, written where it waits for it; the shards once listening."""
    for j, p in enumerate(shards):
        _write_config(_config_path(tmpdir, p.role), shard_config(cfg, server, j, "127.0.0.1"), atomic=True)
    return listening(shards)


def listening(shards: list[Proc]) -> list[Proc]:
    """`shards` once each printed its port; ProcessFailed or Unavailable naming one that did not."""
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


def start_workers(cfg: LaunchConfig, worker: WorkerConfig, addresses: tuple[str, ...], env: dict,
                  chief_summary: str, devices: list[str], tmpdir: str, relay: Relay) -> list[Proc]:
    return [child("worker", f"worker{i}", worker_config(cfg, worker, i, addresses, chief_summary, devices[i]),
                  tmpdir, env, relay)
            for i in range(cfg.num_workers)]


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP, a tracer: state T in
    /proc); False where there is no /proc to say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class StoppedWorkers:
    """Workers stopped by a signal once the chief's run is over: the shards marked them dead and
    the job is done without them, but a stopped process never exits, and the launcher waited for
    it for ever. One still stopped STOPPED_GRACE_S after the chief exited 0 is ended (SIGTERM and
    SIGCONT, so that it leaves the shards as a stopped worker does; SIGKILL after STOP_GRACE),
    said, and counted as done."""

    def __init__(self, workers: list[Proc], say) -> None:
        self.workers, self.say = workers, say
        self.ended: set[int] = set()            # indexes into workers
        self.since: dict[int, float] = {}

    def done(self, i: int) -> bool:
        return i in self.ended or self.workers[i].popen.poll() == 0

    def look(self) -> None:
        if self.workers[0].popen.poll() != 0:
            return
        now = time.monotonic()
        for i, p in enumerate(self.workers):
            if i in self.ended or p.popen.poll() is not None or not is_stopped(p.popen.pid):
                self.since.pop(i, None)
                continue
            if now - self.since.setdefault(i, now) >= STOPPED_GRACE_S:
                self.say(f"{p.role} is stopped by a signal (SIGSTOP?) and the chief's run is over: "
                         f"ending it (the shards took its rank as dead)")
                p.popen.send_signal(signal.SIGTERM)
                p.popen.send_signal(signal.SIGCONT)
                stop_all([p])
                self.ended.add(i)


STOPPED_GRACE_S = 5.0      # a worker stopped this long after the chief's end is ended (StoppedWorkers)


def supervise(shards: list[Proc], workers: list[Proc], say=None) -> None:
    """Return when every worker exited 0 (or, stopped by a signal after the chief's end, was
    ended: StoppedWorkers); raise naming the first process that failed."""
    stuck = StoppedWorkers(workers, say or (lambda line: print(f"pserver launch: {line}", file=sys.stderr,
                                                               flush=True)))
    while True:
        for i, p in enumerate(workers + shards):
            code = p.popen.poll()
            if code is not None and (code != 0 or p in shards) and i not in stuck.ended:
                raise ProcessFailed(p.role, code)
        stuck.look()
        if all(stuck.done(i) for i in range(len(workers))):
            return
        time.sleep(0.1)


def launch(cfg: LaunchConfig, server: ServerConfig, worker: WorkerConfig) -> int:
    """Run the cluster as child processes of this one until the workers are done; the exit code."""
    env = child_env(cfg.num_workers)
    devices = round_robin(cfg.num_workers, cfg.device)   # no GPU for cuda: fail before starting
    if cfg.auth_token:
        env[TOKEN_ENV] = cfg.auth_token      # never in argv or a file: any user can read a command line
    started = time.monotonic()
    procs: list[Proc] = []
    tmpdir = tempfile.mkdtemp(prefix="pserver-launch-")
    chief_summary = os.path.join(tmpdir, "chief-summary.json")
    relay = Relay()
    if worker.progress == "auto" and sys.stderr.isatty():   # we own the terminal: we draw the bar
        worker = dataclasses.replace(worker, progress="relay")
    with stop_on_signals():
        try:
            shards = start_shards(cfg, server, env, procs, tmpdir, relay)
            addresses = tuple(f"127.0.0.1:{p.port}" for p in shards)
            announce(cfg, ",".join(addresses))
            workers = start_workers(cfg, worker, addresses, env, chief_summary, devices, tmpdir, relay)
            procs += workers
            supervise(shards, workers)
            relay.close()
            report(cfg, chief_summary, started)
            return 0
        except Stopped as e:
            return stopped(e)
        finally:
            stop_all([p for p in procs if p.role.startswith("worker")])   # workers first
            stop_all([p for p in procs if not p.role.startswith("worker")])
            relay.close()
            shutil.rmtree(tmpdir, ignore_errors=True)
