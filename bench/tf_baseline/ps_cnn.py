"""The reference CNN under TensorFlow's ParameterServerStrategy, and pserver on the same task
in the same run: end-to-end training samples/s with 1 parameter server and 2 workers.

A local cluster of real processes: NUM_PS parameter-server tasks and NUM_WORKERS worker tasks
(tf.distribute.Server each), and this process as the coordinator, which schedules the training
steps of the TensorFlow tutorial's custom loop (ClusterCoordinator, one step = one worker's
batch, Adam, sparse categorical cross-entropy from logits) and times them after a warm-up.
Runs in its own virtual environment (see bench/tf_baseline/README.md); it imports nothing
from pserver. With --pserver PYTHON it then runs `PYTHON -m pserver launch --ps 1 --workers 2
--model cnn` (Adam 0.001, batch 64 per worker, one epoch of MNIST) and prints both rates.

    python bench/tf_baseline/ps_cnn.py --data-dir DIR_WITH_MNIST_IDX --pserver .venv/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import tempfile
import time

# Keras 2 (the tf-keras package): Keras 3 does not run under ParameterServerStrategy.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"     # CPU, as pserver's workers in the comparison

import numpy as np  # noqa: E402


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = np.frombuffer(data, ">u4", ndim, 4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def mnist(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if split == "train" else "t10k"

    def find(name):
        for ext in ("", ".gz"):
            if os.path.exists(os.path.join(data_dir, name + ext)):
                return os.path.join(data_dir, name + ext)
        raise SystemExit(f"{data_dir}: no {name}(.gz)")
    x = read_idx(find(f"{prefix}-images-idx3-ubyte"))[..., None].astype(np.float32) / 255
    y = read_idx(find(f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    return x, y


def serve(cluster: dict, job: str, index: int) -> None:
    import tensorflow as tf
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", start=True)
    server.join()


@contextlib.contextmanager
def local_cluster(num_ps: int, num_workers: int):
    """Start `num_ps` ps tasks and `num_workers` worker tasks as processes on this machine;
    yields the cluster spec (a dict) and stops the tasks after."""
    ports = free_ports(num_ps + num_workers)
    cluster = {"ps": [f"127.0.0.1:{q}" for q in ports[:num_ps]],
               "worker": [f"127.0.0.1:{q}" for q in ports[num_ps:]]}
    ctx = multiprocessing.get_context("spawn")
    tasks = [ctx.Process(target=serve, args=(cluster, job, i), daemon=True)
             for job in ("ps", "worker") for i in range(len(cluster[job]))]
    for t in tasks:
        t.start()
    try:
        yield cluster
    finally:
        for t in tasks:
            t.terminate()
        for t in tasks:        # reaped, so their CPU time counts in the caller's RUSAGE_CHILDREN
            t.join(10)


def coordinator_for(cluster: dict, variable_partitioner=None):
    """The strategy over `cluster` and the ClusterCoordinator that schedules its steps."""
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def reference_cnn(tf):
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10)])


def training_step(tf, strategy, model, optimizer, batch_size: int):
    """The tutorial's step: one worker's batch, sparse categorical cross-entropy from
    logits, the optimizer's update on the ps."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

    @tf.function
    def step_fn(it):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)),
                                                  global_batch_size=batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        xb, yb = next(it)
        return strategy.run(replica_fn, args=(xb, yb))
    return step_fn


def train(args, cluster: dict) -> dict:
    import tensorflow as tf
    strategy, coordinator = coordinator_for(cluster)
    with strategy.scope():
        model = reference_cnn(tf)
        optimizer = tf.keras.optimizers.Adam(args.lr)
    x, y = mnist(args.data_dir, "train")

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60000, seed=args.seed).repeat()
        return ds.batch(args.batch_size, drop_remainder=True).prefetch(4)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    step_fn = training_step(tf, strategy, model, optimizer, args.batch_size)
    for _ in range(args.warmup):           # tracing, connections, the first allocations
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    started = time.perf_counter()
    for _ in range(args.steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    seconds = time.perf_counter() - started
    x_test, y_test = mnist(args.data_dir, "test")
    accuracy = float(np.mean(np.argmax(model.predict(x_test, batch_size=1000, verbose=0), 1) == y_test))
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy",
            "num_ps": args.ps, "num_workers": args.workers, "batch_size": args.batch_size,
            "samples": args.steps * args.batch_size, "seconds": round(seconds, 3),
            "train_samples_per_second": args.steps * args.batch_size / seconds,
            "test_accuracy_after": accuracy, "cpus": os.cpu_count(), "machine": platform.processor()}


# The vector instructions each side's matrix products may use (--isa). TensorFlow's convolutions
# and products are oneDNN's, which picks for the CPU unless ONEDNN_MAX_CPU_ISA caps it; pserver's
# are OpenBLAS's (through numba), which picks for the CPU unless OPENBLAS_CORETYPE names a core.
ISA_ENV = {"own": ({}, {}),
           # pserver's numba kernels (the Winograd transforms, pooling, the loss) compiled for
           # Haswell too, not for this CPU's AVX-512.
           "avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"},
                    {"OPENBLAS_CORETYPE": "Haswell", "NUMBA_CPU_NAME": "haswell"})}


def isa_env(isa: str, side: str) -> dict:
    """This process's environment for one side under --isa: without both caps, then with the
    side's own (so a cap this machine's environment sets, as OPENBLAS_CORETYPE, is not kept)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE", "NUMBA_CPU_NAME")}
    return env | ISA_ENV[isa][0 if side == "tensorflow" else 1]


def run_pserver(args) -> dict:
    """pserver on the same model, data, batch and optimizer: its summary's samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.json")
        cmd = [args.pserver, "-m", "pserver", "launch", "--ps", str(args.ps), "--workers", str(args.workers),
               "--model", "cnn", "--dataset", "mnist", "--data-dir", args.data_dir, "--optimizer", "adam",
               "--lr", str(args.lr), "--batch-size", str(args.batch_size), "--epochs", "1",
               "--seed", str(args.seed), "--log-every", "1000", "--summary-json", path]
        r = subprocess.run(cmd, capture_output=True, text=True, env=isa_env(args.isa, "pserver"))
        if r.returncode != 0:
            raise SystemExit(f"pserver launch failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        with open(path) as f:
            s = json.load(f)
    return {"framework": "pserver", "num_ps": args.ps, "num_workers": args.workers,
            "batch_size": args.batch_size, "seconds": s["wall_seconds"],
            "samples": round(s["train_samples_per_second"] * s["wall_seconds"]),
            "train_samples_per_second": s["train_samples_per_second"],
            "test_accuracy_after": s["test_accuracy"], "isa": args.isa}


def report(results, lines: list[str], path: str | None) -> None:
    """Print the results as JSON, then a line each; write the JSON to `path` too."""
    print(json.dumps(results, indent=2))
    print("\n".join(lines))
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="directory with the four MNIST IDX files")
    p.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="per step, one worker's (default 64)")
    p.add_argument("--steps", type=int, default=1500, help="timed steps, over all workers (default 1500)")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps first (default 50)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pserver", metavar="PYTHON", help="also run pserver with this interpreter "
                   "(one that has pserver installed) and compare")
    p.add_argument("--isa", choices=tuple(ISA_ENV), default="own",
                   help="the vector instructions of each side's matrix products: own (default), each "
                   "library's choice for this CPU (OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA removed from "
                   "their environments); avx2, both capped (OPENBLAS_CORETYPE=Haswell, "
                   "NUMBA_CPU_NAME=haswell, ONEDNN_MAX_CPU_ISA=AVX2)")
    p.add_argument("--json", metavar="PATH", help="write the results here too")
    args = p.parse_args()
    tf_env = isa_env(args.isa, "tensorflow")      # before TensorFlow loads, here and in its servers
    os.environ.clear()
    os.environ.update(tf_env)
    with local_cluster(args.ps, args.workers) as cluster:
        results = [train(args, cluster) | {"isa": args.isa}]
    if args.pserver:
        results.append(run_pserver(args))
    report(results, [f"{r['framework']:>50}: {r['train_samples_per_second']:>8,.0f} samples/s "
                     f"({r['samples']:,} samples in {r['seconds']:.1f} s, batch {r['batch_size']} per "
                     f"worker; test accuracy after {r['test_accuracy_after']:.4f})" for r in results],
           args.json)


if __name__ == "__main__":
    main()
