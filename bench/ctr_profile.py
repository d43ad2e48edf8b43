"""Where a CTR worker's time goes, one thread, no server: per training batch of criteo-synthetic,
the data generation, the dedupe of the batch's ids (TableLookup.of), and the model's
loss_and_grad, profiled by function (cProfile, the top --top by own time). The rows are filled
with small random values instead of being pulled, so the figures leave out the network and
the shards: what remains is what a worker computes.

The dense layers' matrix products (kernels dense_forward/dense_backward, BLAS gemm) are about
0.54 MFLOP per sample for wide_deep (inputs 221, hidden 256,128): the line "dense GFLOP/s"
says how fast they ran, next to the load average that says how busy the machine was.

    python bench/ctr_profile.py                         # wide_deep, batch 512, 40 batches
    python bench/ctr_profile.py --model deepfm --batch-size 2048
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

# One BLAS thread, as `pserver launch` gives each worker; set before numpy and numba load.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines  # noqa: E402


def batches(seed: int, bias: float, batch_size: int, count: int):
    """`count` criteo-synthetic training batches (records, labels), generated in one call as a
    worker generates a chunk (65,536 samples) at once."""
    from pserver.data.criteo import generate
    x, y = generate(seed, bias, np.arange(count * batch_size, dtype=np.uint64))
    for k in range(0, len(y), batch_size):
        yield x[k:k + batch_size], y[k:k + batch_size]


def train_step(model, w, grad, x, y, rng) -> None:
    """One batch of a worker's compute: dedupe the ids, fill the rows, loss and gradients."""
    from pserver.sparse.dedupe import TableLookup
    tables = model.sparse_tables
    first = TableLookup.of(model.batch_ids(x)[0], tables[0].dim)
    lookups = [first] + [TableLookup.like(first, t.dim) for t in tables[1:]]
    for lk in lookups:
        lk.rows[:] = rng.uniform(-0.05, 0.05, lk.rows.shape)
    model.loss_and_grad(w, x, y, grad, sparse=lookups)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wide_deep", help="lr, fm, wide_deep or deepfm (default wide_deep)")
    p.add_argument("--batch-size", type=int, default=512, help="samples per batch (default 512)")
    p.add_argument("--batches", type=int, default=40, help="profiled batches (default 40)")
    p.add_argument("--top", type=int, default=12, help="functions listed (default 12)")
    args = p.parse_args()
    from pserver.data.criteo import calibrate_bias
    from pserver.models.ctr import ctr_model
    model = ctr_model(args.model)
    w = model.init_params(0)
    grad, rng = np.zeros_like(w), np.random.default_rng(0)
    print("\n".join(machine_lines(machine(("numpy", "numba")))))
    bias = calibrate_bias(0)
    for x, y in batches(0, bias, args.batch_size, 2):    # compilation and first touch, untimed
        train_step(model, w, grad, x, y, rng)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for x, y in batches(0, bias, args.batch_size, args.batches):
        train_step(model, w, grad, x, y, rng)
    profile.disable()
    seconds = time.perf_counter() - start
    samples = args.batches * args.batch_size
    print(f"{args.model}, batch {args.batch_size}: {samples / seconds:,.0f} samples/s on one thread "
          f"(profiled, so a little slower than unprofiled)")
    stats = pstats.Stats(profile)
    gemm = sum(v[2] for k, v in stats.stats.items() if k[2] in ("dense_forward", "dense_backward"))
    deep = [layer for layer in model.layers if layer.name.startswith("deep_")]
    flops = 2 * 3 * samples * sum(int(np.prod(layer.kernel_shape())) for layer in deep)
    if deep:
        print(f"dense GFLOP/s: {flops / gemm / 1e9:.1f} ({gemm / seconds:.0%} of the time)")
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
