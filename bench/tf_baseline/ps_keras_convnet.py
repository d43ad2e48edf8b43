"""Keras's MNIST convnet example under TensorFlow's ParameterServerStrategy, and the same script
on pserver (`pserver run --ps 1 --workers 2`, sync), interleaved: training samples/s of each.

The model of bench/keras_mnist_convnet.py (keras.io's "Simple MNIST convnet": Conv2D(32, 3,
relu) - MaxPooling2D(2) - Conv2D(64, 3, relu) - MaxPooling2D(2) - Flatten - Dropout(0.5) -
Dense(10, softmax)), categorical cross-entropy on one-hot labels, Adam with Keras's defaults
(0.001, epsilon 1e-7), the example's global batch 128: 64 per worker with 2 workers, as
`pserver run` splits it. TensorFlow: ps_cnn.py's local cluster of real tf.distribute.Server
processes (--ps, --workers) and its custom loop (ClusterCoordinator, one scheduled step = one
worker's batch of 64, applied on the ps as it comes: asynchronous), on the 54,000 samples the
example trains on (validation_split=0.1 leaves the last 6,000 out); samples/s over the timed
steps after --warmup, with, at each epoch's end, the evaluation of those 6,000 that the example's
fit does (on the coordinator, in batches of 128; --no-tf-validation leaves it out, as the first
rounds measured). pserver: `PYTHON -m pserver run --ps 1 --workers 2 --seed S -- PYTHON
keras_mnist_convnet.py` with `epochs = --epochs` (the only change; keras_convnet.py's copy),
and the samples/s of its chief's summary (every synchronous step after its warm-up, the
chief's evaluation of the validation data at each epoch's end included). The TensorFlow side
times as many samples as pserver's --epochs train (53,888 an epoch: 421 steps of 2 x 64).

--model toy_resnet measures "The Functional API" guide's toy ResNet the same way (a Functional
model: residual `layers.add`, GlobalAveragePooling2D, Dense(10) logits): RMSprop 1e-3, the guide's
batch 64 (32 per worker), its fit on the first --train-samples of MNIST with validation_split=0.2
(the last 20% of them held out and evaluated at each epoch's end on both sides); pserver runs
bench/keras_io/toy_resnet.py with that fit rewritten as bench/keras_io/compare.py does.

Each of --rounds rounds runs TensorFlow, then pserver (with --pserver), with the load average
before each; the JSON has every run, the medians and pserver's ratio to TensorFlow.

TensorFlow runs in one or more ways (--tf-sides, each in every round, so the load of a shared
machine falls on all of them alike): `loop`, the custom loop above with TensorFlow's default
thread pools (every core, per task); `loop-intra1`, the same with TF_NUM_INTRAOP_THREADS=1 in every
task's environment (the coordinator's too), as pserver's workers use one BLAS thread;
`loop-1thread`, with TF_NUM_INTEROP_THREADS=1 as well (it stalled here: see TF_SIDES);
`fit`, the example's own `model.fit` under the strategy (tf-keras's fit with
a ClusterCoordinator: compile(steps_per_execution=--steps-per-execution), one worker's batch of
64 per step, `validation_data` the held-out 6,000 evaluated at each epoch's end on the workers),
timed over a second `fit` after a short one that traces and connects; `fit-intra1` and `fit-1thread`,
fit with those environments. Before the rounds, one short probe per side's environment runs a training
step of the model with ONEDNN_VERBOSE=1 and records what oneDNN said: its ISA, its thread count
and the primitives TensorFlow called (on the AVX2 EPYC here TensorFlow 2.18's oneDNN graph ops
were off, and it reached oneDNN only through its matrix products: `gemm_api`). The JSON
has the machine's CPU (model, family/model/stepping, widest vector ISA), each run's load average
before and after, and the CPU seconds of each whole run (all its processes, startup included).

--isa gives both sides the same vector instructions for their matrix products: `own` (default)
lets each library choose for the CPU (OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA removed from both
sides' environments: a machine that sets OPENBLAS_CORETYPE=Haswell would give pserver AVX2
kernels while oneDNN, which does not read it, uses AVX-512); `avx2` caps both at AVX2
(pserver's numba kernels compiled for Haswell too: NUMBA_CPU_NAME=haswell).

    bench/tf_baseline/.venv/bin/python bench/tf_baseline/ps_keras_convnet.py \\
        --data-dir $PSERVER_MNIST_DIR --pserver .venv/bin/python --epochs 2 --rounds 3 \\
        --json bench/results/keras/tf-vs-pserver-convnet.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import numpy as np  # noqa: E402
from _util import machine, machine_lines  # noqa: E402

sys.path.append(str(HERE.parent / "keras_io"))
from compare import bind_flag, copies  # noqa: E402
from keras_convnet import ACCURACY, SUMMARY, script_for  # noqa: E402
from ps_cnn import ISA_ENV, coordinator_for, isa_env, local_cluster, mnist  # noqa: E402  (sets TF's env)

OPENBLAS_CORE = re.compile(r"Core: (\S+)$", re.M)      # OpenBLAS's line at load, OPENBLAS_VERBOSE=2
# Both pools at 1 stalled every run here (TensorFlow 2.18, 2 cores): the tasks stop using CPU after
# their start (20 s each) and the run never ends. One intra-op thread alone runs.
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
INTRA_ONE = {"TF_NUM_INTRAOP_THREADS": "1"}
# TensorFlow's ways of training (--tf-sides): (the training function's name, extra environment)
TF_SIDES = {"loop": ("loop", {}), "loop-intra1": ("loop", INTRA_ONE), "loop-1thread": ("loop", ONE_THREAD),
            "fit": ("fit", {}), "fit-intra1": ("fit", INTRA_ONE), "fit-1thread": ("fit", ONE_THREAD)}
ONEDNN_INFO = re.compile(r"^onednn_verbose,(?:v\d+,)?info,cpu,(isa|runtime):(.*)$", re.M)
ONEDNN_EXEC = re.compile(r"^onednn_verbose,(?:v\d+,)?primitive,exec,cpu,([^,]+),([^,]*),", re.M)


def convnet(tf):
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax")])


def toy_resnet(tf):
    """keras.io's "The Functional API" toy ResNet (bench/keras_io/toy_resnet.py), on MNIST's 28x28x1."""
    layers = tf.keras.layers
    inputs = tf.keras.Input(shape=(28, 28, 1), name="img")
    x = layers.Conv2D(32, 3, activation="relu")(inputs)
    x = layers.Conv2D(64, 3, activation="relu")(x)
    block_1_output = layers.MaxPooling2D(3)(x)
    x = layers.Conv2D(64, 3, activation="relu", padding="same")(block_1_output)
    x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
    block_2_output = layers.add([x, block_1_output])
    x = layers.Conv2D(64, 3, activation="relu", padding="same")(block_2_output)
    x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
    block_3_output = layers.add([x, block_2_output])
    x = layers.Conv2D(64, 3, activation="relu")(block_3_output)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(256, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    outputs = layers.Dense(10)(x)
    return tf.keras.Model(inputs, outputs, name="toy_resnet")


# --model: (its Keras model, optimizer, whether the last layer gives logits, the validation split
# of the fit, the global batch the script trains with)
MODELS = {
    "convnet": (convnet, lambda tf: tf.keras.optimizers.Adam(), False, 0.1, 128),   # Keras's defaults
    "toy_resnet": (toy_resnet, lambda tf: tf.keras.optimizers.RMSprop(1e-3), True, 0.2, 64),
}


OPTIMIZER_NAMES = {"convnet": "adam 0.001 (Keras defaults)", "toy_resnet": "rmsprop 0.001"}


def model_for(args, tf):
    build, optimizer, logits, _, _ = MODELS[args.model]
    return build(tf), optimizer(tf), tf.keras.losses.CategoricalCrossentropy(
        from_logits=logits, reduction=tf.keras.losses.Reduction.NONE)


def train_count(args) -> int:
    """The samples the script's fit trains on: its data less the validation split's last part."""
    split = MODELS[args.model][3]
    return args.train_samples - round(args.train_samples * split)


def samples_for(args, epochs: int, per_worker: int) -> int:
    """What pserver trains in `epochs`: each worker's whole batches of its share of the data."""
    return epochs * (train_count(args) // args.workers // per_worker) * args.workers * per_worker


def split_mnist(args):
    """The script's data: its first samples to train, the last of them (validation_split) held out;
    labels one-hot."""
    x, y = mnist(args.data_dir, "train")
    y = np.eye(10, dtype=np.float32)[y]
    n, cut = args.train_samples, train_count(args)
    return (x[:cut], y[:cut]), (x[cut:n], y[cut:n])


def test_accuracy(tf, model, data_dir: str) -> float:
    """The test set's accuracy after training, on the coordinator, whichever way it trained."""
    x_test, y_test = mnist(data_dir, "test")
    predict = tf.function(lambda xb: model(xb, training=False))
    p = np.concatenate([predict(x_test[i:i + 1000]).numpy() for i in range(0, len(x_test), 1000)])
    return float(np.mean(np.argmax(p, 1) == y_test))


def train_tf(args, per_worker: int) -> dict:
    import tensorflow as tf
    with local_cluster(args.ps, args.workers) as cluster:
        strategy, coordinator = coordinator_for(cluster)
        with strategy.scope():
            model, optimizer, loss_fn = model_for(args, tf)
        (x, y), (x_val, y_val) = split_mnist(args)

        def dataset_fn():
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=args.seed).repeat()
            return ds.batch(per_worker, drop_remainder=True).prefetch(4)

        @tf.function
        def step_fn(it):
            def replica_fn(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)),
                                                      global_batch_size=per_worker)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            xb, yb = next(it)
            return strategy.run(replica_fn, args=(xb, yb))

        @tf.function
        def validate_batch(xb, yb):        # what fit's validation_split evaluates: loss and accuracy
            p = model(xb, training=False)
            hits = tf.cast(tf.equal(tf.argmax(p, 1), tf.argmax(yb, 1)), tf.float32)
            return tf.reduce_sum(loss_fn(yb, p)), tf.reduce_sum(hits)

        def validate() -> float:
            """The example's validation at an epoch's end, on the coordinator (as pserver's chief
            evaluates its validation data), in batches of the fit's batch size, as Keras does."""
            hits = 0.0
            for i in range(0, len(x_val), args.batch_size):
                hits += float(validate_batch(x_val[i:i + args.batch_size], y_val[i:i + args.batch_size])[1])
            return hits / len(x_val)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        for _ in range(args.warmup):       # tracing, connections, the first allocations
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        if args.tf_validation:
            validate()                     # its tracing, untimed as the warm-up steps are
        steps = args.tf_steps or samples_for(args, args.epochs, per_worker) // per_worker
        per_epoch = samples_for(args, 1, per_worker) // per_worker
        started, validation_seconds, val_accuracy = time.perf_counter(), 0.0, None
        for done in range(steps):
            coordinator.schedule(step_fn, args=(iterator,))
            if args.tf_validation and (done + 1) % per_epoch == 0:      # an epoch's end, as in fit
                coordinator.join()
                t = time.perf_counter()
                val_accuracy = validate()
                validation_seconds += time.perf_counter() - t
        coordinator.join()
        seconds = time.perf_counter() - started
        accuracy = test_accuracy(tf, model, args.data_dir)
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy, custom loop",
            "samples": steps * per_worker, "seconds": round(seconds, 3),
            "train_samples_per_second": steps * per_worker / seconds,
            "validation_each_epoch": args.tf_validation, "validation_seconds": round(validation_seconds, 3),
            "val_accuracy_last": val_accuracy, "test_accuracy_after": accuracy}


def fit_steps(args, per_worker: int) -> tuple[int, int]:
    """(epochs, steps per epoch) of the timed fit: pserver's epochs, each as many steps of one
    worker's batch as pserver's epoch has, rounded down to whole executions (--tf-steps: one
    epoch of that many)."""
    spe = args.steps_per_execution
    if args.tf_steps:
        return 1, max(spe, args.tf_steps // spe * spe)
    return args.epochs, samples_for(args, 1, per_worker) // per_worker // spe * spe


def train_tf_fit(args, per_worker: int) -> dict:
    """The example's `model.fit` under the strategy: tf-keras schedules its steps through a
    ClusterCoordinator, --steps-per-execution steps of one worker's batch per scheduled function,
    and evaluates validation_data on the workers at each epoch's end."""
    import tensorflow as tf
    (x, y), (x_val, y_val) = split_mnist(args)
    spe = args.steps_per_execution
    with local_cluster(args.ps, args.workers) as cluster:
        strategy, _ = coordinator_for(cluster)           # fit reuses the strategy's coordinator
        with strategy.scope():
            model, optimizer, _ = model_for(args, tf)
            model.compile(optimizer=optimizer, loss=tf.keras.losses.CategoricalCrossentropy(
                              from_logits=MODELS[args.model][2]),
                          metrics=["accuracy"], steps_per_execution=spe)

        def train_fn(_context):
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=args.seed).repeat()
            return ds.batch(per_worker, drop_remainder=True).prefetch(4)

        def validation_fn(_context):
            return tf.data.Dataset.from_tensor_slices((x_val, y_val)).repeat().batch(args.batch_size)
        data = tf.keras.utils.experimental.DatasetCreator(train_fn)
        fit = dict(validation_data=tf.keras.utils.experimental.DatasetCreator(validation_fn),
                   validation_steps=-(-len(x_val) // args.batch_size), verbose=0)
        # a short fit first: tracing, connections, the first allocations (the loop's warm-up)
        model.fit(data, epochs=1, steps_per_epoch=max(spe, args.warmup // spe * spe), **fit)
        epochs, per_epoch = fit_steps(args, per_worker)
        started = time.perf_counter()
        history = model.fit(data, epochs=epochs, steps_per_epoch=per_epoch, **fit)
        seconds = time.perf_counter() - started
        accuracy = test_accuracy(tf, model, args.data_dir)
    samples = epochs * per_epoch * per_worker
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy, model.fit",
            "steps_per_execution": spe, "samples": samples, "seconds": round(seconds, 3),
            "train_samples_per_second": samples / seconds, "validation_each_epoch": True,
            "val_accuracy_last": history.history["val_accuracy"][-1], "test_accuracy_after": accuracy}


def onednn_probe(args) -> None:
    """One training step of the model in this process, for ONEDNN_VERBOSE=1 to describe."""
    import tensorflow as tf
    model, optimizer, loss_fn = model_for(args, tf)
    xb, yb = np.zeros((64, 28, 28, 1), np.float32), np.eye(10, dtype=np.float32)[np.zeros(64, int)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def tf_env(args, side: str) -> dict:
    return isa_env(args.isa, "tensorflow") | TF_SIDES[side][1]


def probe_onednn(args, side: str) -> dict:
    """What oneDNN says of itself in a TensorFlow process with `side`'s environment: its ISA,
    its threads, the primitives TensorFlow's step called, and whether TensorFlow's oneDNN graph
    ops were on (its startup line)."""
    env = tf_env(args, side) | {"ONEDNN_VERBOSE": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}
    r = subprocess.run([sys.executable, __file__, "--onednn-probe", "--model", args.model],
                       capture_output=True, text=True, env=env, timeout=args.tf_timeout)
    out = r.stdout + r.stderr
    info = dict(ONEDNN_INFO.findall(out))
    return {"isa": info.get("isa", "none reported"), "runtime": info.get("runtime", ""),
            "primitives": sorted({f"{kind} {impl}".strip() for kind, impl in ONEDNN_EXEC.findall(out)}),
            "onednn_graph_ops_on": "oneDNN custom operations are on" in out,
            "env": {k: v for k, v in env.items() if k.startswith(("TF_NUM", "ONEDNN_MAX", "TF_ENABLE"))},
            "exit": r.returncode}


class SideFailed(Exception):
    """One run of one side failed: recorded, and the side left out of the rounds after."""


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def train_tf_apart(args, side: str) -> dict:
    """One TensorFlow side in a process of its own (a fresh cluster and eager context each
    round); its output (TensorFlow's logging) is shown only when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tf.json")
        passed = {k: v for k, v in vars(args).items()
                  if v is not None and k not in ("pserver", "json", "tf_json", "rounds", "tf_validation",
                                                 "tf_sides", "tf_side", "pserver_mode", "pserver_bind_cores",
                                                 "isa", "onednn_probe", "tf_timeout")}
        # tf_side is this run's own (below): passed on from the parent too, its default ("loop")
        # came last and every side trained with the custom loop (65f04b6's "fit-intra1" did)
        cmd = [sys.executable, __file__, "--tf-json", path, "--tf-side", side] + [
            a for k, v in passed.items() for a in (f"--{k.replace('_', '-')}", str(v))] + [
            "--tf-validation" if args.tf_validation else "--no-tf-validation"]
        cpu = children_cpu()
        # a session of its own: a run past --tf-timeout goes with its cluster's tasks
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=tf_env(args, side), start_new_session=True)
        try:
            output = proc.communicate(timeout=args.tf_timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0] + f"\n(stopped after --tf-timeout {args.tf_timeout} s)"
        if proc.returncode != 0 or not os.path.exists(path):
            raise SideFailed(f"TensorFlow's run ({side}) failed ({proc.returncode}):\n{output[-3000:]}")
        return json.loads(Path(path).read_text()) | {"cpu_seconds": round(children_cpu() - cpu, 1)}


def train_pserver(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "convnet":
            script = script_for(args.epochs, tmp)
            what = f"bench/keras_mnist_convnet.py, epochs = {args.epochs}"
        else:          # the guide's script, its fit on --train-samples for --epochs (compare.py's copy)
            script = copies("toy_resnet", args.train_samples, args.epochs, Path(tmp))["pserver"]
            what = f"bench/keras_io/toy_resnet.py, x_train[:{args.train_samples}], epochs={args.epochs}"
        cmd = [args.pserver, "-m", "pserver", "run", "--ps", str(args.ps), "--workers", str(args.workers),
               "--seed", str(args.seed), "--mode", args.pserver_mode,
               *bind_flag(args.pserver_bind_cores), "--", args.pserver, str(script)]
        env = isa_env(args.isa, "pserver") | {"PSERVER_MNIST_DIR": args.data_dir, "OPENBLAS_VERBOSE": "2",
                                              "KERAS_IO_SEED": str(args.seed)}
        cpu = children_cpu()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        cpu = children_cpu() - cpu
    if r.returncode != 0:
        raise SystemExit(f"pserver run failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    steps, seconds, rate = SUMMARY.findall(r.stdout)[-1]
    accuracy = float(ACCURACY.findall(r.stdout)[-1])
    rate = float(rate.replace(",", ""))
    return {"framework": f"pserver run ({args.pserver_mode})", "steps": int(steps), "seconds": float(seconds),
            "samples": round(rate * float(seconds)), "train_samples_per_second": rate,
            "test_accuracy_after": accuracy, "cpu_seconds": round(cpu, 1),
            # the kernels OpenBLAS loaded in the run's processes (numpy's and scipy's, each once)
            "openblas_cores": sorted(set(OPENBLAS_CORE.findall(r.stdout + r.stderr))),
            "command": " ".join(["pserver"] + cmd[3:-1]
                                + [what])}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("PSERVER_MNIST_DIR"),
                   help="directory with the four MNIST IDX files (default $PSERVER_MNIST_DIR)")
    p.add_argument("--model", choices=tuple(MODELS), default="convnet",
                   help="convnet: keras.io's mnist_convnet (the default); toy_resnet: the Functional API "
                   "guide's toy ResNet (RMSprop 1e-3, batch 64, validation_split=0.2)")
    p.add_argument("--train-samples", type=int, default=60000,
                   help="toy_resnet: the fit's first N of MNIST's 60,000 training samples, the last "
                   "20%% of them held out for validation (default all; the guide's 1,000 only checks "
                   "that it builds)")
    p.add_argument("--ps", type=int, default=1, help="parameter-server tasks / shards (default 1)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--batch-size", type=int,
                   help="the global batch (default the script's: convnet 128, toy_resnet 64)")
    p.add_argument("--epochs", type=int, default=2,
                   help="pserver's epochs; TensorFlow times as many samples (default 2)")
    p.add_argument("--warmup", type=int, default=50, help="TensorFlow's untimed steps first (default 50)")
    p.add_argument("--tf-steps", type=int, help="TensorFlow's timed steps (of one worker's batch), "
                   "for a quick check (default: as many samples as pserver's --epochs)")
    p.add_argument("--tf-sides", default="loop", help="comma-separated ways TensorFlow trains, each "
                   f"every round: {', '.join(TF_SIDES)} (default loop; see above)")
    p.add_argument("--steps-per-execution", type=int, default=20,
                   help="fit's compile(steps_per_execution=...) (default 20)")
    p.add_argument("--tf-timeout", type=float, default=1200,
                   help="seconds a TensorFlow run may take before it and its cluster are stopped "
                   "(recorded as failed; that side is left out of the later rounds; default 1200)")
    p.add_argument("--rounds", type=int, default=1,
                   help="every TensorFlow side, then pserver, this many times")
    p.add_argument("--tf-validation", action=argparse.BooleanOptionalAction, default=True,
                   help="the loop validates the held-out 6,000 at each epoch's end inside its timed "
                   "run, as the example's fit(validation_split=0.1) does and as pserver's rate includes "
                   "(default; --no-tf-validation: training steps only, as the first rounds measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pserver", metavar="PYTHON", help="also run the example on pserver with this "
                   "interpreter (one that has pserver installed)")
    p.add_argument("--pserver-mode", default="sync", choices=("sync", "async"),
                   help="pserver's mode (default sync, the script's; async: each worker's push applied "
                   "as it comes, as TensorFlow's coordinator applies each scheduled step)")
    p.add_argument("--pserver-bind-cores", action=argparse.BooleanOptionalAction, default=None,
                   help="pserver run --bind-cores (worker i on core i; TensorFlow's processes are not bound) "
                        "or --no-bind-cores (default: neither, pserver run's own default)")
    p.add_argument("--isa", choices=tuple(ISA_ENV), default="own",
                   help="the vector instructions of each side's matrix products: own (default), each "
                   "library's choice for this CPU (OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA removed from "
                   "their environments); avx2, both capped at AVX2 (OPENBLAS_CORETYPE=Haswell, "
                   "NUMBA_CPU_NAME=haswell, ONEDNN_MAX_CPU_ISA=AVX2)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--tf-json", help=argparse.SUPPRESS)     # one TensorFlow run, its result here
    p.add_argument("--tf-side", default="loop", choices=tuple(TF_SIDES), help=argparse.SUPPRESS)
    p.add_argument("--onednn-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.tf_sides = args.tf_sides.split(",")
    args.batch_size = args.batch_size or MODELS[args.model][4]
    if args.model == "convnet" and args.train_samples != 60000:
        p.error("--train-samples: toy_resnet only (the convnet example fits on all 60,000)")
    if set(args.tf_sides) - set(TF_SIDES):
        p.error(f"--tf-sides: choose among {', '.join(TF_SIDES)}")
    if not args.data_dir and not args.onednn_probe:
        p.error("--data-dir: give the MNIST directory (or set PSERVER_MNIST_DIR)")
    if args.batch_size % args.workers:
        p.error(f"--batch-size {args.batch_size}: give a multiple of --workers {args.workers}")
    return args


def one_tf_run(args) -> None:
    """This process is one TensorFlow run (--tf-json) or the oneDNN probe: do it and leave."""
    if args.onednn_probe:
        onednn_probe(args)
    else:
        train = train_tf_fit if TF_SIDES[args.tf_side][0] == "fit" else train_tf
        Path(args.tf_json).write_text(json.dumps(train(args, args.batch_size // args.workers)))
    sys.stdout.flush()
    os._exit(0)          # not TensorFlow's teardown, which calls the tasks local_cluster stopped


def interleaved(args, after_run) -> list[dict]:
    """--rounds rounds of every side in turn; each run with the load average before and after;
    after_run(runs) after each (the JSON so far, kept if the rounds are cut short)."""
    sides = [(f"tensorflow {s}", lambda s=s: train_tf_apart(args, s)) for s in args.tf_sides]
    sides += [("pserver", lambda: train_pserver(args))] if args.pserver else []
    runs, failed = [], set()
    for round_ in range(1, args.rounds + 1):
        for name, fn in sides:
            if name in failed:
                continue
            load = [round(v, 2) for v in os.getloadavg()]
            try:
                got = fn()
            except SideFailed as e:
                print(f"round {round_} {name}: {e}", flush=True)
                runs.append({"round": round_, "side": name, "load_avg_before": load,
                             "failed": str(e)[-1500:]})
                failed.add(name)
                after_run(runs)
                continue
            r = {"round": round_, "side": name, "load_avg_before": load, **got,
                 "load_avg_after": [round(v, 2) for v in os.getloadavg()]}
            runs.append(r)
            print(f"round {round_} {name:>24}: {r['train_samples_per_second']:8,.0f} samples/s "
                  f"({r['samples']:,} samples in {r['seconds']:.1f} s; {r['cpu_seconds']} CPU s in all; "
                  f"test accuracy after {r['test_accuracy_after']:.4f}; load before {load[0]:.2f}, "
                  f"after {r['load_avg_after'][0]:.2f})", flush=True)
            after_run(runs)
    return runs


def summarize(runs: list[dict]) -> dict:
    """Each side's median samples/s, TensorFlow's best side, and pserver's ratio to each."""
    runs = [r for r in runs if "failed" not in r]
    sides = list(dict.fromkeys(r["side"] for r in runs))
    medians = {s: statistics.median(r["train_samples_per_second"] for r in runs if r["side"] == s)
               for s in sides}
    out = {"median_train_samples_per_second": medians}
    tf_sides = [s for s in sides if s != "pserver"]
    if "pserver" in medians and tf_sides:
        best = max(tf_sides, key=medians.get)
        out |= {"tensorflow_best_side": best,
                "ratio_pserver_to_tensorflow_best": round(medians["pserver"] / medians[best], 3),
                "ratio_pserver_to_each": {s: round(medians["pserver"] / medians[s], 3) for s in tf_sides}}
    return out


def main() -> None:
    args = parse_args()
    if args.tf_json or args.onednn_probe:
        one_tf_run(args)
    m = machine(("tensorflow-cpu", "tf_keras", "numpy"))
    print("\n".join(machine_lines(m)), flush=True)
    probes = {}
    for side in args.tf_sides:          # once per environment: fit and loop share theirs
        key = json.dumps(TF_SIDES[side][1], sort_keys=True)
        probes[side] = probes.get(key) or probe_onednn(args, side)
        probes[key] = probes[side]
        print(f"tensorflow {side}: oneDNN isa {probes[side]['isa']!r}, {probes[side]['runtime']}, "
              f"primitives {probes[side]['primitives']}, graph ops on: {probes[side]['onednn_graph_ops_on']}",
              flush=True)
    name = {"convnet": "keras.io mnist_convnet", "toy_resnet": "keras.io Functional API guide's toy ResNet"}
    head = {"what": f"{name[args.model]}: TensorFlow ParameterServerStrategy (tf-keras; sides: "
                    f"{', '.join(args.tf_sides)}) vs the example's script under pserver run "
                    f"({args.pserver_mode})",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "num_ps": args.ps, "num_workers": args.workers, "global_batch": args.batch_size,
            "batch_per_worker": args.batch_size // args.workers, "optimizer": OPTIMIZER_NAMES[args.model],
            "loss": "categorical_crossentropy" + (" (from logits)" if MODELS[args.model][2] else ""),
            "model": args.model, "train_samples": train_count(args),
            "validation_samples": args.train_samples - train_count(args), "epochs_worth": args.epochs,
            "tf_warmup_steps": args.warmup,
            "tf_sides": {s: {"trains_with": TF_SIDES[s][0], "env": TF_SIDES[s][1],
                             "onednn": probes[s]} for s in args.tf_sides},
            "steps_per_execution": args.steps_per_execution,
            "isa": args.isa, "isa_env": {"tensorflow": ISA_ENV[args.isa][0], "pserver": ISA_ENV[args.isa][1]},
            "caps_in_this_environment": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA")
                                         if k in os.environ},
            "machine": m}

    def write(runs: list[dict]) -> dict:
        out = head | {"load_avg_end": [round(v, 2) for v in os.getloadavg()], "runs": runs, **summarize(runs)}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return out
    out = write(interleaved(args, write))
    print(json.dumps({k: v for k, v in out.items() if k.startswith(("median", "tensorflow_best", "ratio"))},
                     indent=1))


if __name__ == "__main__":
    main()
