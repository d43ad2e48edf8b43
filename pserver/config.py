"""Configuration as frozen dataclasses, and the cluster spec from flags or TF_CONFIG.

The CLI builds these; everything below the CLI takes a config object, never argv.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import re
import tempfile
from dataclasses import dataclass, field

from pserver.errors import ConfigError
from pserver.registry import Registry

HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")   # name, IPv4 or [IPv6]
DEFAULT_PORT = 2222            # TensorFlow's default, so TF_CONFIG addresses without a port work
# The consistency modes: pserver.modes holds one policy per name (modes sits above config, so
# the names live here and tests/test_registries.py checks that the two agree).
MODES = Registry("mode", "--mode")
MODES.add("sync", "the mean of all N workers' gradients per step (the default)")
MODES.add("backup", "the first N-b distinct workers to push complete a step (--backup-workers b)")
MODES.add("async", "Hogwild: every push is applied on arrival")
MODES.add("ssp", "async, but no worker runs more than --staleness clocks ahead of the slowest")
# The ServerConfig fields that shape training, by the names of pb.TrainingSettings' fields (and
# of the flags): every shard of one job must hold the same values (worker/client.py compares
# what each shard's Register reply carries). num_workers joins them as the shard serves it.
TRAINING_SETTINGS = ("mode", "backup_workers", "staleness", "optimizer", "lr", "lr_schedule", "momentum",
                     "nesterov", "beta1", "beta2", "eps", "weight_decay", "step_timeout", "rho", "centered",
                     "initial_accumulator", "clipvalue")
# The ServerConfig fields that are make_optimizer's arguments.
OPTIMIZER_ARGS = ("lr", "lr_schedule", "momentum", "nesterov", "beta1", "beta2", "eps", "weight_decay", "rho",
                  "centered", "initial_accumulator", "clipvalue")
DATA_PLANES = Registry("data plane", "--data-plane")
DATA_PLANES.add("auto", "same-host shards and workers exchange payloads through shared memory (default)")
DATA_PLANES.add("grpc", "gRPC streams only")
SCHEDULING = Registry("scheduling policy", "--sched")
SCHEDULING.add("batch", "Linux's SCHED_BATCH for every thread of the shard: a worker's request wakes the "
                        "shard without preempting the worker, which sends on to the other shards and then "
                        "waits, freeing its core (default; where the OS has no such policy, its own)")
SCHEDULING.add("normal", "the OS's default policy, under which the woken shard may preempt the worker")
PROGRESS = ("auto", "bar", "lines", "relay")   # WorkerConfig.progress (pserver.observe.progress)


def check_clipnorms(clipnorm: float, global_clipnorm: float) -> None:
    """A worker's clipnorm or global_clipnorm (pserver.optim.clip): at most one, each >= 0 (0: none)."""
    if not (clipnorm >= 0 and global_clipnorm >= 0) or (clipnorm and global_clipnorm):
        raise ConfigError(f"clipnorm={clipnorm}, global_clipnorm={global_clipnorm}: give one, a number > 0 "
                          "(0: none)")


NOTICE_EVERY_ENV = "PSERVER_NOTICE_EVERY"


def notice_every() -> float:
    """Seconds between repeated "still waiting" lines (a shard unreachable, a session to expire,
    a step below --min-workers): 10, or $PSERVER_NOTICE_EVERY (the tests shorten it)."""
    raw = os.environ.get(NOTICE_EVERY_ENV, "10")
    try:
        every = float(raw)
    except ValueError:
        every = math.nan
    if not every > 0 or math.isinf(every):
        raise ConfigError(f"${NOTICE_EVERY_ENV}={raw!r}: must be a positive number of seconds")
    return every


AUTO_RANK = -1                   # WorkerConfig.rank for `--rank auto`: shard 0 assigns one (never 0)


def parse_rank(text: str) -> int:
    """`--rank`: a number >= 0, or `auto` (AUTO_RANK). A negative number is refused here, not
    passed on: -1 is AUTO_RANK inside, and `--rank -1` ran as `--rank auto`."""
    if text == "auto":
        return AUTO_RANK
    try:
        rank = int(text)
    except ValueError:   # argparse says: argument --rank: expected a number or auto, got 'x'
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"{rank}; give 0..N-1 (N: --num-workers) or auto")
    return rank


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_log_level(text: str) -> str:
    """`--log-level` (serve, slurm): a name of LOG_LEVELS, in any case; one line for another,
    where logging.basicConfig raised ValueError (a traceback) once the shard started."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)} (any case)")
    return text.upper()


# The longest wait any flag may ask for. Deadlines and timers add their seconds to a clock: inf or
# 1e10 overflowed it (OverflowError: timestamp out of range), or went to gRPC as a deadline it
# reads as already passed ("Deadline Exceeded", exit 138: a user's mistake reported as retryable).
# Nothing in a run waits for a day on one RPC, step or timer.
MAX_SECONDS = 86400.0


def check_seconds(flag: str, value: float, off: str | None = None, bound: float = None) -> None:
    """A flag's number of seconds: > 0 and at most `bound` (MAX_SECONDS unless given: a deadline
    or a wait beyond it overflowed the clock's arithmetic) (nan and inf refused); `off`: what 0
    means, where 0 is accepted."""
    bound = MAX_SECONDS if bound is None else bound
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not ((0 <= value if off else 0 < value) and value <= bound):
        zero = f"0 ({off}) or " if off else ""
        most = "a day" if bound == MAX_SECONDS else "finite"
        raise ConfigError(f"{flag}: {value!r}; give {zero}a number of seconds > 0, at most "
                          f"{bound:.0f} ({most})" if math.isfinite(bound) else
                          f"{flag}: {value!r}; give {zero}a finite number of seconds > 0")


# --seed: it travels as an int64 (RegisterRequest.data_seed, SparseTableSpec.seed): a larger one
# failed the worker's Register (ValueError: Value out of range, exit 1) after the data was built.
SEED_LIMIT = 1 << 63


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"--seed: {seed!r}; give an integer in [0, 2**63), what the wire carries")


def check_delay_ranks(ranks: tuple[int, ...] | None, num_workers: int) -> None:
    """launch --delay-ranks: each a worker rank, as --delay-for's are (a rank outside was taken
    and delayed no worker)."""
    bad = [r for r in ranks or () if not 0 <= r < num_workers]
    if bad:
        raise ConfigError(f"--delay-ranks: rank {bad[0]} is outside [0, --workers={num_workers})")


def check_elastic(num_workers: int, min_workers: int, max_workers: int) -> None:
    """--min-workers and --max-workers (elastic workers), one clear line each."""
    for flag, value in (("--min-workers", min_workers), ("--max-workers", max_workers)):
        if value < 0:
            raise ConfigError(f"{flag}: must be >= 1 (0: --num-workers), got {value}")
        if value and not num_workers:
            raise ConfigError(f"{flag}: needs --num-workers (the workers started with the job)")
    if max_workers and max_workers < num_workers:
        raise ConfigError(f"--max-workers: {max_workers} is below --num-workers={num_workers}")
    if min_workers and min_workers > (max_workers or num_workers):
        raise ConfigError(f"--min-workers: {min_workers} is above --max-workers="
                          f"{max_workers or num_workers}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"       # bind address: only this machine unless told otherwise
    port: int = DEFAULT_PORT      # 0 picks a free port, printed at start
    shard: int = 0                # this shard's index J in [0, num_shards)
    num_shards: int = 1           # S
    num_workers: int = 0          # N; 0 = learn it from the first worker that registers
    min_workers: int = 0          # elastic: sync/backup steps wait with fewer members live or left (0: unset,
                                  # today's behaviour: a dead worker never holds the others up)
    max_workers: int = 0          # elastic: ranks are below this; workers may join up to it (0: N)
    mode: str = "sync"            # consistency mode, a name in MODES
    backup_workers: int = 0       # b for mode=backup: a step completes after N-b distinct workers
    staleness: int = 0            # s for mode=ssp: how many clocks a worker may run ahead
    step_timeout: float = 60.0    # seconds a sync/backup step waits for a worker before marking it dead
    optimizer: str = "sgd"        # a name in optim.OPTIMIZERS, run on this shard's slice
    lr: float = 0.05              # base learning rate (for the mean gradient of a step)
    lr_schedule: str = "constant" # multiplier of lr as a function of the step (optim.schedule)
    # momentum, eps and weight_decay: None takes the optimizer's default (optim.with_defaults)
    momentum: float | None = None # momentum coefficient (momentum 0.9, rmsprop 0)
    nesterov: bool = False        # Nesterov momentum
    beta1: float = 0.9            # adam, adamw
    beta2: float = 0.999          # adam, adamw
    eps: float | None = None      # adam 1e-8; adamw, rmsprop, adagrad 1e-7 (Keras's)
    weight_decay: float | None = None  # 0; adamw 0.004. Coupled L2 added to the gradient, decoupled in adamw
    rho: float = 0.9              # rmsprop: discount of the squared-gradient average
    centered: bool = False        # rmsprop: divide by the gradient's estimated variance
    initial_accumulator: float = 0.1  # adagrad: the accumulator's starting value
    clipvalue: float = 0.0        # clip the step's gradient element-wise to [-c, c] (0: none)
    chunk_bytes: int = 1 << 20    # payload bytes per streamed message
    threads: int = 64             # gRPC worker threads (at least 2 per worker + 12): see server/limits.py
    max_inflight_mb: int = 1024   # MiB of gradients being received at once (RESOURCE_EXHAUSTED past it)
    table_threads: int = 2        # threads that one large sparse lookup or push may use (sparse/table.py)
    max_memory_mb: int = 0        # MiB this shard's state may hold (server/budget.py); 0 = 90% of available
    data_plane: str = "auto"      # auto: also offer same-host shared memory; grpc: streams only
    sched: str = "batch"          # the shard's threads' scheduling policy (server/app.py's schedule)
    checkpoint_dir: str | None = None  # where checkpoints go (default: --restore's directory)
    checkpoint_every: int = 0     # also checkpoint every this many steps (0 = off)
    checkpoint_secs: float = 0.0  # also checkpoint every this many seconds (0 = off)
    full_every: int = 10          # a full base every this many checkpoint files, deltas between (1: all full)
    restore: str | None = None    # resume from this directory's checkpoints (persist/reshard.py)
    restore_fresh_if_corrupt: bool = False  # start fresh when every checkpoint in restore is corrupt
    auth_token: str | None = field(default=None, repr=False)  # every RPC must carry it; never shown
    tls_cert: str | None = None   # PEM certificate (chain): serve over TLS (with tls_key)
    tls_key: str | None = None    # PEM private key of tls_cert
    metrics_port: int | None = None  # serve Prometheus metrics here (0: a free port, printed)
    metrics_host: str | None = None  # where they listen (default: host)

    def __post_init__(self) -> None:
        check_metrics(self.metrics_port)
        MODES.get(self.mode)
        if self.num_shards < 1:     # before --shard, which 0 shards would otherwise be blamed on
            raise ConfigError(f"--num-shards: must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"--shard: {self.shard} is outside [0, --num-shards={self.num_shards})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port: {self.port} is not a TCP port")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers: must be >= 0, got {self.num_workers}")
        check_elastic(self.num_workers, self.min_workers, self.max_workers)
        check_seconds("--step-timeout", self.step_timeout)
        if self.threads < 4:
            raise ConfigError(f"--threads: must be at least 4, got {self.threads}")
        if isinstance(self.table_threads, bool) or not isinstance(self.table_threads, int) \
                or not 1 <= self.table_threads <= 64:
            raise ConfigError(f"--table-threads: must be an integer in [1, 64], got {self.table_threads!r}")
        if self.max_inflight_mb < 1:
            raise ConfigError(f"--max-inflight-mb: must be >= 1, got {self.max_inflight_mb}")
        if self.max_memory_mb < 0:
            raise ConfigError(f"--max-memory-mb: must be >= 0 (0: automatic), got {self.max_memory_mb}")
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(f"--data-plane: '{self.data_plane}' is not one of {', '.join(DATA_PLANES)}")
        if self.sched not in SCHEDULING:
            raise ConfigError(f"--sched: '{self.sched}' is not one of {', '.join(SCHEDULING)}")
        from pserver.wire import security  # grpc only when a config is built
        if self.auth_token is not None:
            security.check_token(self.auth_token, "--auth-token")
        security.check_tls_files(self.tls_cert, self.tls_key)
        check_positive(chunk_bytes=self.chunk_bytes)
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every: must be >= 0 (0: off), got {self.checkpoint_every}")
        check_seconds("--checkpoint-secs", self.checkpoint_secs, off="off")
        for flag, path in (("--checkpoint-dir", self.checkpoint_dir), ("--restore", self.restore)):
            check_not_empty(flag, path)
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ConfigError(f"--full-every: must be an integer >= 1 (1: every checkpoint full), "
                              f"got {self.full_every!r}")
        if (self.checkpoint_every or self.checkpoint_secs) and not (self.checkpoint_dir or self.restore):
            raise ConfigError("--checkpoint-every/--checkpoint-secs need --checkpoint-dir (or --restore)")
        if self.restore_fresh_if_corrupt and not self.restore:
            raise ConfigError("--restore-fresh-if-corrupt: needs --restore DIR")
        if self.backup_workers < 0 or self.staleness < 0:
            raise ConfigError("--backup-workers and --staleness must be >= 0")
        if self.mode == "backup" and self.backup_workers < 1:
            raise ConfigError("--backup-workers: mode backup needs at least 1 backup worker")
        if self.num_workers and self.backup_workers >= self.num_workers:
            raise ConfigError(f"--backup-workers: {self.backup_workers} must be below the "
                              f"number of workers ({self.num_workers})")
        from pserver.optim import make_optimizer  # builds no kernel: only checks the values
        make_optimizer(self.optimizer, 1, **self.optimizer_args())

    @property
    def rank_limit(self) -> int:
        """Ranks are below this: --max-workers, else N (0 while N is still to be learnt)."""
        return self.max_workers or self.num_workers

    def training_settings(self, num_workers: int) -> dict:
        """What this shard was started with that shapes training (pb.TrainingSettings), with N as
        the shard serves it (`num_workers`: configured, or learnt from the first Register)."""
        from pserver.optim import with_defaults
        settings = with_defaults(self.optimizer, {name: getattr(self, name) for name in TRAINING_SETTINGS})
        return settings | {"num_workers": num_workers}

    def optimizer_args(self) -> dict:
        """make_optimizer's keyword arguments (but size): the shard's optimizer as configured."""
        args = {name: getattr(self, name) for name in OPTIMIZER_ARGS}
        return args | {"schedule": args.pop("lr_schedule")}


@dataclass(frozen=True)
class WorkerConfig:
    ps: tuple[str, ...] = ("127.0.0.1:2222",)  # shard addresses, shard j at index j
    rank: int = 0                 # this worker's rank; 0 is the chief
    num_workers: int = 1          # N
    model: str = "mlp"            # mlp, logreg, linreg, cnn, or FILE.py:FUNCTION / package.module:FUNCTION
    hidden: tuple[int, ...] | None = None  # hidden widths: mlp (256,256), wide_deep/deepfm towers (256,128)
    dataset: str = "synthetic"    # synthetic, mnist, a path to a .npz file, criteo-synthetic or criteo:PATH
    scale_uint8: str = "auto"     # .npz: divide uint8 features by 255 (auto, saying so) or not (none)
    data_dir: str | None = None   # where the mnist IDX files are (None: data.mnist_dir()'s choice)
    samples: int = 60000          # synthetic, criteo-synthetic: training samples
    test_samples: int = 10000     # synthetic, criteo-synthetic: test samples; criteo:PATH: at most this many
    features: int = 784           # synthetic: input features
    classes: int = 10             # synthetic: classes
    batch_size: int = 64          # samples per step on this worker
    epochs: int = 1               # passes over this worker's slice
    max_steps: int = 0            # stop after this many steps in total (0 = no limit)
    seed: int = 0                 # data order and initial weights
    device: str = "cpu"           # where gradients are computed: cpu, cuda or cuda:I
    log_every: float = 10.0       # seconds between progress lines in a log (stderr not a terminal)
    progress: str = "auto"        # auto: a bar on a terminal (the chief's), lines in a log; lines: always
                                  # lines; relay: the chief's bar drawn by `pserver launch`
                                  # (pserver.observe.progress.style_for)
    connect_timeout: float = 30.0 # seconds to wait for every shard to answer at start
    rpc_deadline: float = 300.0   # seconds one pull/push may take (a sync pull waits for the step)
    chunk_bytes: int = 1 << 20    # payload bytes per streamed message
    eval_batch: int = 4096        # test-set evaluation batch
    summary_json: str | None = None  # chief: write the run summary here
    save: str | None = None       # chief: write the trained model here (pserver.persist.model_file)
    stats_json: str | None = None    # write this worker's time breakdown (compute/push/pull/idle)
    eval_every: float = 0.0       # chief: also evaluate every this many seconds (0 = per epoch only)
    delay: str | None = None      # straggler injection, e.g. lognormal:0.02,1.0 (per step, seeded)
    data_assignment: str = "leases"  # leases: chunks leased by shard 0's coordinator; slices: one per rank
    chunk_batches: int = 16       # leases: batches per chunk of the training data
    no_shuffle: bool = False      # leases: every epoch the data in its order, chunks leased in order
    window_batches: int = 100     # stream:PATH: batches per window (the coordinator's epoch of a stream)
    export_every: float = 0.0     # chief: checkpoint and export (a model, then deltas) every SEC seconds
    export_dir: str | None = None  # chief: where --export-every writes: DIR/model and DIR/deltas
    export_keep_deltas: int = 0    # chief: the newest deltas kept in DIR/deltas (0: every one)
    data_plane: str = "auto"      # auto: shared memory with same-host shards; grpc: streams only
    compress: str = "none"        # push codec: none, bf16, fp16, topk:RATIO, sign (pserver.wire.compress)
    pull_compress: str = "none"   # pull codec over gRPC: none, bf16
    clipnorm: float = 0.0         # clip each tensor of this worker's gradient to this L2 norm (0: none)
    global_clipnorm: float = 0.0  # clip this worker's whole gradient to this L2 norm (0: none)
    require_fresh: bool = False   # chief: refuse shards that already hold trained state (default: continue)
    no_resume: bool = False       # start the data at epoch 1 even where the shards recorded this
                                  # rank's position
    stop_shards: bool = False     # chief: end the shards (exit 0) once the run is over (pserver slurm)
    session_dir: str | None = None  # where the session file is kept (worker/sessions.py): None for
                                    # $XDG_STATE_HOME/pserver/sessions, "none" for no file
    auth_token: str | None = field(default=None, repr=False)  # sent with every RPC; never shown
    tls_ca: str | None = None     # PEM CA certificate to trust: talk to the shards over TLS
    # Sparse embedding tables of the click-through-rate models (lr, fm, wide_deep, deepfm)
    embedding_dim: int = 8        # values per id in the factor table (fm, wide_deep, deepfm)
    row_optimizer: str = "adagrad"  # the tables' row optimizer on the shards: sgd, adagrad, adam, ftrl
    row_lr: float = 0.05          # its learning rate
    row_params: str = ""          # its other hyper-parameters, KEY=VALUE,... (initial_accumulator,
                                  # beta, l2, ...)
    min_count: int = 0            # admission: store an id once it was pushed this many times
    max_rows: int = 0             # eviction: rows per table per shard, least recently updated out first
    ttl_steps: int = 0            # eviction: rows not updated for this many steps
    row_dtype: str = "float32"    # how the tables store rows: float32, float16, bfloat16 (stochastic)
    state_dtype: str = "float32"  # how they store the row optimizer's slots: float32, or row (the row's type)
    metrics_port: int | None = None  # serve Prometheus metrics here (0: a free port, printed)
    metrics_host: str | None = None  # where they listen (default 127.0.0.1)
    tensorboard: str | None = None   # chief: write TensorBoard scalars to this directory

    def __post_init__(self) -> None:
        check_metrics(self.metrics_port)
        if self.tensorboard is not None:
            check_tensorboard(self.tensorboard)
        if not self.ps:
            raise ConfigError("--ps: give at least one shard address host:port")
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers: must be >= 1, got {self.num_workers}")
        if self.rank != AUTO_RANK and not 0 <= self.rank < self.num_workers:
            raise ConfigError(f"--rank: {self.rank} is outside [0, --num-workers={self.num_workers}) "
                              f"(or give --rank auto: shard 0 assigns a free rank)")
        if self.stop_shards and self.rank != 0:
            raise ConfigError("--stop-shards: only the chief (rank 0) ends the run; "
                              f"this is rank {self.rank}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs: must be >= 1, got {self.epochs}")
        if self.progress not in PROGRESS:
            raise ConfigError(f"progress: '{self.progress}' is not one of {', '.join(PROGRESS)}")
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(f"--data-plane: '{self.data_plane}' is not one of {', '.join(DATA_PLANES)}")
        if self.auth_token is not None or self.tls_ca is not None:
            from pserver.wire import security
            security.client_security(self.auth_token, self.tls_ca)   # a bad token or CA file fails now
        from pserver.wire.compress import parse, parse_pull
        parse(self.compress)
        parse_pull(self.pull_compress)
        check_positive(chunk_bytes=self.chunk_bytes)
        check_seconds("--connect-timeout", self.connect_timeout)
        check_seconds("--rpc-deadline", self.rpc_deadline)
        check_seconds("--log-every", self.log_every, bound=math.inf)   # a large one: no progress lines
        check_seconds("--eval-every", self.eval_every, off="per epoch only")
        check_seed(self.seed)
        if self.dataset == "synthetic":
            check_synthetic_memory(self.samples, self.test_samples, self.features, self.classes)
        check_clipnorms(self.clipnorm, self.global_clipnorm)
        if self.max_steps < 0:
            raise ConfigError(f"--max-steps: must be >= 0, got {self.max_steps}")
        check_writable("--summary-json", self.summary_json)
        check_writable("--stats-json", self.stats_json)
        check_writable("--save", self.save, model=True)
        check_not_empty("--export-dir", self.export_dir)
        if self.delay:
            parse_delay(self.delay)
        if self.data_assignment not in DATA_ASSIGNMENTS:
            raise ConfigError(f"--data-assignment: '{self.data_assignment}' is not one of "
                              f"{', '.join(DATA_ASSIGNMENTS)}")
        if self.chunk_batches < 1:
            raise ConfigError(f"--chunk-batches: must be >= 1, got {self.chunk_batches}")
        check_seconds("--export-every", self.export_every, off="no exports")
        if not self.export_every >= 0 or (self.export_every > 0) != bool(self.export_dir):
            raise ConfigError(f"--export-every {self.export_every} --export-dir {self.export_dir}: give both "
                              f"(seconds > 0 and a directory) or neither")
        if self.export_dir and os.path.exists(self.export_dir) and not os.path.isdir(self.export_dir):
            raise ConfigError(f"--export-dir: {self.export_dir} is a file, not a directory")
        if isinstance(self.export_keep_deltas, bool) or not isinstance(self.export_keep_deltas, int) or \
                self.export_keep_deltas < 0 or (self.export_keep_deltas and not self.export_every):
            raise ConfigError(f"--export-keep-deltas: {self.export_keep_deltas!r}; give how many of the "
                              "newest deltas --export-every keeps (an integer >= 1, with --export-every), or "
                              "0 for every one")
        if self.window_batches < 1:
            raise ConfigError(f"--window-batches: must be >= 1, got {self.window_batches}")
        if self.dataset.startswith("stream:") and self.data_assignment != "leases":
            raise ConfigError(f"--dataset {self.dataset}: a stream is read in offsets leased by shard 0 "
                              f"(--data-assignment leases, the default), not in per-rank slices")
        if self.no_shuffle and self.data_assignment != "leases":
            raise ConfigError(f"--no-shuffle: the data in its order is leased in chunks (--data-assignment "
                              f"leases); --data-assignment {self.data_assignment} draws each epoch's "
                              f"permutation")
        from pserver.sparse.optim import hyper, parse_params
        hyper(self.row_optimizer, self.row_lr, parse_params(self.row_params), what="--row-params")
        from pserver.kernels.device import parse_device  # checks the form; imports no CUDA
        parse_device(self.device)
        from pserver.models import check_model_spec  # a user's code runs later, in the worker
        check_model_spec(self.model)


def check_metrics(port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port: {port} is not a TCP port")


def check_tensorboard(directory: str) -> None:
    """--tensorboard: tensorboardX there, and a directory it can write (or make: it makes the
    missing ones), checked before training rather than as a traceback at its first scalar."""
    import importlib.util
    check_not_empty("--tensorboard", directory)
    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(f"--tensorboard: writing to {directory} needs tensorboardX "
                          "(pip install 'pserver[tensorboard]')")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"--tensorboard: {directory} is a file, not a directory")
    existing = os.path.abspath(directory)
    while not os.path.lexists(existing):          # the directory that SummaryWriter's makedirs starts in
        existing = os.path.dirname(existing)
    check_directory_writable("--tensorboard", existing)


def check_positive(**values) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    if "chunk_bytes" in values and values["chunk_bytes"] > (4 << 20) - 1024:
        raise ConfigError(f"--chunk-bytes: {values['chunk_bytes']} is over gRPC's 4 MiB message limit")


def check_not_empty(flag: str, path: str | None) -> None:
    """An empty path is refused: it was read as "not given", so `--save ''` or `--checkpoint-dir ''`
    ran to the end and wrote nothing."""
    if path is not None and not path.strip():
        raise ConfigError(f"{flag}: {path!r} is an empty path; give a path, or leave the flag out")


# A sparse model's directory holds this file (pserver.persist.model_file.MODEL_NPZ; config sits
# below persist in the layers, tests/test_flag_checks.py checks the two agree)
SPARSE_MODEL_NPZ = "model.npz"


def check_writable(flag: str, path: str | None, model: bool = False) -> None:
    """A file we will write at the end (renamed there from a file beside it): checked now, not
    after training, whose result a failed write lost. Not an existing directory (`model`: unless
    it is a pserver model, a sparse one's directory, which --save replaces), in a directory that
    exists and that this process can write."""
    check_not_empty(flag, path)
    if path is None:
        return
    if os.path.isdir(path):
        if not model:
            raise ConfigError(f"{flag}: {path} is a directory; give a file's path")
        if not os.path.isfile(os.path.join(path, SPARSE_MODEL_NPZ)):
            raise ConfigError(f"{flag}: {path} is a directory that is not a pserver model; give another path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(parent):
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    check_directory_writable(flag, parent)


def check_directory_writable(flag: str, directory: str) -> None:
    """`directory` is one this process can create files in: os.access says so and a probe file
    (a unique name, removed at once) is created there, since root passes access() where a
    read-only mount or an immutable directory still refuses the write."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag}: {directory} is not a directory")
    if os.access(directory, os.W_OK):
        try:
            fd, probe = tempfile.mkstemp(prefix=".pserver-write-check-", suffix=".tmp", dir=directory)
        except OSError:
            pass
        else:
            os.close(fd)
            os.unlink(probe)
            return
    raise ConfigError(f"{flag}: cannot write in directory {directory} (read-only or not yours)")


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_synthetic_memory(samples: int, test_samples: int, features: int, classes: int) -> None:
    """The synthetic dataset (pserver.data.synthetic), float32 features of every sample and one
    centre per class, must fit in this machine's memory: a size past it was a numpy
    _ArrayMemoryError traceback in every worker. The flag named is the largest part."""
    memory = physical_memory()
    values = (samples, test_samples, features, classes)
    if memory is None or not all(isinstance(v, int) and v > 0 for v in values):
        return                            # the types and lower bounds: pserver.data's checks
    parts = {"--samples": samples * (features + 1), "--test-samples": test_samples * (features + 1),
             "--classes": classes * features}
    need = 4 * sum(parts.values())
    if need > memory:
        flag = max(parts, key=parts.get)
        raise ConfigError(f"{flag}: the synthetic dataset of --samples {samples}, --test-samples "
                          f"{test_samples}, --features {features} and --classes {classes} would take "
                          f"{need / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB "
                          f"of memory")


@dataclass(frozen=True)
class Cluster:
    """Who is where, from TF_CONFIG: shard addresses, worker addresses (chief first), our task."""
    ps: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    task_type: str = ""
    task_index: int = 0
    has_chief: bool = False

    @property
    def rank(self) -> int:
        """Our worker rank: the chief is 0 and the `worker` list follows it."""
        if self.task_type == "chief":
            return 0
        return self.task_index + (1 if self.has_chief else 0)


def parse_address(addr: str, what: str = "--ps") -> str:
    """'host[:port]' -> 'host:port' with the default port; a clear error otherwise."""
    addr = addr.strip()
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = addr, str(DEFAULT_PORT)
    if not HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: '{addr}' is not an address of the form host:port")
    return f"{host}:{int(port)}"


def parse_tf_config(text: str | None) -> Cluster | None:
    """Parse TF_CONFIG (the JSON TensorFlow and Kubeflow's TFJob set); None if unset."""
    if not text:
        return None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"TF_CONFIG: not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster", {}), dict):
        raise ConfigError("TF_CONFIG: expected an object with 'cluster' and 'task' keys")
    cluster, task = cfg.get("cluster", {}), cfg.get("task", {})
    if not isinstance(task, dict):
        raise ConfigError("TF_CONFIG: 'task' must be an object like {\"type\": \"worker\", \"index\": 0}")
    lists = {}
    for key in ("ps", "worker", "chief"):
        value = cluster.get(key, [])
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ConfigError(f"TF_CONFIG: cluster.{key} must be a list of 'host:port' strings")
        lists[key] = tuple(parse_address(a, f"TF_CONFIG cluster.{key}") for a in value)
    task_type, index = task.get("type", ""), task.get("index", 0)
    if task_type not in ("", "ps", "worker", "chief", "evaluator"):
        raise ConfigError(f"TF_CONFIG: task.type '{task_type}' is not ps, worker or chief")
    if not isinstance(index, int) or index < 0:
        raise ConfigError(f"TF_CONFIG: task.index must be a non-negative integer, got {index!r}")
    if task_type in ("ps", "worker", "chief") and index >= len(lists[task_type]):
        raise ConfigError(f"TF_CONFIG: task {task_type}:{index} is not in cluster.{task_type} "
                          f"({len(lists[task_type])} entries)")
    return Cluster(ps=lists["ps"], workers=lists["chief"] + lists["worker"], task_type=task_type,
                   task_index=index, has_chief=bool(lists["chief"]))


DATA_ASSIGNMENTS = Registry("data assignment", "--data-assignment")
DATA_ASSIGNMENTS.add("leases", "shard 0 leases chunks of every epoch to the workers, so a dead or slow "
                               "worker's rest goes to another (default; docs/guide/data-leases.md)")
DATA_ASSIGNMENTS.add("slices", "each rank trains its own slice of every epoch (the behaviour before leases, "
                               "to reproduce earlier figures)")

# --delay (pserver.worker.stragglers draws the delays): distribution -> how many numbers it takes
DELAYS = {"fixed": 1, "uniform": 2, "exponential": 1, "lognormal": 2}


def parse_delay(spec: str) -> tuple[str, tuple[float, ...]]:
    kind, _, rest = spec.partition(":")
    if kind not in DELAYS:
        raise ConfigError(f"--delay: unknown distribution '{kind}' in '{spec}'; "
                          f"use fixed:S, uniform:A,B, exponential:MEAN or lognormal:MEAN,SIGMA")
    try:
        args = tuple(float(x) for x in rest.split(",")) if rest else ()
    except ValueError:
        raise ConfigError(f"--delay: '{spec}' has a value that is not a number") from None
    if len(args) != DELAYS[kind] or any(x < 0 or not math.isfinite(x) for x in args):
        raise ConfigError(f"--delay: '{spec}' needs {DELAYS[kind]} non-negative number(s) after '{kind}:'")
    if kind == "uniform" and args[0] > args[1]:
        raise ConfigError(f"--delay: '{spec}' has A > B")
    if kind == "lognormal" and args[0] == 0:
        raise ConfigError(f"--delay: '{spec}' needs a mean above 0")
    return kind, args
