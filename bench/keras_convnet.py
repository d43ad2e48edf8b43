"""The MNIST convnet script (bench/keras_mnist_convnet.py: keras.io's example's model) under
`pserver run --ps 2 --workers 4`, sync, for several seeds: its test accuracy and speed.

    python bench/keras_convnet.py --seeds 0,1,2 --epochs 15 --out bench/results/keras/ [--keep]

Each seed's run writes SEED's JSON (the accuracy the script prints, its per-epoch lines, wall
time, the training samples/s of the chief's summary); the summary holds the median. Fewer
epochs than the example's 15 run a copy of the script with `epochs = N` (nothing else
changed) and say so in the result. MNIST: $PSERVER_MNIST_DIR or pserver's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _util import machine, machine_lines  # noqa: E402

SCRIPT = Path(__file__).parent / "keras_mnist_convnet.py"
EPOCHS_LINE = re.compile(r"^epochs = 15$", re.M)
# The chief's lines as `pserver run` shows them: "[worker0] " before each (older runs: none)
CHIEF = r"^(?:\[worker0\] )?"
SUMMARY = re.compile(CHIEF + r"(\d+) steps in (\S+) s: ([\d,.]+) train samples/s$", re.M)
ACCURACY = re.compile(CHIEF + r"Test accuracy: (\S+)$", re.M)
LOSS = re.compile(CHIEF + r"Test loss: (\S+)$", re.M)


def script_for(epochs: int, tmp: str) -> Path:
    if epochs == 15:
        return SCRIPT
    text = SCRIPT.read_text()
    assert EPOCHS_LINE.search(text), "the example's `epochs = 15` line is gone"
    path = Path(tmp) / f"keras_mnist_convnet_{epochs}ep.py"
    path.write_text(EPOCHS_LINE.sub(f"epochs = {epochs}", text))
    return path


def run_one(seed: int, epochs: int, ps: int, workers: int, tmp: str) -> dict:
    cmd = [sys.executable, "-m", "pserver", "run", "--ps", str(ps), "--workers", str(workers), "--seed",
           str(seed), "--", sys.executable, str(script_for(epochs, tmp))]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    if out.returncode != 0:
        raise SystemExit(f"seed {seed}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    acc = float(ACCURACY.findall(out.stdout)[-1])
    loss = float(LOSS.findall(out.stdout)[-1])
    speed = [found[1:] for found in SUMMARY.findall(out.stdout)]
    epochs_lines = re.findall(CHIEF + r"(\d+/\d+ - \d+s - loss: .*)$", out.stdout, re.M)
    return {"seed": seed, "epochs": epochs, "ps": ps, "workers": workers, "mode": "sync",
            "test_accuracy": acc, "test_loss": loss, "wall_seconds": round(wall, 1),
            "train_seconds": float(speed[-1][0]) if speed else None,
            "train_samples_per_second": float(speed[-1][1].replace(",", "")) if speed else None,
            "epoch_lines": epochs_lines, "command": " ".join(cmd[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="results/keras/", help="directory for the JSON files")
    ap.add_argument("--keep", action="store_true", help="keep a seed's result already in --out")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            path = out / f"convnet-{args.epochs}ep-seed{seed}.json"
            if args.keep and path.exists():          # a seed run before (its machine line says when)
                results.append(json.loads(path.read_text()))
                print(f"seed {seed}: kept {path}", flush=True)
                continue
            r = run_one(seed, args.epochs, args.ps, args.workers, tmp)
            r["machine"] = m
            r["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
            results.append(r)
            path.write_text(json.dumps(r, indent=2) + "\n")
            print(f"seed {seed}: {args.epochs} epochs, test accuracy {r['test_accuracy']:.4f}, "
                  f"{r['train_samples_per_second']:,.0f} train samples/s, {r['wall_seconds']:.0f} s",
                  flush=True)
    accs = [r["test_accuracy"] for r in results]
    summary = {"what": "bench/keras_mnist_convnet.py under pserver run --ps "
                       f"{args.ps} --workers {args.workers} (sync)", "epochs": args.epochs,
               "example_epochs": 15, "seeds": seeds, "test_accuracy": accs,
               "median_test_accuracy": statistics.median(accs), "target": 0.990, "machine": m}
    (out / f"convnet-{args.epochs}ep-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"median test accuracy over seeds {seeds}: {summary['median_test_accuracy']:.4f} "
          f"({args.epochs} epochs; target 0.990 at 15)")


if __name__ == "__main__":
    main()
