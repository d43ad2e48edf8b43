"""The training loop of one worker: pull, compute a gradient, push; the chief also evaluates.

Between-graph replication as in TensorFlow's parameter-server training: every worker
runs this loop on its own slice of the data; the shards' consistency mode decides how
the pushes combine and how long each pull waits. The loop does not branch on the mode.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import numpy as np

from pserver.client import PSClient
from pserver.config import WorkerConfig
from pserver.data import Dataset, Stream, as_task, describe, load_dataset
from pserver.device import describe as describe_device
from pserver.device import parse_device, select
from pserver.errors import ConfigError, DataError, DeadlineExceeded, FailedPrecondition, PServerError
from pserver.metrics import (EvalCurve, Progress, StepTimer, combine_counters, format_summary,
                             write_json)
from pserver.models import make_model
from pserver.security import client_security
from pserver.signals import Stopped
from pserver.stragglers import Delay


def build(cfg: WorkerConfig):
    """Device, dataset and model for this worker (the chief and the others build the same).

    A user's model (--model FILE.py:FUNCTION) is built for the dataset's sample shape and
    number of classes; then the data is checked against the model, before any training.
    """
    device = select(parse_device(cfg.device))   # before the model: it binds to this device
    ds = load_data(cfg)
    model = make_model(cfg.model, ds.sample_shape, ds.num_classes, hidden=cfg.hidden,
                       backend=device.backend)
    return device, fit_data(model, ds), model


def load_data(cfg: WorkerConfig) -> Dataset:
    task = "regression" if cfg.model == "linreg" else "classification"
    return load_dataset(cfg.dataset, data_dir=cfg.data_dir, seed=cfg.seed, task=task,
                        samples=cfg.samples, test_samples=cfg.test_samples, features=cfg.features,
                        classes=cfg.classes, scale_uint8=cfg.scale_uint8)


def check_data(cfg: WorkerConfig) -> None:
    """What every worker would find wrong with the data (a dataset name, a directory, a
    file, a batch larger than a worker's slice), found once, before anything starts: as a
    ConfigError, which `pserver launch` exits 2 with."""
    try:   # quietly: the workers say what they do with the data
        load_data(dataclasses.replace(cfg, scale_uint8="none")).steps(cfg.num_workers, cfg.batch_size)
    except DataError as e:
        raise ConfigError(str(e)) from None


def fit_data(model, ds: Dataset | Stream) -> Dataset | Stream:
    """The dataset as the model takes it: float targets for a regression loss, samples
    reshaped to the model's input, everything checked (DataError naming layer and shapes).
    A model without `check_data` (a user's protocol object) gets the data as it is; a
    Stream's batches are checked by the model as they come, its test set here."""
    check = getattr(model, "check_data", None)
    if isinstance(ds, Stream):
        if check is None or ds.x_test is None:
            return ds
        x_test = check(ds.x_test, ds.y_test, f"{ds.name} test set")
        return Stream(ds.name, ds.source, x_test, ds.y_test, ds.num_classes)
    if getattr(model, "task", None) == "regression":
        ds = as_task(ds, "regression")
    if check is None:
        return ds
    x_train = check(ds.x_train, ds.y_train, f"{ds.name} training set")
    x_test = check(ds.x_test, ds.y_test, f"{ds.name} test set")
    return Dataset(ds.name, x_train, ds.y_train, x_test, ds.y_test, ds.num_classes)


def gradient_fn(model, seed: int, rank: int):
    """model.loss_and_grad as f(w, x, y, g, step). A model that draws random numbers
    (Dropout) takes a `seed`: one per (run seed, rank, step), so a run repeats exactly and no
    two workers or steps share a mask."""
    if "seed" not in inspect.signature(model.loss_and_grad).parameters:
        return lambda w, x, y, g, step: model.loss_and_grad(w, x, y, g)

    def step_with_seed(w, x, y, g, step):
        s = int(np.random.SeedSequence((seed, rank, step)).generate_state(1, np.uint64)[0])
        return model.loss_and_grad(w, x, y, g, seed=s)
    return step_with_seed


def model_name(model) -> str:
    return getattr(model, "name", type(model).__name__)


def evaluate(model, w, ds, cfg: WorkerConfig) -> dict:
    """The model's metrics on the test set ({} when there is none: a Stream without one)."""
    if ds.x_test is None:
        return {}
    return model.evaluate(w, ds.x_test, ds.y_test, batch_size=cfg.eval_batch)


def run_worker(cfg: WorkerConfig) -> dict | None:
    """Train until the epochs (or --max-steps) are done; the chief returns the summary."""
    device, ds, model = build(cfg)
    return run(cfg, device, ds, model)


def run(cfg: WorkerConfig, device, ds: Dataset, model) -> dict | None:
    """The training loop with a model and data already built (the CLI and pserver.train)."""
    client = PSClient(cfg.ps, cfg.rank, cfg.num_workers, cfg.chunk_bytes, cfg.rpc_deadline, cfg.data_plane,
                      security=client_security(cfg.auth_token, cfg.tls_ca))
    try:
        client.connect(cfg.connect_timeout)
        infos = client.register(model.layout, cfg.batch_size)
        mode = infos[0].mode
        print(f"worker rank {cfg.rank}/{cfg.num_workers} device {describe_device(device)}; "
              f"model {model_name(model)} {model.layout.total:,} params; {describe(ds)}; mode {mode}, "
              f"{len(cfg.ps)} shard(s) ({client.plane_description()}), optimizer {infos[0].optimizer} "
              f"lr {infos[0].lr:g}", flush=True)
        w = np.empty(model.layout.total, dtype=np.float32)
        start = None
        if cfg.rank == 0:
            start = client.status()            # before Init: no push can come before it
            check_fresh(client, infos, cfg.require_fresh)
            client.init(model.init_params(cfg.seed))
        client.pull(w)                         # waits until the chief's values are there
        warm_up(model, w, ds, cfg.batch_size)
        started = time.monotonic()
        history = train(cfg, ds, model, client, w)
        client.leave()
        if cfg.rank != 0:
            say_if_chief_gone(client)
            return None
        return finish(cfg, ds, model, client, w, mode, history, started, start)
    except (Stopped, KeyboardInterrupt):
        client.leave_on_stop()                 # the others' steps stop waiting for us now
        raise
    finally:
        client.close()


def check_fresh(client: PSClient, infos, require_fresh: bool) -> None:
    """The chief joining shards that already hold values (restored from a checkpoint, or
    trained by an earlier run) continues from them: its Init is ignored. Say so in one
    line, or refuse with --require-fresh."""
    held = [(s, i) for s, i in zip(client.shards, infos) if i.initialized]
    if not held:
        return
    shard, info = held[0]
    what = (f"{shard.label}{f' and {len(held) - 1} more' if len(held) > 1 else ''} already "
            f"hold{'s' if len(held) == 1 else ''} trained state (version {info.version}"
            f"{f', restored from {info.restored_from}' if info.restored_from else ''})")
    if require_fresh:
        raise ConfigError(f"--require-fresh: {what}; start fresh shards, or drop --require-fresh "
                          "to continue from it")
    print(f"{what}: this run continues from it, not from new initial weights "
          "(--require-fresh refuses instead)", flush=True)


def say_if_chief_gone(client: PSClient) -> None:
    """A worker's last line says so when the chief is gone: no final evaluation or summary
    will come from it (a restarted chief rejoins and writes them)."""
    try:
        statuses = client.status()
    except PServerError:
        return
    if any(0 in st.dead_workers for st in statuses):
        print("the chief (rank 0) is gone: the shards marked it dead, so no final evaluation or "
              "summary will be written unless it is restarted", flush=True)


def warm_up(model, w: np.ndarray, ds, batch_size: int) -> None:
    """One forward+backward, result discarded: loading the compiled kernels and sizing the
    activation buffers happen here, not inside the first timed step. (A Stream's batches are
    the user's to read once, so its first step does this instead.)"""
    if isinstance(ds, Stream):
        return
    n = min(batch_size, ds.num_train)
    model.loss_and_grad(w, ds.x_train[:n], ds.y_train[:n], np.empty_like(w))


def train(cfg: WorkerConfig, ds, model, client: PSClient, w: np.ndarray) -> dict:
    steps = ds.steps(cfg.num_workers, cfg.batch_size)
    g = np.empty_like(w)
    gradient = gradient_fn(model, cfg.seed, cfg.rank)
    delay = Delay(cfg.delay, cfg.seed, cfg.rank)
    progress = Progress(cfg.rank, cfg.epochs, steps, cfg.batch_size, cfg.log_every, cfg.num_workers)
    timer, curve = StepTimer(), EvalCurve(cfg.eval_every if cfg.rank == 0 else 0.0)
    clock, epochs_log, outcomes = 0, [], {}
    for epoch in range(cfg.epochs):
        for step, (x, y) in enumerate(ds.epoch(cfg.rank, cfg.num_workers, cfg.batch_size,
                                               cfg.seed, epoch)):
            with timer("compute"):
                loss = gradient(w, x, y, g, clock)
            with timer("delay"):
                delay.sleep()
            with timer("push"):
                for outcome in push(client, g, len(x), clock):
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
            clock += 1
            with timer("pull"):
                client.pull(w, clock)
            progress.step(epoch, step, loss, force=step == steps - 1 or client.finished)
            curve.maybe(lambda: evaluate(model, w, ds, cfg), progress.elapsed, client, clock)
            if client.finished or (cfg.max_steps and clock >= cfg.max_steps):
                break
        if cfg.rank == 0:
            epochs_log.append(log_epoch(cfg, ds, model, w, epoch, progress.elapsed))
            ask_checkpoint(client)
        if client.finished:
            print(f"the shards ended the run at step {max(client.versions)} "
                  f"(too few unfinished workers left for a step); stopping", flush=True)
            break
        if cfg.max_steps and clock >= cfg.max_steps:
            break
    stats = timer.summary(progress.elapsed, rank=cfg.rank, steps=clock, samples=clock * cfg.batch_size,
                          outcomes=outcomes)
    if cfg.stats_json:
        write_json(cfg.stats_json, stats)
    return {"epochs": epochs_log, "outcomes": outcomes, "clock": clock, "curve": curve.points,
            "stats": stats, "seconds": progress.elapsed}


def push(client: PSClient, g: np.ndarray, batch: int, clock: int) -> list[str]:
    """Push; a rejection for a stale step (sync after a timeout) is survivable: the
    next pull brings the current version and training goes on."""
    try:
        return [o for o, _ in client.push(g, batch, clock)]
    except FailedPrecondition as e:
        if "step" not in str(e):
            raise
        return ["rejected"]


def ask_checkpoint(client: PSClient) -> None:
    """The chief asks every shard to checkpoint (a no-op on shards without a directory). A
    shard that cannot write one (disk full, read-only directory) says why, and training
    goes on: a lost checkpoint is no reason to lose the run."""
    def ask(shard):
        try:
            return shard.checkpoint(client.rank, client.rpc_deadline)
        except FailedPrecondition as e:
            return e

    for j, answer in enumerate(client.each(ask)):
        if isinstance(answer, FailedPrecondition):
            print(f"{answer}; training goes on", flush=True)
        elif answer[0]:
            print(f"checkpoint: shard {j} at version {answer[1]} -> {answer[0]}", flush=True)


def log_epoch(cfg, ds, model, w, epoch, elapsed) -> dict:
    ev = evaluate(model, w, ds, cfg)
    print(f"epoch {epoch + 1}/{cfg.epochs} done in {elapsed:.1f} s: {format_metrics(ev)}", flush=True)
    return {"epoch": epoch + 1, "seconds": round(elapsed, 3), **ev}


def format_metrics(ev: dict) -> str:
    if not ev:
        return "no test set"
    shown = [f"test {k} {ev[k]:.4f}" for k in ("accuracy", "auc", "r2") if k in ev]
    return ", ".join(shown + [f"test loss {ev['loss']:.4f}"])


def wait_for_others(client: PSClient, timeout: float) -> None:
    """The chief's final evaluation should see every worker's last update."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(s.live_workers for s in client.status()):
            return
        time.sleep(0.05)
    raise DeadlineExceeded(f"deadline: other workers were still training {timeout:g} s after the chief finished")


def finish(cfg, ds, model, client, w, mode, history, started, start) -> dict:
    wait_for_others(client, cfg.rpc_deadline)
    wall = time.monotonic() - started            # until the last worker finished
    ask_checkpoint(client)
    client.pull(w, seen=[-1] * len(client.shards))      # the final weights
    ev = evaluate(model, w, ds, cfg)
    statuses = client.status()
    counters = combine_counters(statuses, since=start)     # this run's, not the shards' lifetime
    summary = {
        "mode": mode, "num_shards": len(cfg.ps), "num_workers": cfg.num_workers,
        "dataset": ds.name, "model": model_name(model), "num_params": model.layout.total,
        "optimizer": statuses[0].optimizer, "lr": statuses[0].lr, "batch_size": cfg.batch_size,
        "epochs": cfg.epochs, "seed": cfg.seed,
        "test_accuracy": ev.get("accuracy"), "test_loss": ev.get("loss"), "test_r2": ev.get("r2"),
        "test_auc": ev.get("auc"),
        "wall_seconds": round(wall, 3),
        "train_samples_per_second": counters["samples_trained"] / wall if wall > 0 else 0.0,
        "per_epoch": history["epochs"], "eval_curve": history["curve"], "chief": history["stats"],
        **counters,
    }
    print(format_summary(summary), flush=True)
    if cfg.summary_json:
        write_json(cfg.summary_json, summary)
    return summary
