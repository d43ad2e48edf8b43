"""keras.io's MNIST convnet (bench/keras_mnist_convnet.py) on pserver from two source trees,
interleaved: the training samples/s of each and the ratio, to measure a change to pserver
itself (the TensorFlow comparison is bench/tf_baseline/ps_keras_convnet.py).

    .venv/bin/python bench/keras_convnet_ab.py --base /tmp/pserver-old --new . --epochs 2 --rounds 3 \\
        --json bench/results/keras/convnet-ab.json

Each round runs `python -m pserver run --ps 1 --workers 2 --seed 0 -- python SCRIPT` (the
comparison's cluster: sync, 64 per worker) with PYTHONPATH set to --base, then to --new, and
reads the chief's summary line (samples/s over every step after the warm-up, the chief's
validation at each epoch's end included) and the CPU seconds of the whole run (steadier than
samples/s on a loaded machine), with the load average before each run. A copy of
the script with `epochs = --epochs` runs (keras_convnet.py's). Give each tree one warm-up run
first (--warmup) so numba's compile (cached per tree) is not in a timed run's start.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _util import machine  # noqa: E402
from keras_convnet import ACCURACY, SUMMARY, script_for  # noqa: E402


def run(tree: str, script: Path, flags: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--seed", "0", *flags, "--",
           sys.executable, str(script)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    found = SUMMARY.findall(out.stdout)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    steps, seconds, rate = found[-1]
    return {"samples_per_second": float(rate.replace(",", "")), "seconds": float(seconds),
            "steps": int(steps), "test_accuracy": float(ACCURACY.findall(out.stdout)[-1]),
            # CPU seconds of the whole run (launcher, shard, workers; startup and the script's
            # final evaluation included): steadier than samples/s on a loaded machine.
            "cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "load_before": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the source tree to compare against")
    ap.add_argument("--new", default=".", help="the source tree measured (default: this one)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="one untimed 1-epoch run per tree first")
    ap.add_argument("--new-run-flags", default="", help="pserver run flags for the new side only, e.g. "
                    "--bind-cores (with --base and --new the same tree: the flag's effect)")
    ap.add_argument("--json", help="where to write the runs and medians")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = script_for(args.epochs, tmp)
        if args.warmup:
            for tree in (args.base, args.new):
                run(tree, script_for(1, tmp))
        runs = {"base": [], "new": []}
        for r in range(args.rounds):
            for side in ("base", "new"):
                runs[side].append(run(getattr(args, side), script,
                                      tuple(args.new_run_flags.split()) if side == "new" else ()))
                got = runs[side][-1]
                print(f"round {r + 1} {side}: {got['samples_per_second']:,.0f} samples/s, "
                      f"{got['cpu_seconds']} CPU s, test accuracy {got['test_accuracy']:.4f}, "
                      f"load {got['load_before']}", flush=True)
    med = {side: statistics.median(x["samples_per_second"] for x in v) for side, v in runs.items()}
    cpu = {side: statistics.median(x["cpu_seconds"] for x in v) for side, v in runs.items()}
    ratios = [n["samples_per_second"] / b["samples_per_second"] for b, n in zip(runs["base"], runs["new"])]
    print(f"median samples/s: base {med['base']:,.0f}, new {med['new']:,.0f}: new/base "
          f"{med['new'] / med['base']:.3f} (per round {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"median CPU s per run: base {cpu['base']}, new {cpu['new']}: "
          f"base/new {cpu['base'] / cpu['new']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "what": "keras.io mnist_convnet, pserver run --ps 1 --workers 2 (sync, batch 128), "
                    f"{args.epochs} epochs, base vs new source tree, interleaved",
            "base": str(args.base), "new": str(args.new), "new_run_flags": args.new_run_flags,
            "runs": runs, "median": med,
            "median_cpu_seconds": cpu,
            "ratio_new_over_base": round(med["new"] / med["base"], 4),
            "ratio_per_round": [round(r, 4) for r in ratios], "machine": machine()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
