"""Wide & deep on criteo-synthetic, TensorFlow's ParameterServerStrategy against pserver, with the
tables' Adagrad starting its accumulators at 0 and at 0.1 in both: TensorFlow's default is 0.1,
pserver's row adagrad starts at 0, and at batch 512 a row's gradient (of the batch's mean loss)
is so small that 0.1 shrinks its first steps about 100-fold. Four configurations, run --rounds
times interleaved (each round: TensorFlow 0.1, TensorFlow 0, pserver 0, pserver 0.1), on the same
data, batch, cluster (1 ps, 2 workers) and learning rates (tables: Adagrad --row-lr; dense
layers: Adam --lr), with the load average before each run; one JSON with every run and the
medians, and a table of them printed.

Run from pserver's environment; TensorFlow's is --tf-python (see bench/tf_baseline/README.md):

    .venv/bin/python bench/tf_baseline/initial_accumulator.py --samples 1000000 \\
        --test-samples 100000 --out initial_accumulator.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = [("tensorflow", 0.1), ("tensorflow", 0.0), ("pserver", 0.0), ("pserver", 0.1)]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def commands(args, npz: str, framework: str, acc: float, out: str) -> list[str]:
    if framework == "tensorflow":
        return [args.tf_python, str(HERE / "ps_wide_deep.py"), "--data", npz, "--batch-size",
                str(args.batch_size), "--lr", str(args.row_lr), "--dense-lr", str(args.lr),
                "--initial-accumulator", str(acc), "--seed", str(args.seed), "--json", out]
    return [args.pserver, "launch", "--ps", "1", "--workers", "2", "--mode", "sync", "--model", "wide_deep",
            "--dataset", "criteo-synthetic", "--samples", str(args.samples), "--test-samples",
            str(args.test_samples), "--seed", str(args.seed), "--batch-size", str(args.batch_size),
            "--optimizer", "adam", "--lr", str(args.lr), "--row-optimizer", "adagrad", "--row-lr",
            str(args.row_lr), "--row-params", f"initial_accumulator={acc}", "--summary-json", out]


def one_run(args, npz: str, framework: str, acc: float, round_: int, logs: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = commands(args, npz, framework, acc, out)
        load_before = os.getloadavg()
        started = time.perf_counter()
        log = logs / f"round{round_}-{framework}-{acc}.log"
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}); see {log}")
        with open(out) as f:
            result = json.load(f)
    if isinstance(result, list):
        result = result[-1]
    keep = ("test_auc", "test_logloss", "train_samples_per_second", "seconds", "wall_seconds",
            "timed_samples", "samples_trained", "train_samples", "framework", "load_avg_1m")
    return {"round": round_, "framework": framework, "initial_accumulator": acc,
            "test_auc": result["test_auc"], "test_logloss": result.get("test_logloss"),
            "train_samples_per_second": result["train_samples_per_second"],
            "process_wall_seconds": round(wall, 2),
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "command": shlex.join(cmd), "result": {k: result[k] for k in keep if k in result}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1_000_000, help="training samples (default 1,000,000)")
    p.add_argument("--test-samples", type=int, default=100_000, help="held-out samples (default 100,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512, help="per worker (default 512)")
    p.add_argument("--row-lr", type=float, default=0.05, help="the tables' Adagrad lr (default 0.05)")
    p.add_argument("--lr", type=float, default=1e-3, help="the dense layers' Adam lr (default 0.001)")
    p.add_argument("--data", help="criteo_npz.py's .npz of the same --samples, --test-samples and "
                   "--seed (default: written to a temporary file first)")
    p.add_argument("--tf-python", default=str(HERE / ".venv" / "bin" / "python"))
    p.add_argument("--pserver", default=str(Path(sys.executable).with_name("pserver")))
    p.add_argument("--logs", default=None, help="directory for each run's output (default: temporary)")
    p.add_argument("--out", required=True, help="the JSON to write")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        npz = args.data or os.path.join(tmp, "criteo.npz")
        make_npz = [sys.executable, str(HERE / "criteo_npz.py"), "--samples", str(args.samples),
                    "--test-samples", str(args.test_samples), "--seed", str(args.seed), "--out", npz]
        if not os.path.exists(npz):
            subprocess.run(make_npz, check=True)
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        runs = []
        for r in range(1, args.rounds + 1):
            for framework, acc in CONFIGS:
                run = one_run(args, npz, framework, acc, r, logs)
                runs.append(run)
                print(f"round {r} {framework:10} acc {acc:<4}: AUC {run['test_auc']:.4f}, "
                      f"{run['train_samples_per_second']:,.0f} samples/s, load {run['load_avg_before'][0]}",
                      flush=True)
    medians = []
    for framework, acc in CONFIGS:
        mine = [x for x in runs if x["framework"] == framework and x["initial_accumulator"] == acc]
        losses = [x["test_logloss"] for x in mine if x["test_logloss"] is not None]
        medians.append({"framework": framework, "initial_accumulator": acc,
                        "test_auc": statistics.median(x["test_auc"] for x in mine),
                        "test_logloss": statistics.median(losses) if losses else None,
                        "train_samples_per_second": statistics.median(x["train_samples_per_second"]
                                                                      for x in mine)})
    table = ["| framework | initial accumulator | test AUC | test logloss | train samples/s |",
             "|---|---|---|---|---|"]
    table += [f"| {m['framework']} | {m['initial_accumulator']} | {m['test_auc']:.4f} | "
              f"{m['test_logloss']:.4f} | {m['train_samples_per_second']:,.0f} |" for m in medians]
    print(f"medians of {args.rounds} rounds:")
    print("\n".join(table))
    result = {"what": f"wide_deep on criteo-synthetic ({args.samples:,} training, {args.test_samples:,} test "
              f"samples), 1 ps + 2 workers, batch {args.batch_size} per worker, tables Adagrad lr "
              f"{args.row_lr}, dense layers Adam lr {args.lr}; TensorFlow ParameterServerStrategy and "
              "pserver (sync) with the tables' Adagrad accumulators starting at 0.1 and at 0, the four "
              f"interleaved in each of {args.rounds} rounds. TensorFlow's samples/s leaves out its first "
              "50 steps; pserver's counts every step.",
              "command": shlex.join([sys.executable, *sys.argv]),
              "data_command": shlex.join(make_npz[1:]) if not args.data else f"--data {args.data}",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "cpu": cpu_model(), "cpus": os.cpu_count(), "runs": runs, "medians": medians,
              "table": table}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
