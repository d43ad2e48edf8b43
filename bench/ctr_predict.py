"""Predict throughput of an exported CTR model on one core: `pserver.load_model(DIR).predict(x)`
with the tables memory-mapped (docs/model-file.md), batch after batch of criteo-synthetic
records, one thread (BLAS, OpenMP and numba), no server.

Without --model it first makes one: a short wide_deep run (criteo-synthetic, default dims:
13 dense features, 26 fields, embedding 8, tower 256,128) on one shard with checkpoints, and
`pserver export` of them. Samples/s is over whole passes of the test records in batches of
--batch-size; the median of --repeats passes is reported, with min and max.

    python bench/ctr_predict.py --out results/ctr/predict-wide_deep.json
    python bench/ctr_predict.py --model ctr-model --batch-size 512
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

# One thread for everything, set before numpy and numba load.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, result_path, summary  # noqa: E402


def make_model(workdir: str, samples: int, epochs: int) -> str:
    """Train wide_deep briefly with checkpoints and export them; the model directory."""
    ckpt, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "model")
    data = ["--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", str(samples)]
    for args in (["launch", "--ps", "1", "--workers", "1", *data, "--epochs", str(epochs),
                  "--checkpoint-dir", ckpt],
                 ["export", "--restore", ckpt, *data, "--out", out]):
        r = subprocess.run([sys.executable, "-m", "pserver", *args], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"pserver {args[0]} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an exported model directory (default: train and export one)")
    p.add_argument("--samples", type=int, default=60000, help="training samples of the run made without "
                                                                "--model (default 60000)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--records", type=int, default=65536, help="test records per pass (default 65536)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="result JSON (default results/ctr/predict-<model>.json)")
    a = p.parse_args()

    import numba

    import pserver
    from pserver.data.criteo import generate
    numba.set_num_threads(1)
    m = machine(("numpy", "numba"))
    print("\n".join(machine_lines(m)), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_model(tmp, a.samples, a.epochs)
        model = pserver.load_model(path)
        meta = model.meta
        seed = (meta.get("dataset") or {}).get("seed") or 0
        # Records of the run's distribution (its seed) that no training or test set reaches.
        x, _ = generate(seed, 0.0, np.arange(1 << 40, (1 << 40) + a.records, dtype=np.uint64))
        model.predict(x[:a.batch_size], batch_size=a.batch_size)                 # compile, map the pages
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            model.predict(x, batch_size=a.batch_size)
            times.append(time.perf_counter() - t0)
        med, lo, hi = summary([a.records / t for t in times])
        result = {
            "what": f"pserver.load_model(DIR).predict(x, batch_size={a.batch_size}) on {a.records:,} "
                    "criteo-synthetic records, one thread, tables memory-mapped",
            "model": meta["name"], "num_params": meta["num_params"],
            "tables": {t.name: {"rows": int(t.ids.shape[0]), "dim": t.dim} for t in model.tables},
            "trained_on": meta.get("dataset"), "made_here": a.model is None,
            "batch_size": a.batch_size, "records": a.records, "repeats": a.repeats,
            "samples_per_second": {"median": round(med), "min": round(lo), "max": round(hi)},
            "seconds_per_pass": [round(t, 4) for t in times],
            "load_avg_1m_after": round(os.getloadavg()[0], 2), "machine": m,
        }
    print(f"{meta['name']} ({meta['num_params']:,} dense parameters; "
          + ", ".join(f"{k} {v['rows']:,} rows x {v['dim']}" for k, v in result["tables"].items())
          + f"): predict at batch {a.batch_size}, one thread: {med:,.0f} samples/s median "
          f"(min {lo:,.0f}, max {hi:,.0f}, {a.repeats} passes of {a.records:,}); load average after "
          f"{result['load_avg_1m_after']}")
    out = result_path(a.out, f"ctr/predict-{meta['name']}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
