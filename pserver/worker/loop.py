"""The training loop of one worker: pull, compute a gradient, push; the chief also evaluates.

Between-graph replication as in TensorFlow's parameter-server training: every worker
runs this loop on its own slice of the data; the shards' consistency mode decides how
the pushes combine and how long each pull waits. The loop does not branch on the mode.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import os
import sys
import time

import numpy as np

from pserver.build import build
from pserver.config import AUTO_RANK, WorkerConfig
from pserver.data import Dataset, describe
from pserver.errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    LeaseGone,
    PServerError,
    StaleStep,
    Unavailable,
)
from pserver.kernels.cache import CompileWatch
from pserver.kernels.device import blas_note
from pserver.kernels.device import describe as describe_device
from pserver.models.layout import Layout
from pserver.observe.metrics import (
    EvalCurve,
    StepTimer,
    combine_counters,
    format_summary,
    sparse_summary,
    write_json,
)
from pserver.observe.progress import Progress, style_for
from pserver.observe.telemetry import TrainingReport
from pserver.persist import model_file
from pserver.signals import Stopped
from pserver.sparse import TableLookup
from pserver.wire.security import client_security
from pserver.worker.client import PSClient
from pserver.worker.stragglers import Delay


def gradient_fn(model, seed: int, rank: int):
    """model.loss_and_grad as f(w, x, y, g, step, lookups). A model that draws random numbers
    (Dropout) takes a `seed`: one per (run seed, rank, step), so a run repeats exactly and no
    two workers or steps share a mask. A model with sparse tables takes the batch's rows
    (`sparse`, a list of pserver.sparse.TableLookup) and writes their gradients into them."""
    takes = inspect.signature(model.loss_and_grad).parameters

    def step(w, x, y, g, clock, lookups):
        extra = {}
        if "seed" in takes:
            extra["seed"] = int(np.random.SeedSequence((seed, rank, clock)).generate_state(1, np.uint64)[0])
        if lookups:
            extra["sparse"] = lookups
        return model.loss_and_grad(w, x, y, g, **extra)
    return step


def describe_params(model) -> str:
    tables = ", ".join(f"{t.name} (ids x {t.dim}, {t.optimizer})" for t in sparse_tables(model))
    return f"{model.layout.total:,} params" + (f" + sparse tables {tables}" if tables else "")


def sparse_tables(model) -> list:
    """The model's sparse tables (pserver.sparse.TableConfig); [] for a dense model."""
    return list(getattr(model, "sparse_tables", None) or [])


def registered_layout(model) -> Layout:
    """What the shards are told: the dense tensors and the sparse tables."""
    return Layout(model.layout.tensors, tuple(sparse_tables(model)))


class Rows:
    """A worker's view of the model's sparse tables: the batch's unique ids per table, and
    their rows pulled from the shards that hold them."""

    def __init__(self, model, client: PSClient) -> None:
        self.tables = sparse_tables(model)
        self.names = [t.name for t in self.tables]
        self.model, self.client = model, client

    def __bool__(self) -> bool:
        return bool(self.tables)

    def lookup(self, ids_per_table) -> list[TableLookup]:
        lookups, seen = [], {}       # tables fed the same ids (the CTR models' two) dedupe them once
        for ids, t in zip(ids_per_table, self.tables):
            first = seen.get(id(ids))
            lookups.append(TableLookup.like(first, t.dim) if first else TableLookup.of(ids, t.dim))
            seen.setdefault(id(ids), lookups[-1])
        self.client.pull_rows(lookups, self.names)
        return lookups

    def for_batch(self, x) -> list[TableLookup]:
        return self.lookup(self.model.batch_ids(x)) if self.tables else []


def model_name(model) -> str:
    return getattr(model, "name", type(model).__name__)


def evaluate(model, w, ds, cfg: WorkerConfig, rows: Rows | None = None, threads: int = 1) -> dict:
    """The model's metrics on the test set ({} when there is none: a Stream without one).
    A model with sparse tables reads its rows from the shards through `rows`. `threads`: for a
    model whose evaluate takes them (pserver's Sequential), see eval_threads."""
    if ds.x_test is None:
        return {}
    if rows:
        return model.evaluate(w, ds.x_test, ds.y_test, batch_size=cfg.eval_batch, rows=rows.lookup)
    if threads > 1 and "threads" in inspect.signature(model.evaluate).parameters:
        return model.evaluate(w, ds.x_test, ds.y_test, batch_size=cfg.eval_batch, threads=threads)
    return model.evaluate(w, ds.x_test, ds.y_test, batch_size=cfg.eval_batch)


def eval_threads(client: PSClient, others_wait: bool) -> int:
    """Threads for the chief's evaluation: every core this process may run on when no other
    worker is training meanwhile (`others_wait`: the run's end; an epoch's end in sync mode,
    where every other worker's next step waits for the chief's push), else 1. keras.io
    mnist_convnet's 6,000 validation images, 2 cores: 0.43 s on one thread, 0.22 s on two."""
    if not (others_wait or client.shards[0].info.mode == "sync"):
        return 1
    affinity = getattr(os, "sched_getaffinity", None)           # Linux: the cores we may run on
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_EVAL_THREADS))


MAX_EVAL_THREADS = 16


def run_worker(cfg: WorkerConfig) -> dict | None:
    """Train until the epochs (or --max-steps) are done; the chief returns the summary."""
    device, ds, model = build(cfg)
    return run(cfg, device, ds, model, model_file.definition(cfg, model, ds))


def run(cfg: WorkerConfig, device, ds: Dataset, model, definition: dict | None = None,
        callbacks=None) -> dict | None:
    """The training loop with a model and data already built (the CLI and pserver.train).
    `definition` is how the model was built (for --save; None: a model built in Python).
    `callbacks`: an object with Keras's callback methods (pserver.keras.callbacks.CallbackList)
    that the loop calls at the epochs' and steps' ends; its `stop_training` ends the run
    after the epoch."""
    report = TrainingReport(cfg)            # a busy --metrics-port fails here, before any call
    client = PSClient(cfg.ps, cfg.rank, cfg.num_workers, cfg.chunk_bytes, cfg.rpc_deadline, cfg.data_plane,
                      security=client_security(cfg.auth_token, cfg.tls_ca), compression=cfg.compress,
                      pull_compression=cfg.pull_compress, session_dir=cfg.session_dir)
    compiling = CompileWatch().start()        # the first pulls and the warm-up call every kernel
    try:
        client.connect(cfg.connect_timeout)
        steps = ds.steps(cfg.num_workers, cfg.batch_size)
        infos = client.register(registered_layout(model), cfg.batch_size, (cfg.seed, steps))
        if cfg.rank == AUTO_RANK:
            cfg = joined_as(cfg, client.rank)
        check_settings(client, getattr(callbacks, "shard_settings", None), infos[0].settings)
        mode = infos[0].mode
        print(f"worker rank {cfg.rank}/{cfg.num_workers} device {describe_device(device)}; "
              f"model {model_name(model)} {describe_params(model)}; {describe(ds)}; mode {mode}, "
              f"{len(cfg.ps)} shard(s) ({client.plane_description()}), optimizer {infos[0].optimizer} "
              f"lr {infos[0].lr:g}", flush=True)
        note = blas_note(device)
        if note and cfg.rank == 0:
            print(note, flush=True)
        w = np.empty(model.layout.total, dtype=np.float32)
        start = None
        if cfg.rank == 0:
            start = client.status()            # before Init: no push can come before it
            check_fresh(client, infos, cfg.require_fresh)
            client.init(model.init_params(cfg.seed))
        client.pull(w)                         # waits until the chief's values are there
        rows = Rows(model, client)
        warm_up(model, w, ds, cfg.batch_size, rows)
        member_from = client.elastic_join(infos)
        if member_from:                        # until its step opens, a joining worker only pulls
            print(f"worker {cfg.rank} joins: a member from step {member_from} on every shard", flush=True)
            client.pull(w, seen=[member_from - 1] * len(cfg.ps))
        if compiling.stop().compiled and cfg.rank == 0:     # a first run: why it took a while
            print(compiling.describe(), flush=True)
        started = time.monotonic()
        if leased(cfg, ds):
            history = train_leased(cfg, ds, model, client, w, rows, report, mode, callbacks)
        else:
            history = train(cfg, ds, model, client, w, rows, report, resume_clock(cfg, infos, steps),
                            callbacks or NoCallbacks())
        client.leave()
        if cfg.rank != 0:
            say_if_chief_gone(client)
            callbacks and callbacks.on_weights(w)
            return None
        summary = finish(cfg, ds, model, client, w, mode, history, started, start, rows, held_out(callbacks))
        callbacks and callbacks.on_weights(w)         # the final weights (a Keras model keeps them)
        if cfg.save:
            save_model(cfg, client, model, w, definition, summary)
            print(f"saved the model ({model_name(model)}, {model.layout.total:,} parameters) to "
                  f"{cfg.save}", flush=True)
        if cfg.stop_shards:
            client.stop_shards()
            print(f"stopped the {len(cfg.ps)} shard(s): the run is over", flush=True)
        return summary
    except (Stopped, KeyboardInterrupt):
        client.leave_on_stop()                 # the others' steps stop waiting for us now
        raise
    finally:
        report.close()
        client.close()


def joined_as(cfg: WorkerConfig, rank: int) -> WorkerConfig:
    """cfg with the rank shard 0 assigned (--rank auto). A joiner's rank may be at or above its
    --num-workers, the slice count of its data: it trains slice rank % --num-workers."""
    cfg = copy.copy(cfg)
    object.__setattr__(cfg, "rank", rank)     # frozen; the rank was checked by shard 0
    return cfg
def save_model(cfg: WorkerConfig, client: PSClient, model, w: np.ndarray, definition: dict | None,
               summary: dict) -> None:
    """--save: the model file; a model with sparse tables gets every table's rows, streamed
    from the shards (ExportRows) and merged into sorted files as they come. After a sync or
    backup run they are the rows of the final version, as the dense weights are; in async or
    ssp, each shard's rows when its stream began (workers still pushing may move them)."""
    tables, origin = None, None
    if sparse_tables(model):
        tables, versions = {}, None
        for t in sparse_tables(model):
            versions, count, pages = client.export_table(t.name, max(cfg.rpc_deadline, 3600.0))
            tables[t.name] = model_file.TableRows(count, pages)
        origin = {"live": True, "num_shards": len(cfg.ps), "versions": versions,
                  "version": max(versions), "job": registered_layout(model).signature()}
    model_file.save(cfg.save, model, w, definition, summary, tables=tables, origin=origin)


def check_settings(client: PSClient, expected: dict | None, settings: dict | None) -> None:
    """The shards' training settings (Register's answer) against those a script compiled
    (a Keras model's optimizer): ConfigError naming the first difference, the rank freed."""
    for name, want in (expected or {}).items():
        have = (settings or {}).get(name)
        if have != want and not (isinstance(want, float) and isinstance(have, float)
                                 and abs(have - want) <= 1e-12 * max(abs(want), 1.0)):
            client.leave_on_stop()
            raise ConfigError(f"the model was compiled with {name}={want!r}, the shards at "
                              f"{client.shards[0].label} run {name}={have!r}; compile the same "
                              f"optimizer or start the shards with --{name.replace('_', '-')} {want}")


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


def resume_clock(cfg: WorkerConfig, infos, steps: int) -> int:
    """The step this rank goes on from: where every shard recorded it (the smallest, since each
    checkpointed at its own time), when it followed this data order; else 0. Says which, in one line."""
    found = [i.position for i in infos]
    if all(p is None or p.clock == 0 for p in found):
        return 0
    if cfg.no_resume:
        print(f"--no-resume: starting at epoch 1 (the shards recorded rank {cfg.rank} at step "
              f"{max(p.clock for p in found if p)})", flush=True)
        return 0
    other = next((p for p in found if p and (p.data_seed, p.steps_per_epoch) != (cfg.seed, steps)), None)
    if other is not None or not steps:
        why = ("its data has no known epoch length" if not steps else
               f"they were counted in another data order (seed {other.data_seed}, "
               f"{other.steps_per_epoch} steps per epoch; now seed {cfg.seed}, {steps})")
        print(f"the shards recorded rank {cfg.rank}'s position, but {why}: starting at epoch 1", flush=True)
        return 0
    clock = min(p.clock if p else 0 for p in found)
    at = found[0]._replace(clock=clock)
    left = ("nothing is left to train" if at.epoch >= cfg.epochs or (cfg.max_steps and clock >= cfg.max_steps)
            else f"{steps * cfg.epochs - clock} step(s) to go")
    print(f"resuming rank {cfg.rank} at epoch {at.epoch + 1}/{cfg.epochs}, step {at.step + 1}/{steps} "
          f"(step {clock} of the run, as the shards recorded it; --no-resume starts over): {left}",
          flush=True)
    return clock


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


def warm_up(model, w: np.ndarray, ds, batch_size: int, rows: Rows) -> None:
    """One forward+backward, result discarded: loading the compiled kernels and sizing the
    activation buffers happen here, not inside the first timed step. (A Stream's batches are
    the user's to read once, so its first step does this instead; streamed Criteo data warms
    up on its test set.)"""
    batch = ds.warm_up_batch(batch_size)
    if batch is None:
        return
    x, y = batch
    if rows:
        model.loss_and_grad(w, x, y, np.empty_like(w), sparse=rows.for_batch(x))
    else:
        model.loss_and_grad(w, x, y, np.empty_like(w))


class NoCallbacks:
    """What the loop calls when no one listens (the CLI's workers)."""
    stop_training = False

    def on_train_begin(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_train_batch_end(self, batch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_weights(self, w): pass


def train(cfg: WorkerConfig, ds, model, client: PSClient, w: np.ndarray, rows: Rows,
          report: TrainingReport, start: int = 0, callbacks=None) -> dict:
    """The epochs, from step `start` of the run on (a resumed worker's; 0 otherwise).
    `callbacks` hear of each step and epoch (the chief's epoch logs hold the test metrics)."""
    callbacks = callbacks or NoCallbacks()
    steps = ds.steps(cfg.num_workers, cfg.batch_size)
    g = np.empty_like(w)
    gradient = gradient_fn(model, cfg.seed, cfg.rank)
    delay = Delay(cfg.delay, cfg.seed, cfg.rank)
    style = style_for(cfg.progress, cfg.rank, sys.stderr.isatty())
    progress = Progress(cfg.epochs, steps, cfg.log_every, style, start)
    timer, curve = StepTimer(), EvalCurve(cfg.eval_every if cfg.rank == 0 else 0.0)
    clock, epochs_log, outcomes, samples = start, [], {}, 0
    first_epoch, skip = divmod(start, steps) if steps else (0, 0)
    if cfg.max_steps and start >= cfg.max_steps:
        first_epoch = cfg.epochs               # resumed past --max-steps: nothing left
    callbacks.on_train_begin({})
    for epoch in range(first_epoch, cfg.epochs):
        callbacks.on_epoch_begin(epoch, {})
        offset, skip = skip, 0                 # a resumed epoch starts at its step
        epoch_started = time.monotonic()
        batches = itertools.islice(ds.epoch(cfg.rank % cfg.num_workers, cfg.num_workers, cfg.batch_size,
                                            cfg.seed, epoch), offset, None)
        for step, (x, y) in enumerate(batches, start=offset):
            step_started = time.perf_counter()
            loss, exchange_started = one_step(client, gradient, delay, timer, rows, w, g, x, y, clock,
                                              outcomes)
            clock += 1
            samples += len(x)                  # the epoch's last batch may be smaller
            done = time.perf_counter()
            report.step(done - step_started, done - exchange_started, len(x))
            last = step == steps - 1 or client.finished or (cfg.max_steps and clock >= cfg.max_steps)
            callbacks.on_train_batch_end(step, {"loss": loss, "size": len(x)})
            line = progress.step(epoch, step, loss, len(x), force=bool(last))
            if line:
                report.progress(clock, *line)
            curve.maybe(lambda: evaluate(model, w, ds, cfg, rows, eval_threads(client, others_wait=False)),
                        progress.elapsed, client, clock)
            if client.finished or (cfg.max_steps and clock >= cfg.max_steps):
                break
        if cfg.rank == 0:
            epochs_log.append(chief_epoch_end(cfg, ds, model, w, epoch, epoch_started, rows, progress,
                                              report, client, clock, held_out(callbacks)))
        callbacks.on_epoch_end(epoch, dict(epochs_log[-1]) if cfg.rank == 0 else {})
        if callbacks.stop_training:
            break
        if client.finished:
            progress.say(f"the shards ended the run at step {max(client.versions)} "
                         f"(too few unfinished workers left for a step); stopping")
            break
        if cfg.max_steps and clock >= cfg.max_steps:
            break
    progress.close()
    callbacks.on_train_end({})
    stats = timer.summary(progress.elapsed, rank=cfg.rank, steps=clock - start,
                          samples=samples, outcomes=outcomes)
    if cfg.stats_json:
        write_json(cfg.stats_json, stats)
    return {"epochs": epochs_log, "outcomes": outcomes, "clock": clock, "curve": curve.points,
            "stats": stats, "seconds": progress.elapsed, "resumed_at_step": start}


def leased(cfg: WorkerConfig, ds) -> bool:
    """Whether this worker takes its data on lease (--data-assignment leases and data that can be
    cut into chunks); a user's generator keeps its rank's own batches, and the worker says so."""
    if cfg.data_assignment != "leases":
        return False
    if getattr(ds, "leased_batches", None) is None:
        print(f"worker {cfg.rank}: --data-assignment leases: {ds.name} cannot be cut into chunks (batches "
              f"read in order); each rank reads its own batches (slices)", flush=True)
        return False
    return True


def train_leased(cfg: WorkerConfig, ds, model, client: PSClient, w: np.ndarray, rows: Rows,
                 report: TrainingReport, mode: str, callbacks=None) -> dict:
    """The epochs on chunks leased from shard 0's coordinator (pserver/server/coordinator.py): the
    worker asks for a chunk, trains its batches in order (each push to shard 0 says which batch it
    carries: the ones before it are done), reports it finished with the next ask, and goes on
    until the coordinator opens epoch --epochs. With no chunk left in the epoch it pushes an
    empty contribution in sync and backup (0 samples: it counts toward the step, weighs nothing)
    and waits a moment in the other modes. Epochs end when every chunk is done, on every worker.
    `callbacks` hear of each batch and epoch as in train (an epoch ends when the worker learns it)."""
    callbacks = callbacks or NoCallbacks()
    data = ds.leased_batches(cfg.batch_size, cfg.seed, cfg.chunk_batches, shuffle=not cfg.no_shuffle)
    plan = (data.num_batches, cfg.chunk_batches, cfg.seed, data.fingerprint, cfg.epochs, cfg.no_shuffle)
    steps = max(1, -(-data.num_batches // cfg.num_workers))   # a progress bar's epoch: about this
    g = np.empty_like(w)
    gradient = gradient_fn(model, cfg.seed, cfg.rank)
    delay = Delay(cfg.delay, cfg.seed, cfg.rank)
    style = style_for(cfg.progress, cfg.rank, sys.stderr.isatty())
    progress = Progress(cfg.epochs, steps, cfg.log_every, style)
    timer, curve = StepTimer(), EvalCurve(cfg.eval_every if cfg.rank == 0 else 0.0)
    clock, epochs_log, outcomes, samples = 0, [], {}, 0
    lease, at, finished, first_ask = None, 0, None, True
    # What this worker did under shard 0's coordinator (epoch, chunk, end): reported when a reply
    # shows a new one (shard 0 restored), which counts what falls after its checkpoint.
    done_log, coordinator = [], ""
    epoch, step, epoch_started = 0, 0, time.monotonic()
    empty_counts = mode in ("sync", "backup")
    # Keras on a cluster: every worker's callbacks take the chief's epoch logs and stop decision
    shares = getattr(callbacks, "shares_logs", False) and cfg.num_workers > 1

    def push_empty() -> None:          # no batch to train: 0 samples, counts toward the step
        nonlocal clock
        g.fill(0.0)
        with timer("push_pull"):
            for outcome in push_pull(client, g, w, 0, clock):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
        clock += 1

    callbacks.on_train_begin({})
    while not client.finished and not (cfg.max_steps and clock >= cfg.max_steps):
        if lease is None:
            reply = client.lease_data(*plan, finished=finished, restart=first_ask and cfg.no_resume)
            finished = None
            if reply.coordinator_id != coordinator:
                if coordinator and done_log:            # shard 0 restored: report, then go on as told
                    reply = client.lease_data(*plan, done_before_restore=done_log)
                    progress.say(f"worker {cfg.rank}: shard 0's data coordinator restored from a checkpoint; "
                                 f"told it the {len(done_log)} chunk(s) this worker trained before (what "
                                 f"falls after the checkpoint counts as trained twice)")
                done_log, coordinator = [], reply.coordinator_id
            if first_ask:                               # a job that goes on: its epoch, not an epoch's end
                first_ask, epoch = False, reply.epoch
                say_where_leases_begin(cfg, reply.epoch, progress.say)
                if epoch < cfg.epochs:
                    callbacks.on_epoch_begin(epoch, {})
            if reply.epoch > epoch:                     # every chunk of the epoch is done
                line = progress.epoch_ended(epoch)
                if line:
                    report.progress(clock, *line)
                if cfg.rank == 0:
                    epochs_log.append(chief_epoch_end(cfg, ds, model, w, epoch, epoch_started, rows,
                                                      progress, report, client, clock, held_out(callbacks)))
                logs = dict(epochs_log[-1]) if cfg.rank == 0 else {}
                if reply.epoch == epoch + 1 and reply.trained_samples > 0:    # every worker's batches
                    logs["trained"] = {"loss_sum": reply.trained_loss_sum, "correct": reply.trained_correct,
                                       "samples": reply.trained_samples}
                if shares and cfg.rank != 0:
                    logs = chief_logs(client, cfg.rank, epoch, push_empty if empty_counts else None)
                callbacks.on_epoch_end(epoch, logs)
                if shares and cfg.rank == 0:
                    client.epoch_logs(epoch, share=(callbacks.epoch_logs, callbacks.stop_training))
                if callbacks.stop_training:
                    break
                epoch, step, epoch_started = reply.epoch, 0, time.monotonic()
                if epoch < cfg.epochs:
                    callbacks.on_epoch_begin(epoch, {})
            elif reply.epoch < epoch:                   # shard 0 restored from an earlier epoch's checkpoint
                epoch, step = reply.epoch, 0
            if epoch >= cfg.epochs:
                break
            if reply.has_lease:
                lease, at = reply, reply.first_batch
        step_started = time.perf_counter()
        if lease is None:
            if not empty_counts:
                time.sleep(0.05)                        # async: nothing to wait for; ask again
                continue
            push_empty()
            continue
        x, y = data.batch(lease.epoch, at)
        if len(x) == 0:                                 # a file's byte range where no training line starts
            at += 1
            if at == lease.end_batch:
                done_log.append((lease.epoch, lease.chunk, at))
                finished, lease = (lease.epoch, lease.chunk), None
            continue
        rejected = outcomes.get("rejected", 0)
        try:
            loss, exchange_started = one_step(client, gradient, delay, timer, rows, w, g, x, y, clock,
                                              outcomes, lease=(lease.epoch, lease.chunk, at), model=model)
        except LeaseGone as e:                          # marked dead meanwhile: the chunk went elsewhere
            progress.say(f"worker {cfg.rank}: {e}")
            outcomes["lease_gone"] = outcomes.get("lease_gone", 0) + 1
            client.pull(w, clock + 1)                   # a refused push pulled nothing
            done_log.append((lease.epoch, lease.chunk, at))
            lease, finished = None, None
            continue
        clock += 1
        if outcomes.get("rejected", 0) > rejected:      # a stale step: the batch again, on the weights pulled
            continue
        at += 1
        samples += len(x)                               # a last batch may be smaller
        if at == lease.end_batch:                       # every shard took its last batch in
            done_log.append((lease.epoch, lease.chunk, at))
            finished, lease = (lease.epoch, lease.chunk), None
        done = time.perf_counter()
        report.step(done - step_started, done - exchange_started, len(x))
        line = progress.step(epoch, min(step, steps - 1), loss, len(x))
        callbacks.on_train_batch_end(step, {"loss": loss, "size": len(x)})
        step += 1
        if line:
            report.progress(clock, *line)
        curve.maybe(lambda: evaluate(model, w, ds, cfg, rows, eval_threads(client, others_wait=False)),
                    progress.elapsed, client, clock)
    progress.close()
    callbacks.on_train_end({})
    stats = timer.summary(progress.elapsed, rank=cfg.rank, steps=clock, samples=samples, outcomes=outcomes)
    if cfg.stats_json:
        write_json(cfg.stats_json, stats)
    return {"epochs": epochs_log, "outcomes": outcomes, "clock": clock, "curve": curve.points,
            "stats": stats, "seconds": progress.elapsed, "resumed_at_step": 0}


def chief_logs(client: PSClient, rank: int, epoch: int, push_empty=None, poll: float = 0.02) -> dict:
    """A worker other than the chief at `epoch`'s end: the chief's logs of it and its stop decision,
    once it gave them (its evaluation done, its callbacks run), as {"shared": logs, "stop_training":
    bool}. Meanwhile, in sync and backup (`push_empty`), a chief not yet told the epoch ended may be
    waiting in a step for this worker's contribution: push an empty one, so that it learns."""
    untold = 0
    while True:
        reply = client.epoch_logs(epoch)
        if reply.has_logs:
            return {"shared": dict(zip(reply.log_names, reply.log_values)),
                    "stop_training": reply.stop_training}
        if not reply.chief_live:
            raise Unavailable(f"worker {rank}: the chief (rank 0) left or was marked dead before it gave "
                              f"epoch {epoch + 1}'s logs, which every worker's callbacks take")
        untold = 0 if reply.chief_told else untold + 1
        if push_empty is not None and untold >= 3:       # not told after a few polls: it waits on us
            push_empty()
            untold = 0
        else:
            time.sleep(poll)


def say_where_leases_begin(cfg: WorkerConfig, epoch: int, say) -> None:
    """One line when shard 0's coordinator is past epoch 1 at this worker's first lease: a run that
    goes on from an earlier one's data (--no-resume starts a finished one over)."""
    if epoch == 0:
        return
    if epoch >= cfg.epochs:
        say(f"shard 0's data coordinator has done all {cfg.epochs} epoch(s) of this data: nothing is left "
            f"to train (--no-resume starts over)")
    else:
        say(f"shard 0's data coordinator is at epoch {epoch + 1}/{cfg.epochs} of this data: going on from "
            f"there (--no-resume starts a finished run over)")


def one_step(client: PSClient, gradient, delay, timer, rows, w: np.ndarray, g: np.ndarray, x, y, clock: int,
             outcomes: dict, lease=None, model=None) -> tuple[float, float]:
    """One batch: pull its rows, compute the gradient into g, straggle (--delay), push and pull,
    counting each push's outcome; its loss and when its exchange began (perf_counter). With a
    lease, the push tells shard 0 what the step measured (the batch's loss x samples, and the
    samples `model` classed right): the epoch's training loss and accuracy over every worker."""
    with timer("pull"):
        lookups = rows.for_batch(x)
    with timer("compute"):
        loss = gradient(w, x, y, g, clock, lookups)
    trained = (loss * len(x), float(getattr(model, "batch_correct", 0.0)))
    with timer("delay"):
        delay.sleep()
    exchange_started = time.perf_counter()
    with timer("push_pull"):
        for outcome in push_pull(client, g, w, len(x), clock, lookups, rows.names, lease=lease,
                                 trained=trained):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return loss, exchange_started


def chief_epoch_end(cfg: WorkerConfig, ds, model, w: np.ndarray, epoch: int, epoch_started: float, rows,
                    progress, report, client: PSClient, clock: int, label: str = "test") -> dict:
    """The chief at an epoch's end: its log (test metrics), the report's, and a checkpoint asked for."""
    logged = log_epoch(cfg, ds, model, w, epoch, (epoch_started, progress.started), rows, progress.say,
                       eval_threads(client, others_wait=False), label)
    report.evaluated(clock, logged, lambda: combine_counters(client.status())["staleness_mean"])
    ask_checkpoint(client, progress.say)
    return logged


def push_pull(client: PSClient, g: np.ndarray, w: np.ndarray, batch: int, clock: int, lookups=(),
              tables=(), lease=None, trained=(0.0, 0.0)) -> list[str]:
    """Push, then pull into w (one exchange per shard over the data plane); the outcomes.
    A rejection for a stale step (sync after a timeout; a push already held) is survivable:
    the pull brings the current version and training goes on."""
    try:
        return client.push_pull(g, w, batch, clock, lookups=lookups, tables=tables, lease=lease,
                                trained=trained)
    except StaleStep:
        client.pull(w, clock + 1)
        return ["rejected"]


def ask_checkpoint(client: PSClient, say=print) -> None:
    """The chief asks every shard to checkpoint (a no-op on shards without a directory). A
    shard that cannot write one (disk full, read-only directory) says why, and training
    goes on: a lost checkpoint is no reason to lose the run. A checkpoint written is the
    shard's to log (once per version), not ours as well."""
    def ask(shard):
        try:
            return shard.checkpoint(client.rank, client.rpc_deadline)
        except FailedPrecondition as e:
            return e

    for answer in client.each(ask):
        if isinstance(answer, FailedPrecondition):
            say(f"{answer}; training goes on")


def log_epoch(cfg, ds, model, w, epoch, started: tuple[float, float], rows, say=print,
              threads: int = 1, label: str = "test") -> dict:
    """The chief's line at an epoch's end: the epoch's own time (and the run's so far, from
    `started`: the epoch's start and the run's), its metrics on the held-out set (on `threads`),
    named `label` (held_out)."""
    ev = evaluate(model, w, ds, cfg, rows, threads)
    now = time.monotonic()
    own, total = now - started[0], now - started[1]
    say(f"epoch {epoch + 1}/{cfg.epochs} done in {own:.1f} s ({total:.1f} s in all): "
        f"{format_metrics(ev, label)}")
    return {"epoch": epoch + 1, "seconds": round(total, 3), "epoch_seconds": round(own, 3), **ev}


def held_out(callbacks) -> str:
    """What the chief's evaluation set is called in its lines and summary: "test", or what the
    callbacks say it is (a Keras fit's: "validation", the validation_split or validation_data,
    beside which the script may print its own test accuracy)."""
    return getattr(callbacks, "held_out", None) or "test"


def format_metrics(ev: dict, label: str = "test") -> str:
    if not ev:
        return f"no {label} set"
    shown = [f"{label} {k} {ev[k]:.4f}" for k in ("accuracy", "auc", "r2") if k in ev]
    return ", ".join(shown + [f"{label} loss {ev['loss']:.4f}"])


def wait_for_others(client: PSClient, timeout: float) -> None:
    """The chief's final evaluation should see every worker's last update."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(s.live_workers for s in client.status()):
            return
        time.sleep(0.05)
    raise DeadlineExceeded(f"deadline: other workers were still training {timeout:g} s "
                           "after the chief finished")


def binary_metrics(ev: dict, ds) -> dict:
    """A click-through-rate run's figures: logloss by its name, and the best AUC any model
    can reach on the test set when the data says (criteo-synthetic's planted model)."""
    if "auc" not in ev:
        return {}
    out = {"test_logloss": ev.get("loss")}
    if getattr(ds, "best_auc", None) is not None:
        out["best_auc"] = ds.best_auc
    return out


def finish(cfg, ds, model, client, w, mode, history, started, start, rows, label: str = "test") -> dict:
    wait_for_others(client, cfg.rpc_deadline)
    wall = time.monotonic() - started            # until the last worker finished
    ask_checkpoint(client)
    client.pull(w, seen=[-1] * len(client.shards))      # the final weights
    ev = evaluate(model, w, ds, cfg, rows, eval_threads(client, others_wait=True))
    statuses = client.status()
    counters = combine_counters(statuses, since=start)     # this run's, not the shards' lifetime
    summary = {
        "mode": mode, "num_shards": len(cfg.ps), "num_workers": cfg.num_workers,
        "dataset": ds.name, "model": model_name(model), "num_params": model.layout.total,
        "optimizer": statuses[0].optimizer, "lr": statuses[0].lr, "batch_size": cfg.batch_size,
        "epochs": cfg.epochs, "seed": cfg.seed, "resumed_at_step": history["resumed_at_step"],
        "test_accuracy": ev.get("accuracy"), "test_loss": ev.get("loss"), "test_r2": ev.get("r2"),
        "test_auc": ev.get("auc"), "evaluated_on": label,
        **binary_metrics(ev, ds),
        # every rank that registered with the shards: an elastic job's joiners (and those that left) too
        "workers_registered": sorted(set().union(*(st.registered_workers for st in statuses))),
        "wall_seconds": round(wall, 3),
        "train_samples_per_second": counters["samples_trained"] / wall if wall > 0 else 0.0,
        "per_epoch": history["epochs"], "eval_curve": history["curve"], "chief": history["stats"],
        **counters, **sparse_summary(statuses),
    }
    print(format_summary(summary), flush=True)
    if cfg.summary_json:
        write_json(cfg.summary_json, summary)
    return summary
