"""One training step (loss_and_grad: forward, loss, backward) of the two convolutional models,
on pserver from two source trees in turn: a change to the CPU kernels, before and after.

    python bench/conv_step_ab.py --base /tmp/pserver-old --batches 64,128 --rounds 5 --json ab.json

The models: the seeds' reference CNN (`--model cnn`: Conv2D(32, 3, relu), MaxPooling2D,
Flatten, Dense(64, relu), Dense(10)) and keras.io's mnist_convnet (bench/convnet_layers.py's
layers: a second convolution, 32 to 64 channels). Each tree runs in a child process of its own
(PYTHONPATH set to it) with one thread for numba and BLAS, and times --runs steps per model and
batch after a warm-up (median); the trees take turns --rounds times, so load from elsewhere
falls on both, and a figure is the median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_lines, positive_ints, table  # noqa: E402

ONE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}
MODELS = ("cnn", "mnist_convnet")


def model_of(name: str):
    from pserver.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D
    from pserver.models.cnn import cnn
    from pserver.models.sequential import Sequential
    if name == "cnn":
        return cnn().build()
    return Sequential([Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), MaxPooling2D(2),
                       Conv2D(64, 3, activation="relu"), MaxPooling2D(2), Flatten(), Dropout(0.5),
                       Dense(10)]).build()


def step_seconds(name: str, batch: int, runs: int) -> tuple[float, float]:
    """Median seconds of one loss_and_grad, warm, on random images and labels: by the clock and
    in this process's CPU time (on a shared machine the clock also counts others' turns)."""
    import numpy as np
    model = model_of(name)
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    grad = np.zeros_like(w)
    x, y = rng.random((batch, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, batch)
    times, cpu = [], []
    for run in range(5 + runs):
        t, c = time.perf_counter(), time.process_time()
        model.loss_and_grad(w, x, y, grad, seed=run)
        if run >= 5:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the source tree to compare against")
    p.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the source tree measured (default: this checkout)")
    p.add_argument("--batches", type=positive_ints, default=[64, 128])
    p.add_argument("--runs", type=int, default=30, help="timed steps per model, batch and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # one tree's side
    args = p.parse_args()
    if args.child:
        print(json.dumps({f"{m} {b}{what}": s for m in MODELS for b in args.batches
                          for what, s in zip(("", " cpu"), step_seconds(m, b, args.runs))}))
        return
    m = machine(("numpy", "numba"))
    print("\n".join(machine_lines(m)))
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    seen: dict = {name: [] for name in trees}
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--base", "-", "--runs", str(args.runs),
            "--batches", ",".join(map(str, args.batches))]
    for _ in range(args.rounds):
        for name, tree in trees.items():
            r = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                               env=os.environ | ONE_THREAD | {"PYTHONPATH": tree})
            if r.returncode:
                sys.exit(f"the {name} side failed:\n{r.stderr[-2000:]}")
            seen[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    keys = list(seen["base"][0])
    med = {name: {k: statistics.median(r[k] for r in rounds) for k in keys} for name, rounds in seen.items()}
    rows = [[k, f"{med['base'][k] * 1e3:.2f}", f"{med['new'][k] * 1e3:.2f}",
             f"{med['base'][k] / med['new'][k]:.2f}"] for k in keys]
    print(table(["model batch (cpu: CPU time)", "base ms/step", "new ms/step", "base / new"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "trees": trees, "runs": args.runs, "rounds": args.rounds,
                       "threads": ONE_THREAD, "pserver_isa": m["cpu_id"].get("isa"),
                       "median_seconds": med, "rounds_seconds": seen,
                       "load_avg_1m_end": round(os.getloadavg()[0], 2)}, f, indent=1)


if __name__ == "__main__":
    main()
