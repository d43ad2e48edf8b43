"""How much a model amplifies float32 rounding: train it twice on the same MNIST batches, once
from its initial weights and once from them changed by EPS relative (a draw per weight), and
print both batch losses every 10 steps. A model whose losses part after a few steps cannot give
the same numbers on two devices whose products round differently (bench/results/gpu/README.md,
run 11: the toy ResNet on the GPU and the CPU).

    python bench/perturbed_start.py --model bench/gpu_models.py:toy_resnet --steps 40 --json OUT.json

One process, no shards: `loss_and_grad` of the model and Adam (lr 1e-3, Keras's betas, epsilon
1e-7) in NumPy, batch 256, the first STEPS x 256 training images in order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_lines  # noqa: E402

from pserver.data.mnist import load_raw  # noqa: E402
from pserver.models import make_model  # noqa: E402


def losses(model, x, y, eps: float, steps: int, batch: int) -> list[float]:
    w = model.init_params(0)
    w = (w * (1 + eps * np.random.default_rng(1).standard_normal(w.size))).astype(np.float32)
    m, v, g, out = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w), []
    for t in range(1, steps + 1):
        part = slice((t - 1) * batch, t * batch)
        out.append(float(model.loss_and_grad(w, x[part], y[part], g, seed=t)))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= (1e-3 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-7)).astype(np.float32)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench/gpu_models.py:toy_resnet",
                   help="a built-in name or FILE.py:FUNCTION")
    p.add_argument("--data-dir", default=None, help="MNIST's IDX files (default: pserver's MNIST directory)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eps", type=float, default=1e-7)
    p.add_argument("--json", metavar="PATH", help="write the command, the machine and both curves here")
    a = p.parse_args()
    head = machine(("numpy", "numba"))
    for line in machine_lines(head):
        print(line)
    (images, digits), _ = load_raw(a.data_dir)
    n = a.steps * a.batch_size
    x, y = (images[:n].astype(np.float32) / 255)[..., None], digits[:n].astype(np.int32)
    start = time.perf_counter()
    base = losses(make_model(a.model, (28, 28, 1), 10), x, y, 0.0, a.steps, a.batch_size)
    moved = losses(make_model(a.model, (28, 28, 1), 10), x, y, a.eps, a.steps, a.batch_size)
    print(f"{a.model}: batch loss from its initial weights, and from them changed by {a.eps:g} relative")
    for t in range(9, a.steps, 10):
        print(f"step {t + 1:4d}  {base[t]:.4f}  {moved[t]:.4f}  difference {moved[t] - base[t]:+.4f}")
    print(f"({time.perf_counter() - start:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**head, "model": a.model, "eps": a.eps, "base": base, "perturbed": moved}, f, indent=1)


if __name__ == "__main__":
    main()
