"""The shards' optimizer kernels with numba's default error model against error_model="numpy",
the one pserver.optim compiles them with.

Under the default ("python") every division checks its divisor for zero so that it can raise
ZeroDivisionError, and that branch keeps LLVM from vectorizing the loop. For each rule this
compiles its `update` both ways, checks that one step from the same state gives the same bits,
and times a step on `--size` float32 weights (default 347,146: the reference CNN's, the
--model cnn shard of `pserver launch --ps 1`). It prints, and keeps in the JSON, the milliseconds
per step of each, the ratio, and the instructions each form's machine code uses (vector
registers: xmm only means scalar code).

    .venv/bin/python bench/optim_kernels.py --out bench/results/kernels/optim_kernels.json
"""

from __future__ import annotations

import argparse
import json
import re
import time

import llvmlite.binding as llvm
import numpy as np
from _util import machine, machine_lines, table
from numba import njit

from pserver.optim import adagrad, adam, adamw, momentum, rmsprop, sgd

# Each rule's state arrays and the scalars after them, as pserver.optim's classes pass them.
RULES = {
    "sgd": (sgd, 0, (0.01, 0.0)),
    "momentum": (momentum, 1, (0.01, 0.9, False, 0.0)),
    "adam": (adam, 2, (1e-3, 0.9, 0.999, 1e-8, 3, 0.0)),
    "adamw": (adamw, 2, (1e-3, 0.9, 0.999, 1e-7, 3, 0.004)),
    "rmsprop": (rmsprop, 3, (1e-3, 0.9, 0.9, 1e-7, True, 0.0)),
    "adagrad": (adagrad, 1, (1e-3, 1e-7, 0.0)),
}


def arrays(size: int, states: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    w, g = (rng.standard_normal(size).astype(np.float32) for _ in range(2))
    return [w, g, *(np.abs(rng.standard_normal(size)).astype(np.float32) for _ in range(states))]


def per_step_ms(fn, args, repeats: int) -> float:
    """The fastest of 5 rounds of `repeats` steps, in ms per step."""
    fn(*args)
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        best.append((time.perf_counter() - t) / repeats * 1e3)
    return min(best)


def vector_use(fn) -> str:
    asm = fn.inspect_asm(fn.signatures[0])
    regs = [r for r in ("zmm", "ymm", "xmm") if re.search(rf"\b{r}\d", asm)]
    packed = len(re.findall(r"\bv(?:add|mul|fmadd\w*|div|sqrt)ps\b", asm))
    return f"{'/'.join(regs) or 'none'}, {packed} packed float ops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=347_146,
                    help="weights per step (default: the reference CNN's)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    m = machine(("numpy", "numba", "llvmlite"))
    m["llvm_host_cpu"] = llvm.get_host_cpu_name()
    print("\n".join(machine_lines(m)), f"\nLLVM host CPU: {m['llvm_host_cpu']}\n")
    rows, results = [], []
    for name, (module, states, scalars) in RULES.items():
        forms = {model: njit(nogil=True, error_model=model)(module.update.py_func)
                 for model in ("python", "numpy")}
        after = {}
        for model, fn in forms.items():
            a = arrays(args.size, states)
            fn(*a, *scalars)
            after[model] = a
        same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(after["python"], after["numpy"]))
        ms = {model: per_step_ms(fn, [*arrays(args.size, states), *scalars], args.repeats)
              for model, fn in forms.items()}
        isa = {model: vector_use(fn) for model, fn in forms.items()}
        results.append({"rule": name, "size": args.size, "ms_default": round(ms["python"], 4),
                        "ms_numpy_errors": round(ms["numpy"], 4),
                        "speedup": round(ms["python"] / ms["numpy"], 2),
                        "same_bits": same, "isa_default": isa["python"], "isa_numpy_errors": isa["numpy"]})
        rows.append([name, f"{ms['python']:.3f}", f"{ms['numpy']:.3f}", f"{ms['python'] / ms['numpy']:.2f}x",
                     "yes" if same else "NO", isa["python"], isa["numpy"]])
    print(f"one step on {args.size:,} float32 weights, ms (fastest of 5 rounds of {args.repeats}):")
    print(table(["rule", "default", "error_model=numpy", "speed-up", "same bits", "default's code",
                 "numpy's code"], rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": m, "results": results}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
