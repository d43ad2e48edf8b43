"""A 3x3 convolution of stride 1 both ways pserver's CPU kernels can run it, in one process:
im2col + gemm against Winograd's F(2x2, 3x3), forward and backward (a training step's pair:
conv2d_forward_cols, then conv2d_backward_cols with the input's gradient and ReLU), on one
thread, the two paths taking turns --rounds times. What `_winograd`'s threshold (16 channels
in) rests on, and what each layer of a model gains.

    python bench/conv_paths.py --shapes 28x8x32,28x16x16,28x16x32,26x32x64,8x64x64 --json out.json

A shape is SIZExCINxCOUT: a SIZE x SIZE image, 'same' padding (26x32x64 is 'valid': the toy
ResNet's second convolution). Each figure is the median over rounds of the best of --runs
steps; `ratio` is im2col's time over Winograd's (above 1: Winograd is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"                       # one worker's core, as `pserver launch` sets it

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_lines, table  # noqa: E402

DEFAULT_SHAPES = "28x8x32,28x8x64,28x16x16,28x16x32,26x32x64,8x64x64"


def shape_of(text: str) -> tuple[int, int, int]:
    try:
        size, c, f = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not SIZExCINxCOUT (as 28x16x32)") from None
    if min(size, c, f) < 1 or size < 3:
        raise argparse.ArgumentTypeError(f"'{text}': SIZE must be at least 3, channels at least 1")
    return size, c, f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=lambda t: [shape_of(s) for s in t.split(",")],
                   default=[shape_of(s) for s in DEFAULT_SHAPES.split(",")])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--runs", type=int, default=5, help="steps per path and round; the best counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    import numpy as np

    from pserver.kernels import conv_output, cpu
    info = machine(("numpy", "numba"))
    print("\n".join(machine_lines(info)))
    rng = np.random.default_rng(0)
    rows = []
    for size, c, f in args.shapes:
        padding = "valid" if (size, c, f) == (26, 32, 64) else "same"
        oh, pad = conv_output(size, 3, 1, padding)
        n = args.batch
        x = rng.standard_normal((n, size, size, c)).astype(np.float32)
        w = (rng.standard_normal((3, 3, c, f)) * 0.1).astype(np.float32)
        b = rng.standard_normal(f).astype(np.float32)
        out = np.empty((n, oh, oh, f), np.float32)
        dy = rng.standard_normal(out.shape).astype(np.float32)
        cols = np.empty((n * oh * oh, 9 * c), np.float32)
        dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
        fits = 16 * ((oh + 1) // 2) ** 2 <= 9 * oh * oh

        def im2col():
            cpu._im2col_forward(x, w, b, out, cols, 1, 1, pad, pad, True)
            cpu._im2col_backward(cols, w, out, dy.copy(), dx, dw, db, 1, 1, pad, pad, True)

        def winograd():
            cpu._wino_forward(x, w, b, out, cols, pad, pad, True)
            cpu._wino_backward(cols, w, out, dy.copy(), dx, dw, db, pad, pad, True)

        paths = {"im2col": im2col, "winograd": winograd} if fits else {"im2col": im2col}
        best = {k: [] for k in paths}
        for _ in range(args.rounds):
            for name, step in paths.items():
                step()                                          # warm (and compiled)
                times = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t)
                best[name].append(min(times))
        ms = {k: statistics.median(v) * 1e3 for k, v in best.items()}
        taken = bool(cpu._winograd(w, out, 1, 1))
        rows.append({"shape": f"{size}x{c}x{f}", "padding": padding, "batch": n,
                     "im2col_ms": ms["im2col"], "winograd_ms": ms.get("winograd"),
                     "ratio": ms["im2col"] / ms["winograd"] if "winograd" in ms else None,
                     "pserver_takes": "winograd" if taken else "im2col"})
    print(f"forward + backward (ReLU, input gradient), batch {args.batch}, one thread: median over "
          f"{args.rounds} rounds of the best of {args.runs}")
    cells = [[r["shape"], r["padding"], f"{r['im2col_ms']:.2f}",
              "-" if r["winograd_ms"] is None else f"{r['winograd_ms']:.2f}",
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["pserver_takes"]] for r in rows]
    print(table(["shape", "padding", "im2col ms", "winograd ms", "im2col / winograd", "pserver takes"], cells,
                left=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**info, "batch": args.batch, "runs": args.runs, "rounds": args.rounds, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
