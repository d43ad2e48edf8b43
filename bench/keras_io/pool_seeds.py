"""Pool compare.py's runs of one script and setting over several result files: the seeds that both
sides ran, each side's median and mean test accuracy, the medians' difference with a bootstrap 90%
interval, and how often a pserver run beats a Keras run.

    .venv/bin/python bench/keras_io/pool_seeds.py --script toy_resnet \\
        --setting "fit on the first 60000 samples for 1 epoch(s)" FILE...

FILE: a compare.py JSON result, or a compare.py log (its per-run lines: a run cut short leaves
those and no JSON), relative to --dir (the committed results, bench/results/keras_io; only read).
A seed a later file ran again takes the later file's result; a seed only one side ran is left out
and named.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

LINE = re.compile(r"^(\S+) (pserver|keras) seed (\d+): test accuracy ([0-9.]+)")


def runs_of(path: Path, script: str, setting: str) -> dict[tuple[str, int], float]:
    """(side, seed) -> test accuracy, from one result file or log."""
    out = {}
    if path.suffix == ".json":
        for c in json.loads(path.read_text())["comparisons"]:
            if Path(c["script"]).stem == script and c["setting"] == setting:
                out.update({(r["side"], int(r["seed"])): float(r["test_accuracy"]) for r in c["runs"]})
        return out
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if m and m[1] == script:
            out[(m[2], int(m[3]))] = float(m[4])
    return out


def bootstrap_interval(a: np.ndarray, b: np.ndarray, resamples: int = 20_000, seed: int = 0) -> tuple:
    """The 5th and 95th percentiles of median(a*) - median(b*), each side resampled on its own."""
    rng = np.random.default_rng(seed)
    d = (np.median(rng.choice(a, (resamples, len(a))), axis=1)
         - np.median(rng.choice(b, (resamples, len(b))), axis=1))
    return float(np.percentile(d, 5)), float(np.percentile(d, 95))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="compare.py JSON results or logs, oldest first")
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "keras_io",
                    help="where FILEs are (default: the committed results, bench/results/keras_io)")
    ap.add_argument("--script", required=True, help="the script's name without .py (toy_resnet)")
    ap.add_argument("--setting", required=True, help="the comparison's setting, as the JSON names it")
    args = ap.parse_args(argv)
    runs: dict[tuple[str, int], float] = {}
    for f in args.files:
        got = runs_of(args.dir / f, args.script, args.setting)
        print(f"{f}: {len(got)} run(s)")
        runs.update(got)
    seeds = sorted({s for _, s in runs})
    both = [s for s in seeds if ("pserver", s) in runs and ("keras", s) in runs]
    lone = [f"{side} {s}" for side, s in sorted(runs) if s not in both]
    if not both:
        raise SystemExit("pool_seeds: no seed that both sides ran")
    a = np.array([runs["pserver", s] for s in both]) * 100
    b = np.array([runs["keras", s] for s in both]) * 100
    print(f"{args.script}, {args.setting}: {len(both)} seeds both sides ran ({both[0]}-{both[-1]})"
          + (f"; left out, one side only: {', '.join(lone)}" if lone else ""))
    print(f"{'seed':>4}  {'pserver %':>9}  {'keras %':>8}")
    for s, x, y in zip(both, a, b):
        print(f"{s:>4}  {x:>9.2f}  {y:>8.2f}")
    low, high = bootstrap_interval(a, b)
    print(f"medians: pserver {np.median(a):.2f}%, keras {np.median(b):.2f}%, "
          f"difference {np.median(a) - np.median(b):+.2f} points "
          f"(bootstrap 90% interval {low:+.2f} to {high:+.2f}, 20,000 resamples of each side)")
    print(f"means: pserver {a.mean():.2f}%, keras {b.mean():.2f}%, "
          f"difference {a.mean() - b.mean():+.2f} points")
    print(f"a pserver run above a keras run, over all {len(a) * len(b)} pairs: "
          f"{np.mean(a[:, None] > b[None, :]):.3f} (0.5: neither side ahead)")


if __name__ == "__main__":
    main()
