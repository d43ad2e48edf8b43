"""The Python API: serve a shard and train a model from a script or a notebook.

    shard = pserver.serve(mode="sync", optimizer="adam", lr=1e-3, num_workers=1)
    summary = pserver.train(model, x, y, ps=[shard.address], validation_data=(x_test, y_test))
    shard.stop()

or, all in this process, `pserver.train(model, x, y, ps=2, optimizer="adam", lr=1e-3)`, which
starts two shards here, trains one worker and stops them. `pserver serve` and `pserver worker`
run the same code (pserver.server.app, pserver.worker.loop) from flags. With `save="model.npz"`
(`--save`), the chief writes the trained model; `pserver.load_model("model.npz")` reads it
back and `pserver.predict(...)` runs it. `pserver.launch_cluster(ps=2, workers=2,
backend="ray", ...)` runs a whole cluster as `pserver launch` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from pserver.config import ServerConfig, WorkerConfig
from pserver.data import Stream, from_arrays
from pserver.errors import ConfigError, DataError, PServerError
from pserver.persist.model_file import SavedModel, load


@dataclass
class Server:
    """A shard serving in this process (gRPC threads); stop() it, or use it as a context."""
    address: str
    config: ServerConfig
    _server: object
    _shard: object

    def stop(self, grace: float = 2.0) -> None:
        self._shard.close()             # wake pulls that wait for a step
        self._server.stop(grace=grace).wait()

    def status(self) -> dict:
        return self._shard.status()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(*, port: int = 0, host: str = "127.0.0.1", **options) -> Server:
    """Start one shard in this process. `options` are ServerConfig's fields, the `pserver
    serve` flags with underscores: shard, num_shards, num_workers, mode, optimizer, lr, ...
    Port 0 (the default) picks a free port: see `.address`."""
    from pserver.server.app import create_server
    cfg = ServerConfig(host=host, port=port, **options)
    server, bound, shard = create_server(cfg)
    return Server(f"{host}:{bound}", cfg, server, shard)


def serve_model(path: str, *, port: int = 8500, http_port: int = 8501, host: str = "127.0.0.1",
                follow: str | None = None, poll: float = 0.5, threads: int = 8, compact_every: int = 0,
                auth_token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                block: bool = True):
    """`pserver serve-model`: answer the model file's predictions (gRPC and HTTP), following the
    delta exports in `follow`. block=True runs until SIGTERM or SIGINT and returns the exit code;
    block=False returns the started pserver.serving.ModelServer (its .port, .http_port, .served,
    .stop())."""
    from pserver.serving import ModelServer, ServeModelConfig
    from pserver.serving import serve_model as run_server
    cfg = ServeModelConfig(path, port=port, http_port=http_port, host=host, follow=follow, poll=poll,
                           threads=threads, compact_every=compact_every, auth_token=auth_token,
                           tls_cert=tls_cert, tls_key=tls_key)
    return run_server(cfg) if block else ModelServer(cfg).start()


def ingest(out: str, *, port: int = 9000, host: str = "127.0.0.1", block: bool = True):
    """`pserver ingest`: append the lines sent over TCP to `out`, the file a job follows with
    --dataset stream:FILE. block=True runs until SIGTERM or SIGINT and returns the exit code;
    block=False returns the started pserver.data.ingest.IngestServer (its .port, .lines)."""
    from pserver.data.ingest import ingest as run_ingest
    return run_ingest(out, port, host, block)


def train(model, x, y=None, *, ps, validation_data=None, rank: int = 0, num_workers: int = 1,
          callbacks=None, **options) -> dict | None:
    """Train `model` (a Sequential, or an object with the model protocol) as worker `rank`.

    x, y: arrays (a seeded tenth is held out for evaluation unless validation_data=(x, y)
    is given; y a list or a dict by name for a model with several outputs), or x alone as an
    iterable of (x, y) batches, or a function returning one per epoch: this worker's data,
    streamed. ps: shard addresses, or a number of shards to start
    in this process for this one worker (they take the shard options: mode, optimizer, lr,
    ...). Other `options` are WorkerConfig's fields (batch_size, epochs, seed, max_steps,
    device, ...). `callbacks`: Keras-style hooks the loop calls (pserver.worker.loop.run).
    Returns the run summary on the chief (rank 0), None on the others.
    """
    if isinstance(ps, int) and not isinstance(ps, bool):
        if (rank, num_workers) != (0, 1):
            raise ConfigError(f"rank={rank}, num_workers={num_workers}: shards started by train "
                              "(ps=N) serve this one worker; for more, start them with serve()")
        return _train_on_own_shards(model, x, y, ps, validation_data, options, callbacks)
    _check_options(options, WorkerConfig, "a worker option; shards at addresses have their own "
                                          "settings (pserver serve --mode, --optimizer, --lr)")
    if options.get("auth_token") is None:         # as `pserver worker`: PSERVER_AUTH_TOKEN when set
        from pserver.wire.security import resolve_token
        options["auth_token"] = resolve_token(None)
    cfg = WorkerConfig(ps=_addresses(ps), rank=rank, num_workers=num_workers, **options)
    return _run(cfg, model, _data(model, x, y, validation_data, cfg.seed), callbacks)


def preload() -> None:
    """What a worker's training imports and sets up before its first step (the loop, its RPC
    stubs and data plane, numba's CPU target), loaded lazily by train: a process that waits
    anyway does it first (a Keras fit under `pserver run`, while its shards start)."""
    import pserver.build  # noqa: F401
    import pserver.worker.loop  # noqa: F401
    from pserver.kernels.cache import load_numba
    load_numba()


def _run(cfg: WorkerConfig, model, data, callbacks=None) -> dict | None:
    from pserver.build import fit_data
    from pserver.kernels.device import parse_device, select
    from pserver.launch.cores import watch_core
    from pserver.models import on_device
    from pserver.worker.loop import run
    device = select(parse_device(cfg.device))
    model = on_device(model, device.backend)
    watch_core()       # under `pserver run`, its shards serve now: a bound worker's wait counts from here
    return run(cfg, device, fit_data(model, data), model, callbacks=callbacks)


def _train_on_own_shards(model, x, y, num_shards, validation_data, options, callbacks=None) -> dict | None:
    if num_shards < 1:
        raise ConfigError(f"ps: a number of shards must be >= 1, got {num_shards}")
    shard_fields = set(ServerConfig.__dataclass_fields__) - {"host", "port", "shard", "num_shards",
                                                             "num_workers"}
    shard_opts = {k: options.pop(k) for k in list(options) if k in shard_fields}
    _check_options(options, WorkerConfig, "neither a worker nor a shard option")
    data = _data(model, x, y, validation_data, options.get("seed", 0))
    with contextlib.ExitStack() as stack:
        shards = [stack.enter_context(serve(shard=j, num_shards=num_shards, num_workers=1,
                                            **shard_opts)) for j in range(num_shards)]
        cfg = WorkerConfig(ps=tuple(s.address for s in shards), **options)
        return _run(cfg, model, data, callbacks)


def _check_options(options: dict, config, why: str) -> None:
    unknown = sorted(set(options) - set(config.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not an option here ({why})")


def _addresses(ps) -> tuple[str, ...]:
    from pserver.config import parse_address
    if isinstance(ps, str):
        ps = ps.split(",")
    return tuple(parse_address(a, "ps") for a in ps)


def _data(model, x, y, validation_data, seed: int):
    test = (None, None) if validation_data is None else tuple(validation_data)
    if len(test) != 2:
        raise ConfigError("validation_data: give (x_test, y_test)")
    y, test = _labels(model, y), (test[0], _labels(model, test[1]))
    if y is None:
        if isinstance(x, np.ndarray):
            raise ConfigError("y: required when x is an array (x alone is an iterable of (x, y) batches)")
        x_test, y_test = (None, None) if test[0] is None else (np.asarray(test[0]), np.asarray(test[1]))
        classes = 0 if y_test is None or y_test.dtype.kind == "f" else int(y_test.max()) + 1
        return Stream("batches", x, x_test, y_test, classes)
    return from_arrays(x, y, *test, seed=seed)


def _labels(model, y):
    """A model with several outputs: their labels (a list, or a dict by name) as the one array
    it takes, a column per output (pserver.models.outputs)."""
    if not getattr(model, "several", False) or not isinstance(y, (list, tuple, dict)):
        return y
    try:
        return model.loss.labels(y)
    except ValueError as e:
        raise DataError(str(e)) from None


def launch_cluster(*, ps: int = 1, workers: int = 2, backend: str = "local", address: str | None = None,
                   **options) -> dict:
    """Run `ps` shards and `workers` workers to the end, as `pserver launch` does: processes
    on this machine (backend="local") or Ray actors (backend="ray": on the Ray cluster at
    `address`, "auto" or "HOST:PORT", else on a Ray started here for this run). `options` are
    launch's flags with underscores, as values of the configs' fields (model="logreg",
    mode="sync", epochs=2, lr=0.1, hidden=(64, 64), ...; True for a switch): each goes to the
    shards' config (ServerConfig), the workers' (WorkerConfig) or both; delay, delay_ranks,
    delay_for (["0,2=fixed:0.1"] as the flag, or (rank, delay) pairs), device and metrics_port
    to the launch's (LaunchConfig). Returns the run summary; raises PServerError when a process
    fails or a signal stops the run."""
    from pserver.launch import LaunchConfig, launch
    from pserver.launch.base import LAUNCH_OPTIONS, PER_PROCESS, parse_delay_for
    per_cluster = {k: options.pop(k) for k in LAUNCH_OPTIONS if k in options}
    if per_cluster.get("delay_for") and isinstance(per_cluster["delay_for"][0], str):
        per_cluster["delay_for"] = parse_delay_for(per_cluster["delay_for"], workers)
    server = {k: v for k, v in options.items() if k in ServerConfig.__dataclass_fields__}
    worker = {k: v for k, v in options.items() if k in WorkerConfig.__dataclass_fields__}
    unknown = sorted(set(options) - set(server) - set(worker) | set(options) & PER_PROCESS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a launch option")
    per_cluster["device"] = worker["device"] = per_cluster.get("device") or "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "summary.json")
        cfg = LaunchConfig(num_shards=ps, num_workers=workers, summary_json=path, backend=backend,
                           address=address, **per_cluster)
        code = launch(cfg, ServerConfig(num_shards=ps, **server), WorkerConfig(num_workers=workers, **worker))
        if code != 0:
            raise PServerError(f"launch stopped with exit code {code}")
        with open(path) as f:
            return json.load(f)


class Cluster:
    """A cluster started by `start_cluster`, running in the background: `pserver launch` as a
    child process, with room for `max_workers` workers. add_workers(k) starts k more (`pserver
    worker --rank auto`, which shard 0 gives free ranks): processes here with the local backend,
    actors in the cluster's Ray with the Ray backend (pserver.launch.ray.RayJoiners, whose Ray
    launch is given). wait() returns the summary."""

    def __init__(self, argv: list[str], worker_flags: list[str], summary: str, tmp,
                 ray_joiner=None) -> None:
        """`ray_joiner`: (cpus, Ray address or None, WorkerConfig of an added worker) with the
        Ray backend; None with the local one."""
        import subprocess
        import sys
        import threading
        self._cmd = [sys.executable, "-m", "pserver"]
        self._worker_flags, self._summary, self._tmp = worker_flags, summary, tmp
        self.lines: list[str] = []
        self.added: list = []
        self.ray = self._joiner_config = None
        if ray_joiner is not None:
            from pserver.launch.ray import RayJoiners
            cpus, address, self._joiner_config = ray_joiner
            self.ray = RayJoiners(address, cpus, self.lines.append)
            argv = [*argv, "--address", self.ray.address]
        self.launch = subprocess.Popen([*self._cmd, "launch", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
        self._ready = threading.Event()
        self.addresses, self.token_file = "", ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(300) or not self.addresses:
            self.stop()
            raise PServerError("start_cluster: pserver launch did not start its shards:\n"
                               + "".join(self.lines))

    def _read(self) -> None:
        import re
        for line in self.launch.stdout:
            self.lines.append(line)
            m = re.search(r"--ps (\S+) --token-file (\S+)", line)
            if m:
                self.addresses, self.token_file = m.group(1), m.group(2)
                self._ready.set()
        self._ready.set()

    def add_workers(self, k: int) -> list[int]:
        """Start k more workers; returns their process ids (each prints the rank it was given)."""
        import subprocess
        if self.ray is not None:
            import dataclasses

            from pserver.wire.security import read_token_file
            config = dataclasses.replace(self._joiner_config, ps=tuple(self.addresses.split(",")))
            token = read_token_file(self.token_file) if self.token_file else None
            return [self.ray.add(config, token) for _ in range(k)]
        procs = [subprocess.Popen([*self._cmd, "worker", "--rank", "auto", "--ps", self.addresses,
                                   "--token-file", self.token_file, *self._worker_flags],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(k)]
        self.added += procs
        return [p.pid for p in procs]

    def wait(self, timeout: float | None = None) -> dict:
        """Until the run is over (the added workers too); the run summary."""
        code = self.launch.wait(timeout)
        codes = [p.wait(timeout) for p in self.added] + (self.ray.wait(timeout) if self.ray else [])
        if code != 0 or any(codes):
            raise PServerError(f"launch stopped with exit code {code}; added workers' codes {codes}:\n"
                               + "".join(self.lines[-20:]))
        with open(self._summary) as f:
            return json.load(f)

    def stop(self) -> None:
        for p in [*self.added, self.launch]:
            if p.poll() is None:
                p.terminate()
        for p in [*self.added, self.launch]:
            p.wait()
        if self.ray is not None:
            self.ray.stop()
        self._tmp.cleanup()


def start_cluster(*, ps: int = 1, workers: int = 2, max_workers: int = 0, **options) -> Cluster:
    """Start a cluster (as `pserver launch` does, in the background) that workers may join up to
    `max_workers` (default `workers`): `cluster.add_workers(k)`, then `cluster.wait()` for the
    summary. `options` are launch's flags with underscores (model="logreg", epochs=2, ...);
    backend="ray" runs it on Ray (started here, or the one at address=), where added workers
    are actors too."""
    def flags(items) -> list[str]:
        out = []
        for k, v in items:
            flag = "--" + k.replace("_", "-")
            if v is True:
                out.append(flag)
            elif v is not None and v is not False:
                out += [flag, ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)]
        return out

    ServerConfig(num_workers=workers, max_workers=max_workers)       # the flags' one-line checks
    worker = [(k, v) for k, v in options.items() if k in WorkerConfig.__dataclass_fields__]
    tmp = tempfile.TemporaryDirectory()
    summary = os.path.join(tmp.name, "summary.json")
    argv = ["--ps", str(ps), "--workers", str(workers), "--max-workers", str(max_workers or workers),
            "--summary-json", summary,
            *flags((k, v) for k, v in options.items() if k != "address" or options.get("backend") != "ray")]
    joiner = None
    if options.get("backend") == "ray":         # launch runs on the Ray that the added workers join
        from pserver.config import AUTO_RANK
        joiner = (ps + (max_workers or workers), options.get("address"),
                  WorkerConfig(**dict(worker), rank=AUTO_RANK, num_workers=workers, device="cpu"))
    return Cluster(argv, flags(worker), summary, tmp, joiner)


def evaluate_files(model_file: str | None, checkpoint: str | None, options: dict, mode: str = "sync") -> dict:
    """`pserver evaluate`: the test metrics of a model with the weights of a model file or of
    the checkpoints in `checkpoint` (pserver.persist.export.evaluate_files)."""
    from pserver.persist import export
    return export.evaluate_files(model_file, checkpoint, options, mode)


def export_checkpoints(directory: str, out: str, options: dict, mode: str = "sync",
                       since: str | None = None) -> dict:
    """`pserver export`: the model a directory's checkpoints hold, written as a model file at
    `out` (a delta since the model `since`, when given); what was written
    (pserver.persist.export.export_checkpoints)."""
    from pserver.persist import export
    return export.export_checkpoints(directory, out, options, mode, since)


def load_model(path: str, model=None, safe_mode: bool = True) -> SavedModel:
    """A model file written by `--save` / `train(..., save=PATH)` or `pserver export` (a
    directory, for a model with sparse tables: they are memory-mapped): the model, built again from
    its definition, with its trained weights (`.model`, `.weights`, `.meta`; `.predict(x)`,
    `.evaluate(x, y)`). A model built in Python is not rebuilt by the file: pass it as
    `model` (a Sequential with the same layers); `model` may also be a --model spec string.
    As Keras's load_model, `safe_mode` (default True) runs no code the file names: a model built
    by a --model FILE.py:FUNCTION or package.module:FUNCTION is refused (UnsafeModelFile) unless
    safe_mode=False or `model` is given. A malformed file raises ModelFileError naming why."""
    return load(path, model, safe_mode)


def predict(model, x, *, weights=None, batch_size: int = 4096) -> np.ndarray:
    """The last layer's outputs for x, (n, units): logits for a classifier (their argmax is the
    class), predicted values for regression. `model` is a model file's path, a SavedModel,
    or a model with its flat `weights`."""
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model = load(str(model))
    if isinstance(model, SavedModel):
        if weights is not None:
            raise ConfigError("weights: a saved model has its own; give one or the other")
        return model.predict(x, batch_size)
    if weights is None:
        raise ConfigError("weights: give the model's flat weights (or a model file's path)")
    return model.predict(np.asarray(weights, dtype=np.float32), x, batch_size=batch_size)


__all__ = ["Server", "SavedModel", "serve", "serve_model", "ingest", "train", "launch_cluster", "load_model",
           "predict", "export_checkpoints"]
