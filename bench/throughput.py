"""End-to-end training throughput with real processes, for each consistency mode.

    .venv/bin/python bench/throughput.py [--modes sync,async,...] [--epochs 3] [--repeats 3] [--json PATH]

Runs `pserver launch --ps 1 --workers 2` (MLP 784-256-256-10, batch 256 per worker,
synthetic MNIST-shaped data, SGD) once per mode and repeat, and reports the run's
train samples/s as the chief's summary measures it: samples pushed to the shard
divided by the wall time from the first pull to the last worker's finish (process
start-up, data generation and one warm-up step that loads the compiled kernels are
excluded; every push and pull of training is inside it). For a comparison with TensorFlow's
ParameterServerStrategy measured in the same run, see bench/tf_baseline/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import cpu_model, result_path  # noqa: E402

MODE_FLAGS = {"sync": [], "backup": ["--backup-workers", "1"], "async": [], "ssp": ["--staleness", "2"]}


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_once(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.json")
        cmd = [sys.executable, "-m", "pserver", "launch", "--ps", "1", "--workers", "2", "--mode", mode,
               *MODE_FLAGS[mode], "--model", "mlp", "--dataset", "synthetic", "--batch-size", "256",
               "--epochs", str(args.epochs), "--optimizer", "sgd", "--lr", "0.05", "--log-every", "1000",
               "--summary-json", path, *args.extra]
        started = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{mode}: pserver launch failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        s = json.load(open(path))
        return {"mode": mode, "train_samples_per_second": s["train_samples_per_second"],
                "wall_seconds": s["wall_seconds"], "steps": s["steps"],
                "launch_seconds": round(time.monotonic() - started, 2), "test_accuracy": s["test_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,backup,async,ssp")
    p.add_argument("--epochs", type=int, default=5, help="epochs per run (default 5: 585 steps per worker)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    p.add_argument("--json", metavar="PATH", help="write the {mode, train_samples_per_second, wall_seconds, "
                   "steps} rows here (default results/throughput.json)")
    p.add_argument("extra", nargs="*", help="more flags for pserver launch (after --)")
    args = p.parse_args()
    print(f"pserver end-to-end throughput: 1 shard + 2 workers, MLP 784-256-256-10, batch 256/worker, "
          f"synthetic data, {args.epochs} epoch(s), median of {args.repeats}")
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M')}")
    rows = []
    for mode in args.modes.split(","):
        runs = [run_once(mode, args) for _ in range(args.repeats)]
        rates = [r["train_samples_per_second"] for r in runs]
        best = sorted(runs, key=lambda r: r["train_samples_per_second"])[len(runs) // 2]
        row = dict(best, min=min(rates), max=max(rates), repeats=len(runs))
        rows.append(row)
        print(f"  {mode:7s} {row['train_samples_per_second']:>9,.0f} samples/s (min {min(rates):,.0f}, "
              f"max {max(rates):,.0f})  {row['steps']} steps in {row['wall_seconds']:.2f} s  "
              f"acc {row['test_accuracy']:.3f}", flush=True)
    path = result_path(args.json, "throughput.json")
    path.write_text(json.dumps(rows, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
