"""Two BLAS thread pools in one process: numpy's wheel and scipy's each bundle an OpenBLAS, the
kernels' products (numba's np.dot) use scipy's and the graph ops' (pserver.ops matmul) numpy's.
pserver.kernels.cpu sets numpy's pool to one thread (single_numpy_blas); this measures why.

1. A pair of 512x192x192 products, numpy's np.dot then the Dense kernel's backward (scipy's
   BLAS), back to back, in a child process per setting: numpy's pool at its default threads
   (the two pools spin against each other) and at one (what pserver sets).
2. keras-rs's DCN example on MovieLens-100K fit in one process (no cluster:
   `python bench/keras_io/dcn_movielens.py`) from two source trees, --base and --new,
   interleaved: fit seconds and test RMSE of each.

    PSERVER_MOVIELENS_DIR=DIR .venv/bin/python bench/blas_pools.py --base /tmp/old --new . \\
        --rounds 2 --out results/blas_pools.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _util import machine, machine_lines

HERE = Path(__file__).resolve().parent

PAIR = r"""
import sys, time, numpy as np
from pserver.kernels import cpu
if sys.argv[1] == "default":                      # undo pserver's setting: numpy's pool as it loads
    from threadpoolctl import ThreadpoolController
    for lib in ThreadpoolController().lib_controllers:
        if "numpy" in lib.filepath:
            lib.set_num_threads(cpu.NUMPY_BLAS_THREADS or lib.num_threads)
rng = np.random.default_rng(0)
x, w, dz = (rng.random(s, dtype=np.float32) for s in ((512, 192), (192, 192), (512, 192)))
out, dx = np.empty((512, 192), np.float32), np.empty_like(x)
dw, db = np.empty_like(w), np.empty(192, np.float32)
def pair():
    np.dot(x, w, out)
    cpu.dense_backward(x, w, dz, dw, db, dx, False)
pair()
best = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(100):
        pair()
    best.append((time.perf_counter() - t) / 100 * 1e3)
print(min(best))
"""


def pair_ms(setting: str) -> float:
    out = subprocess.run([sys.executable, "-c", PAIR, setting], capture_output=True, text=True, check=True)
    return round(float(out.stdout.split()[-1]), 3)


def dcn_fit(tree: str, npz: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "KERAS_IO_MOVIELENS": npz, "KERAS_IO_SEED": "1"}
    out = subprocess.run([sys.executable, str(HERE / "keras_io" / "dcn_movielens.py")], capture_output=True,
                         text=True, env=env, cwd=HERE / "keras_io", check=True).stdout
    return {"fit_seconds": float(re.search(r"Fit: ([\d.]+) s", out).group(1)),
            "test_rmse": float(re.search(r"Test RMSE: ([\d.]+)", out).group(1)),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the source tree before the change")
    ap.add_argument("--new", default=".", help="the source tree with it (default .)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="results/blas_pools.json")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE / "keras_io"))
    import compare  # its MovieLens .npz, as compare.py makes it
    m = machine(("numpy", "scipy", "numba", "threadpoolctl"))
    pairs = {s: pair_ms(s) for s in ("default", "one")}
    print(f"a 512x192x192 np.dot then Dense's backward: {pairs['default']} ms with numpy's pool at its "
          f"default threads, {pairs['one']} ms at one ({pairs['default'] / pairs['one']:.1f}x)", flush=True)
    runs: dict[str, list] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        npz = compare.movielens_npz(Path(tmp))
        for _ in range(args.rounds):
            for side, tree in (("base", args.base), ("new", args.new)):
                runs[side].append(dcn_fit(str(Path(tree).resolve()), npz))
                print(f"DCN in one process, {side}: {runs[side][-1]}", flush=True)
    best = {side: min(r["fit_seconds"] for r in rs) for side, rs in runs.items()}
    result = {**m, "pair_ms": pairs, "dcn_runs": runs,
              "dcn_best_fit_seconds": best, "dcn_speed_new_over_base": round(best["base"] / best["new"], 2)}
    print("\n".join(machine_lines(m)))
    print(f"DCN fit (best of {args.rounds}): base {best['base']} s, new {best['new']} s: "
          f"{result['dcn_speed_new_over_base']}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
