"""Building and running one shard server process."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from concurrent import futures

import grpc

from pserver.config import ServerConfig
from pserver.errors import ConfigError, FailedPrecondition
from pserver.observe.metrics import describe_updates
from pserver.observe.telemetry import serve_metrics
from pserver.server import dataplane, memory
from pserver.server.health import Readiness
from pserver.server.limits import pool_threads
from pserver.server.servicer import ParameterServerServicer, add_to_server
from pserver.server.shard import Shard
from pserver.signals import Stopped, stop_on_signals, thread_ids
from pserver.wire import frames, security
from pserver.wire.codec import MAX_CHUNK_BYTES

log = logging.getLogger("pserver.server")


def flow_control(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC options that bound what a shard buffers per stream. By default each stream's
    window grows with the bandwidth-delay product that gRPC probes for (megabytes on
    loopback), and a shard that several workers push to holds that much received data per
    stream: 60-200 MiB above its memory bound in bench/transport.py's shard memory row. A
    fixed window of one chunk (at least gRPC's 64 KiB) keeps about a chunk per stream in
    flight; no ratio of bench/transport.py (loopback, or --two-hosts at 10 Gbit/s) moved
    beyond its run-to-run noise."""
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", max(chunk_bytes, 64 << 10))]


def create_server(cfg: ServerConfig) -> tuple[grpc.Server, int, Shard]:
    """A started gRPC server for one shard; returns (server, bound port, shard).

    Port 0 binds a free port, which is how tests and `pserver launch` start shards.
    """
    shard = Shard(cfg, open_now=False)
    shard.readiness = Readiness()         # NOT_SERVING until shard.open() below is done
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=pool_threads(cfg.threads, cfg.num_workers),
                                   thread_name_prefix="pserver-rpc"),   # split by server/limits.py
        options=[("grpc.max_receive_message_length", MAX_CHUNK_BYTES),
                 ("grpc.so_reuseport", 0), *flow_control(cfg.chunk_bytes)],
        # token check, readiness gate, safe decoding
        interceptors=security.server_interceptors(cfg.auth_token, shard.readiness))
    add_to_server(ParameterServerServicer(shard), server)
    shard.readiness.add_to(server)
    address = f"{cfg.host}:{cfg.port}"
    check_port_free(cfg.host, cfg.port)
    try:
        port = security.add_port(server, address, cfg.tls_cert, cfg.tls_key)
    except RuntimeError as e:
        raise ConfigError(f"--port: cannot bind {address} ({e})") from None
    if port == 0:
        raise ConfigError(f"--port: cannot bind {address} (in use, or not an address of this host)")
    server.start()
    try:
        shard.open()
    except BaseException:
        server.stop(0)
        raise
    shard.readiness.serving()
    if cfg.data_plane == "auto" and frames.supported():
        shard.dataplane = dataplane.DataPlaneServer(shard)
    return server, port, shard


def check_port_free(host: str, port: int) -> None:
    """A port that another process listens on is named in one line, before gRPC tries it
    (its failure comes with a log line of its own and a vaguer reason)."""
    if port == 0:
        return
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return                        # gRPC's own error names an address it cannot use
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC binds
        try:
            probe.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--port: port {port} is already in use on {host}; stop what holds it "
                                  "or pick another port (--port 0 picks a free one)") from None


def schedule(policy: str) -> bool:
    """Every thread of this process under `policy` (ServerConfig.sched); threads started after
    inherit it. "batch" is Linux's SCHED_BATCH: a thread it wakes does not preempt the running
    one. A worker that pushes wakes each shard in turn and then waits for their replies; under
    the default policy the first shard it woke preempted it on its core, and the next shard got
    the push only once the first had applied it (0.23-0.43 ms after the first, and 0.03 ms under
    SCHED_BATCH, in timestamps taken at each send and request of DCN's sync step under `pserver
    run --ps 2 --workers 2` on 2 cores). bench/step_timeline.py on that run, unbound: the median
    exchange 1.63-1.67 ms under SCHED_BATCH against 1.92-2.02 ms under the default policy
    (bench/results/keras_rs/xeon-2026-12-03-bind/). Whether it was set; where the OS has no such
    policy or refuses it, the shard runs under its own (said once in the log)."""
    if policy != "batch":
        return False
    if not hasattr(os, "SCHED_BATCH"):
        log.info("--sched batch: this OS has no SCHED_BATCH; the shard runs under its default policy")
        return False
    for tid in thread_ids():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            pass                             # a thread that ended meanwhile
        except OSError as e:
            log.info("--sched batch: the OS refused SCHED_BATCH (%s); the shard runs under its default "
                     "policy", e)
            return False
    return True


def serve(cfg: ServerConfig) -> int:
    """Run a shard until SIGTERM, SIGHUP or SIGINT, or until the chief ends the run (worker
    --stop-shards), then stop gracefully (in-flight calls get 2 s), write a last checkpoint
    where there is a directory, and return 128+signal (0 when the chief ended it)."""
    memory.configure()
    schedule(cfg.sched)                     # before the server's threads start: they inherit it
    with stop_on_signals():
        server, port, shard = create_server(cfg)
        shard.store.warm_kernels()
        if cfg.metrics_port is not None:
            try:
                serve_metrics(shard.metrics.registry, cfg.metrics_host or cfg.host, cfg.metrics_port,
                              f"pserver serve: shard {cfg.shard}")
            except ConfigError:
                server.stop(0)
                raise
        stopped = None
        try:                                # a signal right after the line below is a stop too
            print(f"pserver serve: shard {cfg.shard}/{cfg.num_shards} mode={cfg.mode} "
                  f"optimizer={cfg.optimizer} lr={shard.lr():g}"
                  f"{' (the chief set it before the checkpoint restored)' if shard.lr() != cfg.lr else ''} "
                  f"listening on {cfg.host}:{port}"
                  f"{' (TLS)' if cfg.tls_cert else ''}{' (token required)' if cfg.auth_token else ''}",
                  flush=True)
            while not shard.ended.wait(0.5):
                pass
        except Stopped as e:
            stopped = e
        shard.close()                       # wake pulls that wait for a step
        server.stop(grace=2.0).wait()
        try:
            shard.checkpoint()              # no push can come now: this is the final state
        except FailedPrecondition:
            pass                            # logged and counted where it failed
    st = shard.status()
    c = st["counters"]
    why = f"stopped by {stopped}" if stopped else "done (the chief ended the run)"
    at = f" at version {st['version']}" if st["version"] >= 0 else ", not initialized (no Init came)"
    print(f"pserver serve: shard {cfg.shard} {why}{at}: "
          f"{describe_updates(c)}", flush=True)
    sys.stdout.flush()
    return stopped.exit_code if stopped else 0
