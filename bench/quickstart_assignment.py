"""The README's quick start with leases (now the default) against fixed slices: is it slower?

    .venv/bin/python bench/quickstart_assignment.py --pairs 5 --vary-seed   # ~2 min on 2 cores

Each pair runs `pserver launch --ps 2 --workers 4 --optimizer adam --lr 0.001 --epochs 1` (MNIST
from $PSERVER_MNIST_DIR or the cache) once with `--data-assignment leases` and once with
`--data-assignment slices`, interleaved, the order alternating pair by pair. Figures from each
run's summary: wall seconds (until the last worker finished), test accuracy, steps and samples
trained; the ratio leases / slices of the median wall times. --vary-seed runs pair p with --seed p,
so the accuracy difference is measured over seeds (the mean of the paired differences and their
spread), not on one data order. The machine's load is printed first and kept.

Out: bench/results/leases/quickstart.json (every run) and a printed table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, table  # noqa: E402

QUICK_START = ["launch", "--ps", "2", "--workers", "4", "--optimizer", "adam", "--lr", "0.001",
               "--epochs", "1"]


def run(assignment: str, work: Path, seed: int = 0) -> dict:
    summary = work / f"{assignment}-{time.monotonic_ns()}.json"
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pserver", *QUICK_START, "--data-assignment", assignment,
                        "--seed", str(seed), "--summary-json", str(summary)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{assignment}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    return {"assignment": assignment, "wall_seconds": s["wall_seconds"], "launch_seconds":
            round(time.monotonic() - started, 3), "test_accuracy": s["test_accuracy"],
            "samples_trained": s["samples_trained"], "steps": s["steps"],
            "chunks_done": s.get("chunks_done", 0)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--vary-seed", action="store_true", help="pair p runs with --seed p (default: all seed 0)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results/leases/quickstart.json"))
    args = p.parse_args(argv)
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = ("leases", "slices") if pair % 2 == 0 else ("slices", "leases")
            seed = pair if args.vary_seed else 0
            for assignment in order:
                runs.append({"pair": pair, "seed": seed, **run(assignment, Path(tmp), seed)})
                print(json.dumps(runs[-1]), flush=True)
    med = {a: statistics.median(r["wall_seconds"] for r in runs if r["assignment"] == a)
           for a in ("leases", "slices")}
    acc = {a: statistics.median(r["test_accuracy"] for r in runs if r["assignment"] == a)
           for a in ("leases", "slices")}
    ratio = med["leases"] / med["slices"]
    print(table(["data assignment", "median wall (s)", "median accuracy"],
                [[a, f"{med[a]:.2f}", f"{acc[a]:.4f}"] for a in ("leases", "slices")]))
    print(f"leases / slices wall time: {ratio:.3f} (median of {args.pairs} interleaved pairs; load "
          f"{m['load_avg_1m']} at the start)")
    by = {(r["pair"], r["assignment"]): r["test_accuracy"] for r in runs}
    diffs = [by[(p, "leases")] - by[(p, "slices")] for p in range(args.pairs)]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    seeds = f"seeds 0..{args.pairs - 1}" if args.vary_seed else "seed 0"
    print(f"accuracy, leases - slices, paired: mean {statistics.mean(diffs):+.4f}, standard deviation "
          f"{spread:.4f} over {args.pairs} pairs ({seeds})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "command": QUICK_START, "runs": runs, "median_wall": med,
                               "median_accuracy": acc, "ratio_leases_to_slices": round(ratio, 4),
                               "accuracy_differences": [round(d, 4) for d in diffs]},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
