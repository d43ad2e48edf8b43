"""Criteo data on a worker: the TSV reader in lines/s and criteo-synthetic's generator in samples/s.

  reader     one epoch of rank 0 over a Criteo-format file written here (--lines lines of random
             values, a fifth of the integer and a tenth of the categorical fields empty), plain
             and gzip, for each --workers count: every worker reads and parses every line and
             keeps its share, so lines/s counts all the file's lines.
  synthetic  one epoch of rank 0 of criteo-synthetic with --samples samples, for each --workers
             count: a worker generates only its share, so samples/s counts its own samples.

Each row runs once after a warm-up pass on a small file or sample (numba compiles or loads its
cache there), and shows wall-clock and CPU time: on a shared machine the CPU figure says what
the code costs, the wall figure what a worker got.

    python bench/criteo_data.py                       # 1M lines, 1M samples, 1 and 4 workers
    python bench/criteo_data.py --lines 200000 --samples 200000 --workers 1
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, positive_ints, table  # noqa: E402

from pserver.data import load_dataset  # noqa: E402


def write_tsv(path: Path, lines: int, seed: int = 0) -> None:
    """`lines` random Criteo-format lines, written 100,000 at a time."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, lines, 100_000):
            n = min(100_000, lines - start)
            ints = rng.integers(0, 5000, (n, 13)).astype(str).astype(object)
            ints[rng.random((n, 13)) < 0.2] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2 ** 32, (n, 26))).astype(object)
            cats[rng.random((n, 26)) < 0.1] = ""
            cols = np.concatenate([rng.integers(0, 2, (n, 1)).astype(str).astype(object), ints, cats], axis=1)
            f.write("\n".join("\t".join(row) for row in cols.tolist()) + "\n")


def timed_epoch(ds, workers: int, batch: int) -> tuple[int, float, float]:
    """(samples rank 0 got, wall seconds, CPU seconds) for one epoch of rank 0."""
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    for x, _ in ds.epoch(0, workers, batch, 0, 0):
        n += len(x)
    return n, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000, help="lines in the file the reader reads")
    ap.add_argument("--samples", type=int, default=1_000_000, help="criteo-synthetic's training samples")
    ap.add_argument("--workers", type=positive_ints, default=[1, 4], help="worker counts (rank 0 is timed)")
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()
    print("\n".join(machine_lines(machine(("numpy", "numba")))))
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="criteo-bench-"))
    try:
        plain, packed = tmp / "day.tsv", tmp / "day.tsv.gz"
        write_tsv(plain, args.lines)
        with open(plain, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        write_tsv(tmp / "warm.tsv", 1000)
        timed_epoch(load_dataset(f"criteo:{tmp / 'warm.tsv'}", test_samples=10), 1, 16)
        for path in (plain, packed):
            ds = load_dataset(f"criteo:{path}", test_samples=10_000)
            for workers in args.workers:
                n, wall, cpu = timed_epoch(ds, workers, args.batch_size)
                rows.append([f"reader {path.name}", str(workers), f"{n:,}", f"{args.lines / wall:,.0f}",
                             f"{args.lines / cpu:,.0f}", "lines/s"])
    finally:
        shutil.rmtree(tmp)
    ds = load_dataset("criteo-synthetic", samples=args.samples, test_samples=10_000)
    timed_epoch(load_dataset("criteo-synthetic", samples=1000, test_samples=100), 1, 16)
    for workers in args.workers:
        n, wall, cpu = timed_epoch(ds, workers, args.batch_size)
        rows.append(["criteo-synthetic", str(workers), f"{n:,}", f"{n / wall:,.0f}", f"{n / cpu:,.0f}",
                     "samples/s"])
    print(table(["what", "workers", "rank 0's samples", "per s (wall)", "per s (CPU)", "unit"], rows, left=1))


if __name__ == "__main__":
    main()
