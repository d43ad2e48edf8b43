"""Sparse-table kernels on one thread: ids/s of the worker's dedupe, rows/s of a shard's table.

Rows, each against a NumPy baseline timed in the same run (ratio = ours / baseline's rate):

  unique_inverse   --ids ids drawn from --unique distinct random 64-bit ids, made unique with
                   first-appearance order and an inverse; baseline np.unique(return_inverse=True)
  segment_sum      the --ids row gradients (dim --dim) summed per unique id; baseline np.add.at
  apply <opt>      SparseTable.apply of --batch distinct ids (all stored) with their gradients,
                   into a table already holding --rows rows: find, the row optimizer, last update;
                   baseline np.add.at of the same gradients into a dense float32 matrix of
                   --rows rows at known row numbers (no hashing, no optimizer)
  lookup <opt>     SparseTable.lookup of the same ids; baseline the dense matrix's fancy-index
                   gather at known row numbers

Each row: --warmup untimed runs (compilation, first touch), then --runs timed ones, each on a
fresh random batch, ours and the baseline in turn; the table shows the rate of the fastest run
of each. Timing is wall-clock on a machine that may be shared: the load average printed first
says how busy it was.

    python bench/sparse_kernels.py                      # 1M ids / 64k unique, 1M-row tables
    python bench/sparse_kernels.py --rows 100000 --runs 5 --optimizers sgd
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, table  # noqa: E402

from pserver.sparse import ROW_OPTIMIZERS, SparseTable, TableConfig, segment_sum, unique_inverse  # noqa: E402


def rates(ours, base, items: int, args) -> tuple[float, float]:
    """items/s of ours and of base, each (call, make): make builds a fresh input outside the
    timed region. The two run in turn, so load from elsewhere falls on both; each rate is
    from its fastest run, the one least disturbed on a shared machine."""
    times = ([], [])
    for k in range(args.warmup + args.runs):
        for which, (call, make) in enumerate((ours, base)):
            inputs = make()
            start = time.perf_counter()
            call(*inputs)
            if k >= args.warmup:
                times[which].append(time.perf_counter() - start)
    return items / min(times[0]), items / min(times[1])


def dedupe_rows(args, rng) -> list[list[str]]:
    pool = rng.integers(0, 2**64, args.unique, dtype=np.uint64)

    def batch():
        return (pool[rng.integers(0, args.unique, args.ids)],)

    def grads_batch():
        ids = batch()[0]
        _, inverse = unique_inverse(ids)
        return (rng.standard_normal((args.ids, args.dim)).astype(np.float32), inverse,
                int(inverse.max()) + 1)

    def add_at(grads, inverse, u):
        np.add.at(np.zeros((u, grads.shape[1]), np.float32), inverse, grads)

    pairs = [("unique_inverse", "ids/s", (unique_inverse, batch),
              (lambda ids: np.unique(ids, return_inverse=True), batch)),
             ("segment_sum", "ids/s", (segment_sum, grads_batch), (add_at, grads_batch))]
    return [row(name, unit, ours, base, args.ids, args) for name, unit, ours, base in pairs]


def row(name, unit, ours, base, items, args) -> list[str]:
    a, b = rates(ours, base, items, args)
    print(f"  {name}: {a / 1e6:.2f}M {unit} (baseline {b / 1e6:.2f}M)", flush=True)
    return [name, unit, f"{a / 1e6:.2f}M", f"{b / 1e6:.2f}M", f"{a / b:.1f}x"]


def table_rows(opt: str, args, rng) -> list[list[str]]:
    t = SparseTable(TableConfig("bench", args.dim, optimizer=opt), 0)
    stored = rng.integers(0, 2**64, args.rows, dtype=np.uint64)
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    for start in range(0, args.rows, args.batch):
        part = stored[start:start + args.batch]
        t.apply(part, grads[:part.size], 0)
    dense = np.zeros((args.rows, args.dim), np.float32)
    out = np.empty((args.batch, args.dim), np.float32)

    def pick():
        where = rng.choice(args.rows, args.batch, replace=False)
        return where, stored[where]

    apply = (lambda ids: t.apply(ids, grads, 1), lambda: (pick()[1],))
    lookup = (lambda ids: t.lookup(ids, out), lambda: (pick()[1],))
    add_at = (lambda where: np.add.at(dense, where, grads), lambda: (pick()[0],))
    gather = (lambda where: dense[where], lambda: (pick()[0],))
    return [row(f"apply {opt}", "rows/s", apply, add_at, args.batch, args),
            row(f"lookup {opt}", "rows/s", lookup, gather, args.batch, args)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ids", type=int, default=1_000_000, help="ids per dedupe call")
    p.add_argument("--unique", type=int, default=65536, help="distinct ids among them")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows stored in each table")
    p.add_argument("--batch", type=int, default=65536, help="distinct ids per apply/lookup")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizers", default=",".join(ROW_OPTIMIZERS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    opts = [o for o in args.optimizers.split(",") if o]
    unknown = sorted(set(opts) - set(ROW_OPTIMIZERS))
    if unknown:
        p.error(f"--optimizers: unknown {unknown[0]!r}; choose from {','.join(ROW_OPTIMIZERS)}")
    print("\n".join(machine_lines(machine(("numpy", "numba")))))
    print(f"one thread; dedupe: {args.ids} ids of {args.unique} distinct; tables: {args.rows} rows "
          f"of dim {args.dim}, {args.batch} distinct ids per call; best of {args.runs} runs")
    rng = np.random.default_rng(args.seed)
    rows = dedupe_rows(args, rng)
    for opt in opts:
        rows += table_rows(opt, args, rng)
    print(table(["kernel", "unit", "ours", "numpy", "ratio"], rows))


if __name__ == "__main__":
    main()
