"""Where a compact-row push spends its time, and whether fusing its three passes pays.

    .venv/bin/python bench/compact_push.py                  # 100k rows of dim 16, 7 rounds

A push to a table with float16 or bfloat16 rows widens the touched entries into a float32
scratch matrix, steps them there with the row rule's numba kernel and narrows them back,
rounding each value stochastically (pserver.sparse.compact.step_rows): three passes over the
rows. This measures, for adagrad and adam at dim 16, one thread, every row pushed once per
round, rounds interleaved across the tables (medians; ratios within this run):

- push: SparseTable.apply, against a float32 table's (the same optimizer and rows);
- its parts: widen, the row rule's kernel on the widened rows, narrow (each alone; the rest of a
  push is finding the rows);
- fused: the row update done BLOCK rows at a time (widen, step, narrow a block that stays in
  cache: one pass over the table and no table-sized scratch; `step_fused` below, the same
  kernels, checked to give the same bits), against the three passes of step_rows;
- with --baseline REV: widen and narrow of pserver/sparse/compact.py at git revision REV (loaded
  as a module of its own), interleaved with today's on the same rows, checked to give the same
  bits: the speed-up of a change to those kernels, measured in one process.

    .venv/bin/python bench/compact_push.py --baseline c8a251c   # the per-format loops' gain

Writes results/sparse/compact-push.json (--out bench/results/sparse/compact-push.json for the
committed figures; compact-push-before-after.json there: this script run on the code before and
after the float16 narrow loop, alternating).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path, table  # noqa: E402

from pserver.sparse import SparseTable, TableConfig, compact, optim  # noqa: E402

PAIRS = [("bfloat16", "float32"), ("bfloat16", "row"), ("float16", "float32"), ("float16", "row")]
BLOCK = 32
RULES = {"adagrad": 1, "adam": 2}


@njit(cache=True, nogil=True)
def step_fused(rule, params, data, steps, counts, idx, ids, grads, scale, key, version, dim, row_fmt,
               state_fmt, slots, roots):
    """compact.step_rows BLOCK rows at a time: widen a block into a scratch that stays in cache,
    step it with the rule's kernel (1 adagrad, 2 adam), narrow it back."""
    n, width = idx.shape[0], dim * (slots + 1)
    work = np.empty((BLOCK, width), np.float32)
    local = np.arange(BLOCK)
    own = np.zeros(BLOCK, np.int64)
    for a in range(0, n, BLOCK):
        b = min(a + BLOCK, n)
        rows, w, g = idx[a:b], work[:b - a], grads[a:b]
        at = np.where(rows >= 0, local[:b - a], -1)
        compact.widen(data, rows, dim, row_fmt, state_fmt, slots, roots, w)
        if counts:
            for i in range(b - a):
                own[i] = steps[rows[i]] if rows[i] >= 0 else 0
        if rule == 1:
            optim.adagrad(w, own, at, g, scale, params[0], params[1])
        else:
            optim.adam(w, own, at, g, scale, params[0], params[1], params[2], params[3])
        if counts:
            for i in range(b - a):
                if rows[i] >= 0:
                    steps[rows[i]] = own[i]
        compact.narrow(data, rows, ids[a:b], key, version, dim, row_fmt, state_fmt, slots, roots, w, True)


def fused(t: SparseTable, idx, ids, grads, version) -> None:
    lay = t.layout
    params = np.array([t.opt.h[k] for k in t.opt.rule.kernel_params], np.float64)
    step_fused(RULES[t.opt.name], params, t._rows.arrays["data"], t._steps(),
               t.opt.counts_steps, idx, ids, grads, 1.0, t._key, version, lay.dim, lay.row_fmt,
               lay.state_fmt, lay.slots, lay.roots)


def three_passes(t: SparseTable, idx, ids, grads, version) -> None:
    compact.step_rows(t.opt, t._rows.arrays["data"], t._steps(), idx, ids, grads, 1.0, t._key, version,
                      t.layout, True)


def same_bits(config: TableConfig, ids, grads) -> bool:
    """The fused update and the three passes leave the same words and step counts."""
    a, b = SparseTable(config, 0), SparseTable(config, 0)
    for t in (a, b):
        t.apply(ids, grads, 0)
    idx = np.arange(ids.shape[0], dtype=np.int64)
    fused(a, idx, ids, grads, 1)
    three_passes(b, idx, ids, grads, 1)
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in ((a._rows.arrays["data"][:a._rows.n], b._rows.arrays["data"][:b._rows.n]),
                            (a._steps()[:a._rows.n], b._steps()[:b._rows.n])))


def measure(optimizer: str, dim: int, rows: int, rounds: int) -> list[dict]:
    ids = np.arange(1, rows + 1, dtype=np.uint64)
    grads = np.random.default_rng(0).normal(0, 0.01, (rows, dim)).astype(np.float32)
    idx = np.arange(rows, dtype=np.int64)
    base = SparseTable(TableConfig("t", dim, optimizer=optimizer), 0)
    base.apply(ids, grads, 0)
    cases = []
    for row, state in PAIRS:
        config = TableConfig("t", dim, optimizer=optimizer, row_dtype=row, state_dtype=state)
        t = SparseTable(config, 0)
        t.apply(ids, grads, 0)
        lay = t.layout
        work = np.empty((rows, dim * (1 + lay.slots)), np.float32)
        data = t._rows.arrays["data"]
        fmts = (lay.row_fmt, lay.state_fmt, lay.slots, lay.roots)
        parts = dict(widen=lambda data=data, fmts=fmts, work=work: compact.widen(data, idx, dim, *fmts, work),
                     kernel=lambda t=t, work=work: t.opt.step(work, np.zeros(rows, np.int64), idx, grads,
                                                              1.0),
                     narrow=lambda t=t, data=data, fmts=fmts, work=work: compact.narrow(
                         data, idx, ids, t._key, 10**6, dim, *fmts, work, True))
        cases.append(dict(t=t, parts=parts, row=row, state=state, same_bits=same_bits(config, ids[:2000],
                                                                                        grads[:2000])))
    times: dict = {}

    def timed(key, fn):
        start = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - start)

    for k in range(rounds + 1):             # round 0 compiles or loads the kernels: not counted
        timed("float32", lambda: base.apply(ids, grads, 1 + k, checked=True))
        for c in cases:
            t, key = c["t"], (c["row"], c["state"])
            timed(key + ("push",), lambda: t.apply(ids, grads, 1 + k, checked=True))
            timed(key + ("three passes",), lambda: three_passes(t, idx, ids, grads, 10**5 + k))
            timed(key + ("fused",), lambda: fused(t, idx, ids, grads, 2 * 10**5 + k))
            for name, fn in c["parts"].items():
                timed(key + (name,), fn)
    ns = {key: float(np.median(v[1:])) / rows * 1e9 for key, v in times.items()}
    out = []
    for c in cases:
        key = (c["row"], c["state"])
        r = dict(optimizer=optimizer, row_dtype=c["row"], state_dtype=c["state"], same_bits=c["same_bits"],
                 float32_push_ns_per_row=round(ns["float32"], 1),
                 **{f"{p.replace(' ', '_')}_ns_per_row": round(ns[key + (p,)], 1)
                    for p in ("push", "widen", "kernel", "narrow", "three passes", "fused")})
        r["push_vs_float32"] = round(ns[key + ("push",)] / ns["float32"], 2)
        r["fused_speedup"] = round(ns[key + ("three passes",)] / ns[key + ("fused",)], 2)
        out.append(r)
    return out


def load_baseline(rev: str):
    """pserver/sparse/compact.py at git revision rev, imported as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:pserver/sparse/compact.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="compact-baseline-")) / "compact_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("compact_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against_baseline(old, rev: str, dim: int, rows: int, rounds: int) -> list[dict]:
    """widen and narrow of `old` (compact at rev) and of today's, interleaved on the same rows."""
    ids = np.arange(1, rows + 1, dtype=np.uint64)
    grads = np.random.default_rng(0).normal(0, 0.01, (rows, dim)).astype(np.float32)
    idx = np.arange(rows, dtype=np.int64)
    out = []
    for optimizer in RULES:
        for row, state in PAIRS:
            t = SparseTable(TableConfig("t", dim, optimizer=optimizer, row_dtype=row, state_dtype=state), 0)
            t.apply(ids, grads, 0)
            t.apply(ids, grads, 1)
            lay, data = t.layout, t._rows.arrays["data"][:rows]
            fmts = (dim, lay.row_fmt, lay.state_fmt, lay.slots, lay.roots)
            work = np.empty((rows, dim * (1 + lay.slots)), np.float32)
            compact.widen(data, idx, *fmts, work)
            times: dict = {}
            results = {}
            for k in range(rounds + 1):
                for name, mod in (("baseline", old), ("now", compact)):
                    wide, narrowed, stepped = np.empty_like(work), data.copy(), work.copy()
                    widen = lambda: mod.widen(data, idx, *fmts, wide)  # noqa: E731
                    narrow = lambda: mod.narrow(narrowed, idx, ids, t._key, 9, *fmts, stepped, True)  # noqa: E731
                    for part, fn in (("widen", widen), ("narrow", narrow)):
                        start = time.perf_counter()
                        fn()
                        times.setdefault((name, part), []).append(time.perf_counter() - start)
                    results[name] = (wide.tobytes(), narrowed.tobytes())
            ns = {key: float(np.median(v[1:])) / rows * 1e9 for key, v in times.items()}
            r = dict(optimizer=optimizer, row_dtype=row, state_dtype=state, baseline=rev,
                     same_bits=results["baseline"] == results["now"],
                     **{f"{name}_{part}_ns_per_row": round(v, 1) for (name, part), v in ns.items()})
            for part in ("widen", "narrow"):
                r[f"{part}_speedup"] = round(ns[("baseline", part)] / ns[("now", part)], 2)
            out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000, help="rows pushed each round (default 100k)")
    ap.add_argument("--dim", type=int, default=16, help="row width (default 16)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--baseline", default=None, metavar="REV", help="also time widen and narrow of "
                    "pserver/sparse/compact.py at this git revision against today's")
    ap.add_argument("--out", default=None, help="the JSON (default bench/results/sparse/compact-push.json)")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)))
    results = [r for opt in RULES for r in measure(opt, args.dim, args.rows, args.rounds)]
    m["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(f"\nns per row, {args.rows:,} rows of dim {args.dim}, one thread, medians of {args.rounds} "
          f"interleaved rounds (load average after: {m['load_avg_1m_after']}):")
    print(table(["optimizer", "row", "state", "float32 push", "push", "vs float32", "widen", "kernel",
                 "narrow", "3 passes", "fused", "fused speedup", "same bits"],
                [[r["optimizer"], r["row_dtype"], r["state_dtype"]]
                 + [f"{r[k]:.0f}" for k in ("float32_push_ns_per_row", "push_ns_per_row")]
                 + [f"{r['push_vs_float32']:.2f}"]
                 + [f"{r[k + '_ns_per_row']:.0f}"
                    for k in ("widen", "kernel", "narrow", "three_passes", "fused")]
                 + [f"{r['fused_speedup']:.2f}", str(r["same_bits"])] for r in results], left=3))
    baseline = []
    if args.baseline:
        old = load_baseline(args.baseline)
        baseline = against_baseline(old, args.baseline, args.dim, args.rows, args.rounds)
        print(f"\nwiden and narrow, ns per row, against compact.py at {args.baseline} (interleaved, same "
              f"rows; load average after: {os.getloadavg()[0]:.2f}):")
        print(table(["optimizer", "row", "state", "widen then", "widen now", "speed-up", "narrow then",
                     "narrow now", "speed-up", "same bits"],
                    [[r["optimizer"], r["row_dtype"], r["state_dtype"]]
                     + [f"{r[k]:.0f}" for k in ("baseline_widen_ns_per_row", "now_widen_ns_per_row")]
                     + [f"{r['widen_speedup']:.2f}"]
                     + [f"{r[k]:.0f}" for k in ("baseline_narrow_ns_per_row", "now_narrow_ns_per_row")]
                     + [f"{r['narrow_speedup']:.2f}", str(r["same_bits"])] for r in baseline], left=3))
    out = result_path(args.out, "sparse/compact-push.json")
    out.write_text(json.dumps(dict(machine=m, rows=args.rows, dim=args.dim, rounds=args.rounds, block=BLOCK,
                                   results=results, against_baseline=baseline), indent=2, sort_keys=True)
                   + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
