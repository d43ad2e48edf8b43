"""Compact rows: bytes per row for each row type x state type, and test AUC against float32.

    .venv/bin/python bench/compact_rows.py                       # 1M criteo-synthetic samples
    .venv/bin/python bench/compact_rows.py --samples 200000      # what a loaded machine fits

Bytes: a SparseTable of dim 16 (adagrad and adam) with --rows rows pushed once; per row, the
values (row and slots, in their types) and the whole entry as the shard's budget counts it (id
and last update, 8 bytes each, adam's step count, 8 more), with the table's measured bytes
(`stats()`, including its index) divided by its rows; each against float32's. Then the time of
a push of every row (one thread, three rounds interleaved across the types; medians, and their
ratio to float32's).

AUC: `pserver launch` of wide_deep on criteo-synthetic (sync, --ps 2 --workers 2, adam 0.001 on
the dense weights, adagrad 0.05 on the rows: the settings of bench/results/ctr), once per type
pair, float32 first; the test AUC after the epoch of each and its difference from float32's
(target: within 0.002). Prints both tables and writes results/ctr/compact-rows.json (--out
bench/results/ctr/compact-rows.json for the committed figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path, table  # noqa: E402

from pserver.sparse import SparseTable, TableConfig  # noqa: E402

PAIRS = [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "row"), ("float16", "float32"),
         ("float16", "row")]


def bytes_rows(dim: int, rows: int, rounds: int = 3) -> list[dict]:
    """Bytes per row of each (optimizer, row type, state type), and the time of a push of every
    row (one thread), rounds interleaved across the types: the median, and its ratio to float32's."""
    out, tables = [], []
    ids = np.arange(1, rows + 1, dtype=np.uint64)
    grads = np.random.default_rng(0).normal(0, 0.01, (rows, dim)).astype(np.float32)
    for optimizer in ("adagrad", "adam"):
        for row, state in PAIRS:
            config = TableConfig("t", dim, optimizer=optimizer, row_dtype=row, state_dtype=state)
            t = SparseTable(config, 0)
            t.apply(ids, grads, 0)
            t.apply(ids[:64], grads[:64], 1)            # kernels compiled or loaded before timing
            stats = t.stats()
            tables.append(t)
            out.append(dict(optimizer=optimizer, row_dtype=row, state_dtype=state,
                            value_bytes=config.layout().bytes_per_row(), entry_bytes=t._rows.entry_bytes,
                            measured_bytes_per_row=round(stats["bytes"] / stats["rows"], 2), push_seconds=[]))
    for k in range(rounds):
        for r, t in zip(out, tables):
            start = time.perf_counter()
            t.apply(ids, grads, 2 + k, checked=True)
            r["push_seconds"].append(round(time.perf_counter() - start, 4))
    for r in out:
        base = next(b for b in out if b["optimizer"] == r["optimizer"] and b["row_dtype"] == "float32")
        r["vs_float32"] = round(r["entry_bytes"] / base["entry_bytes"], 3)
        r["push_ns_per_row"] = round(float(np.median(r["push_seconds"])) / rows * 1e9, 1)
        ratio = np.median(r["push_seconds"]) / np.median(base["push_seconds"])
        r["push_time_vs_float32"] = round(float(ratio), 2)
    return out


def auc_run(row: str, state: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "-m", "pserver", "launch", "--ps", "2", "--workers", "2", "--mode", "sync",
               "--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", str(args.samples),
               "--test-samples", str(args.test_samples), "--batch-size", "512", "--optimizer", "adam",
               "--lr", "0.001", "--row-optimizer", "adagrad", "--row-lr", "0.05", "--row-dtype", row,
               "--state-dtype", state, "--summary-json", summary]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        s = json.loads(Path(summary).read_text())
    bytes_ = {name: t["bytes"] for name, t in s.get("sparse_tables", {}).items()}
    return dict(row_dtype=row, state_dtype=state, auc=s["per_epoch"][-1]["auc"], planted_auc=s["best_auc"],
                wall_seconds=round(wall, 1),
                table_bytes=bytes_, command=" ".join(["pserver"] + cmd[3:-2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000, help="training samples (default 1M)")
    ap.add_argument("--test-samples", type=int, default=100_000, help="test samples (default 100k)")
    ap.add_argument("--rows", type=int, default=100_000, help="rows of the bytes tables (default 100k)")
    ap.add_argument("--dim", type=int, default=16, help="the bytes tables' dim (default 16)")
    ap.add_argument("--pairs", default="all", help="row:state pairs for the AUC runs, comma separated "
                    "(default all five; float32:float32 always runs first)")
    ap.add_argument("--bytes-only", action="store_true", help="measure bytes and push times only, and "
                    "replace them in the JSON at --out, keeping its AUC runs (after a kernel change that "
                    "keeps every bit: the AUCs stand)")
    ap.add_argument("--out", default=None, help="the JSON (default bench/results/ctr/compact-rows.json)")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)))
    load = os.getloadavg()
    sizes = bytes_rows(args.dim, args.rows)
    print(f"\nbytes per row, dim {args.dim} ({args.rows:,} rows; entry = id 8 + last update 8 "
          f"[+ adam's steps 8] + values):")
    print(table(["optimizer", "row", "state", "values", "entry", "measured", "vs float32", "push ns/row",
                 "push time vs float32"],
                [[r["optimizer"], r["row_dtype"], r["state_dtype"], str(r["value_bytes"]),
                  str(r["entry_bytes"]),
                  f"{r['measured_bytes_per_row']:.1f}", f"{r['vs_float32']:.3f}",
                  f"{r['push_ns_per_row']:.0f}",
                  f"{r['push_time_vs_float32']:.2f}"] for r in sizes], left=3))
    if args.bytes_only:
        out = result_path(args.out, "ctr/compact-rows.json")
        kept = json.loads(out.read_text()) if out.exists() else {}
        kept.update(bytes=sizes, bytes_machine=m, bytes_load_average_before=load)
        out.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {out} (bytes and push times; its AUC runs kept)")
        return 0
    pairs = PAIRS if args.pairs == "all" else [("float32", "float32")] + [
        tuple(p.split(":")) for p in args.pairs.split(",") if p != "float32:float32"]
    runs = []
    out = result_path(args.out, "ctr/compact-rows.json")
    for row, state in pairs:       # the JSON is rewritten after each run: a cut-short bench keeps its runs
        runs.append(auc_run(row, state, args))
        runs[-1]["auc_vs_float32"] = round(runs[-1]["auc"] - runs[0]["auc"], 5)
        print(f"  {row}/{state}: test AUC {runs[-1]['auc']:.4f} ({runs[-1]['wall_seconds']} s)", flush=True)
        out.write_text(json.dumps(dict(machine=m, load_average_before=load, samples=args.samples,
                                       test_samples=args.test_samples, dim=args.dim, bytes=sizes, auc=runs),
                                  indent=2, sort_keys=True) + "\n")
    print(f"\ntest AUC, wide_deep on {args.samples:,} criteo-synthetic samples ({args.test_samples:,} test):")
    print(f"(the planted model's AUC: {runs[0]['planted_auc']:.4f})")
    print(table(["row", "state", "test AUC", "vs float32", "seconds"],
                [[r["row_dtype"], r["state_dtype"], f"{r['auc']:.4f}", f"{r['auc_vs_float32']:+.4f}",
                  str(r["wall_seconds"])] for r in runs], left=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
