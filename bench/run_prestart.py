"""`pserver run`'s shards started with the workers (waiting for their settings) against started at
the workers' fit: the fit seconds that keras-rs's DCN example on MovieLens-100K prints
(bench/keras_io/dcn_movielens.py, as bench/keras_io/compare.py writes it for pserver's side)
under `pserver run --ps 2 --workers 2`, from two source trees, interleaved (base, new, base, ...).

    PSERVER_MOVIELENS_DIR=DIR .venv/bin/python bench/run_prestart.py --base /tmp/old --new . \\
        --rounds 5 --out bench/results/keras_rs/run_prestart.json
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
from pathlib import Path

from _util import machine, machine_lines

HERE = Path(__file__).resolve().parent
FIT = re.compile(r"Fit: ([0-9.]+) s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the source tree before (a git worktree)")
    ap.add_argument("--new", required=True, help="the source tree after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)))
    sys.path.insert(0, str(HERE / "keras_io"))
    import compare
    tmp = Path(tempfile.mkdtemp(prefix="run-prestart-"))
    script, env = compare.dcn_pserver_run(args.seed, tmp)
    trees = {"base": str(Path(args.base).resolve()), "new": str(Path(args.new).resolve())}
    runs = []
    for r in range(args.rounds):
        for side, tree in trees.items():
            cmd = [sys.executable, "-m", "pserver", "run", "--ps", "2", "--workers", "2",
                   "--seed", str(args.seed), "--", sys.executable, str(script)]
            load = round(os.getloadavg()[0], 2)
            out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": tree},
                                 cwd=tmp, timeout=600)
            fit = FIT.findall(out.stdout)
            if out.returncode != 0 or not fit:
                raise SystemExit(f"{side} round {r + 1}: exit {out.returncode}\n{out.stdout[-2000:]}\n"
                                 f"{out.stderr[-2000:]}")
            runs.append({"side": side, "tree": tree, "round": r + 1, "fit_seconds": float(fit[-1]),
                         "load_avg_1m_start": load, "command": f"PYTHONPATH={tree} " + " ".join(cmd)})
            print(f"round {r + 1} {side}: fit {fit[-1]} s (load {load})", flush=True)
    medians = {side: statistics.median(x["fit_seconds"] for x in runs if x["side"] == side) for side in trees}
    print(f"median fit seconds: base {medians['base']:.2f}, new {medians['new']:.2f} "
          f"(new / base {medians['new'] / medians['base']:.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": m, "median_fit_seconds": medians, "runs": runs}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
