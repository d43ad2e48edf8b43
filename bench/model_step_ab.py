"""One model's `loss_and_grad` from two source trees, interleaved in one run: the seconds per
step of each (min over every step) and the ratio, to measure a change to a model's core; and
each tree's gradient at the same weights, batch and dropout seed, to check the change computes
the same thing.

    .venv/bin/python bench/model_step_ab.py --base /tmp/pserver-old --new . --model cnn --batch 64 \\
        --rounds 6 --steps 10

Each tree runs in a child process (PYTHONPATH set to it) that builds the model, warms it up
(numba's compile) and then, at each of the parent's turns, times --steps steps; the parent
alternates the children for --rounds rounds, so both see the same load. Besides wall time it
reports the step thread's CPU time (time.thread_time), which a loaded machine disturbs less;
with NUMBA_NUM_THREADS=1 that is the whole step's. Models: cnn (the seeds' CNN on MNIST's
shape), mlp (784-256-256-10), drop (Embedding, Flatten, Dropout, Dense), the CTR models lr, fm,
wide_deep and deepfm on Criteo-shaped records, whose rows (the same in both trees, from a seeded
generator) come as the worker hands them (their gradient compared is the dense one followed by
every table's row gradients), and frozen-convnet (keras.io's MNIST convnet with its two
convolutions frozen, as when fine-tuning a head: a tree that skips a frozen base's backward
pass leaves its gradient zero where the other computed it).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine  # noqa: E402

CHILD = r"""
import json, sys, time
import numpy as np
from pserver.layers import Dense, Dropout, Embedding, Flatten
from pserver.models import make_model
from pserver.models.sequential import Sequential

name, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
extra, rows = {"seed": 7}, []
if name in ("lr", "fm", "wide_deep", "deepfm"):
    from pserver.sparse import TableLookup
    model = make_model(name, (), 2, backend="cpu")
    rng = np.random.default_rng(1)
    x = np.zeros(batch, [("dense", np.float32, (13,)), ("cat", np.int64, (26,))])
    x["dense"] = rng.random((batch, 13), dtype=np.float32)
    x["cat"] = rng.integers(0, 50, (batch, 26)) * 26 + np.arange(26)   # ids repeat in the batch
    first = TableLookup.of(x["cat"], 1)
    rows = [TableLookup.like(first, t.dim) for t in model.sparse_tables]
    for lk in rows:
        lk.rows[:] = rng.standard_normal(lk.rows.shape, dtype=np.float32) * 0.1
    extra = {"sparse": rows}
elif name == "frozen-convnet":     # keras.io's convnet with its two convolutions frozen (fine-tuning)
    from pserver.layers import Conv2D, MaxPooling2D
    base = [Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), MaxPooling2D(2),
            Conv2D(64, 3, activation="relu"), MaxPooling2D(2)]
    for layer in base[::2]:
        layer.trainable = False
    model = Sequential([*base, Flatten(), Dense(10)], name="frozen_convnet")
    x = np.random.default_rng(1).random((batch, 28, 28, 1), dtype=np.float32)
elif name == "drop":
    model = Sequential([Embedding(50, 8, input_shape=(6,)), Flatten(), Dense(32, activation="relu"),
                        Dropout(0.5), Dense(10)], name="drop")
    x = np.random.default_rng(1).integers(0, 50, (batch, 6))
else:
    shape = (28, 28, 1) if name == "cnn" else (784,)
    model = make_model(name, shape, 10)
    x = np.random.default_rng(1).random((batch, *shape), dtype=np.float32)
y = np.random.default_rng(2).integers(0, 2 if rows else 10, batch)
w = model.init_params(0)
g = np.zeros_like(w)
for _ in range(5):
    model.loss_and_grad(w, x, y, g, **extra)
np.save(out, np.concatenate([g, *(lk.grads.ravel() for lk in rows)]))
import pserver
print("ready", pserver.__file__, flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        t, c = time.perf_counter(), time.thread_time()
        model.loss_and_grad(w, x, y, g, **extra)
        times.append((time.perf_counter() - t, time.thread_time() - c))
    print(json.dumps(times), flush=True)
"""


def start(tree: str, model: str, batch: int, grad: str) -> tuple[subprocess.Popen, str]:
    """The child measuring `tree`, and the pserver it imported. It runs in the tree: `python -c`
    puts the working directory ahead of PYTHONPATH, so a child started from another checkout
    imported that one (before 2026-11-29 both sides of a run from /work/main measured main)."""
    root = str(Path(tree).resolve())
    p = subprocess.Popen([sys.executable, "-c", CHILD, model, str(batch), grad], cwd=root, text=True,
                         env=dict(os.environ, PYTHONPATH=root), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ready, _, imported = p.stdout.readline().strip().partition(" ")
    if ready != "ready":
        raise SystemExit(f"{tree}: the child did not start")
    if not imported.startswith(root + os.sep):
        raise SystemExit(f"{tree}: the child imported pserver from {imported}, not from the tree")
    return p, imported


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the source tree to compare against")
    ap.add_argument("--new", default=".", help="the source tree measured (default: this one)")
    ap.add_argument("--model", default="cnn",
                    choices=("cnn", "mlp", "drop", "lr", "fm", "wide_deep", "deepfm", "frozen-convnet"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="steps per child per round")
    args = ap.parse_args()
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": args.base, "new": args.new}
        started = {k: start(t, args.model, args.batch, f"{tmp}/{k}.npy") for k, t in trees.items()}
        kids = {k: p for k, (p, _) in started.items()}
        times: dict[str, list[float]] = {k: [] for k in kids}
        for _ in range(args.rounds):
            for k, p in kids.items():
                p.stdin.write(f"{args.steps}\n")
                p.stdin.flush()
                times[k] += json.loads(p.stdout.readline())
        for p in kids.values():
            p.stdin.close()
            p.wait()
        gb, gn = np.load(f"{tmp}/base.npy"), np.load(f"{tmp}/new.npy")
    rel = float(np.abs(gn - gb).max() / max(np.abs(gb).max(), 1e-30))
    best = {k: min(t for t, _ in v) for k, v in times.items()}
    cpu = {k: min(c for _, c in v) for k, v in times.items()}
    print(json.dumps({**machine(), "base": str(args.base),
                      "imported": {k: imported for k, (_, imported) in started.items()},
                      "model": args.model, "batch": args.batch, "steps_each": len(times["new"]),
                      "min_ms": {k: round(v * 1e3, 3) for k, v in best.items()},
                      "speed_new_over_base": round(best["base"] / best["new"], 3),
                      "min_thread_cpu_ms": {k: round(v * 1e3, 3) for k, v in cpu.items()},
                      "cpu_speed_new_over_base": round(cpu["base"] / cpu["new"], 3),
                      "grad_max_rel_diff": rel, "grad_bitwise_equal": bool(np.array_equal(gn, gb)),
                      "load": round(os.getloadavg()[0], 2),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))


if __name__ == "__main__":
    main()
