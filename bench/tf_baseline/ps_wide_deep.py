"""A 26-table wide & deep click-through-rate model under TensorFlow's ParameterServerStrategy:
end-to-end training samples/s with 1 parameter server and 2 workers, and the test AUC after.

The model, as `pserver --model wide_deep` builds it: per categorical field a deep embedding
(--dim, pserver's --embedding-dim) and a wide one (dim 1); deep = concat(26 deep embeddings,
13 dense features) -> Dense(256, relu) -> Dense(128, relu) -> Dense(1); wide = the sum of the
26 wide embeddings + Dense(1) on the dense features; logit = wide + deep; binary
cross-entropy from logits. The embedding tables take sparse updates: the
gradient of a Keras Embedding is an IndexedSlices of the batch's rows, which Adagrad (--lr)
applies on the parameter server to those rows only; the dense layers train with Adam
(--dense-lr). TensorFlow's tables have a fixed size, so each field's ids are first mapped to
0..k-1 over the k distinct ids that field has in the file (a perfect vocabulary: no hash
collisions, and no row that is never used).

The data is an .npz with `dense` float32 (n, 13), `cat` int64 (n, 26) and `label` float32
(n,); its last `test_rows` rows (a key of the file; else the last --test-fraction) are held
out for the AUC. criteo_npz.py writes criteo-synthetic so, from pserver's environment. The
cluster and the custom loop are those of ps_cnn.py (real tf.distribute.Server processes on
this machine, the coordinator in this process); one step is one worker's batch, and samples/s
counts the steps after --warmup. Runs in its own virtual environment (see
bench/tf_baseline/README.md).

    python bench/tf_baseline/ps_wide_deep.py --data criteo.npz --json tf_wide_deep.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np  # noqa: E402
from ps_cnn import coordinator_for, local_cluster, report  # sets TensorFlow's environment first

NUM_DENSE, NUM_CAT = 13, 26


def load(path: str, test_fraction: float) -> tuple[tuple, tuple, list[int]]:
    """(train, test, table sizes): each split is (dense, cat indices, label)."""
    with np.load(path) as f:
        missing = {"dense", "cat", "label"} - set(f.files)
        if missing:
            raise SystemExit(f"--data {path}: no {', '.join(sorted(missing))} in the file")
        dense, cat, label = f["dense"].astype(np.float32), f["cat"], f["label"].astype(np.float32)
        test_rows = int(f["test_rows"]) if "test_rows" in f.files else round(len(label) * test_fraction)
    n = len(label)
    if dense.shape != (n, NUM_DENSE) or cat.shape != (n, NUM_CAT) or cat.dtype.kind not in "iu":
        raise SystemExit(f"--data {path}: need dense (n, {NUM_DENSE}), integer cat (n, {NUM_CAT}) "
                         f"and label (n,); got {dense.shape}, {cat.dtype} {cat.shape}, {label.shape}")
    index = np.empty(cat.shape, np.int32)
    sizes = []
    for f in range(NUM_CAT):
        uniq, index[:, f] = np.unique(cat[:, f], return_inverse=True)
        sizes.append(len(uniq))
    cut = n - test_rows
    if not 0 < cut < n:
        raise SystemExit(f"--data {path}: {test_rows} test rows of {n} leave no training or no test rows")
    return (dense[:cut], index[:cut], label[:cut]), (dense[cut:], index[cut:], label[cut:]), sizes


def auc(label: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic, ties counted half."""
    order = np.argsort(score, kind="stable")
    s = score[order]
    ranks = np.empty(len(s))
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)     # mean rank of each tie
    pos = label > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def wide_deep(tf, sizes: list[int], dim: int):
    class WideDeep(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.deep = [tf.keras.layers.Embedding(k, dim, name=f"deep_{i}") for i, k in enumerate(sizes)]
            self.wide = [tf.keras.layers.Embedding(k, 1, name=f"wide_{i}") for i, k in enumerate(sizes)]
            self.linear = tf.keras.layers.Dense(1)
            self.mlp = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                            tf.keras.layers.Dense(128, activation="relu"),
                                            tf.keras.layers.Dense(1)])

        def call(self, inputs):
            dense, cat = inputs
            deep = tf.concat([e(cat[:, i]) for i, e in enumerate(self.deep)] + [dense], axis=1)
            wide = tf.add_n([e(cat[:, i]) for i, e in enumerate(self.wide)]) + self.linear(dense)
            return tf.squeeze(self.mlp(deep) + wide, axis=1)

        def tables(self):
            return [v for e in self.deep + self.wide for v in e.trainable_variables]

    return WideDeep()


def train(args, cluster: dict, data: tuple, sizes: list[int]) -> dict:
    import tensorflow as tf
    # With more than one ps, each table is split into row ranges over them (at most one per ps).
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=args.ps)
    strategy, coordinator = coordinator_for(cluster, partitioner)
    with strategy.scope():
        model = wide_deep(tf, sizes, args.dim)
        model((tf.zeros((1, NUM_DENSE)), tf.zeros((1, NUM_CAT), tf.int32)))       # build the weights
        # The legacy optimizers apply an IndexedSlices in one fused op on the ps
        # (ResourceSparseApplyAdagradV2); they ran faster here than the newer Keras ones.
        table_opt = tf.keras.optimizers.legacy.Adagrad(
            args.lr, initial_accumulator_value=args.initial_accumulator)
        dense_opt = tf.keras.optimizers.legacy.Adam(args.dense_lr)
    tables = model.tables()
    table_ids = {id(v) for v in tables}
    dense_vars = [v for v in model.trainable_variables if id(v) not in table_ids]
    (dense, cat, label), test = data

    def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices(((dense, cat), label))
        ds = ds.shuffle(min(len(label), 1 << 17), seed=args.seed).repeat()
        return ds.batch(args.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step_fn(it):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                losses = tf.nn.sigmoid_cross_entropy_with_logits(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(losses, global_batch_size=args.batch_size)
            grads = tape.gradient(loss, tables + dense_vars)
            table_opt.apply_gradients(zip(grads[:len(tables)], tables))      # IndexedSlices: rows only
            dense_opt.apply_gradients(zip(grads[len(tables):], dense_vars))
            return loss
        xb, yb = next(it)
        return strategy.run(replica_fn, args=(xb, yb))

    steps = args.steps or len(label) // args.batch_size
    if steps <= args.warmup:
        raise SystemExit(f"--steps {steps}: need more than --warmup {args.warmup}")
    for _ in range(args.warmup):           # tracing, connections, the first allocations
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    started = time.perf_counter()
    for _ in range(steps - args.warmup):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    seconds = time.perf_counter() - started
    t_dense, t_cat, t_label = test
    scores = model.predict((t_dense, t_cat), batch_size=8192, verbose=0)
    timed = (steps - args.warmup) * args.batch_size
    logits = np.asarray(scores, np.float64).reshape(-1)
    # binary cross-entropy from the logit, as pserver's test_logloss
    logloss = float(np.mean(np.logaddexp(0.0, logits) - t_label * logits))
    return {"framework": f"tensorflow {tf.__version__} ParameterServerStrategy", "model": "wide_deep",
            "num_ps": args.ps, "num_workers": args.workers, "batch_size": args.batch_size,
            "dim": args.dim, "table_lr": args.lr, "table_initial_accumulator": args.initial_accumulator,
            "dense_lr": args.dense_lr, "tables": NUM_CAT * 2, "table_rows": 2 * sum(sizes),
            "train_samples": steps * args.batch_size, "timed_samples": timed, "seconds": round(seconds, 3),
            "train_samples_per_second": timed / seconds, "test_samples": len(t_label),
            "test_auc": auc(t_label, scores), "test_logloss": logloss, "data": os.path.abspath(args.data),
            "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "machine": platform.processor()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help=".npz with dense (n, 13), cat (n, 26), label (n,)")
    p.add_argument("--test-fraction", type=float, default=0.1,
                   help="the last part of the rows held out for the AUC, where the file has no "
                   "test_rows (default 0.1)")
    p.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    p.add_argument("--batch-size", type=int, default=512, help="per step, one worker's (default 512)")
    p.add_argument("--dim", type=int, default=8, help="deep embedding dimension (default 8, as "
                   "pserver's --embedding-dim)")
    p.add_argument("--steps", type=int, default=0,
                   help="steps over all workers (default: one pass over the training rows)")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps first (default 50)")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate of the tables "
                                                          "(default 0.05)")
    p.add_argument("--initial-accumulator", type=float, default=0.1,
                   help="Adagrad's initial_accumulator_value for the tables (default 0.1, TensorFlow's; "
                   "pserver's row adagrad starts at 0, --row-params initial_accumulator=)")
    p.add_argument("--dense-lr", type=float, default=1e-3, help="Adam learning rate of the dense layers "
                   "(default 0.001)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the result here too")
    args = p.parse_args()
    train_split, test_split, sizes = load(args.data, args.test_fraction)
    with local_cluster(args.ps, args.workers) as cluster:
        result = train(args, cluster, (train_split, test_split), sizes)
    report(result, [f"{result['framework']} wide_deep: {result['train_samples_per_second']:,.0f} samples/s "
                    f"({result['timed_samples']:,} samples in {result['seconds']:.1f} s after {args.warmup} "
                    f"warm-up steps, batch {args.batch_size} per worker); test AUC {result['test_auc']:.4f}"],
           args.json)


if __name__ == "__main__":
    main()
