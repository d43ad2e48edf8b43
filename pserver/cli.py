"""The `pserver` command: serve, worker, launch, slurm, status, evaluate, checkpoint, export.

Each subcommand parses flags (falling back to TF_CONFIG for the cluster), builds a
frozen config and calls one function. A user's mistake prints one line and exits 2; a
failure at run time prints one line and exits 1, or 138 when a restart may fix it (a shard
unreachable past the deadline); there is never a traceback for any of them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass, field

from pserver import __version__
from pserver.config import (
    DATA_ASSIGNMENTS,
    DATA_PLANES,
    MODES,
    SCHEDULING,
    ServerConfig,
    WorkerConfig,
    check_delay_ranks,
    check_seconds,
    parse_address,
    parse_log_level,
    parse_rank,
    parse_tf_config,
)
from pserver.data import DATASETS
from pserver.data.npz import SCALE_UINT8
from pserver.errors import ConfigError
from pserver.launch.base import BACKENDS, parse_delay_for
from pserver.launch.roles import exit_code, one_blas_thread, run_shard, run_training
from pserver.models import MODELS
from pserver.optim import OPTIMIZERS, SCHEDULES
from pserver.signals import exiting_after, follow_parent
from pserver.sparse.compact import ROW_DTYPES, STATE_DTYPES
from pserver.sparse.optim import ROWS
from pserver.wire.compress import CODECS, PULL_CODECS

DESCRIPTION = """\
pserver: a parameter server for data-parallel training.

Shards (`pserver serve`) hold the model's parameters, cut into contiguous ranges, and
apply updates; workers (`pserver worker`) pull the weights, compute gradients on their
slice of the data and push them back. `pserver launch` runs a whole cluster on this
machine; `pserver status` shows what the shards are doing.

Consistency modes (--mode):
""" + "".join(f"  {name:8} {summary}\n" for name, summary in MODES.table_rows())


def described(registry) -> str:
    """A registry's entries for a flag's help: "form: summary; form: summary; ..."."""
    return "; ".join(f"{form}: {summary}" for form, summary in registry.table_rows())


def row_params_help() -> str:
    """Each row optimizer's hyper-parameters and their defaults, from ROWS."""
    return "; ".join(f"{rule.name} " + ", ".join(f"{k} ({p.default:g})" for k, p in rule.params.items())
                     for rule in ROWS.values() if rule.params)


@dataclass(frozen=True)
class Flag:
    name: str
    kwargs: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error, like every other error of ours (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def unrecognized(self, extra: list[str]):
        """The error for arguments no flag takes, with the closest flag to the first one."""
        bad = next((a for a in extra if a.startswith("-")), extra[0])
        known = [o for o in self._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(bad.partition("=")[0], known, n=1)
        self.error(f"unrecognized argument {bad}" + (f"; did you mean {close[0]}?" if close else ""))


def shard_count(text: str) -> int:
    """launch --ps: how many shards to start; shard addresses get told what --ps means here."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a number: on launch, --ps is how many shards to start on this machine "
            "(`pserver worker` and `pserver status` take shard addresses host:port)") from None


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None


# Flags forwarded by `launch` to every shard: everything but where the shard listens.
SERVER_FLAGS = [
    Flag("--mode", dict(choices=MODES.names(), help="consistency mode (default sync)")),
    Flag("--backup-workers", dict(type=int, metavar="B", help="backup mode: a step completes once N-B "
                                                              "distinct workers pushed")),
    Flag("--min-workers", dict(type=int, metavar="N", help="elastic workers: sync and backup steps wait "
                               "while fewer members are live or finished (default: not set, a dead "
                               "worker never holds the others up)")),
    Flag("--max-workers", dict(type=int, metavar="N", help="elastic workers: workers may join (pserver "
                               "worker --rank auto) up to N in all (default --num-workers)")),
    Flag("--staleness", dict(type=int, metavar="S", help="ssp mode: a worker may run at most S clocks ahead "
                                                         "of the slowest")),
    Flag("--step-timeout", dict(type=float, metavar="SEC", help="seconds a step waits for a worker before "
                                                                "marking it dead (default 60)")),
    Flag("--optimizer", dict(choices=OPTIMIZERS.names(), help="update rule run on the shards "
                             f"(default sgd). {described(OPTIMIZERS)}")),
    Flag("--lr", dict(type=float, help="learning rate for the mean gradient of a step (default 0.05)")),
    Flag("--lr-schedule", dict(metavar="SPEC", help=" | ".join(SCHEDULES.forms()))),
    Flag("--momentum", dict(type=float, help="momentum: the momentum coefficient (default 0.9); rmsprop: "
                            "the momentum of its increments (default 0: none)")),
    Flag("--nesterov", dict(action="store_true", default=None, help="Nesterov momentum (momentum only)")),
    Flag("--beta1", dict(type=float, help="adam, adamw: beta1 (default 0.9)")),
    Flag("--beta2", dict(type=float, help="adam, adamw: beta2 (default 0.999)")),
    Flag("--eps", dict(type=float, help="adam: epsilon added to the corrected sqrt(v) (default 1e-8); adamw: "
                       "added to sqrt(v), Keras's epsilon hat (default 1e-7); rmsprop, adagrad: added under "
                       "the square root (default 1e-7)")),
    Flag("--weight-decay", dict(type=float, help="sgd, momentum, adam, rmsprop, adagrad: L2 coefficient "
                                "added to the gradient (coupled; default 0); adamw: decoupled decay, "
                                "w -= lr * wd * w before the step, as Keras (default 0.004)")),
    Flag("--clipvalue", dict(type=float, metavar="C", help="clip the step's gradient element-wise to "
                             "[-C, C] before the update rule, Keras's clipvalue (default 0: none)")),
    Flag("--rho", dict(type=float, help="rmsprop: discount of the moving average of squared gradients "
                       "(default 0.9)")),
    Flag("--centered", dict(action="store_true", default=None, help="rmsprop: divide by the gradient's "
                            "estimated variance rather than its second moment")),
    Flag("--initial-accumulator", dict(type=float, metavar="A", help="adagrad: the accumulator's starting "
                                       "value (default 0.1)")),
    Flag("--threads", dict(type=int, help="gRPC threads per shard (default 64, raised to 2 per "
                                          "worker + 12): parked pulls may take 60%% of the threads "
                                          "left after 8 kept for Status and other control calls")),
    Flag("--max-inflight-mb", dict(type=int, help="MiB of pushed gradients a shard receives at once "
                                                  "(default 1024); more pushes wait their turn "
                                                  "(RESOURCE_EXHAUSTED, retried by workers)")),
    Flag("--table-threads", dict(type=int, metavar="T", help="threads one sparse pull or push of at least "
                                 "16,384 ids may use on a shard, in parts of 8,192 or more ids "
                                 "(default 2; 1: the calling thread only)")),
    Flag("--sched", dict(choices=SCHEDULING.names(), help=described(SCHEDULING))),
    Flag("--max-memory-mb", dict(type=int, help="MiB this shard may hold: the dense range and every "
                                                "sparse table's rows, slots and index, with an eighth "
                                                "for pushes in flight; a push whose new rows do not "
                                                "fit evicts rows of tables with max_rows or ttl_steps, "
                                                "else is refused (default 0: 90%% of the memory "
                                                "available at start)")),
    Flag("--checkpoint-dir", dict(metavar="DIR", help="write checkpoints here, atomically (checked writable "
                                  "at start; newest 3 kept; after every epoch, at the end and "
                                  "on SIGTERM too)")),
    Flag("--restore", dict(metavar="DIR", help="resume from DIR's checkpoints: in sync and backup the "
                           "newest version every shard's file loads at, in async and ssp this shard's "
                           "newest; files of another number of shards are combined (fresh if DIR has "
                           "none; refused if it has only corrupt ones)")),
    Flag("--restore-fresh-if-corrupt", dict(action="store_true", default=None,
                                            help="with --restore: start fresh, losing the trained state, "
                                                 "when every checkpoint in DIR is corrupt "
                                                 "(default: refuse to start)")),
    Flag("--checkpoint-every", dict(type=int, metavar="STEPS", help="checkpoint at versions STEPS, 2*STEPS, "
                                    "... (needs --checkpoint-dir)")),
    Flag("--checkpoint-secs", dict(type=float, metavar="SEC", help="checkpoint every SEC seconds "
                                                                   "(needs --checkpoint-dir)")),
    Flag("--full-every", dict(type=int, metavar="N", help="write a full base every N checkpoints and, "
                              "between them, deltas of the rows changed since the file before (a base "
                              "also as soon as the deltas add up to a third of it); 1: every checkpoint "
                              "full (default 10)")),
]

# What `pserver run`'s shards take from the script's compile(optimizer=...), not from flags.
RUN_FROM_COMPILE = {"--optimizer", "--lr", "--lr-schedule", "--momentum", "--nesterov", "--beta1", "--beta2",
                    "--eps", "--weight-decay", "--rho", "--centered", "--initial-accumulator", "--clipvalue"}

# Flags forwarded by `launch` to every worker: everything but rank and addresses.
WORKER_FLAGS = [
    Flag("--model", dict(metavar="NAME", help=f"one of {', '.join(MODELS.names())} (default mlp; "
                         "lr, fm, wide_deep and deepfm take Criteo data and keep sparse embedding tables "
                         "on the shards); or your own: FILE.py:FUNCTION or package.module:FUNCTION "
                         "returning a pserver.Sequential")),
    Flag("--hidden", dict(type=int_list, metavar="W,W", help="hidden widths: mlp (default 256,256), the deep "
                                                                  "tower of wide_deep and deepfm "
                                                                  "(default 256,128)")),
    Flag("--dataset", dict(metavar="NAME", help=f"default synthetic. {described(DATASETS)}")),
    Flag("--data-dir", dict(metavar="DIR", help="directory with the MNIST IDX files, downloaded there when "
                                                "missing (default $PSERVER_MNIST_DIR, else "
                                                "$XDG_CACHE_HOME/pserver/mnist, ~/.cache/pserver/mnist)")),
    Flag("--scale-uint8", dict(choices=SCALE_UINT8, help="a .npz whose x is uint8 (0-255 pixels): "
                               "auto (default) divides it by 255 and says so; none keeps the raw values")),
    Flag("--samples", dict(type=int, help="synthetic, criteo-synthetic: training samples (default 60000)")),
    Flag("--test-samples", dict(type=int, help="synthetic, criteo-synthetic: test samples; criteo:PATH: "
                                                        "at most this many held-out lines (default 10000)")),
    Flag("--features", dict(type=int, help="synthetic: input features (default 784)")),
    Flag("--classes", dict(type=int, help="synthetic: classes (default 10)")),
    Flag("--batch-size", dict(type=int, help="samples per step on each worker (default 64)")),
    Flag("--epochs", dict(type=int, help="passes over each worker's slice of the data (default 1)")),
    Flag("--max-steps", dict(type=int, help="stop each worker after this many steps (default: no limit)")),
    Flag("--seed", dict(type=int, help="seed for data order and initial weights (default 0)")),
    Flag("--device", dict(help="where gradients are computed: cpu (default), cuda or cuda:I (numba.cuda, "
                               "for models of Dense, Conv2D, pooling, Flatten and Dropout layers; "
                               "honours CUDA_VISIBLE_DEVICES; launch spreads workers over the GPUs)")),
    Flag("--log-every", dict(type=float, metavar="SEC", help="seconds between progress lines when the output "
                             "is not a terminal (default 10; on one, the chief shows a bar)")),
    Flag("--connect-timeout", dict(type=float, metavar="SEC", help="seconds to wait for the shards at start "
                                                                   "(default 30)")),
    Flag("--rpc-deadline", dict(type=float, metavar="SEC", help="seconds one pull or push may take "
                                                                "(default 300)")),
    Flag("--eval-every", dict(type=float, metavar="SEC", help="chief: evaluate every SEC seconds too "
                                                              "(accuracy against time in the summary)")),
    Flag("--compress", dict(metavar="CODEC", help=f"compress pushes. {described(CODECS)}. The lossy ones "
                            "keep what they drop as a residual added to the next gradient. Compressed "
                            "pushes always go over gRPC (README: Choosing a codec)")),
    Flag("--pull-compress", dict(metavar="CODEC", help=f"compress gRPC pulls. {described(PULL_CODECS)}: "
                                 "the worker computes with the weights rounded to bf16. Pulls through "
                                 "shared memory stay float32")),
    Flag("--delay", dict(metavar="DIST", help="straggler delay per step: fixed:S, uniform:A,B, "
                                              "exponential:MEAN, lognormal:MEAN,SIGMA")),
    Flag("--data-assignment", dict(choices=DATA_ASSIGNMENTS.names(), help=described(DATA_ASSIGNMENTS)
                                   + " (leases: in-memory data and MNIST)")),
    Flag("--chunk-batches", dict(type=int, metavar="B", help="leases: batches per chunk of the data "
                                 "(default 16)")),
    Flag("--no-shuffle", dict(action="store_true", default=None,
                              help="leases: train every epoch on the data in its order (chunks leased in "
                                   "order, batches in order within them), as Keras's fit(shuffle=False); "
                                   "default: each epoch a permutation drawn from --seed")),
    Flag("--window-batches", dict(type=int, metavar="B", help="stream:PATH: batches per window, the stream's "
                                  "epoch: --epochs N trains N windows, the chief prints each window's "
                                  "progressive metrics at its end, chunks are leased within it "
                                  "(default 100)")),
    Flag("--export-every", dict(type=float, metavar="SEC", help="chief: every SEC seconds ask the shards to "
                                "checkpoint (they need one --checkpoint-dir) and export what they hold into "
                                "--export-dir: DIR/model the first time, then a delta since the one before "
                                "into DIR/deltas, which pserver serve-model DIR/model --follow DIR/deltas "
                                "applies")),
    Flag("--export-dir", dict(metavar="DIR", help="chief: where --export-every writes")),
    Flag("--export-keep-deltas", dict(type=int, metavar="N", help="chief: keep the N newest deltas in "
                                      "DIR/deltas, removing older ones (default 0: every one); a server "
                                      "behind them takes up the model they make whole")),
    Flag("--embedding-dim", dict(type=int, metavar="K", help="fm, wide_deep, deepfm: values per id in the "
                                 "sparse factor table (default 8)")),
    Flag("--row-optimizer", dict(choices=ROWS.names(), help="lr, fm, wide_deep, deepfm: the sparse "
                                 "tables' row optimizer, run on the shards on the rows a push touches "
                                 f"(default adagrad). {described(ROWS)}")),
    Flag("--row-lr", dict(type=float, help="the row optimizer's learning rate (default 0.05)")),
    Flag("--row-params", dict(metavar="KEY=VALUE,...", help="the row optimizer's other hyper-parameters, "
                              f"with their defaults: {row_params_help()}; e.g. "
                              "--row-params initial_accumulator=0.1 (Keras's)")),
    Flag("--min-count", dict(type=int, metavar="K", help="sparse tables: store an id's row only once it was "
                             "pushed K times; until then it reads its initial value (default 0: at once)")),
    Flag("--max-rows", dict(type=int, metavar="R", help="sparse tables: at most R rows per table per shard, "
                            "the least recently updated evicted first (default 0: no bound)")),
    Flag("--ttl-steps", dict(type=int, metavar="T", help="sparse tables: evict rows not updated for T steps "
                             "(default 0: never)")),
    Flag("--row-dtype", dict(choices=ROW_DTYPES.names(), help="sparse tables: how the shards store rows; "
                             "float16 and bfloat16 halve a row, the optimizer computing in float32 and "
                             "rounding stochastically (seeded: runs repeat) (default float32)")),
    Flag("--state-dtype", dict(choices=STATE_DTYPES.names(), help="sparse tables: how the shards store the "
                               "row optimizer's slots: float32, or row (the row's type) (default float32)")),
    Flag("--require-fresh", dict(action="store_true", default=None,
                                 help="chief: refuse (exit 2) when the shards already hold trained state "
                                      "(default: continue from it, saying so)")),
    Flag("--no-resume", dict(action="store_true", default=None,
                             help="start this worker's data at epoch 1, step 1, even where the shards "
                                  "recorded its position (default: a restarted worker, or a job restored "
                                  "from checkpoints, goes on from the step it had reached; --epochs counts "
                                  "the epochs of the whole run, as in Keras)")),
    Flag("--session-dir", dict(metavar="DIR", help="where this worker keeps its session credentials, in a "
                               "file of mode 0600 in a directory of mode 0700, so that a restarted worker "
                               "takes its rank back at once instead of waiting --step-timeout for its old "
                               "session (default $XDG_STATE_HOME/pserver/sessions, i.e. "
                               "~/.local/state/pserver/sessions; 'none': keep no file)")),
    Flag("--tensorboard", dict(metavar="DIR", help="chief: write TensorBoard scalars here (train loss, "
                               "samples/s, staleness; test accuracy or AUC and loss per epoch)")),
    Flag("--save", dict(metavar="PATH", help="chief: write the trained model here at the end: its definition "
                                             "and weights in an .npz that numpy reads; a model with sparse "
                                             "tables, a directory with every table's rows gathered from "
                                             "the shards (docs/model-file.md; "
                                             "`pserver evaluate --model-file PATH`)")),
]
# What `pserver evaluate` takes of the worker flags: the model and the dataset.
EVALUATE_FLAGS = [f for f in WORKER_FLAGS if f.name in ("--model", "--hidden", "--dataset", "--data-dir",
                                                        "--samples", "--test-samples", "--features",
                                                        "--classes", "--seed")]
# What `pserver export` takes of them: evaluate's, and the embedding width (default: the checkpoints').
EXPORT_FLAGS = EVALUATE_FLAGS + [f for f in WORKER_FLAGS if f.name == "--embedding-dim"]

COMMON_FLAGS = [
    Flag("--chunk-bytes", dict(type=int, help="payload bytes per streamed message (default 1048576)")),
    Flag("--data-plane", dict(choices=DATA_PLANES.names(), help=described(DATA_PLANES))),
]

# Prometheus metrics, on shards and workers alike; launch and slurm give each process its own port.
METRICS_FLAGS = [
    Flag("--metrics-port", dict(type=int, metavar="P", help="serve Prometheus metrics at "
                                "http://HOST:P/metrics (0: a free port, printed); under launch and slurm the "
                                "processes of a host get P, P+1, ..., shards first")),
    Flag("--metrics-host", dict(metavar="HOST", help="address the metrics listen on (default: a shard's "
                                "--host, a worker's 127.0.0.1)")),
]

# Security flags: in no table above, because launch must never put a token on a child's
# command line (it hands PSERVER_AUTH_TOKEN over in the environment).
AUTH_TOKEN = Flag("--auth-token", dict(metavar="TOKEN", help="shared secret that every RPC must carry "
                  "(default: $PSERVER_AUTH_TOKEN, which is safer: a flag shows in `ps`)"))
TLS_CERT = Flag("--tls-cert", dict(metavar="PEM", help="serve over TLS with this certificate (chain)"))
TLS_KEY = Flag("--tls-key", dict(metavar="PEM", help="the private key of --tls-cert"))
TLS_CA = Flag("--tls-ca", dict(metavar="PEM", help="talk to the shards over TLS, "
                                                   "trusting this CA certificate"))
TOKEN_FILE = Flag("--token-file", dict(metavar="PATH", help="read the token from this file (one line; "
                  "it must be your own, mode 0600, as ssh asks of a key); `pserver launch` writes its "
                  "generated token to one and prints its path"))
SERVE_SECURITY = [AUTH_TOKEN, TOKEN_FILE, TLS_CERT, TLS_KEY]
CLIENT_SECURITY = [AUTH_TOKEN, TOKEN_FILE, TLS_CA]


def add_flags(parser, flags, title):
    group = parser.add_argument_group(title)
    for f in flags:
        group.add_argument(f.name, **({"default": None} | f.kwargs))


def given(ns, flags) -> dict:
    """The flags the user actually set, by config field name."""
    return {f.dest: getattr(ns, f.dest) for f in flags if getattr(ns, f.dest, None) is not None}


CHECKPOINT_HELP = """\
Checkpoint directories, offline (no shard needs to run).
Example: pserver checkpoint inspect ckpt
         pserver checkpoint reshard --from ckpt --to ckpt3 --num-shards 3
A shard started with --restore on a directory of another number of shards does
the same as reshard by itself (docs/semantics.md, "Checkpoints").
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pserver", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pserver {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p.commands = sub.choices          # name -> its parser, for main's errors
    fmt = argparse.RawDescriptionHelpFormatter

    s = sub.add_parser("serve", help="run one parameter-server shard", formatter_class=fmt,
                       description="Run one shard: hold parameters [start, end) of the flat vector and apply "
                                   "updates.\n"
                                   "Example: pserver serve --port 2222 --shard 0 --num-shards 2 "
                                   "--num-workers 4 --optimizer adam --lr 0.001")
    g = s.add_argument_group("cluster (TF_CONFIG with task.type ps fills what is not given)")
    g.add_argument("--host", default=None,
                   help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=None,
                   help="port to bind (default 2222; 0 picks a free one and prints it)")
    g.add_argument("--shard", type=int, default=None, help="this shard's index J (default 0)")
    g.add_argument("--num-shards", type=int, default=None, help="number of shards S (default 1)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="number of workers N (default: learnt from the first worker)")
    g.add_argument("--log-level", type=parse_log_level, default="INFO", metavar="LEVEL",
                   help="server log level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)")
    add_flags(s, SERVER_FLAGS, "training")
    add_flags(s, COMMON_FLAGS, "transport")
    add_flags(s, METRICS_FLAGS, "metrics")
    add_flags(s, SERVE_SECURITY, "security")

    w = sub.add_parser("worker", help="run one worker", formatter_class=fmt,
                       description="Run one worker: pull weights, compute gradients with numba kernels, push "
                                   "them.\n"
                                   "Example: pserver worker --ps 127.0.0.1:2222,127.0.0.1:2223 --rank 0 "
                                   "--num-workers 2 --dataset mnist")
    g = w.add_argument_group("cluster (TF_CONFIG with task.type worker or chief fills what is not given)")
    g.add_argument("--ps", default=None, metavar="ADDR[,ADDR...]",
                   help="shard addresses host:port, shard 0 first (default: TF_CONFIG's cluster.ps, "
                        "else 127.0.0.1:2222, which the worker then says it dials)")
    g.add_argument("--rank", type=parse_rank, default=None, metavar="RANK|auto",
                   help="this worker's rank; 0 is the chief (default 0). auto: join a running job with "
                        "a free rank that shard 0 assigns (never 0; needs --max-workers on the shards)")
    g.add_argument("--num-workers", type=int, default=None, help="number of workers N (default 1)")
    g.add_argument("--summary-json", default=None, metavar="PATH", help="chief: write the run summary here")
    g.add_argument("--stats-json", default=None, metavar="PATH",
                   help="write this worker's time breakdown here")
    g.add_argument("--stop-shards", action="store_true", default=None,
                   help="chief: once the run is over, every shard checkpoints and exits 0")
    add_flags(w, WORKER_FLAGS, "training")
    add_flags(w, COMMON_FLAGS, "transport")
    add_flags(w, METRICS_FLAGS, "metrics")
    add_flags(w, CLIENT_SECURITY, "security")

    la = sub.add_parser("launch", help="run S shards and N workers on this machine", formatter_class=fmt,
                        description="Start S shard processes and N worker processes on 127.0.0.1 with free "
                                    "ports,\n"
                                    "prefix their output with their role, stop everything if one fails, and "
                                    "report.\n"
                                    "Any serve or worker flag below is passed on to every shard or worker.\n"
                                    "With --backend ray they are Ray actors instead, on a Ray started here "
                                    "or the\n"
                                    "cluster at --address, with the same output, summary and exit codes.\n"
                                    "Example: pserver launch --ps 2 --workers 4 --dataset mnist --optimizer "
                                    "adam --lr 0.001 --epochs 2")
    la.add_argument("--ps", type=shard_count, default=1, metavar="S",
                    help="number of shards to start (default 1); worker and status take addresses instead")
    la.add_argument("--workers", type=int, default=2, metavar="N", help="number of workers (default 2)")
    la.add_argument("--summary-json", default=None, metavar="PATH", help="write the run summary here")
    la.add_argument("--backend", choices=BACKENDS.names(), default="local",
                    help=f"{described(BACKENDS)}; ray needs pip install -e '.[ray]'")
    la.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                    help="with --backend ray: the running Ray cluster to use (auto: the one this machine "
                         "belongs to); default: start a Ray on this machine for this run")
    la.add_argument("--delay-ranks", type=int_list, default=None, metavar="I,J",
                    help="apply --delay only to these worker ranks (default: all)")
    la.add_argument("--delay-for", action="append", default=[], metavar="I[,J]=DIST",
                    help="these ranks get this delay instead (repeatable), e.g. --delay fixed:0.02 "
                         "--delay-for 0=fixed:0.08: every worker slowed, rank 0 four times as much")
    add_flags(la, SERVER_FLAGS, "shard flags (passed to every shard)")
    add_flags(la, WORKER_FLAGS, "worker flags (passed to every worker)")
    add_flags(la, COMMON_FLAGS, "transport")
    add_flags(la, METRICS_FLAGS, "metrics")
    add_flags(la, SERVE_SECURITY + [TLS_CA], "security (a token is generated unless given; it reaches "
                                             "the processes in their environment, never their argv)")

    ru = sub.add_parser("run", help="run a script once per worker, with S shards: pserver run --ps 2 "
                                    "--workers 4 -- python train.py", formatter_class=fmt,
                        description="Start a command (a Keras-style script: pserver.keras) once per "
                                    "worker, with the\n"
                                    "cluster in its environment, as torchrun does; the shards start "
                                    "beside them and\n"
                                    "run the optimizer the workers' fit says they compiled. Only the chief "
                                    "prints what\n"
                                    "fit prints; the exit code is the first failing worker's. fit's "
                                    "batch_size is the\n"
                                    "global batch, split across the workers (launch's --batch-size is "
                                    "per worker).\n"
                                    "Example: pserver run --ps 2 --workers 4 -- python "
                                    "keras_mnist_convnet.py")
    ru.add_argument("--ps", type=shard_count, default=1, metavar="S", help="number of shards (default 1)")
    ru.add_argument("--workers", type=int, default=2, metavar="N", help="number of workers (default 2)")
    ru.add_argument("--seed", type=int, default=None, help="the run's seed: initial weights, shuffling, "
                                                            "dropout (default 0)")
    ru.add_argument("--bind-cores", action=argparse.BooleanOptionalAction, default=None,
                    help="bind worker i to core i of the cores this process may use, in turn when there "
                         "are more workers, as mpirun --bind-to core (Linux); the shards are not bound. "
                         "Default: bound when every worker has a core of its own, and a worker that "
                         "waits for its core (another process keeps it busy) lets go of it; "
                         "--no-bind-cores: never bound")
    add_flags(ru, [f for f in SERVER_FLAGS if f.name not in RUN_FROM_COMPILE],
              "shard flags (the optimizer is the script's compile's)")
    ru.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                    help="the command each worker runs; a script.py alone runs under this Python")

    sl = sub.add_parser("slurm", help="one task of an srun step: a shard or a worker, by SLURM_PROCID",
                        formatter_class=fmt,
                        description="Run as every task of one srun step: tasks 0..S-1 serve, the others are "
                                    "workers\n"
                                    "with rank SLURM_PROCID - S; the chief ends the shards when the run is "
                                    "over.\n"
                                    "The token comes from $PSERVER_AUTH_TOKEN (deploy/slurm/pserver.sbatch "
                                    "makes one).\n"
                                    "Exit codes: 0 done, 2 a bad flag or environment, 1 a failure, "
                                    "128+signal when\n"
                                    "stopped (143: scancel's SIGTERM); srun exits with the highest of its "
                                    "tasks'.\n"
                                    "Example: srun --ntasks=6 pserver slurm --ps 2 --dataset mnist "
                                    "--epochs 2")
    sl.add_argument("--ps", type=int, required=True, metavar="S",
                    help="how many of the step's tasks are shards")
    sl.add_argument("--base-port", type=int, default=8888, metavar="P",
                    help="a task listens on P + its index on its host (default 8888)")
    sl.add_argument("--host", default=None, help="address shards bind (default: their host's name as "
                                                 "SLURM_STEP_NODELIST lists it, the one the workers dial)")
    sl.add_argument("--summary-json", default=None, metavar="PATH", help="chief: write the run summary here")
    sl.add_argument("--log-level", type=parse_log_level, default="INFO", metavar="LEVEL",
                    help="shard log level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)")
    add_flags(sl, SERVER_FLAGS, "shard flags")
    add_flags(sl, WORKER_FLAGS, "worker flags")
    add_flags(sl, COMMON_FLAGS, "transport")
    add_flags(sl, METRICS_FLAGS, "metrics")
    add_flags(sl, [TOKEN_FILE, TLS_CERT, TLS_KEY, TLS_CA], "security")

    st = sub.add_parser("status", help="show each shard's version, mode, size and counters",
                        description="Example: pserver status --ps 127.0.0.1:2222,127.0.0.1:2223")
    st.add_argument("--ps", default=None, metavar="ADDR[,ADDR...]",
                    help="shard addresses (default: from TF_CONFIG)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each shard (default 5)")
    add_flags(st, CLIENT_SECURITY, "security")

    ev = sub.add_parser("evaluate", help="test metrics of a saved model (--save) or of checkpoints",
                        formatter_class=fmt,
                        description="Evaluate a trained model on a dataset's test set: the model file that "
                                    "--save\n"
                                    "wrote (its definition, weights and dataset), or the shards' checkpoints "
                                    "in\n"
                                    "--checkpoint DIR (weights only: the model and dataset from the file or "
                                    "the flags).\n"
                                    "Example: pserver evaluate --model-file model.npz\n"
                                    "         pserver evaluate --checkpoint ckpt --model mlp --dataset mnist")
    ev.add_argument("--model-file", default=None, metavar="PATH", help="a model file written by --save")
    ev.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="take the weights from DIR's checkpoints: the state a restore reads (--mode)")
    ev.add_argument("--mode", default="sync", choices=MODES,
                    help="with --checkpoint, the job's mode: sync and backup read the newest version every "
                         "shard has (a consistent cut), async and ssp each shard's newest (default sync)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of a line")
    add_flags(ev, EVALUATE_FLAGS, "model and dataset (default: the model file's)")

    ck = sub.add_parser("checkpoint", help="inspect a checkpoint directory, or reshard it offline",
                        formatter_class=fmt,
                        description=CHECKPOINT_HELP)
    cks = ck.add_subparsers(dest="action", metavar="ACTION", required=True)
    ins = cks.add_parser("inspect", help="files, versions, layout, tables, rows, bytes, checksums and the "
                                         "consistent cuts of a directory")
    ins.add_argument("directory", metavar="DIR")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.add_argument("--mode", default="sync", choices=MODES,
                     help="the job's mode, for the state a restore reads: sync and backup the newest "
                          "version every shard has (a consistent cut), async and ssp each shard's newest "
                          "(default sync); exit 1 when there is none")
    rs = cks.add_parser("reshard", help="write the newest usable set of DIR as checkpoints of S' shards",
                        description="Combine the checkpoints S shards wrote into files for S' shards: each "
                                    "new shard\ntakes its dense range and the rows whose id hashes to it, "
                                    "with their optimizer state.")
    rs.add_argument("--from", dest="source", required=True, metavar="DIR", help="the directory to read")
    rs.add_argument("--to", dest="target", required=True, metavar="DIR", help="where the new files go")
    rs.add_argument("--num-shards", type=int, required=True, metavar="S", help="the new number of shards")
    rs.add_argument("--mode", default="sync", choices=MODES,
                    help="the job's mode: sync and backup read the newest version every shard has (a "
                         "consistent cut), async and ssp each shard's newest (default sync)")

    ex = sub.add_parser("export", help="write the model that a checkpoint directory holds as a model file",
                        formatter_class=fmt,
                        description="Build a model file offline from the newest usable checkpoints in DIR "
                                    "(any number of\nshards): the dense weights and, for a model with "
                                    "sparse tables, every table's rows\n(a directory; docs/model-file.md). "
                                    "The model and dataset flags are the training run's.\n"
                                    "Example: pserver export --restore ckpt --model wide_deep "
                                    "--dataset criteo-synthetic --out ctr-model\n"
                                    "         pserver evaluate --model-file ctr-model")
    ex.add_argument("--restore", required=True, metavar="DIR", help="the checkpoint directory to read")
    ex.add_argument("--out", required=True, metavar="MODEL", help="where the model goes (written beside it "
                    "as MODEL.PID.tmp, then renamed)")
    ex.add_argument("--mode", default="sync", choices=MODES,
                    help="the job's mode: sync and backup read the newest version every shard has (a "
                         "consistent cut), async and ssp each shard's newest (default sync)")
    ex.add_argument("--since", default=None, metavar="MODEL",
                    help="write a delta instead: the rows changed since MODEL (an export or --save of "
                         "this job) and the ids gone since; apply it with load_model(MODEL).apply(OUT)")
    ex.add_argument("--follow", action="store_true",
                    help="with --since: keep going, writing into the directory --out a delta each time "
                         "the checkpoints reach a newer version, each since the one before (what "
                         "pserver serve-model MODEL --follow DIR applies); stops on SIGTERM or SIGINT")
    ex.add_argument("--poll", type=float, default=5.0, metavar="S",
                    help="--follow: seconds between looks at the checkpoints (default 5)")
    ex.add_argument("--keep-deltas", type=int, default=0, metavar="N",
                    help="--follow: keep the N newest deltas in --out and remove the older ones (default "
                         "0: keep every one); a server that falls behind them takes up the model they "
                         "make (OUT/.base) whole")
    ex.add_argument("--json", action="store_true", help="print JSON instead of a line")
    add_flags(ex, EXPORT_FLAGS, "model and dataset (as the run trained; seed and --embedding-dim default "
                                "to the checkpoints')")
    ig = sub.add_parser("ingest", help="append the lines sent over TCP to the file a stream job follows",
                        formatter_class=fmt,
                        description="Listen for events sent as lines over TCP and append each complete line "
                                    "to FILE,\nwhich a job trains on with --dataset stream:FILE (a "
                                    "worker that dies loses none:\nthe lines are in the file before any "
                                    "worker reads them). A connection's bytes\nafter its last newline are "
                                    "dropped and counted. SIGTERM or SIGINT stops it.\n"
                                    "Example: pserver ingest --port 9000 --out events.tsv")
    ig.add_argument("--out", required=True, metavar="FILE", help="the file to append to (created if missing)")
    ig.add_argument("--port", type=int, default=9000, help="TCP port (default 9000; 0 picks a free one)")
    ig.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; the "
                                                        "lines are not authenticated: keep it local or "
                                                        "behind your network's rules)")
    sm = sub.add_parser("serve-model", help="answer a model file's predictions over gRPC and HTTP, following "
                                            "its delta exports", formatter_class=fmt,
                        description="Serve a model file (a --save, an export, or one compacted after "
                                    "deltas): predictions over gRPC\n(pserver.v1.Predictor) and HTTP/JSON "
                                    "(POST /v1/models/NAME:predict, TensorFlow Serving's shape),\n"
                                    "health (/healthz and grpc.health.v1), Prometheus metrics (/metrics). "
                                    "Each request is\nanswered by one model version, which the reply "
                                    "names. --follow DIR applies the deltas\n(pserver export --since) "
                                    "that appear in DIR in their chain's order, between requests;\na "
                                    "corrupt or out-of-order one is refused and the version served stays.\n"
                                    "Example: pserver serve-model ctr-model --port 8500 --http-port 8501 "
                                    "--follow deltas/")
    sm.add_argument("model", metavar="MODEL",
                    help="the model file (a directory for a model with sparse tables)")
    sm.add_argument("--port", type=int, default=8500, help="gRPC port (default 8500; 0 picks a free one)")
    sm.add_argument("--http-port", type=int, default=8501,
                    help="HTTP port (default 8501; 0 picks a free one; -1: no HTTP)")
    sm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: "
                                                        "every interface, with a token and TLS)")
    sm.add_argument("--follow", default=None, metavar="DIR", help="a directory of delta exports to apply as "
                                                                  "they appear")
    sm.add_argument("--poll", type=float, default=0.5, metavar="S", help="seconds between looks at --follow "
                                                                         "(default 0.5)")
    sm.add_argument("--threads", type=int, default=8, help="gRPC worker threads (default 8)")
    sm.add_argument("--compact-every", type=int, default=0, metavar="N",
                    help="rewrite MODEL with the deltas applied after every N of them (atomically; memory "
                         "then stops growing with them, and a restart starts from there); default 0: never")
    add_flags(sm, SERVE_SECURITY, "security (as pserver serve's; HTTP asks for Authorization: Bearer TOKEN)")
    return p


def parse_ps(text: str, command: str) -> tuple[str, ...]:
    if text.strip().isdigit():
        raise ConfigError(f"--ps: '{text}' is a number: on {command}, --ps takes shard addresses "
                          "host:port, shard 0 first (`pserver launch --ps S` starts S shards)")
    addrs = tuple(parse_address(a) for a in text.split(",") if a.strip())
    if not addrs:
        raise ConfigError("--ps: give at least one shard address host:port")
    return addrs


def security_given(ns, flags) -> dict:
    """The security flags set, the token from --auth-token, else --token-file, else
    PSERVER_AUTH_TOKEN."""
    from pserver.wire.security import resolve_token
    kw = {k: v for k, v in given(ns, flags).items() if k != "token_file"}
    return kw | {"auth_token": resolve_token(getattr(ns, "auth_token", None),
                                             token_file=getattr(ns, "token_file", None))}


def server_config(ns) -> ServerConfig:
    kw = given(ns, SERVER_FLAGS + COMMON_FLAGS + METRICS_FLAGS) | security_given(ns, SERVE_SECURITY)
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    refuse_evaluator(cluster)
    if cluster and cluster.task_type == "ps":
        kw.update(shard=cluster.task_index, num_shards=len(cluster.ps),
                  port=int(cluster.ps[cluster.task_index].rpartition(":")[2]))
        if cluster.workers:
            kw["num_workers"] = len(cluster.workers)
    for name in ("host", "port", "shard", "num_shards", "num_workers"):
        if getattr(ns, name) is not None:
            kw[name] = getattr(ns, name)
    return ServerConfig(**kw)


def refuse_evaluator(cluster) -> None:
    """TF_CONFIG's evaluator task (TensorFlow evaluates the newest checkpoint there while
    the others train) has no pserver counterpart: the chief evaluates. Refused, not ignored."""
    if cluster and cluster.task_type == "evaluator":
        raise ConfigError("TF_CONFIG: task.type 'evaluator' is not supported: pserver has no evaluator "
                          "task (the chief, rank 0, evaluates on the test set after every epoch and with "
                          "--eval-every); leave this task out of the job")


def worker_config(ns) -> WorkerConfig:
    kw = given(ns, WORKER_FLAGS + COMMON_FLAGS + METRICS_FLAGS) | security_given(ns, CLIENT_SECURITY)
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    refuse_evaluator(cluster)
    if cluster and cluster.task_type in ("worker", "chief"):
        kw.update(ps=cluster.ps, rank=cluster.rank, num_workers=len(cluster.workers))
    if ns.ps is not None:
        kw["ps"] = parse_ps(ns.ps, "worker")
    elif "ps" not in kw:
        print(f"pserver worker: no --ps and no TF_CONFIG: dialing {WorkerConfig.ps[0]}, the default shard "
              "address", flush=True)
    for name in ("rank", "num_workers", "summary_json", "stats_json", "stop_shards"):
        if getattr(ns, name) is not None:
            kw[name] = getattr(ns, name)
    return WorkerConfig(**kw)


def cmd_serve(ns) -> int:
    return run_shard(server_config(ns), ns.log_level)


def cmd_worker(ns) -> int:
    one_blas_thread()
    return run_training(worker_config(ns))


def cmd_slurm(ns) -> int:
    from pserver.launch.slurm import slurm_task
    from pserver.wire.security import TOKEN_ENV, resolve_token
    task = slurm_task(os.environ, ns.ps, ns.base_port)
    token = resolve_token(None, token_file=ns.token_file)   # never the token itself as a flag: argv is public
    if token is None:      # other users' jobs share the cluster's network
        raise ConfigError(f"{TOKEN_ENV}: pserver slurm needs a token in every task's environment or "
                          "--token-file (deploy/slurm/pserver.sbatch writes one to a file only the job "
                          "can read)")
    print(f"pserver slurm: {task.describe()}", flush=True)
    metrics = given(ns, METRICS_FLAGS)
    if ns.metrics_port:                # the same offset on its host as its gRPC port
        metrics["metrics_port"] = ns.metrics_port + task.ports[task.procid] - ns.base_port
    if task.is_shard:
        return run_shard(ServerConfig(host=ns.host or task.hosts[task.procid], port=task.ports[task.procid],
                                      shard=task.index, num_shards=task.num_shards,
                                      num_workers=task.num_workers, auth_token=token, **metrics,
                                      **given(ns, SERVER_FLAGS + COMMON_FLAGS + [TLS_CERT, TLS_KEY])),
                         ns.log_level)
    chief = task.index == 0
    one_blas_thread()
    return run_training(WorkerConfig(ps=task.shards, rank=task.index, num_workers=task.num_workers,
                                     summary_json=ns.summary_json if chief else None, stop_shards=chief,
                                     auth_token=token, **metrics,
                                     **given(ns, WORKER_FLAGS + COMMON_FLAGS + [TLS_CA])))


def cmd_run(ns) -> int:
    from pserver.launch.run import run_command
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    server = ServerConfig(num_shards=ns.ps,
                          **given(ns, [f for f in SERVER_FLAGS if f.name not in RUN_FROM_COMPILE]))
    return run_command(ns.ps, ns.workers, cmd, server, ns.seed, bind_cores=ns.bind_cores)


def cmd_launch(ns) -> int:
    from pserver.launch import LaunchConfig, launch
    check_delay_ranks(ns.delay_ranks, ns.workers)
    cfg = LaunchConfig(num_shards=ns.ps, num_workers=ns.workers, summary_json=ns.summary_json,
                       delay=ns.delay, delay_ranks=ns.delay_ranks,
                       delay_for=parse_delay_for(ns.delay_for, ns.workers), metrics_port=ns.metrics_port,
                       device=ns.device or "cpu", backend=ns.backend, address=ns.address,
                       token_file=ns.token_file)
    # The token: the flag's, the file's or PSERVER_AUTH_TOKEN's; launch() makes one otherwise.
    token = security_given(ns, [])["auth_token"]
    # --metrics-port is given per process (launch/base.py); --metrics-host goes to every one
    server_flags = SERVER_FLAGS + COMMON_FLAGS + [TLS_CERT, TLS_KEY] + METRICS_FLAGS[1:]
    worker_flags = WORKER_FLAGS + COMMON_FLAGS + [TLS_CA] + METRICS_FLAGS[1:]
    server_cfg = ServerConfig(num_shards=ns.ps, num_workers=ns.workers, auth_token=token,
                              **given(ns, server_flags))
    worker_cfg = WorkerConfig(num_workers=ns.workers, auth_token=token, **given(ns, worker_flags))
    return launch(cfg, server_cfg, worker_cfg)


def cmd_status(ns) -> int:
    from pserver.observe.status import show_status
    check_seconds("--timeout", ns.timeout)
    text = ns.ps
    if text is None:
        cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
        if not cluster or not cluster.ps:
            raise ConfigError("--ps: give the shard addresses (or set TF_CONFIG)")
        addrs = cluster.ps
    else:
        addrs = parse_ps(text, "status")
    from pserver.wire.security import client_security
    from pserver.worker.client import PSClient
    client = PSClient(addrs, security=client_security(security_given(ns, [])["auth_token"], ns.tls_ca))
    try:
        client.connect(ns.timeout)
        statuses = client.status(ns.timeout)
    finally:
        client.close()
    return show_status(statuses, as_json=ns.json)


def cmd_evaluate(ns) -> int:
    import json

    from pserver.persist.export import evaluate_files
    result = evaluate_files(ns.model_file, ns.checkpoint, given(ns, EVALUATE_FLAGS), ns.mode)
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("test_") and
                        k != "test_samples")
    print(f"{result['model']} ({result['num_params']:,} parameters) with the weights of {result['weights']}, "
          f"on the {result['dataset']} test set ({result['test_samples']:,} samples): "
          f"{metrics.replace('_', ' ')}")
    return 0


def cmd_checkpoint(ns) -> int:
    import json

    from pserver.persist import checkpoint_dir, reshard
    if ns.action == "reshard":
        if ns.num_shards < 1:
            raise ConfigError(f"--num-shards: must be at least 1, got {ns.num_shards}")
        paths = reshard.reshard_directory(ns.source, ns.target, ns.num_shards, ns.mode)
        print(f"wrote {len(paths)} checkpoint(s) to {ns.target}: "
              + ", ".join(os.path.basename(p) for p in paths))
        return 0
    report = checkpoint_dir.inspect(ns.directory, ns.mode)
    print(json.dumps(report, indent=2) if ns.json else "\n".join(checkpoint_dir.describe(report)))
    if report["sets"] and report["restores"] is None:     # files, and no state a restore could read
        print(f"pserver checkpoint: error: {ns.directory} holds no state a restore in mode {ns.mode} "
              "could read (each file's reason above)", file=sys.stderr)
        return 1
    return 0


def cmd_export(ns) -> int:
    import json

    from pserver.persist.export import export_checkpoints, follow_checkpoints
    if ns.follow:
        import signal
        import threading
        if not ns.since:
            raise ConfigError("--follow: give --since MODEL (the model a server serves); "
                              "--out is then the directory the deltas go to")
        check_seconds("--poll", ns.poll)
    elif ns.keep_deltas:
        raise ConfigError("--keep-deltas: only with --follow (a single export writes one file)")
    if ns.follow:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        print(f"pserver export: following {ns.restore}, deltas since {ns.since} into {ns.out}", flush=True)
        n = follow_checkpoints(ns.restore, ns.since, ns.out, given(ns, EXPORT_FLAGS), ns.mode, ns.poll, stop,
                               say=lambda line: print(line, flush=True), keep=ns.keep_deltas)
        print(f"pserver export: stopped after {n} delta(s)", flush=True)
        return 0
    result = export_checkpoints(ns.restore, ns.out, given(ns, EXPORT_FLAGS), ns.mode, since=ns.since)
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    tables = "".join(f", table {name} {n:,} rows" for name, n in result["tables"].items())
    if ns.since:
        removed = sum(result["removed"].values())
        print(f"exported a delta of {result['model']} since {ns.since} (version {result['since']}: "
              f"{tables[2:] or 'no tables'} changed, {removed:,} ids removed) from the checkpoints of "
              f"{result['num_shards']} shard(s) at version {result['version']} to {result['out']}")
        return 0
    print(f"exported {result['model']} ({result['num_params']:,} parameters{tables}) from the checkpoints of "
          f"{result['num_shards']} shard(s) at version {result['version']} to {result['out']}")
    return 0


def cmd_serve_model(ns) -> int:
    from pserver.api import serve_model
    check_seconds("--poll", ns.poll)
    if ns.threads < 1 or ns.compact_every < 0:
        raise ConfigError(f"--threads must be >= 1 and --compact-every >= 0, got {ns.threads} and "
                          f"{ns.compact_every}")
    return serve_model(ns.model, port=ns.port, http_port=ns.http_port, host=ns.host, follow=ns.follow,
                       poll=ns.poll, threads=ns.threads, compact_every=ns.compact_every,
                       **security_given(ns, SERVE_SECURITY))


def cmd_ingest(ns) -> int:
    from pserver.api import ingest
    return ingest(ns.out, port=ns.port, host=ns.host)


COMMANDS = {"serve": cmd_serve, "worker": cmd_worker, "launch": cmd_launch, "slurm": cmd_slurm,
            "status": cmd_status, "evaluate": cmd_evaluate, "checkpoint": cmd_checkpoint,
            "export": cmd_export, "run": cmd_run, "serve-model": cmd_serve_model, "ingest": cmd_ingest}


def main(argv: list[str] | None = None) -> int:
    # A Ctrl-C before the command runs (while the flags are parsed: argparse loads gettext) is
    # still the loading handler's one line and exit 130; exit_code hands SIGINT back to Python.
    follow_parent()                            # started by launch: stop when it dies
    # gRPC's C core prints INFO lines (one per failed TLS handshake, say) that would bury
    # the one line we print; read before grpc loads, and GRPC_VERBOSITY=debug still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[ns.command].unrecognized(extra)
    return exiting_after(exit_code(ns.command, lambda: COMMANDS[ns.command](ns)))


if __name__ == "__main__":
    sys.exit(main())
