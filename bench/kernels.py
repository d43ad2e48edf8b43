"""Model-math kernels: the matrix product in GFLOP/s, an MLP training step in samples/s.

Rows, each on float32 data already where the kernel reads it, unless a row says otherwise:

  matmul   C = A @ B, n x n:
           numpy   np.dot, i.e. the BLAS numpy links (the CPU reference)
           cpu     pserver.kernels.cpu.dense_forward with a zero bias: numba's np.dot, the
                   same BLAS gemm, plus the bias pass
           cuda    pserver.kernels.cuda.matmul: the tiled shared-memory kernel (device arrays)
           cupy    cupy.matmul, i.e. cuBLAS (the GPU reference), when CuPy and a GPU are there
  mlp      one loss_and_grad of the 784-256-256-10 MLP (forward, softmax cross-entropy,
           backward into the flat gradient), as the worker calls it:
           numpy   the "reference" backend (NumPy twins)
           cpu     the "cpu" backend (numba kernels)
           cuda    the CUDA model, including its per-step copies: w, x, y to the device
                   and the gradient back, through pinned buffers
           cupy    the same math in CuPy, with the same copies (pageable memory)

Each row: warm-up first, never timed (compilation, first touch, caches, BLAS threads waking),
until both --warmup runs and --warmup-seconds are reached; then timed runs until both
--min-runs and --min-seconds are; the table shows the median. Ratios are to the CPU reference
(numpy) and to the GPU reference (cupy).

    python bench/kernels.py                                   # 1024,2048,4096; batches 256,4096
    python bench/kernels.py --sizes 512 --batches 256         # quick
    python bench/kernels.py --json kernels.json
    NUMBA_ENABLE_CUDASIM=1 python bench/kernels.py --sizes 32 --batches 256   # simulator smoke

With no GPU the CUDA and CuPy rows are skipped, and the output says why. Under numba's CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) the CUDA rows run only for sizes up to 64 (one Python thread
per CUDA thread: a 4096^2 product would take days), say that they measure nothing about a GPU,
and the MLP's CUDA row is skipped (its 784-wide layer alone is thousands of simulated blocks).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, positive_ints, summary, table  # noqa: E402

MLP_WIDTHS = (784, 256, 256, 10)
SIM_MAX_SIZE = 64
BACKENDS = ("numpy", "cpu", "cuda", "cupy")


# -- what there is to run on ---------------------------------------------------------------

def gpu_status() -> dict:
    """{"cuda": None or why not, "simulator": bool, "device": name, "cupy": module or why not}."""
    from pserver.device import describe, is_simulator, parse_device, select
    from pserver.errors import ConfigError
    st = {"simulator": False, "device": "none", "cuda": None}
    try:
        dev = select(parse_device("cuda"))
        st["simulator"], st["device"] = is_simulator(), describe(dev)
    except ConfigError as e:
        st["cuda"] = str(e)
    st["cupy"] = _cupy(st)
    return st


def _cupy(st: dict):
    if st["cuda"] or st["simulator"]:
        return "no GPU" if st["cuda"] else "the CUDA simulator is on (no GPU in use)"
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as e:  # not installed, or installed for another CUDA: say which
        return f"CuPy unavailable ({type(e).__name__}: {e})".splitlines()[0]


def blas_name() -> str:
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas.get('version', '')}".strip()
    except (AttributeError, KeyError, TypeError):
        return "unknown BLAS"


# -- timing ----------------------------------------------------------------------------------

def measure(fn, sync, args) -> dict:
    """Median seconds per call of fn(), after untimed warm-up calls.

    Warm-up is counted in calls and in seconds: the first calls compile, and on a small
    machine the BLAS threads take a few hundred ms of steady calls to stop paying wake-ups
    (measured here: 12-28 ms per 256^2 product for ~0.3 s, then 0.2 ms).
    """
    start, done = time.perf_counter(), 0
    while done < args.warmup or time.perf_counter() - start < args.warmup_seconds:
        fn()
        sync()
        done += 1
    times, start = [], time.perf_counter()
    while len(times) < args.min_runs or time.perf_counter() - start < args.min_seconds:
        t0 = time.perf_counter()
        fn()
        sync()   # a GPU call returns before the work is done: time until it is
        times.append(time.perf_counter() - t0)
    med, lo, hi = summary(times)
    return {"seconds": med, "min_seconds": lo, "max_seconds": hi, "runs": len(times)}


def _nothing():
    pass


# -- matrix products -------------------------------------------------------------------------

def matmul_row(backend: str, n: int, st: dict, rng):
    """(fn, sync) for C = A @ B of n x n float32 on `backend`, or a string saying why not."""
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    if backend == "numpy":
        c = np.empty((n, n), np.float32)
        return (lambda: np.dot(a, b, out=c)), _nothing
    if backend == "cpu":
        from pserver.kernels import cpu
        c, bias = np.empty((n, n), np.float32), np.zeros(n, np.float32)
        return (lambda: cpu.dense_forward(a, b, bias, c, False)), _nothing
    if backend == "cuda":
        if st["cuda"]:
            return st["cuda"]
        if st["simulator"] and n > SIM_MAX_SIZE:
            # About 0.075 s per 16 x 16 block and 16-wide step along K, measured on 2 cores.
            hours = (n / 16) ** 3 * 0.075 / 3600
            return (f"simulator: n > {SIM_MAX_SIZE} not run (n = {n} would take about "
                    f"{hours:.2g} h per product; try --sizes 32)")
        from numba import cuda
        from pserver.kernels import cuda as kernels
        da, db, dc = cuda.to_device(a), cuda.to_device(b), cuda.device_array((n, n), np.float32)
        return (lambda: kernels.matmul(da, db, dc)), cuda.synchronize
    cp = st["cupy"]
    if isinstance(cp, str):
        return cp
    da, db, dc = cp.asarray(a), cp.asarray(b), cp.empty((n, n), cp.float32)
    return (lambda: cp.matmul(da, db, out=dc)), cp.cuda.Device().synchronize


# -- the MLP step ------------------------------------------------------------------------------

def mlp_row(backend: str, batch: int, st: dict, rng):
    """(fn, sync) for one MLP loss_and_grad at this batch size, or a string saying why not."""
    from pserver.models import make_model
    host = make_model("mlp", MLP_WIDTHS[0], MLP_WIDTHS[-1], hidden=MLP_WIDTHS[1:-1],
                      backend="reference")
    w = host.init_params(0)
    g = np.empty_like(w)
    x = rng.standard_normal((batch, MLP_WIDTHS[0]), dtype=np.float32)
    y = rng.integers(0, MLP_WIDTHS[-1], batch).astype(np.int32)
    if backend in ("numpy", "cpu"):
        model = host if backend == "numpy" else make_model(
            "mlp", MLP_WIDTHS[0], MLP_WIDTHS[-1], hidden=MLP_WIDTHS[1:-1], backend="cpu")
        return (lambda: model.loss_and_grad(w, x, y, g)), _nothing
    if backend == "cuda":
        if st["cuda"]:
            return st["cuda"]
        if st["simulator"]:
            return "simulator: the 784-wide layer alone is thousands of simulated blocks per step"
        model = make_model("mlp", MLP_WIDTHS[0], MLP_WIDTHS[-1], hidden=MLP_WIDTHS[1:-1],
                           backend="cuda")
        return (lambda: model.loss_and_grad(w, x, y, g)), _nothing   # it waits for its copy
    cp = st["cupy"]
    if isinstance(cp, str):
        return cp
    wd, gd = cp.empty_like(cp.asarray(w)), cp.empty(w.size, cp.float32)

    def step():
        wd.set(w)
        xp_mlp_step(cp, host.layout, wd, cp.asarray(x), cp.asarray(y), gd)
        gd.get(out=g)
    return step, cp.cuda.Device().synchronize


def xp_mlp_step(xp, layout, w, x, y, g) -> float:
    """The MLP's loss and flat gradient in array-API calls: NumPy or CuPy (the cuBLAS row).

    Checked against the reference model with xp = numpy before anything is timed.
    """
    p, d = layout.views(w), layout.views(g)
    layers = len(layout.tensors) // 2
    acts = [x]
    for i in range(layers):
        z = acts[-1] @ p[f"w{i}"] + p[f"b{i}"]
        acts.append(xp.maximum(z, 0) if i < layers - 1 else z)
    z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)
    n, rows = x.shape[0], xp.arange(x.shape[0])
    loss = float((xp.log(s[:, 0]) - z[rows, y]).mean())
    delta = e / s
    delta[rows, y] -= 1
    delta /= n
    for i in range(layers - 1, -1, -1):
        d[f"w{i}"][...] = acts[i].T @ delta
        d[f"b{i}"][...] = delta.sum(axis=0)
        if i:
            delta = (delta @ p[f"w{i}"].T) * (acts[i] > 0)
    return loss


def check_xp_step() -> None:
    """The CuPy row's math, run with NumPy, equals the reference model (small batch)."""
    from pserver.models import make_model
    model = make_model("mlp", 20, 4, hidden=(16, 8), backend="reference")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(model.layout.total) * 0.5).astype(np.float32)
    x, y = rng.standard_normal((9, 20)).astype(np.float32), rng.integers(0, 4, 9).astype(np.int32)
    want, got = np.empty_like(w), np.empty_like(w)
    loss = model.loss_and_grad(w, x, y, want)
    assert abs(xp_mlp_step(np, model.layout, w, x, y, got) - loss) < 1e-5 * max(1.0, loss)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


# -- report ------------------------------------------------------------------------------------

def run_rows(kind: str, sizes, st: dict, args) -> list[dict]:
    rows, build = [], matmul_row if kind == "matmul" else mlp_row
    for n in sizes:
        for backend in args.backends:
            made = build(backend, n, st, np.random.default_rng(n))
            row = {"kind": kind, "size": n, "backend": backend}
            if isinstance(made, str):
                rows.append({**row, "skipped": made})
                continue
            row.update(measure(*made, args))
            if kind == "matmul":
                row["gflops"] = 2 * n ** 3 / row["seconds"] / 1e9
            else:
                row["samples_per_second"] = n / row["seconds"]
            rows.append(row)
            print(f"  {kind} {n} {backend}: {row['seconds'] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    return rows


def run_backend_alone(backend: str, args) -> list[dict]:
    """One backend's rows, measured in a fresh process of this script.

    numpy's BLAS and the one numba calls through scipy are two OpenBLAS libraries with two
    thread pools; once numpy's has run, numba's 256^2 product took 12.6 ms instead of 0.17 ms
    on this 2-core machine (measured), whatever the warm-up. Apart, each gets the cores.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--backends", backend,
                "--sizes", ",".join(map(str, args.sizes)), "--batches", ",".join(map(str, args.batches)),
                "--warmup", str(args.warmup), "--warmup-seconds", str(args.warmup_seconds),
                "--min-runs", str(args.min_runs), "--min-seconds", str(args.min_seconds),
                "--child-json", str(out)]
        subprocess.run(argv, check=True)
        return json.loads(out.read_text())


def child(args) -> int:
    """--child-json: measure args.backends here, write the rows, print nothing on stdout."""
    st = gpu_status() if set(args.backends) & {"cuda", "cupy"} else {}
    rows = run_rows("matmul", args.sizes, st, args) + run_rows("mlp", args.batches, st, args)
    Path(args.child_json).write_text(json.dumps(rows))
    return 0


def add_ratios(rows: list[dict], metric: str) -> None:
    for r in rows:
        for ref in ("numpy", "cupy"):
            base = next((b for b in rows if b["size"] == r["size"] and b["backend"] == ref
                         and metric in b), None)
            if base and metric in r:
                r[f"vs_{ref}"] = r[metric] / base[metric]


def render(rows: list[dict], metric: str, label: str, sim: bool) -> str:
    """The table, with each distinct reason for a skipped row once, as a note below it."""
    out, notes = [], []
    for r in rows:
        name = r["backend"] + (" (simulator)" if sim and r["backend"] == "cuda" else "")
        if "skipped" in r:
            if r["skipped"] not in notes:
                notes.append(r["skipped"])
            out.append([str(r["size"]), name, f"skipped [{notes.index(r['skipped']) + 1}]",
                        "", "", "", ""])
            continue
        ratio = [f"{r[k]:.2f}x" if k in r else "-" for k in ("vs_numpy", "vs_cupy")]
        out.append([str(r["size"]), name, f"{r['seconds'] * 1e3:.3f}", f"{r[metric]:,.1f}",
                    *ratio, str(r["runs"])])
    text = table(["size", "backend", "ms (median)", label, "vs numpy", "vs cupy", "runs"], out, left=2)
    return "\n".join([text, *(f"  [{i}] {n}" for i, n in enumerate(notes, 1))])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_json:
        return child(args)
    check_xp_step()
    st = gpu_status()
    host = machine(("numpy", "numba", "numba-cuda", "cupy"))
    print("\n".join(machine_lines(host)))
    print(f"BLAS (numpy, and numba's np.dot through scipy): {blas_name()}")
    gpu = st["device"] if not st["cuda"] else f"none ({st['cuda']})"
    print(f"GPU: {gpu}; CuPy: {'yes' if not isinstance(st['cupy'], str) else st['cupy']}")
    print(f"timing per row: warm-up (at least {args.warmup} runs and {args.warmup_seconds:g} s) "
          f"excluded; then at least {args.min_runs} runs and {args.min_seconds:g} s timed; "
          f"median shown")
    if st["simulator"]:
        print("NOTE: the CUDA rows ran in numba's CUDA simulator: they check that the kernels run, "
              "they say nothing about a GPU's speed")
    rows = [r for b in args.backends for r in run_backend_alone(b, args)]
    rows.sort(key=lambda r: (r["size"], BACKENDS.index(r["backend"])))
    mm, mlp = ([r for r in rows if r["kind"] == kind] for kind in ("matmul", "mlp"))
    add_ratios(mm, "gflops")
    add_ratios(mlp, "samples_per_second")
    print("\nmatrix product C = A @ B, n x n float32 (size = n)")
    print(render(mm, "gflops", "GFLOP/s", st["simulator"]))
    print(f"\nMLP {'-'.join(map(str, MLP_WIDTHS))} forward + backward, one loss_and_grad (size = batch)")
    print(render(mlp, "samples_per_second", "samples/s", st["simulator"]))
    if args.json:
        doc = {"machine": host, "blas": blas_name(), "gpu": gpu, "simulator": st["simulator"],
               "timing": {"warmup": args.warmup, "warmup_seconds": args.warmup_seconds,
                          "min_runs": args.min_runs,
                          "min_seconds": args.min_seconds, "statistic": "median"},
               "rows": mm + mlp}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _backends(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or set(names) - set(BACKENDS):
        raise argparse.ArgumentTypeError(f"'{text}': choose from {','.join(BACKENDS)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive_ints, default=[1024, 2048, 4096], help="matmul n (default 1024,2048,4096)")
    p.add_argument("--batches", type=positive_ints, default=[256, 4096], help="MLP batch sizes (default 256,4096)")
    p.add_argument("--backends", type=_backends, default=list(BACKENDS),
                   help=f"which rows (default {','.join(BACKENDS)})")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per row, at least (default 2)")
    p.add_argument("--warmup-seconds", type=float, default=0.5,
                   help="untimed seconds per row, at least (default 0.5)")
    p.add_argument("--min-runs", type=int, default=3, help="timed runs per row, at least (default 3)")
    p.add_argument("--min-seconds", type=float, default=1.0, help="timed seconds per row, at least (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write every row (and the machine) as JSON")
    p.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
