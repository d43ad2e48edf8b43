"""A whole cluster from one call: S shards and N workers, started, supervised and stopped.

    launch(LaunchConfig(num_shards=2, num_workers=4), ServerConfig(...), WorkerConfig(...)) -> exit code

takes configs, never argv: `pserver launch` builds them from its flags, pserver.launch_cluster
from keyword arguments. The backends behind it (BACKENDS, chosen by LaunchConfig.backend):

    local   child processes on this machine (pserver.launch.local)
    ray     Ray actors, on a Ray started here or a running cluster (pserver.launch.ray)

`pserver slurm` runs one process of a cluster per Slurm task instead (pserver.launch.slurm).
Each process runs one role (pserver.launch.roles): a shard or a worker.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex

from pserver.config import ServerConfig, WorkerConfig, check_writable
from pserver.errors import ConfigError
from pserver.launch.base import BACKENDS, LaunchConfig


def launch(cfg: LaunchConfig, server: ServerConfig, worker: WorkerConfig) -> int:
    """Run the cluster to its end on cfg.backend; the exit code (0 when every worker
    finished; the failed process's code read as launch reads it; 128+signal when stopped).
    Everything that can be checked is checked before the first process starts."""
    from pserver.wire.security import resolve_token, write_token_file  # grpc: not when the CLI merely starts
    if (server.tls_cert is None) != (worker.tls_ca is None):
        raise ConfigError("--tls-ca: launch needs --tls-cert/--tls-key and --tls-ca together "
                          "(its shards serve TLS and its workers must trust them)")
    check_writable("--summary-json", cfg.summary_json)
    from pserver.persist.checkpoint import check_directory
    from pserver.persist.checkpoint_dir import check_layout, check_start, write_directory
    first = check_start(server.checkpoint_dir, server.restore)   # another run's directory: refused
    where = write_directory(server)
    if where:
        check_directory(*where)        # now, rather than as a shard's exit once it started
    from pserver.build import check_model_and_data
    from pserver.worker.loop import registered_layout
    model = check_model_and_data(worker)   # a model file's mistake too, before any process starts
    if server.restore and getattr(model, "layout", None) is not None:
        # another model's checkpoints: refused now, on the layout the workers register (tables too)
        check_layout(server.restore, registered_layout(model))
    if first:
        print(f"pserver launch: {first}", flush=True)
    # Our own cluster gets a fresh random token unless one is given (config, file or environment);
    # a generated one goes to a file only this user can read, for `pserver status --token-file`.
    token = server.auth_token or worker.auth_token or resolve_token(None)
    written = None
    if token is None:
        token = secrets.token_urlsafe(32)
        written = write_token_file(token, f"launch-{os.getpid()}.token")
    cfg = dataclasses.replace(cfg, auth_token=token, token_file=cfg.token_file or written,
                              status_flags=status_flags(cfg.token_file or written, worker.tls_ca))
    try:
        if cfg.backend == "ray":
            from pserver.launch import ray  # Ray is imported only when asked for
            return ray.launch(cfg, server, worker)
        from pserver.launch import local
        return local.launch(cfg, server, worker)
    finally:
        if written is not None:
            os.unlink(written)          # the token dies with the cluster


def status_flags(token_file: str | None, tls_ca: str | None) -> str:
    """What `pserver status` needs besides --ps to reach a launched cluster."""
    how = (f" --token-file {shlex.quote(token_file)}" if token_file
           else " (with this launch's token in PSERVER_AUTH_TOKEN)")
    return (f" --tls-ca {shlex.quote(tls_ca)}" if tls_ca else "") + how


__all__ = ["BACKENDS", "LaunchConfig", "launch"]
