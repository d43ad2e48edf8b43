"""The README's quick start with leases (now the default) against fixed slices: is it slower?

    .venv/bin/python bench/quickstart_assignment.py --pairs 3     # ~3 min on 2 busy cores

Each pair runs `pserver launch --ps 2 --workers 4 --optimizer adam --lr 0.001 --epochs 1` (MNIST
from $PSERVER_MNIST_DIR or the cache) once with `--data-assignment leases` and once with
`--data-assignment slices`, interleaved, the order alternating pair by pair. Figures from each
run's summary: wall seconds (until the last worker finished), test accuracy and samples trained;
the ratio leases / slices of the median wall times. The machine's load is printed first and kept.

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


def run(assignment: str, work: Path) -> dict:
    summary = work / f"{assignment}-{time.monotonic_ns()}.json"
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pserver", *QUICK_START, "--data-assignment", assignment,
                        "--summary-json", str(summary)], capture_output=True, text=True, timeout=900)
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
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results/leases/quickstart.json"))
    args = p.parse_args(argv)
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = ("leases", "slices") if pair % 2 == 0 else ("slices", "leases")
            for assignment in order:
                runs.append({"pair": pair, **run(assignment, Path(tmp))})
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "command": QUICK_START, "runs": runs, "median_wall": med,
                               "median_accuracy": acc, "ratio_leases_to_slices": round(ratio, 4)},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
