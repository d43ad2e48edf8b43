"""The training loop of one worker: pull, compute a gradient, push; the chief also evaluates.

Between-graph replication as in TensorFlow's parameter-server training: every worker
runs this loop on its own slice of the data; the shards' consistency mode decides how
the pushes combine and how long each pull waits. The loop does not branch on the mode.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time

import numpy as np

from pserver.build import build
from pserver.config import WorkerConfig
from pserver.data import Dataset, describe
from pserver.errors import (
    ConfigError,
    DeadlineExceeded,
    LeaseGone,
    PServerError,
    Unavailable,
)
from pserver.kernels.cache import CompileWatch
from pserver.kernels.device import blas_note
from pserver.kernels.device import describe as describe_device
from pserver.models import metrics
from pserver.models.layout import Layout
from pserver.observe.metrics import (
    combine_counters,
    format_summary,
    shard_restarts,
    sparse_summary,
    write_json,
)
from pserver.observe.progress import Progress, style_for
from pserver.observe.telemetry import TrainingReport
from pserver.optim.clip import gradient_clip
from pserver.persist import model_file
from pserver.signals import Stopped
from pserver.sparse import TableLookup
from pserver.wire.security import client_security
from pserver.worker.client import PSClient, ask_checkpoint
from pserver.worker.exports import ChiefExports
from pserver.worker.run import Run, push_pull
from pserver.worker.sources import Batch, EpochEnd, Leases, Slices, source_for
from pserver.worker.stragglers import Delay


def gradient_fn(model, seed: int, rank: int, clip=None):
    """model.loss_and_grad as f(w, x, y, g, step, lookups). A model that draws random numbers
    (Dropout) takes a `seed`: one per (run seed, rank, step), so a run repeats exactly and no
    two workers or steps share a mask. A model with sparse tables takes the batch's rows
    (`sparse`, a list of pserver.sparse.TableLookup) and writes their gradients into them.
    `clip` (pserver.optim.clip.gradient_clip) then clips the dense gradient in place."""
    takes = inspect.signature(model.loss_and_grad).parameters

    def step(w, x, y, g, clock, lookups):
        extra = {}
        if "seed" in takes:
            extra["seed"] = int(np.random.SeedSequence((seed, rank, clock)).generate_state(1, np.uint64)[0])
        if lookups:
            extra["sparse"] = lookups
        loss = model.loss_and_grad(w, x, y, g, **extra)
        if clip is not None:
            clip(g)
        return loss
    return step


def worker_clip(cfg: WorkerConfig, layout: Layout):
    """--clipnorm / --global-clipnorm over the trained tensors of `layout` (None: neither)."""
    offsets = layout.offsets()
    ranges = [offsets[t.name] for t in layout.tensors if not t.frozen and t.size]
    return gradient_clip(ranges, cfg.clipnorm, cfg.global_clipnorm)


def describe_params(model) -> str:
    tables = ", ".join(f"{t.name} (ids x {t.dim}, {t.optimizer})" for t in sparse_tables(model))
    return f"{model.layout.total:,} params" + (f" + sparse tables {tables}" if tables else "")


def sparse_tables(model) -> list:
    """The model's sparse tables (pserver.sparse.TableConfig); [] for a dense model."""
    return list(getattr(model, "sparse_tables", None) or [])


def registered_layout(model) -> Layout:
    """What the shards are told: the dense tensors (those frozen now marked, and the moving
    statistics, which stay frozen) and the sparse tables."""
    frozen = getattr(model, "frozen_weights", list)()
    stats = [t.name for t in model.layout.tensors if t.momentum is not None]
    return model.layout.with_tables(sparse_tables(model)).freezing([*frozen, *stats])


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


def evaluate(run: Run, threads: int = 1) -> dict:
    """The model's metrics on the test set ({} when there is none: a Stream without one).
    A model with sparse tables reads its rows from the shards through `run.rows`. `threads`: for a
    model whose evaluate takes them (pserver's Sequential), see eval_threads."""
    model, ds, batch = run.model, run.ds, run.cfg.eval_batch
    if ds.x_test is None:
        return {}
    if run.rows:
        return model.evaluate(run.w, ds.x_test, ds.y_test, batch_size=batch, rows=run.rows.lookup)
    if threads > 1 and "threads" in inspect.signature(model.evaluate).parameters:
        return model.evaluate(run.w, ds.x_test, ds.y_test, batch_size=batch, threads=threads)
    return model.evaluate(run.w, ds.x_test, ds.y_test, batch_size=batch)


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
    exports = None
    try:
        training, source, counted_from = set_up(cfg, device, ds, model, client, report,
                                                NoCallbacks() if callbacks is None else callbacks)
        if training.chief and cfg.export_every:
            exports = ChiefExports(cfg, client, training.mode, training.progress.say).start()
        started = time.monotonic()
        stats = train(training, source)
        if exports is not None:
            exports.close()                    # the last export: the run's final state
        client.leave()
        return end(training, stats, started, counted_from, definition)
    except (Stopped, KeyboardInterrupt):
        client.leave_on_stop()                 # the others' steps stop waiting for us now
        raise
    finally:
        if exports is not None:
            exports.stop()
        report.close()
        client.close()


def set_up(cfg: WorkerConfig, device, ds, model, client: PSClient, report: TrainingReport,
           callbacks) -> tuple[Run, Slices | Leases, list | None]:
    """Connect and register (where the rank is set, once: --rank auto learns the one shard 0
    assigns), let the chief initialize, pull, warm up and join: the Run, its batch source, and
    the chief's statuses of the shards before it (its summary counts this run's part of them)."""
    compiling = CompileWatch().start()        # the first pulls and the warm-up call every kernel
    client.connect(cfg.connect_timeout)
    data_order = (cfg.seed, ds.steps(cfg.num_workers, cfg.batch_size))
    layout = registered_layout(model)
    infos = client.register(layout, cfg.batch_size, data_order)
    check_settings(client, getattr(callbacks, "shard_settings", None), infos[0].settings)
    rank = client.rank
    say_started(cfg, rank, device, ds, model, client, infos[0])
    w = np.empty(model.layout.total, dtype=np.float32)
    counted_from = None
    if rank == 0:
        counted_from = client.status()     # before Init: no push can come before it
        check_fresh(client, infos, cfg.require_fresh)
        client.init(model.init_params(cfg.seed))
    client.pull(w)                         # waits until the chief's values are there
    rows = Rows(model, client)
    warm_up(model, w, ds, cfg.batch_size, rows)
    join(client, rank, w, infos)
    if compiling.stop().compiled and rank == 0:     # a first run: why it took a while
        print(compiling.describe(), flush=True)
    source = source_for(cfg, ds, rank, infos)
    if getattr(ds, "stream", False):
        measure_progressively(model)
    progress = Progress(cfg.epochs, source.steps, cfg.log_every,
                        style_for(cfg.progress, rank, sys.stderr.isatty()), source.start)
    training = Run(cfg, rank, ds, model, client, w, rows, report, callbacks, infos[0].mode, progress,
                   gradient_fn(model, cfg.seed, rank, worker_clip(cfg, layout)),
                   Delay(cfg.delay, cfg.seed, rank), start=source.start)
    return training, source, counted_from


def say_started(cfg: WorkerConfig, rank: int, device, ds, model, client: PSClient, info) -> None:
    print(f"worker rank {rank}/{cfg.num_workers} device {describe_device(device)}; "
          f"model {model_name(model)} {describe_params(model)}; {describe(ds)}; mode {info.mode}, "
          f"{len(cfg.ps)} shard(s) ({client.plane_description()}), optimizer {info.optimizer} "
          f"lr {info.lr:g}", flush=True)
    note = blas_note(device)
    if note and rank == 0:
        print(note, flush=True)


def join(client: PSClient, rank: int, w: np.ndarray, infos) -> None:
    """An elastic joiner waits for its step: until it opens, a joining worker only pulls."""
    member_from = client.elastic_join(infos)
    if member_from:
        print(f"worker {rank} joins: a member from step {member_from} on every shard", flush=True)
        client.pull(w, seen=[member_from - 1] * len(client.shards))


def end(run: Run, stats: dict, started: float, counted_from, definition: dict | None) -> dict | None:
    """After the last step: a worker other than the chief hands its callbacks the weights (the
    chief's restored ones, when the callbacks restored some: follow_restored); the chief
    evaluates and returns the summary, saves the model and stops the shards, as asked."""
    if not run.chief:
        say_if_chief_gone(run.client)
        follow_restored(run)
        run.callbacks.on_weights(run.w)
        keep_tables(run)
        return None
    cfg, client, model = run.cfg, run.client, run.model
    summary = finish(run, stats, started, counted_from)
    run.callbacks.on_weights(run.w)         # the final weights (a Keras model keeps them)
    keep_tables(run)
    if cfg.save:
        save_model(cfg, client, model, run.w, definition, summary)
        print(f"saved the model ({model_name(model)}, {model.layout.total:,} parameters) to "
              f"{cfg.save}", flush=True)
    if cfg.stop_shards:
        client.stop_shards()
        print(f"stopped the {len(cfg.ps)} shard(s): the run is over", flush=True)
    return summary


def save_model(cfg: WorkerConfig, client: PSClient, model, w: np.ndarray, definition: dict | None,
               summary: dict, path: str | None = None, layer_configs: bool = True) -> None:
    """--save (or `path`): the model file; a model with sparse tables gets every table's rows,
    streamed from the shards (ExportRows) and merged into sorted files as they come. After a
    sync or backup run they are the rows of the final version, as the dense weights are; in
    async or ssp, each shard's rows when its stream began (workers still pushing may move them).
    A model without tables records each shard's version when it is saved (Status), so that
    `pserver export --since` can write deltas since it too."""
    tables, versions = None, None
    if sparse_tables(model):
        tables = {}
        for t in sparse_tables(model):
            versions, count, pages = client.export_table(t.name, max(cfg.rpc_deadline, 3600.0))
            tables[t.name] = model_file.TableRows(count, pages)
    else:
        with contextlib.suppress(PServerError):   # a shard gone: the model is saved without them
            versions = [int(r.version) for r in client.status()]
    origin = None if not versions or min(versions) < 0 else \
        {"live": True, "num_shards": len(cfg.ps), "versions": [int(v) for v in versions],
         "version": int(max(versions)), "job": registered_layout(model).signature()}
    model_file.save(path or cfg.save, model, w, definition, summary, tables=tables, origin=origin,
                    layer_configs=layer_configs)


def keep_tables(run: Run) -> None:
    """A Keras model with sparse tables keeps their final rows, as it keeps the weights: every
    rank (the same rows on each, read from the shards before the chief stops them) writes them
    where its fit asked (CallbackList.tables_dir), for its predict, evaluate and save. Without
    the layers' configs: fit reads them back into its own model, and a layer of the script's
    own need not be registered until the model is saved (as in Keras)."""
    where = getattr(run.callbacks, "tables_dir", None)
    if where and sparse_tables(run.model):
        save_model(run.cfg, run.client, run.model, run.w, None, {}, path=where, layer_configs=False)


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
    restored = None

    def on_train_begin(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_train_batch_end(self, batch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_weights(self, w): pass
    def lr_change(self): return None


def train(run: Run, source: Slices | Leases) -> dict:
    """The epochs of `source`'s batches (each rank's slices, or chunks leased from shard 0), from
    step run.start on; the chief's epoch logs hold the test metrics. `run.callbacks` hear of each
    batch and epoch (with leases, an epoch ends when the worker learns it). This worker's stats."""
    run.callbacks.on_train_begin({})
    for item in source.batches(run):
        if isinstance(item, EpochEnd):
            if end_epoch(run, item):
                break
        elif exchange(run, item) == "trained" or (item.outcome == "rejected" and not source.retries):
            report_batch(run, item, force=item.last or (source.line_at_end and run.over()))
    run.progress.close()
    run.callbacks.on_train_end({})
    stats = run.timer.summary(run.progress.elapsed, rank=run.rank, steps=run.clock - run.start,
                              samples=run.samples, outcomes=run.outcomes)
    if run.cfg.stats_json:
        write_json(run.cfg.stats_json, stats)
    return stats


def exchange(run: Run, batch: Batch) -> str:
    """Train `batch` (one_step); its outcome, which its source reads too (Batch)."""
    rejected = run.outcomes.get("rejected", 0)
    try:
        batch.loss, batch.exchange_started = one_step(run, batch.x, batch.y, batch.lease)
    except LeaseGone as e:                      # marked dead meanwhile: the chunk went elsewhere
        run.progress.say(f"worker {run.rank}: {e}")
        run.count("lease_gone")
        run.client.pull(run.w, run.clock + 1)   # a refused push pulled nothing
        batch.outcome = "gone"
        return batch.outcome
    run.clock += 1
    batch.outcome = "rejected" if run.outcomes.get("rejected", 0) > rejected else "trained"
    return batch.outcome


def report_batch(run: Run, batch: Batch, force: bool) -> None:
    """A batch done with: counted, reported (the metrics, the callbacks, a progress line, shown
    whatever the time when `force`), and the chief's evaluation curve when it is time."""
    size = len(batch.x)                         # an epoch's last batch may be smaller
    run.samples += size
    done = time.perf_counter()
    run.report.step(done - batch.started, done - batch.exchange_started, size)
    run.callbacks.on_train_batch_end(batch.step, {"loss": batch.loss, "size": size})
    line = run.progress.step(batch.epoch, batch.shown, batch.loss, size, force=force)
    if line:
        run.report.progress(run.clock, *line)
    run.curve.maybe(lambda: evaluate(run, eval_threads(run.client, others_wait=False)),
                    run.progress.elapsed, run.client, run.clock)


def end_epoch(run: Run, ended: EpochEnd) -> bool:
    """An epoch's end: the chief's evaluation (chief_epoch_end), then the callbacks hear it with
    the epoch's logs and the weights pulled after its last step. Whether they stop the run."""
    logs = {}
    if run.chief:
        logged = chief_epoch_end(run, ended.epoch, ended.all_done)
        if ended.again:                           # the summary takes the epoch's evaluation now
            run.epochs_log = [e for e in run.epochs_log if e["epoch"] != logged["epoch"]]
        run.epochs_log.append(logged)
        if getattr(run.ds, "stream", False):
            run.epochs_log[-1]["progressive"] = window_metrics(run, ended)
        logs = dict(run.epochs_log[-1])
    if ended.again:
        return run.callbacks.stop_training
    if ended.trained:                             # every worker's batches
        logs["trained"] = ended.trained
    if ended.shared and not run.chief:
        logs = chief_logs(run.client, run.rank, ended.epoch, run.push_empty if run.empty_counts else None)
    run.callbacks.on_weights(run.w)               # the weights a callback saves (ModelCheckpoint)
    run.callbacks.on_epoch_end(ended.epoch, logs)
    run.follow_lr()
    if ended.shared and run.chief:
        run.client.epoch_logs(ended.epoch, share=(run.callbacks.epoch_logs, run.callbacks.stop_training))
    return run.callbacks.stop_training


def measure_progressively(model) -> None:
    """A stream's metrics are progressive: each push carries what its batch measured before the
    update, summed per window by shard 0. A click model without compiled metrics gets the AUC's
    sums, the metric stream training reports (pserver.models.metrics.AUC)."""
    if getattr(model, "metric_objects", None) == [] and getattr(model, "task", "") == "classification":
        # the metrics see the outputs as the model states them: a click model's are logits
        logits = getattr(model, "output_activation", "linear") not in ("sigmoid", "softmax")
        model.metric_objects = [metrics.AUC(name="auc", from_logits=logits)]


def window_metrics(run: Run, ended: EpochEnd) -> dict:
    """The chief's line for a stream's window: every worker's batches of it, each measured before
    it was trained (progressive validation); the figures, for the summary."""
    t = ended.trained
    if not t or not t["samples"]:
        return {}
    n = t["samples"]
    out = {"events": n, "logloss": t["loss_sum"] / n, "accuracy": t["correct"] / n}
    objects = getattr(run.model, "metric_objects", [])
    if objects and len(t["metric_sums"]) == sum(m.size() for m in objects):
        out.update(metrics.values_of(objects, np.asarray(t["metric_sums"], np.float64)))
    shown = ", ".join(f"{k} {out[k]:.4f}" for k in ("logloss", "accuracy", "auc") if k in out)
    run.progress.say(f"window {ended.epoch + 1}/{run.cfg.epochs}: {n:,} events, progressive {shown} "
                     f"(each batch measured before it was trained)")
    return out


def chief_logs(client: PSClient, rank: int, epoch: int, push_empty=None, poll: float = 0.02,
               first_poll: float = 0.001, empty_after: float = 0.005) -> dict:
    """A worker other than the chief at `epoch`'s end: the chief's logs of it and its stop decision,
    once it gave them (its evaluation done, its callbacks run), as {"shared": logs, "stop_training":
    bool}. Asked again after `first_poll` seconds, doubling up to `poll`: the chief's epoch end
    takes milliseconds, which a fixed `poll` would round up to it at every epoch. Meanwhile, in
    sync and backup (`push_empty`), a chief not yet told the epoch ended for `empty_after` seconds
    is waiting in a step for this worker's contribution (the epoch's chunks are all done, so the
    chief is told at its next ask, a round trip away, unless a step holds it): push an empty one,
    so that it learns."""
    wait, untold_since = first_poll, None
    while True:
        reply = client.epoch_logs(epoch)
        if reply.has_logs:
            return {"shared": dict(zip(reply.log_names, reply.log_values)),
                    "stop_training": reply.stop_training}
        if not reply.chief_live:
            raise Unavailable(f"worker {rank}: the chief (rank 0) left or was marked dead before it gave "
                              f"epoch {epoch + 1}'s logs, which every worker's callbacks take")
        now = time.monotonic()
        untold_since = None if reply.chief_told else (now if untold_since is None else untold_since)
        if push_empty is not None and untold_since is not None and now - untold_since >= empty_after:
            push_empty()                                  # the step it waits in is done: ask again now
            wait, untold_since = first_poll, None
        else:
            time.sleep(wait)
            wait = min(2 * wait, poll)


def one_step(run: Run, x, y, lease=None) -> tuple[float, float]:
    """One batch: pull its rows, compute the gradient into run.g, straggle (--delay), push and
    pull, counting each push's outcome; its loss and when its exchange began (perf_counter). With
    a lease, the push tells shard 0 what the step measured (the batch's loss x samples, and the
    samples the model classed right, the compiled metrics' sums): the epoch's training loss and
    metrics over every worker."""
    timer = run.timer
    with timer("pull"):
        lookups = run.rows.for_batch(x)
    with timer("compute"):
        loss = run.gradient(run.w, x, y, run.g, run.clock, lookups)
    trained = (loss * len(x), float(getattr(run.model, "batch_correct", 0.0)),
               tuple(getattr(run.model, "batch_metric_sums", ())))
    with timer("delay"):
        run.delay.sleep()
    exchange_started = time.perf_counter()
    with timer("push_pull"):
        for outcome in push_pull(run.client, run.g, run.w, len(x), run.clock, lookups, run.rows.names,
                                 lease=lease, trained=trained):
            run.count(outcome)
    return loss, exchange_started


def chief_epoch_end(run: Run, epoch: int, all_done: bool = False) -> dict:
    """The chief at an epoch's end: its log (test metrics), the report's, and a checkpoint asked for.
    `all_done`: the run's last epoch, every worker's batches of it done (EpochEnd.all_done). No
    one trains then, so the chief evaluates on every core, on the final weights (pulled again:
    outside sync another worker's last push may have come after the chief's last pull), and the
    summary takes that evaluation rather than making it again (finish)."""
    if all_done:
        run.client.pull(run.w, seen=[-1] * len(run.client.shards))
    logged = log_epoch(run, epoch, eval_threads(run.client, others_wait=all_done))
    if all_done and not run.rows:             # a sparse model's rows are not in w: never reused
        run.last_eval = (run.w.copy(), {k: v for k, v in logged.items()
                                        if k not in ("epoch", "seconds", "epoch_seconds")})
    run.report.evaluated(run.clock, logged, lambda: combine_counters(run.client.status())["staleness_mean"])
    ask_checkpoint(run.client, run.progress.say)
    return logged


def log_epoch(run: Run, epoch: int, threads: int = 1) -> dict:
    """The chief's line at an epoch's end: the epoch's own time (and the run's so far), its
    metrics on the held-out set (on `threads`), named as held_out says."""
    ev = evaluate(run, threads)
    now = time.monotonic()
    own, total = now - run.epoch_started, now - run.progress.started
    label = held_out(run.callbacks)
    run.progress.say(f"epoch {epoch + 1}/{run.cfg.epochs} done in {own:.1f} s ({total:.1f} s in all)"
                     + (f": {format_metrics(ev, label)}" if label else ""))
    return {"epoch": epoch + 1, "seconds": round(total, 3), "epoch_seconds": round(own, 3), **ev}


def held_out(callbacks) -> str | None:
    """What the chief's evaluation set is called in its lines and summary: "test", or what the
    callbacks say it is (a Keras fit's: "validation", the validation_split or validation_data,
    beside which the script may print its own test accuracy; None for a fit without any, whose
    placeholder sample no line shows)."""
    return getattr(callbacks, "held_out", "test")


def held_out_metrics(ev: dict, label: str | None) -> dict:
    """The summary's figures on the held-out set (none without one: label None)."""
    ev = ev if label else {}
    return {"test_accuracy": ev.get("accuracy"), "test_loss": ev.get("loss"), "test_r2": ev.get("r2"),
            "test_auc": ev.get("auc"), "evaluated_on": label}


def format_metrics(ev: dict, label: str = "test") -> str:
    if not ev:
        return f"no {label} set"
    shown = [f"{label} {k} {ev[k]:.4f}" for k in ("accuracy", "auc", "r2") if k in ev]
    return ", ".join(shown + [f"{label} loss {ev['loss']:.4f}"])


def wait_for_others(client: PSClient, timeout: float, starting: int = 0, say=print) -> None:
    """The chief's final evaluation should see every worker's last update: wait until no
    worker is live and, with `starting` (--data-assignment slices: each of ranks 0..N-1 owns
    its slice of the data), until each of those ranks has registered. Without this a chief
    that finished its slice before another rank's process started (async, a slow start)
    summarized and checkpointed half the data, and left: the late rank then began another
    job on the shards alone."""
    deadline, said = time.monotonic() + timeout, False
    while True:
        statuses = client.status()
        coming = set(range(starting)) - set().union(*(s.registered_workers for s in statuses))
        if not coming and not any(s.live_workers for s in statuses):
            return
        if coming and not said:
            say(f"the chief waits for worker(s) {sorted(coming)} to register and train their slices "
                f"(--data-assignment slices), at most {timeout:g} s (--rpc-deadline)")
            said = True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if coming:
        raise DeadlineExceeded(f"deadline: worker(s) {sorted(coming)} never registered within {timeout:g} s "
                               "of the chief's end, and with --data-assignment slices their slices "
                               "of the data are not trained without them")
    raise DeadlineExceeded(f"deadline: other workers were still training {timeout:g} s "
                           "after the chief finished")


def assign_restored(run: Run) -> None:
    """The chief, once every other worker left: weights its callbacks set at the end of the run
    (`callbacks.restored`: EarlyStopping(restore_best_weights=True)'s copy of the best epoch's)
    become the shards' (AssignWeights, the optimizer's state kept), so that the final pull,
    evaluation and checkpoint, every worker's model (follow_restored) and a later fit start
    from them."""
    restored = run.callbacks.restored
    if restored is None:
        return
    versions = run.client.assign(restored)
    run.progress.say(f"the shards hold the weights the callbacks restored (version {max(versions)})")


def follow_restored(run: Run, poll: float = 0.05) -> None:
    """A worker other than the chief whose callbacks restored weights at the end (the chief's
    made the same decision on the same logs): wait until the chief assigned its copy on every
    shard (a version past this worker's last pull, status's assigned_version), then pull it,
    so that every worker ends with the chief's weights, not its own copy."""
    if run.callbacks.restored is None:
        return
    client, seen = run.client, list(run.client.versions)
    deadline = time.monotonic() + run.cfg.rpc_deadline
    while True:
        statuses = client.status()
        if all(st.assigned_version > v for st, v in zip(statuses, seen)):
            break
        if any(0 in st.dead_workers for st in statuses):
            raise Unavailable(f"worker {run.rank}: the chief (rank 0) was marked dead before it restored "
                              "the best weights on the shards")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"worker {run.rank}: the chief did not restore the weights on the shards "
                                   f"within {run.cfg.rpc_deadline:g} s of this worker's end")
        time.sleep(poll)
    client.pull(run.w, seen=[-1] * len(client.shards))


def binary_metrics(ev: dict, ds) -> dict:
    """A click-through-rate run's figures: logloss by its name, and the best AUC any model
    can reach on the test set when the data says (criteo-synthetic's planted model)."""
    if "auc" not in ev:
        return {}
    out = {"test_logloss": ev.get("loss")}
    if getattr(ds, "best_auc", None) is not None:
        out["best_auc"] = ds.best_auc
    return out


def finish(run: Run, stats: dict, started: float, counted_from) -> dict:
    """The chief's summary of the run, once every worker finished: the final weights' metrics,
    this run's counters (since `counted_from`), printed and written as asked."""
    cfg, client, ds, model = run.cfg, run.client, run.ds, run.model
    wait_for_others(client, cfg.rpc_deadline, say=run.progress.say,
                    starting=cfg.num_workers if cfg.data_assignment == "slices" else 0)
    wall = time.monotonic() - started            # until the last worker finished
    assign_restored(run)
    ask_checkpoint(client)
    client.pull(run.w, seen=[-1] * len(client.shards))      # the final weights
    if run.last_eval is not None and np.array_equal(run.last_eval[0], run.w):
        ev = run.last_eval[1]                 # the last epoch's evaluation was of these weights
    else:
        ev = evaluate(run, eval_threads(client, others_wait=True))
    statuses = client.status()
    counters = combine_counters(statuses, since=counted_from)     # this run's, not the shards' lifetime
    summary = {
        "mode": run.mode, "num_shards": len(cfg.ps), "num_workers": cfg.num_workers,
        "dataset": ds.name, "model": model_name(model), "num_params": model.layout.total,
        "optimizer": statuses[0].optimizer, "lr": statuses[0].lr, "batch_size": cfg.batch_size,
        "epochs": cfg.epochs, "seed": cfg.seed, "resumed_at_step": run.start,
        **held_out_metrics(ev, held_out(run.callbacks)),
        **binary_metrics(ev if held_out(run.callbacks) else {}, ds),
        # every rank that registered with the shards: an elastic job's joiners (and those that left) too
        "workers_registered": sorted(set().union(*(st.registered_workers for st in statuses))),
        "wall_seconds": round(wall, 3),
        "train_samples_per_second": counters["samples_trained"] / wall if wall > 0 else 0.0,
        "per_epoch": run.epochs_log, "eval_curve": run.curve.points, "chief": stats,
        **counters, **sparse_summary(statuses),
        "shard_restarts": shard_restarts(statuses, counted_from, [s.restarts for s in client.shards]),
    }
    print(format_summary(summary), flush=True)
    if cfg.summary_json:
        write_json(cfg.summary_json, summary)
    return summary
