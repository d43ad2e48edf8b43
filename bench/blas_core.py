"""One training step of keras.io's MNIST convnet (batch 64, one thread) with each OpenBLAS core
type, interleaved: what OPENBLAS_CORETYPE costs pserver's CPU kernels.

    .venv/bin/python bench/blas_core.py --cores Haswell,own --rounds 5 \\
        --json bench/results/keras/blas-core.json

OpenBLAS reads OPENBLAS_CORETYPE once, when it loads, so each measurement is a fresh process:
`own` removes the variable (OpenBLAS picks its kernels for this CPU), any other name sets it.
Each process times Sequential.loss_and_grad (the worker's compute of one step, forward and
backward, Dropout included) on a batch of 64 random images after 20 untimed steps and prints the
mean over --steps steps and the kernels OpenBLAS loaded (OPENBLAS_VERBOSE=2); the table has the
best and the median of the rounds and the ratio of each core type to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _util import machine, result_path  # noqa: E402

CORE = re.compile(r"Core: (\S+)")


def one_process(steps: int) -> None:
    """In the child: the step's mean time in ms, as the last line of stdout."""
    import numpy as np

    import pserver.keras as keras
    from pserver.keras import layers
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(), layers.Dropout(0.5), layers.Dense(10, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam")
    core = model._core
    core.build()
    w = core.init_params(0)
    g = np.empty_like(w)
    rng = np.random.default_rng(0)
    x = rng.random((64, 28, 28, 1), dtype=np.float32)
    y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)]
    for i in range(20):
        core.loss_and_grad(w, x, y, g, seed=i)
    started = time.perf_counter()
    for i in range(steps):
        core.loss_and_grad(w, x, y, g, seed=i)
    print(f"{(time.perf_counter() - started) / steps * 1e3:.4f}", flush=True)


def measure(core: str, steps: int) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env |= {"OPENBLAS_NUM_THREADS": "1", "OPENBLAS_VERBOSE": "2"}
    if core != "own":
        env["OPENBLAS_CORETYPE"] = core
    r = subprocess.run([sys.executable, __file__, "--child", str(steps)], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise SystemExit(f"core {core}: exit {r.returncode}\n{r.stderr[-2000:]}")
    loaded = sorted(set(CORE.findall(r.stdout + r.stderr)))
    return float(r.stdout.strip().splitlines()[-1]), ",".join(loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="Haswell,own",
                    help="OpenBLAS core types, comma-separated; own: OpenBLAS's choice (default Haswell,own)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per process (default 200)")
    ap.add_argument("--json", help="where to write the rounds (default: results/blas-core.json)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        one_process(args.child)
        return
    cores = [c.strip() for c in args.cores.split(",") if c.strip()]
    m = machine(("numpy", "numba", "scipy"))
    print(f"{m['date']}: {m['cpu']}, {m['cores']} cores, load average {m['load_avg_1m']}", flush=True)
    ms: dict[str, list[float]] = {c: [] for c in cores}
    loaded: dict[str, str] = {}
    for round_ in range(1, args.rounds + 1):
        for c in cores:
            t, loaded[c] = measure(c, args.steps)
            ms[c].append(t)
            print(f"round {round_} {c:>12} (OpenBLAS loaded {loaded[c]}): {t:.2f} ms a step", flush=True)
    best = {c: min(v) for c, v in ms.items()}
    med = {c: statistics.median(v) for c, v in ms.items()}
    base = cores[0]
    for c in cores:
        print(f"{c:>12}: best {best[c]:.2f} ms, median {med[c]:.2f} ms; {base} / {c}: "
              f"{med[base] / med[c]:.2f}x (median)")
    path = result_path(args.json, "blas-core.json")
    path.write_text(json.dumps({
        "what": "keras.io mnist_convnet, Sequential.loss_and_grad at batch 64, one thread, per OpenBLAS "
                "core type, a fresh process each, interleaved", "steps_per_process": args.steps,
        "ms_per_step": {c: [round(t, 3) for t in v] for c, v in ms.items()},
        "openblas_loaded": loaded, "best_ms": {c: round(v, 3) for c, v in best.items()},
        "median_ms": {c: round(v, 3) for c, v in med.items()},
        "speedup_median_vs_first": {c: round(med[base] / med[c], 3) for c in cores},
        "environment_had": os.environ.get("OPENBLAS_CORETYPE"), "machine": m}, indent=1) + "\n")


if __name__ == "__main__":
    main()
