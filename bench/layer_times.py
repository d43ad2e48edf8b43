"""Where one worker's training step spends its time, layer by layer: a model's `loss_and_grad` on
one thread (NUMBA_NUM_THREADS and the BLAS libraries at 1, as `pserver launch` sets a worker),
with each layer's forward and backward pass timed inside it. The rest of the step (ops between
layers, the loss, the buffers) is the row "the rest".

    .venv/bin/python bench/layer_times.py --model bench/gpu_models.py:toy_resnet --batch 32 --json out.json

--model is a built-in model (cnn, mlp, ...) or FILE.py:FUNCTION, on MNIST's shape (28, 28, 1) and
10 classes, with random inputs and labels (the time does not depend on their values). Each
layer's time is the median over --steps steps, after --warmup steps (numba compiles in the
first); the step's wall time is the median too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ONE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in ONE_THREAD.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | ONE_THREAD)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_lines  # noqa: E402

from pserver.models import make_model  # noqa: E402


def timed(model, steps: int, warmup: int, batch: int) -> dict:
    """{"step": [seconds per step], layer label: {"forward": [...], "backward": [...]}}."""
    times: dict = {}

    def wrap(layer, name):
        inner = getattr(layer, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.setdefault(layer.label, {"forward": [], "backward": []})[name].append(
                    time.perf_counter() - start)
        setattr(layer, name, run)

    for layer in model.layers:
        wrap(layer, "forward")
        wrap(layer, "backward")
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    w = model.init_params(0)
    g = np.empty_like(w)
    step = []
    for i in range(warmup + steps):
        if i == warmup:
            times.clear()
        start = time.perf_counter()
        model.loss_and_grad(w, x, y, g, seed=i)
        if i >= warmup:
            step.append(time.perf_counter() - start)
    return {"step": step, **times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench/gpu_models.py:toy_resnet")
    p.add_argument("--batch", type=int, default=32, help="samples per step on one worker (default 32)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="", help="write the results here too")
    a = p.parse_args()
    head = machine(("numpy", "numba"))
    for line in machine_lines(head):
        print(line)
    model = make_model(a.model, (28, 28, 1), 10)
    t = timed(model, a.steps, a.warmup, a.batch)
    step = float(np.median(t.pop("step")))
    rows, counted = [], 0.0
    for label, parts in t.items():
        fw = float(np.median(parts["forward"])) if parts["forward"] else 0.0
        bw = float(np.median(parts["backward"])) if parts["backward"] else 0.0
        counted += fw + bw
        rows.append({"layer": label, "forward_ms": 1e3 * fw, "backward_ms": 1e3 * bw})
    rows.append({"layer": "the rest", "forward_ms": 0.0, "backward_ms": 1e3 * max(step - counted, 0.0)})
    print(f"{a.model}, batch {a.batch}, one thread: {1e3 * step:.2f} ms per step (median of {a.steps}), "
          f"{a.batch / step:,.0f} samples/s")
    print(f"{'layer':45s} {'forward ms':>10s} {'backward ms':>11s} {'share':>6s}")
    for r in rows:
        share = (r["forward_ms"] + r["backward_ms"]) / (1e3 * step)
        print(f"{r['layer'][:45]:45s} {r['forward_ms']:10.2f} {r['backward_ms']:11.2f} {share:6.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**head, "model": a.model, "batch": a.batch, "step_ms": 1e3 * step, "layers": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
