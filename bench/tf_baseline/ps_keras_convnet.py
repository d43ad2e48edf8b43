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

Each of --rounds rounds runs TensorFlow, then pserver (with --pserver), with the load average
before each; the JSON has every run, the medians and pserver's ratio to TensorFlow.

--isa gives both sides the same vector instructions for their matrix products: `own` (default)
lets each library choose for the CPU (OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA removed from both
sides' environments: a machine that sets OPENBLAS_CORETYPE=Haswell would give pserver AVX2
kernels while oneDNN, which does not read it, uses AVX-512); `avx2` caps both at AVX2.

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import numpy as np  # noqa: E402
from _util import machine  # noqa: E402
from keras_convnet import script_for  # noqa: E402
from ps_cnn import ISA_ENV, coordinator_for, isa_env, local_cluster, mnist  # noqa: E402  (sets TF's env)

TRAIN = 54000            # the example's fit: validation_split=0.1 of 60,000
SUMMARY = re.compile(r"^(\d+) steps in (\S+) s: ([\d,.]+) train samples/s$", re.M)
OPENBLAS_CORE = re.compile(r"Core: (\S+)$", re.M)      # OpenBLAS's line at load, OPENBLAS_VERBOSE=2
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


def samples_for(epochs: int, workers: int, per_worker: int) -> int:
    """What pserver trains in `epochs`: each worker's whole batches of its share of TRAIN."""
    return epochs * (TRAIN // workers // per_worker) * workers * per_worker


def train_tf(args, per_worker: int) -> dict:
    import tensorflow as tf
    with local_cluster(args.ps, args.workers) as cluster:
        strategy, coordinator = coordinator_for(cluster)
        with strategy.scope():
            model = convnet(tf)
            optimizer = tf.keras.optimizers.Adam()          # Keras's defaults, the example's "adam"
        x, y = mnist(args.data_dir, "train")
        x_val, y_val = x[TRAIN:], np.eye(10, dtype=np.float32)[y[TRAIN:]]
        x, y = x[:TRAIN], np.eye(10, dtype=np.float32)[y[:TRAIN]]
        loss_fn = tf.keras.losses.CategoricalCrossentropy(reduction=tf.keras.losses.Reduction.NONE)

        def dataset_fn():
            ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(TRAIN, seed=args.seed).repeat()
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
        steps = args.tf_steps or samples_for(args.epochs, args.workers, per_worker) // per_worker
        per_epoch = samples_for(1, args.workers, per_worker) // per_worker
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
        x_test, y_test = mnist(args.data_dir, "test")
        accuracy = float(np.mean(np.argmax(model.predict(x_test, batch_size=1000, verbose=0), 1) == y_test))
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy",
            "samples": steps * per_worker, "seconds": round(seconds, 3),
            "train_samples_per_second": steps * per_worker / seconds,
            "validation_each_epoch": args.tf_validation, "validation_seconds": round(validation_seconds, 3),
            "val_accuracy_last": val_accuracy, "test_accuracy_after": accuracy}


def train_tf_apart(args) -> dict:
    """train_tf in a process of its own (a fresh cluster and eager context each round); its
    output (TensorFlow's logging) is shown only when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tf.json")
        passed = {k: v for k, v in vars(args).items()
                  if v is not None and k not in ("pserver", "json", "tf_json", "rounds", "tf_validation",
                                                 "pserver_mode", "pserver_bind_cores", "isa")}
        cmd = [sys.executable, __file__, "--tf-json", path] + [
            a for k, v in passed.items() for a in (f"--{k.replace('_', '-')}", str(v))] + [
            "--tf-validation" if args.tf_validation else "--no-tf-validation"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=isa_env(args.isa, "tensorflow"))
        if r.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"TensorFlow's run failed ({r.returncode}):\n"
                             f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
        return json.loads(Path(path).read_text())


def train_pserver(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = script_for(args.epochs, tmp)
        cmd = [args.pserver, "-m", "pserver", "run", "--ps", str(args.ps), "--workers", str(args.workers),
               "--seed", str(args.seed), "--mode", args.pserver_mode,
               *(["--bind-cores"] if args.pserver_bind_cores else []), "--", args.pserver, str(script)]
        env = isa_env(args.isa, "pserver") | {"PSERVER_MNIST_DIR": args.data_dir, "OPENBLAS_VERBOSE": "2"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"pserver run failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    steps, seconds, rate = SUMMARY.findall(r.stdout)[-1]
    accuracy = float(re.findall(r"^Test accuracy: (\S+)$", r.stdout, re.M)[-1])
    rate = float(rate.replace(",", ""))
    return {"framework": f"pserver run ({args.pserver_mode})", "steps": int(steps), "seconds": float(seconds),
            "samples": round(rate * float(seconds)), "train_samples_per_second": rate,
            "test_accuracy_after": accuracy,
            # the kernels OpenBLAS loaded in the run's processes (numpy's and scipy's, each once)
            "openblas_cores": sorted(set(OPENBLAS_CORE.findall(r.stdout + r.stderr))),
            "command": " ".join(["pserver"] + cmd[3:-1]
                                + [f"bench/keras_mnist_convnet.py, epochs = {args.epochs}"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("PSERVER_MNIST_DIR"),
                   help="directory with the four MNIST IDX files (default $PSERVER_MNIST_DIR)")
    p.add_argument("--ps", type=int, default=1, help="parameter-server tasks / shards (default 1)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--batch-size", type=int, default=128, help="the global batch (the example's 128)")
    p.add_argument("--epochs", type=int, default=2,
                   help="pserver's epochs; TensorFlow times as many samples (default 2)")
    p.add_argument("--warmup", type=int, default=50, help="TensorFlow's untimed steps first (default 50)")
    p.add_argument("--tf-steps", type=int, help="TensorFlow's timed steps (of one worker's batch), "
                   "for a quick check (default: as many samples as pserver's --epochs)")
    p.add_argument("--rounds", type=int, default=1, help="TensorFlow then pserver, this many times")
    p.add_argument("--tf-validation", action=argparse.BooleanOptionalAction, default=True,
                   help="TensorFlow validates the held-out 6,000 at each epoch's end inside its timed "
                   "run, as the example's fit(validation_split=0.1) does and as pserver's rate includes "
                   "(default; --no-tf-validation: training steps only, as the first rounds measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pserver", metavar="PYTHON", help="also run the example on pserver with this "
                   "interpreter (one that has pserver installed)")
    p.add_argument("--pserver-mode", default="sync", choices=("sync", "async"),
                   help="pserver's mode (default sync, the script's; async: each worker's push applied "
                   "as it comes, as TensorFlow's coordinator applies each scheduled step)")
    p.add_argument("--pserver-bind-cores", action="store_true",
                   help="pserver run --bind-cores: worker i on core i (TensorFlow's processes are not bound)")
    p.add_argument("--isa", choices=tuple(ISA_ENV), default="own",
                   help="the vector instructions of each side's matrix products: own (default), each "
                   "library's choice for this CPU (OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA removed from "
                   "their environments); avx2, both capped at AVX2 (OPENBLAS_CORETYPE=Haswell, "
                   "ONEDNN_MAX_CPU_ISA=AVX2)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--tf-json", help=argparse.SUPPRESS)     # one TensorFlow run, its result here
    args = p.parse_args()
    if not args.data_dir:
        raise SystemExit("--data-dir: give the MNIST directory (or set PSERVER_MNIST_DIR)")
    if args.batch_size % args.workers:
        raise SystemExit(f"--batch-size {args.batch_size}: give a multiple of --workers {args.workers}")
    per_worker = args.batch_size // args.workers
    if args.tf_json:
        Path(args.tf_json).write_text(json.dumps(train_tf(args, per_worker)))
        sys.stdout.flush()
        os._exit(0)          # not TensorFlow's teardown, which calls the tasks local_cluster stopped
    m = machine(("tensorflow", "tf_keras", "numpy"))
    print(f"{m['date']}: {m['cpu']}, {m['cores']} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for round_ in range(1, args.rounds + 1):
        for name, fn in [("tensorflow", lambda: train_tf_apart(args))] + \
                        ([("pserver", lambda: train_pserver(args))] if args.pserver else []):
            load = [round(v, 2) for v in os.getloadavg()]
            r = {"round": round_, "side": name, "load_avg_before": load, **fn()}
            runs.append(r)
            print(f"round {round_} {name:>10}: {r['train_samples_per_second']:8,.0f} samples/s "
                  f"({r['samples']:,} samples in {r['seconds']:.1f} s; test accuracy after "
                  f"{r['test_accuracy_after']:.4f}; load before {load[0]:.2f})", flush=True)
    medians = {side: statistics.median(r["train_samples_per_second"] for r in runs if r["side"] == side)
               for side in ("tensorflow", "pserver") if any(r["side"] == side for r in runs)}
    out = {"what": f"keras.io mnist_convnet: TensorFlow ParameterServerStrategy (tf-keras, custom loop, "
                   "async; validating each epoch: see runs) vs the example's script under pserver run "
                   f"({args.pserver_mode})",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "num_ps": args.ps, "num_workers": args.workers, "global_batch": args.batch_size,
           "batch_per_worker": per_worker, "optimizer": "adam 0.001 (Keras defaults)",
           "loss": "categorical_crossentropy", "epochs_worth": args.epochs, "tf_warmup_steps": args.warmup,
           "isa": args.isa, "isa_env": {"tensorflow": ISA_ENV[args.isa][0], "pserver": ISA_ENV[args.isa][1]},
           "caps_in_this_environment": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA")
                                        if k in os.environ},
           "machine": m, "load_avg_end": [round(v, 2) for v in os.getloadavg()], "runs": runs,
           "median_train_samples_per_second": medians}
    if len(medians) == 2:
        out["ratio_pserver_to_tensorflow"] = round(medians["pserver"] / medians["tensorflow"], 3)
        out["ratio_per_round"] = [round(p["train_samples_per_second"] / t["train_samples_per_second"], 3)
                                  for t, p in zip(runs[0::2], runs[1::2])]
    print(f"{'round':>5} | {'TensorFlow':>10} | {'pserver':>10} | ratio")
    for i in range(1, args.rounds + 1):
        rates = {r["side"]: r["train_samples_per_second"] for r in runs if r["round"] == i}
        ps = rates.get("pserver")
        print(f"{i:>5} | {rates['tensorflow']:>10,.0f} | {ps or 0:>10,.0f} | "
              f"{ps / rates['tensorflow'] if ps else 0:.3f}")
    print(f"{'med.':>5} | {medians['tensorflow']:>10,.0f} | {medians.get('pserver', 0):>10,.0f} | "
          f"{out.get('ratio_pserver_to_tensorflow', 0):.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
