"""The MLP of bench/throughput.py under TensorFlow's ParameterServerStrategy: training
samples/s with 1 parameter server and 2 workers on this machine, for as many seconds as asked.

The same task as `pserver launch --model mlp --dataset synthetic`: MLP 784-256-256-10 (ReLU),
plain SGD, batch 256 per step (one worker's), sparse categorical cross-entropy from logits,
on random MNIST-shaped data. The cluster and the custom loop are ps_cnn.py's (real
tf.distribute.Server processes, a ClusterCoordinator scheduling one worker's batch per step);
steps are scheduled in rounds until `--seconds` of training have been timed, after a warm-up.
bench/throughput.py runs it in its own virtual environment (see README.md) and prints the
ratio; it imports nothing from pserver.

    python bench/tf_baseline/ps_mlp.py --seconds 20 --json tf_mlp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np  # noqa: E402  (ps_cnn set TensorFlow's environment first)
from ps_cnn import coordinator_for, local_cluster, training_step  # the script's directory is on sys.path

ROUND = 100           # steps scheduled between two looks at the clock


def mlp(tf, hidden: tuple[int, ...] = (256, 256)):
    layers = [tf.keras.layers.Dense(h, activation="relu") for h in hidden]
    return tf.keras.Sequential([tf.keras.Input(shape=(784,)), *layers, tf.keras.layers.Dense(10)])


def train(args, cluster: dict) -> dict:
    import tensorflow as tf
    strategy, coordinator = coordinator_for(cluster)
    with strategy.scope():
        model = mlp(tf)
        optimizer = tf.keras.optimizers.SGD(args.lr)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(args.samples, seed=args.seed).repeat()
        return ds.batch(args.batch_size, drop_remainder=True).prefetch(4)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    step_fn = training_step(tf, strategy, model, optimizer, args.batch_size)

    def schedule(steps: int) -> None:
        for _ in range(steps):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()

    schedule(args.warmup)              # tracing, connections, the first allocations
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < args.seconds:
        schedule(ROUND)
        steps += ROUND
    seconds = time.perf_counter() - started
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy",
            "model": "mlp 784-256-256-10",
            "optimizer": f"sgd {args.lr}", "num_ps": args.ps, "num_workers": args.workers,
            "batch_size": args.batch_size, "steps": steps, "samples": steps * args.batch_size,
            "seconds": round(seconds, 3), "train_samples_per_second": steps * args.batch_size / seconds,
            "cpus": os.cpu_count()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="per step, one worker's (default 256)")
    p.add_argument("--seconds", type=float, default=20.0, help="timed training, at least (default 20)")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps first (default 50)")
    p.add_argument("--samples", type=int, default=60000, help="random training samples (default 60000)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the result here too")
    args = p.parse_args()
    with local_cluster(args.ps, args.workers) as cluster:
        result = train(args, cluster)
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
