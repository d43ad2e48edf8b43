"""Prometheus metrics (--metrics-port, shards and workers) and TensorBoard curves
(--tensorboard, the chief).

A shard records only what its hot paths alone know (rejections by reason, payload bytes,
pull waits) in prometheus_client's thread-safe metrics; everything else (pushes by outcome,
staleness, sizes, checkpoints) is read from the shard's own counters when Prometheus scrapes,
so the two can never disagree.
"""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pserver.errors import ConfigError

# Seconds: a pull that does not wait (async) to a sync step behind a slow worker.
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OUTCOMES = ("received", "applied", "aggregated", "dropped_late", "rejected")


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str) -> None:
    """The /metrics endpoint on a daemon thread; says where, as the gRPC port is said."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(f"--metrics-port: cannot serve metrics on {host}:{port} ({e.strerror})") from None
    print(f"{what}: Prometheus metrics at http://{host}:{server.server_port}/metrics", flush=True)


class ShardMetrics:
    """What a shard's calls record as they happen."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rejected = Counter("pserver_pushes_rejected", "Pushes refused, by the status code sent back",
                                ["reason"], registry=self.registry)
        self.received = Counter("pserver_received_bytes", "Gradient payload bytes received in pushes",
                                registry=self.registry)
        self.sent = Counter("pserver_sent_bytes", "Parameter payload bytes sent in pulls",
                            registry=self.registry)
        self.pull_wait = Histogram("pserver_pull_wait_seconds", "Seconds a pull waited for the step the "
                                   "mode requires", buckets=WAIT_BUCKETS, registry=self.registry)

    def watch(self, shard) -> None:
        """Also expose the shard's own counters and state, read at every scrape."""
        self.registry.register(ShardState(shard))


class ShardState:
    """A collector over Shard.status(): pushes by outcome, staleness, sizes, checkpoints."""

    def __init__(self, shard) -> None:
        self.shard = shard

    def collect(self):
        st = self.shard.status()
        c = st["counters"]
        pushes = CounterMetricFamily("pserver_pushes", "Pushes by outcome (received = the sum of the others)",
                                     labels=["outcome"])
        for outcome in OUTCOMES:
            pushes.add_metric([outcome], c[f"pushes_{outcome}"])
        yield pushes
        yield CounterMetricFamily("pserver_updates", "Updates applied to the parameters",
                                  value=c["updates_applied"])
        yield staleness_histogram(c)
        yield GaugeMetricFamily("pserver_version", "Parameter version (steps applied)", value=st["version"])
        yield GaugeMetricFamily("pserver_parameters", "Dense parameters held by this shard",
                                value=st["num_params"])
        rows = GaugeMetricFamily("pserver_table_rows", "Rows of each sparse table held by this shard",
                                 labels=["table"])
        held = GaugeMetricFamily("pserver_table_bytes", "Bytes of each sparse table on this shard (rows, "
                                 "optimizer state, hash index, pending admission counts)", labels=["table"])
        for t in st["tables"]:
            rows.add_metric([t["name"]], t["rows"])
            held.add_metric([t["name"]], t["bytes"])
        yield rows
        yield held
        moved = CounterMetricFamily("pserver_rows", "Sparse rows sent in pulls, and rows updated by pushes "
                                    "(a row that several workers of a sync step pushed is updated once)",
                                    labels=["direction"])
        moved.add_metric(["pulled"], c["rows_pulled"])
        moved.add_metric(["pushed"], c["rows_pushed"])
        yield moved
        workers = GaugeMetricFamily("pserver_workers", "Workers by state", labels=["state"])
        workers.add_metric(["live"], len(st["live_workers"]))
        workers.add_metric(["dead"], len(st["dead_workers"]))
        yield workers
        ckpt = CounterMetricFamily("pserver_checkpoints", "Checkpoints by result", labels=["result"])
        ckpt.add_metric(["written"], c["checkpoints_written"])
        ckpt.add_metric(["failed"], c["checkpoints_failed"])
        yield ckpt
        written = self.shard.checkpointer.last_written if self.shard.checkpointer else None
        if written is not None:
            yield GaugeMetricFamily("pserver_checkpoint_age_seconds",
                                    "Seconds since the last checkpoint written",
                                    value=time.monotonic() - written)


def staleness_histogram(c: dict) -> HistogramMetricFamily:
    """The shard's staleness buckets (staleness 0, 1, ..., and the last for 'that or more')
    as a Prometheus histogram: cumulative, le = 0, 1, ..., +Inf."""
    counts = c["staleness_histogram"]
    cumulative, total = [], 0
    for i, n in enumerate(counts):
        total += n
        cumulative.append((str(float(i)) if i < len(counts) - 1 else "+Inf", total))
    return HistogramMetricFamily("pserver_push_staleness", "Versions a push's gradient was behind when it "
                                 "arrived", buckets=cumulative, sum_value=c["staleness_mean"] * total)


class WorkerMetrics:
    """A worker's step time, pull wait and throughput. A scrape sees whole steps: a step's three
    updates (`step`) and a scrape's reading (`collect`) take one lock, so the step count, the
    pull count and the samples always agree (prometheus_client locks each metric on its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_seconds = Histogram("pserver_worker_step_seconds",
                                      "Seconds per training step (compute, push, pull)",
                                      buckets=WAIT_BUCKETS, registry=None)
        self.pull_seconds = Histogram("pserver_worker_pull_seconds", "Seconds a step's push and pull took "
                                      "(one exchange over the data plane), waiting included",
                                      buckets=WAIT_BUCKETS, registry=None)
        self.samples = Counter("pserver_worker_samples", "Training samples this worker computed gradients "
                               "on", registry=None)
        self.rate = Gauge("pserver_worker_samples_per_second", "Training samples per second over the last "
                          "progress interval", registry=None)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def step(self, seconds: float, pull_seconds: float, samples: int) -> None:
        with self._lock:
            self.step_seconds.observe(seconds)
            self.pull_seconds.observe(pull_seconds)
            self.samples.inc(samples)

    def collect(self):
        with self._lock:
            families = [f for m in (self.step_seconds, self.pull_seconds, self.samples, self.rate)
                        for f in m.collect()]
        yield from families


class EpochScalars:
    """Keras's TensorBoard callback's event files (tensorboardX, as --tensorboard's): each epoch's
    logs as scalars at step `epoch`, "epoch_" + the name, in log_dir/train, and the val_ ones
    (without the prefix) in log_dir/validation, as Keras lays them out."""

    def __init__(self, log_dir: str) -> None:
        from tensorboardX import SummaryWriter
        self.writers = {part: SummaryWriter(os.path.join(log_dir, part)) for part in ("train", "validation")}

    def write(self, epoch: int, logs: dict) -> None:
        for name, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                part = "validation" if name.startswith("val_") else "train"
                self.writers[part].add_scalar(f"epoch_{name.removeprefix('val_')}", value, epoch)
        for w in self.writers.values():
            w.flush()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


class TrainingReport:
    """What the training loop reports beyond its progress lines: Prometheus metrics
    (--metrics-port) and, on the chief, TensorBoard scalars (--tensorboard); either may be off."""

    def __init__(self, cfg) -> None:
        self.prom = self.board = None
        if cfg.metrics_port is not None:
            self.prom = WorkerMetrics()
            serve_metrics(self.prom.registry, cfg.metrics_host or "127.0.0.1", cfg.metrics_port,
                          f"worker {cfg.rank}")
        if cfg.tensorboard and cfg.rank == 0:
            from tensorboardX import SummaryWriter
            self.board = SummaryWriter(cfg.tensorboard)

    def step(self, seconds: float, pull_seconds: float, samples: int) -> None:
        if self.prom:
            self.prom.step(seconds, pull_seconds, samples)

    def progress(self, clock: int, loss: float, rate: float) -> None:
        """At every progress line: its mean loss and samples/s."""
        if self.prom:
            self.prom.rate.set(rate)
        if self.board:
            self.board.add_scalar("train/loss", loss, clock)
            self.board.add_scalar("train/samples_per_second", rate, clock)

    def evaluated(self, clock: int, ev: dict, staleness_mean) -> None:
        """The chief's test metrics; `staleness_mean()` asks the shards, only when written."""
        if not self.board:
            return
        for name in ("accuracy", "auc", "r2", "loss"):
            if name in ev:
                self.board.add_scalar(f"test/{name}", ev[name], clock)
        self.board.add_scalar("train/staleness_mean", staleness_mean(), clock)
        self.board.flush()

    def close(self) -> None:
        if self.board:
            self.board.close()
