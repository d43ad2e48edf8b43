"""Model-math kernels: the matrix product in GFLOP/s, an MLP training step in samples/s, the
reference CNN on one CPU thread against PyTorch, and the CNN on the GPU against cuDNN.

Rows, each on float32 data already where the kernel reads it, unless a row says otherwise:

  matmul   C = A @ B, n x n:
           numpy   np.dot, i.e. the BLAS numpy links (the CPU reference)
           cpu     pserver.kernels.cpu.dense_forward with a zero bias: numba's np.dot, the
                   same BLAS gemm, plus the bias pass
           cpu1    the same in a process where every library has one thread (one CPU core)
           cuda    pserver.kernels.cuda.matmul on device arrays, the kernel its tile_for picks;
                   checked against numpy before it is timed
           cuda-t16, cuda-b64k16p, cuda-b128k16pc
                   the same with every product forced to one kernel: t16 one element of C per
                   thread, b<tile>k<depth>[p][c] a register-blocked tile (BLOCKED_VARIANTS)
           cupy    cupy.matmul, i.e. cuBLAS (the GPU reference), when CuPy and a GPU are there;
                   fp32 math (CuPy uses TF32 only when CUPY_TF32=1, and the JSON says which)
  mlp      one loss_and_grad of the 784-256-256-10 MLP (forward, softmax cross-entropy,
           backward into the flat gradient), as the worker calls it:
           numpy   the "reference" backend (NumPy twins)
           cpu     the "cpu" backend (numba kernels); cpu1 the same on one core
           cuda*   the CUDA model, including its per-step copies: w, x, y to the device
                   and the gradient back, through pinned buffers; the h2d/compute/d2h column
                   splits its step by CUDA events (medians of 20 steps)
           cupy    the same math in CuPy, with the same copies (pageable memory)
  cnn      one forward + backward of the reference CNN (Conv2D(32, 3, relu) on 28x28x1,
           MaxPooling2D(2), Flatten, Dense(64, relu), Dense(10), softmax cross-entropy),
           in a process where every library has one thread:
           cpu     the numba CPU kernels, called as a Sequential calls them
           torch   the same network and weights in PyTorch (CPU, torch.set_num_threads(1)),
                   when torch is installed (pip install torch: a bench-only dependency);
                   checked to give our loss and gradients before anything is timed.
                   The two are timed in turn, so load from elsewhere falls on both.
  gpu-cnn  on a GPU with PyTorch: one Conv2D layer's forward + backward (conv2d rows, GFLOP/s)
           and the reference CNN's training step (samples/s), ours against cuDNN (fp32, TF32
           off); see gpu_cnn_rows.
  gpu-sweep on a GPU: every product variant (--sweep-matmul) at --sizes against cuBLAS, and
           every convolution kernel (--sweep-conv) at three layer shapes against cuDNN, each
           checked first; device time by CUDA events with the host's dispatch apart
           (DeviceClock); not in the default sections.

Each row: warm-up first, never timed (compilation, first touch, caches, BLAS threads waking),
until both --warmup runs and --warmup-seconds are reached; then timed runs until both
--min-runs and --min-seconds are; the table shows the median. Ratios are to the CPU reference
(numpy), to one CPU core (cpu1) and to the GPU reference (cupy).

    python bench/kernels.py                                   # 1024,2048,4096; batches 256,4096
    python bench/kernels.py --sizes 512 --batches 256         # quick
    .venv/bin/python bench/kernels.py --json kernels.json
    python bench/kernels.py --sections cnn --cnn-batches 64,256   # the CNN against PyTorch
    NUMBA_ENABLE_CUDASIM=1 python bench/kernels.py --sizes 32 --batches 256   # simulator smoke
    bash bench/gpu_check.sh OUT_DIR       # on a GPU machine: the CUDA tests, this, MNIST

With no GPU the CUDA and CuPy rows are skipped, and the output says why. Under numba's CUDA
simulator (NUMBA_ENABLE_CUDASIM=1) the CUDA rows run only for sizes up to 64 (one Python thread
per CUDA thread: a 4096^2 product would take days), say that they measure nothing about a GPU,
and the MLP's CUDA row is skipped (its 784-wide layer alone is thousands of simulated blocks).
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

import numpy as np

from pserver.observe.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, positive_ints, result_path, summary, table  # noqa: E402

MLP_WIDTHS = (784, 256, 256, 10)
SIM_MAX_SIZE = 64
# cuda-t16: the one-element-per-thread kernel; cuda-b<tile>k<depth>[p][c]: a register-blocked
# variant of pserver.kernels.cuda.BLOCKED_VARIANTS (tile side, strip depth, prefetch, runs of 4
# consecutive floats per thread), every
# product of the row forced to it; cuda alone: the kernel tile_for chooses per product.
# (The sweeps in bench/results/gpu/run-3 and run-4 timed twelve b* variants; see BLOCKED_VARIANTS.)
CUDA_KERNELS = ("t16", "b64k16p", "b128k16pc")
BACKENDS = ("numpy", "cpu", "cpu1", "cuda", *(f"cuda-{k}" for k in CUDA_KERNELS), "cupy", "torch")
# torch: the MLP's and the products' rows come from cupy (cuBLAS); torch times the CNN on the GPU.
SECTIONS = ("matmul", "mlp", "cnn", "gpu-cnn", "gpu-sweep")
DEFAULT_SECTIONS = ("matmul", "mlp", "cnn", "gpu-cnn")


# -- what there is to run on ---------------------------------------------------------------

def gpu_status() -> dict:
    """{"cuda": None or why not, "simulator": bool, "device": name, "cupy": module or why not}."""
    from pserver.errors import ConfigError
    from pserver.kernels.device import describe, is_simulator, parse_device, select
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


def step_split(fn, args) -> dict:
    """{"split_ms": medians of a GPU step's h2d/compute/d2h over >= 20 steps} if `fn` has a
    `split` (a step that returns its CUDA-event timings), else nothing."""
    if not hasattr(fn, "split"):
        return {}
    splits = [fn.split() for _ in range(max(args.min_runs, 20))]
    return {"split_ms": {k: summary([sp[k] for sp in splits])[0] for k in splits[0]}}


def split_text(split) -> str:
    return "/".join(f"{split[k]:.3f}" for k in ("h2d", "compute", "d2h")) if split else ""


# -- matrix products -------------------------------------------------------------------------

def matmul_row(backend: str, n: int, st: dict, rng):
    """(fn, sync) for C = A @ B of n x n float32 on `backend`, or a string saying why not."""
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    if backend == "numpy":
        c = np.empty((n, n), np.float32)
        return (lambda: np.dot(a, b, out=c)), _nothing
    if backend in ("cpu", "cpu1"):
        from pserver.kernels import cpu
        c, bias = np.empty((n, n), np.float32), np.zeros(n, np.float32)
        return (lambda: cpu.dense_forward(a, b, bias, c, False)), _nothing
    if backend == "torch":
        return "torch: CNN rows only (cupy is the cuBLAS reference)"
    if backend.startswith("cuda"):
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
        kernels.matmul(da, db, dc)
        want = np.dot(a, b)
        err = float(np.linalg.norm(dc.copy_to_host() - want) / np.linalg.norm(want))
        # float32 sums of n products: far under 1e-5 relative; a wrong kernel is far over it
        assert err < 1e-5, f"{backend} n={n}: relative error {err:.2e} against numpy"
        fn = lambda: kernels.matmul(da, db, dc)   # noqa: E731
        fn.rel_error = err
        return fn, cuda.synchronize
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
    if backend in ("numpy", "cpu", "cpu1"):
        model = host if backend == "numpy" else make_model(
            "mlp", MLP_WIDTHS[0], MLP_WIDTHS[-1], hidden=MLP_WIDTHS[1:-1], backend="cpu")
        return (lambda: model.loss_and_grad(w, x, y, g)), _nothing
    if backend == "torch":
        return "torch: CNN rows only (cupy is the cuBLAS reference)"
    if backend.startswith("cuda"):
        if st["cuda"]:
            return st["cuda"]
        if st["simulator"]:
            return "simulator: the 784-wide layer alone is thousands of simulated blocks per step"
        model = make_model("mlp", MLP_WIDTHS[0], MLP_WIDTHS[-1], hidden=MLP_WIDTHS[1:-1],
                           backend="cuda")

        def step():
            model.loss_and_grad(w, x, y, g)   # it waits for its copy
        # Where a step's time goes: CUDA events between upload, compute and download.
        step.split = lambda: model.loss_and_grad(w, x, y, g, timings=True)[1]
        return step, _nothing
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
    # The tensors in layout order: each layer's kernel, then its bias (whatever their names).
    p, d = (list(layout.views(a).values()) for a in (w, g))
    layers = len(p) // 2
    acts = [x]
    for i in range(layers):
        z = acts[-1] @ p[2 * i] + p[2 * i + 1]
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
        d[2 * i][...] = acts[i].T @ delta
        d[2 * i + 1][...] = delta.sum(axis=0)
        if i:
            delta = (delta @ p[2 * i].T) * (acts[i] > 0)
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


# -- the reference CNN ---------------------------------------------------------------------------
#
# Conv2D(32, 3, relu) on 28x28x1 -> MaxPooling2D(2) -> Flatten -> Dense(64, relu) -> Dense(10),
# softmax cross-entropy: one forward + backward, written straight on the CPU kernels (the way a
# Sequential calls them), against the same network in PyTorch, both on one thread.

CNN_IMAGE, CNN_FILTERS, CNN_KERNEL, CNN_POOL, CNN_HIDDEN, CNN_CLASSES = 28, 32, 3, 2, 64, 10
# Set before numpy, numba and torch load, in the child process that times the CNN.
ONE_THREAD = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                "NUMBA_NUM_THREADS")}


def glorot(rng, shape, fan_in, fan_out):
    limit = np.sqrt(6 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape).astype(np.float32)


class KernelCNN:
    """The reference CNN on `pserver.kernels.cpu`, its buffers allocated once per batch size."""

    def __init__(self, batch: int, rng):
        from pserver.kernels import conv_output
        k, f, h = CNN_KERNEL, CNN_FILTERS, CNN_HIDDEN
        self.conv_hw = conv_output(CNN_IMAGE, k, 1, "valid")[0]                # 26
        self.pool_hw = conv_output(self.conv_hw, CNN_POOL, CNN_POOL, "valid")[0]  # 13
        flat = self.pool_hw ** 2 * f
        self.params = {"w1": glorot(rng, (k, k, 1, f), k * k, k * k * f), "b1": np.zeros(f, np.float32),
                       "w2": glorot(rng, (flat, h), flat, h), "b2": np.zeros(h, np.float32),
                       "w3": glorot(rng, (h, CNN_CLASSES), h, CNN_CLASSES),
                       "b3": np.zeros(CNN_CLASSES, np.float32)}
        self.grads = {name: np.empty_like(v) for name, v in self.params.items()}
        conv, pool = (batch, self.conv_hw, self.conv_hw, f), (batch, self.pool_hw, self.pool_hw, f)
        self.a1, self.da1 = np.empty(conv, np.float32), np.empty(conv, np.float32)
        self.p, self.dp = np.empty(pool, np.float32), np.empty(pool, np.float32)
        self.argmax = np.empty(pool, np.int32)
        self.h, self.dh = np.empty((batch, h), np.float32), np.empty((batch, h), np.float32)
        self.logits = np.empty((batch, CNN_CLASSES), np.float32)
        self.dlogits = np.empty_like(self.logits)

    def step(self, x, y) -> float:
        """Loss of one batch; every parameter's gradient into self.grads."""
        from pserver.kernels import cpu as k
        p, g, n = self.params, self.grads, x.shape[0]
        k.conv2d_forward(x, p["w1"], p["b1"], self.a1, 1, 1, 0, 0, True)
        k.maxpool2d_forward(self.a1, self.p, self.argmax, CNN_POOL, CNN_POOL, CNN_POOL, CNN_POOL, 0, 0)
        flat, dflat = self.p.reshape(n, -1), self.dp.reshape(n, -1)
        k.dense_forward(flat, p["w2"], p["b2"], self.h, True)
        k.dense_forward(self.h, p["w3"], p["b3"], self.logits, False)
        loss = k.softmax_xent(self.logits, y, self.dlogits)
        k.dense_backward(self.h, p["w3"], self.dlogits, g["w3"], g["b3"], self.dh, True)
        k.dense_backward(flat, p["w2"], self.dh, g["w2"], g["b2"], dflat, False)
        k.maxpool2d_backward(self.dp, self.argmax, self.da1)
        k.activation_backward("relu", self.a1, self.da1, self.da1)
        k.conv2d_backward(x, p["w1"], self.da1, None, g["w1"], g["b1"], 1, 1, 0, 0)
        return loss


def torch_cnn(torch, cnn: KernelCNN):
    """The same network in PyTorch (NCHW, its native layout), with cnn's weights."""
    f, hw = CNN_FILTERS, cnn.pool_hw
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, f, CNN_KERNEL), torch.nn.ReLU(), torch.nn.MaxPool2d(CNN_POOL),
        torch.nn.Flatten(), torch.nn.Linear(hw * hw * f, CNN_HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(CNN_HIDDEN, CNN_CLASSES))
    p = cnn.params
    # Our Flatten reads (h, w, c) and torch's (c, h, w): reorder the dense layer's rows to match.
    w2 = p["w2"].reshape(hw, hw, f, -1).transpose(2, 0, 1, 3).reshape(hw * hw * f, -1)
    with torch.no_grad():
        for layer, w, b in ((net[0], p["w1"].transpose(3, 2, 0, 1), p["b1"]),
                            (net[4], w2.T, p["b2"]), (net[6], p["w3"].T, p["b3"])):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
            layer.bias.copy_(torch.from_numpy(b))
    return net


def cnn_pair(batch: int, rng):
    """{"cpu": step, "torch": step or the reason torch is absent}, checked equal first."""
    cnn = KernelCNN(batch, rng)
    x = rng.standard_normal((batch, CNN_IMAGE, CNN_IMAGE, 1), dtype=np.float32)
    y = rng.integers(0, CNN_CLASSES, batch).astype(np.int32)
    steps = {"cpu": lambda: cnn.step(x, y)}
    try:
        import torch
    except ImportError:
        steps["torch"] = "torch not installed (pip install torch)"
        return steps
    torch.set_num_threads(1)
    net, lossf = torch_cnn(torch, cnn), torch.nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(y.astype(np.int64))

    def torch_step():
        net.zero_grad(set_to_none=False)
        loss = lossf(net(tx), ty)
        loss.backward()
        return loss

    want = torch_step().item()
    assert abs(steps["cpu"]() - want) < 1e-4 * max(1.0, want), "the two CNNs differ"
    np.testing.assert_allclose(cnn.grads["w1"].transpose(3, 2, 0, 1), net[0].weight.grad.numpy(),
                               rtol=1e-3, atol=1e-5)
    steps["torch"] = torch_step
    return steps


def measure_interleaved(fns: dict, args) -> dict:
    """Median seconds per call of each fn, the fns timed in turn, so that load from elsewhere
    on the machine falls on all of them alike; warm-up as `measure`.

    Each call's CPU time (the process's, all threads) is kept beside its wall time: with one
    thread per library the work is the CPU time, and it counts no time spent waiting for a
    core that another process holds (wall time does; on a shared machine that is most of it).
    """
    start, done = time.perf_counter(), 0
    while done < args.warmup or time.perf_counter() - start < args.warmup_seconds:
        for fn in fns.values():
            fn()
        done += 1
    wall, cpu = ({name: [] for name in fns} for _ in range(2))
    start = time.perf_counter()
    while done < args.warmup + args.min_runs or time.perf_counter() - start < args.min_seconds:
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
        done += 1
    return {name: {**dict(zip(("seconds", "min_seconds", "max_seconds"), summary(wall[name]))),
                   "cpu_seconds": summary(cpu[name])[0], "runs": len(wall[name])}
            for name in fns}


def cnn_rows(args) -> list[dict]:
    rows = []
    for n in args.cnn_batches:
        steps = cnn_pair(n, np.random.default_rng(n))
        ready = {name: fn for name, fn in steps.items() if not isinstance(fn, str)}
        timed = measure_interleaved(ready, args)
        for name, fn in steps.items():
            row = {"kind": "cnn", "size": n, "backend": name}
            row.update({"skipped": fn} if isinstance(fn, str) else
                       {**timed[name], "samples_per_second": n / timed[name]["seconds"]})
            rows.append(row)
        print(f"  cnn {n}: " + ", ".join(f"{k} {v['seconds'] * 1e3:.3f} ms" for k, v in timed.items()),
              file=sys.stderr, flush=True)
    return rows


def run_cnn_alone(args) -> list[dict]:
    """The CNN rows, in a fresh process with one thread for every library (see ONE_THREAD)."""
    return _section_in_child(args, "--child-cnn-json", ONE_THREAD, "cnn")


def _section_in_child(args, flag: str, env: dict, kind: str, extra=()) -> list[dict]:
    """A section's rows, measured by a fresh process of this script (`flag` says which); if it
    fails, one row saying so (its traceback is above), so the other sections still count."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--cnn-batches",
                ",".join(map(str, args.cnn_batches)), *_timing_argv(args), *extra, flag, str(out)]
        r = subprocess.run(argv, env={**os.environ, **env})
        if r.returncode != 0:
            return [{"kind": kind, "skipped": f"the measuring process exited with {r.returncode}"}]
        return json.loads(out.read_text())


def render_cnn(rows: list[dict]) -> str:
    out, notes = [], []
    for r in rows:
        if "skipped" in r:
            notes.append(r["skipped"])
            out.append([str(r.get("size", "-")), r.get("backend", "-"), "skipped", "", "", "", "", ""])
            continue
        torch_row = next((b for b in rows if b["size"] == r["size"] and b["backend"] == "torch"
                          and "seconds" in b), None)
        ratios = [f"{torch_row[k] / r[k]:.2f}x" if torch_row else "-"
                  for k in ("seconds", "cpu_seconds")]
        out.append([str(r["size"]), r["backend"], f"{r['seconds'] * 1e3:.3f}",
                    f"{r['cpu_seconds'] * 1e3:.3f}", f"{r['samples_per_second']:,.0f}", *ratios,
                    str(r["runs"])])
    text = table(["batch", "backend", "wall ms", "CPU ms", "samples/s (wall)", "vs torch (wall)",
                  "vs torch (CPU)", "runs"], out, left=2)
    return "\n".join([text, *(f"  {n}" for n in dict.fromkeys(notes))])


# -- the CNN on the GPU: our kernels against cuDNN -------------------------------------------------
#
# Two tables (section gpu-cnn), float32 on both sides, TF32 off in PyTorch, cuDNN free to pick its
# fastest algorithm (cudnn.benchmark):
#   conv2d   one Conv2D layer's forward + backward (output, weight, bias and input gradients) on
#            device-resident data: pserver.kernels.cuda (channels-last) against
#            torch.nn.functional.conv2d (cuDNN, channels-first), checked equal first.
#   step     one training step of the reference CNN: ours is CudaModel.loss_and_grad as the
#            worker calls it (weights and batch up, gradient down, through pinned buffers), with
#            its compute part from CUDA events beside it; torch's is forward + backward on data
#            already on the GPU (no copies): its numbers favour torch.

# (name, input h = w, channels, filters, kernel, padding): the reference CNN's convolution, and the
# shape a second convolution would have after its pooling.
GPU_CONVS = (("conv1 28x28x1->32", 28, 1, 32, 3, "valid"), ("conv2 13x13x32->64", 13, 32, 64, 3, "same"))


def torch_gpu_status():
    """(torch, None) or (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    if not torch.cuda.is_available():
        return None, "torch sees no GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    return torch, None


def gpu_baselines() -> dict:
    """The GPU reference libraries' versions and math modes, as measured rows name them."""
    out = {}
    torch, why = torch_gpu_status()
    if torch:
        out["torch"] = {"version": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                        "cuda": torch.version.cuda, "allow_tf32": {
                            "matmul": torch.backends.cuda.matmul.allow_tf32,
                            "cudnn": torch.backends.cudnn.allow_tf32}}
    else:
        out["torch"] = why
    try:
        import cupy
        from cupy_backends.cuda.libs import cublas
        out["cupy"] = {"version": cupy.__version__,
                       "cublas": cublas.getVersion(cupy.cuda.device.get_cublas_handle()),
                       "CUPY_TF32": os.environ.get("CUPY_TF32", "0 (unset: fp32 math)")}
    except Exception as e:  # noqa: BLE001 - not there, or no GPU: say so
        out["cupy"] = f"{type(e).__name__}: {e}".splitlines()[0]
    try:
        from numba import cuda
        dev = cuda.get_current_device()
        out["gpu"] = {"name": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
                      "compute_capability": list(dev.compute_capability),
                      "multiprocessors": dev.MULTIPROCESSOR_COUNT,
                      # the CUDA version the driver supports (nvidia-smi gives its own number)
                      "driver_cuda_version": ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))}
    except Exception as e:  # noqa: BLE001
        out["gpu"] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


def conv_pair(torch, n: int, hw: int, c: int, f: int, k: int, pad: str, rng):
    """{"cuda": fn, "torch": fn}, each one conv forward + backward, checked equal first."""
    from numba import cuda

    from pserver.kernels import conv_output
    from pserver.kernels import cuda as K
    oh, top = conv_output(hw, k, 1, pad)
    x = rng.standard_normal((n, hw, hw, c), dtype=np.float32)
    w = (rng.standard_normal((k, k, c, f)) / np.sqrt(k * k * c)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    dy = rng.standard_normal((n, oh, oh, f), dtype=np.float32)
    dx_, dw_, db_ = (cuda.device_array(s, np.float32) for s in (x.shape, w.shape, (f,)))
    xd, wd, bd, dyd = (cuda.to_device(a) for a in (x, w, b, dy))
    out = cuda.device_array(dy.shape, np.float32)

    def ours():
        K.conv2d_forward(xd, wd, bd, out, 1, 1, top, top, False)
        K.conv2d_backward(xd, wd, dyd, dx_, dw_, db_, 1, 1, top, top)

    dev = torch.device("cuda")
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).to(dev).requires_grad_(True)
    wt = torch.from_numpy(w.transpose(3, 2, 0, 1).copy()).to(dev).requires_grad_(True)
    bt = torch.from_numpy(b).to(dev).requires_grad_(True)
    dyt = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy()).to(dev)
    F = torch.nn.functional

    def theirs():
        for t in (xt, wt, bt):
            t.grad = None
        yt = F.conv2d(xt, wt, bt, padding=top)
        yt.backward(dyt)
        return yt

    yt = theirs()
    ours()
    cuda.synchronize()
    torch.cuda.synchronize()
    rel = lambda got, want: float(np.linalg.norm(got - want) / np.linalg.norm(want))  # noqa: E731
    errs = {"out": rel(out.copy_to_host(), yt.detach().cpu().numpy().transpose(0, 2, 3, 1)),
            "dw": rel(dw_.copy_to_host(), wt.grad.cpu().numpy().transpose(2, 3, 1, 0)),
            "db": rel(db_.copy_to_host(), bt.grad.cpu().numpy()),
            "dx": rel(dx_.copy_to_host(), xt.grad.cpu().numpy().transpose(0, 2, 3, 1))}
    assert max(errs.values()) < 1e-3, f"conv2d differs from cuDNN: {errs}"
    flops = 3 * 2 * n * oh * oh * f * k * k * c     # forward, weight and input gradients
    syncs = {"cuda": cuda.synchronize, "torch": torch.cuda.synchronize}
    return {"cuda": ours, "torch": theirs}, syncs, flops, errs


def cnn_step_pair(torch, n: int, rng):
    """{"cuda": our worker's step, "torch": forward + backward on device-resident data}."""
    from pserver.models import make_model
    model = make_model("cnn", (CNN_IMAGE, CNN_IMAGE, 1), CNN_CLASSES, backend="cuda")
    cpu = make_model("cnn", (CNN_IMAGE, CNN_IMAGE, 1), CNN_CLASSES, backend="cpu")
    w = model.init_params(n)
    g, g_cpu = np.empty_like(w), np.empty_like(w)
    x = rng.standard_normal((n, CNN_IMAGE, CNN_IMAGE, 1), dtype=np.float32)
    y = rng.integers(0, CNN_CLASSES, n).astype(np.int32)
    loss, loss_cpu = model.loss_and_grad(w, x, y, g), cpu.loss_and_grad(w, x, y, g_cpu)
    assert abs(loss - loss_cpu) < 1e-4 * max(1.0, loss_cpu), (loss, loss_cpu)
    assert np.linalg.norm(g - g_cpu) < 1e-4 * np.linalg.norm(g_cpu), "GPU and CPU gradients differ"

    def ours():
        model.loss_and_grad(w, x, y, g)
    ours.split = lambda: model.loss_and_grad(w, x, y, g, timings=True)[1]

    kc = KernelCNN(n, rng)    # the same network, torch's layout (see torch_cnn)
    net = torch_cnn(torch, kc).cuda()
    lossf = torch.nn.CrossEntropyLoss()
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).cuda()
    yt = torch.from_numpy(y.astype(np.int64)).cuda()

    def theirs():
        net.zero_grad(set_to_none=False)
        lossf(net(xt), yt).backward()

    return {"cuda": ours, "torch": theirs}, {"cuda": _nothing, "torch": torch.cuda.synchronize}


def gpu_cnn_rows(args) -> list[dict]:
    torch, why = torch_gpu_status()
    st = gpu_status()
    if st["cuda"] or st["simulator"] or torch is None:
        reason = st["cuda"] or ("the CUDA simulator is on" if st["simulator"] else why)
        return [{"kind": "gpu-cnn", "skipped": reason}]
    rows = []
    for n in args.cnn_batches:
        for name, hw, c, f, k, pad in GPU_CONVS:
            fns, syncs, flops, errs = conv_pair(torch, n, hw, c, f, k, pad, np.random.default_rng(n))
            for backend, fn in fns.items():
                r = measure(fn, syncs[backend], args)
                rows.append({"kind": "conv2d", "size": n, "layer": name, "backend": backend, **r,
                             "gflops": flops / r["seconds"] / 1e9, "rel_error_vs_cudnn": errs})
                print(f"  conv2d {name} batch {n} {backend}: {r['seconds'] * 1e3:.3f} ms",
                      file=sys.stderr, flush=True)
        fns, syncs = cnn_step_pair(torch, n, np.random.default_rng(n))
        for backend, fn in fns.items():
            r = {"kind": "cnn-step", "size": n, "backend": backend, **measure(fn, syncs[backend], args)}
            r["samples_per_second"] = n / r["seconds"]
            r.update(step_split(fn, args))
            rows.append(r)
            print(f"  cnn step batch {n} {backend}: {r['seconds'] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    return rows


def run_gpu_cnn_alone(args) -> list[dict]:
    return _section_in_child(args, "--child-gpu-cnn-json", {}, "gpu-cnn")


def render_gpu_cnn(rows: list[dict]) -> str:
    if rows and "skipped" in rows[0]:
        return f"  skipped: {rows[0]['skipped']}"
    out = []
    for r in rows:
        what = r.get("layer", "whole step")
        base = next((b for b in rows if b["kind"] == r["kind"] and b["size"] == r["size"]
                     and b.get("layer") == r.get("layer") and b["backend"] == "torch"), None)
        out.append([str(r["size"]), what, r["backend"], f"{r['seconds'] * 1e3:.3f}",
                    f"{r['gflops']:,.0f}" if "gflops" in r else f"{r['samples_per_second']:,.0f}",
                    f"{base['seconds'] / r['seconds']:.2f}x" if base else "-",
                    split_text(r.get("split_ms")),
                    str(r["runs"])])
    return table(["batch", "what", "backend", "ms (median)", "GFLOP/s | samples/s", "vs torch",
                  "h2d/compute/d2h ms", "runs"], out, left=2)


# -- the GPU sweep: every variant against cuBLAS and cuDNN, device time apart from dispatch --------
#
# Section gpu-sweep (issue 36). Each kernel is checked first (matmul against cuBLAS's product,
# or numpy's without CuPy; convolutions against cuDNN's output and gradients, or the NumPy twins
# without PyTorch), then timed by DeviceClock: device milliseconds per call from CUDA events,
# and the host's milliseconds per call (Python and the launches: dispatch) apart.

# Run 8's (issue 36, second round): the defaults before it (b64k16p, g128k8cr2, g128x64k8c) and
# the new variants (run-7's sweeps are in bench/results/gpu/run-7).
SWEEP_MATMUL = ("b64k16p", "g128k8cr2", "g128x64k8c", "g128k8cwr2", "g128k8dcwr2", "g128x64k8cw",
                "g128x64k8cwr2", "g128x64k16cwr2", "g128k8cr2s2", "g128k8cr2s4", "g128k8cr2sa",
                "g128k8cwr2s4", "g128k8cwr2sa", "g128x64k8cs2", "g128x64k8cws2", "g64k16cs2")
SWEEP_CONV = ("g64k16", "g128x64k8c", "g128x64k8cr2", "g128x64k8cw", "g128x64k8cwr2", "g128x64k16cwr2")
# (name, batch, h = w, channels, filters, kernel, padding, input gradient): the reference CNN's
# second-layer shape as run-2 timed it, a 3x3 64 -> 64 layer, and the first layer (no dx).
SWEEP_CONVS = (("conv2 13x13x32->64", 256, 13, 32, 64, 3, "same", True),
               ("3x3 28x28x64->64", 256, 28, 64, 64, 3, "same", True),
               ("conv1 28x28x1->32", 256, 28, 1, 32, 3, "valid", False))


class DeviceClock:
    """Device time per call by CUDA events around `reps` calls, with the host's time per call
    (dispatch) apart. A one-thread kernel first holds the GPU (nanosleep) while the host
    queues the calls, so the events see the kernels back to back: launch gaps from a slow
    dispatch do not count as device time. `gapped` says the host outran the hold (the device
    time then includes gaps; it is an upper bound)."""

    def __init__(self):
        from numba import cuda
        self.cuda = cuda
        self.hold = None
        if not cuda.config.ENABLE_CUDASIM:
            @cuda.jit
            def hold(n):
                for _ in range(n):
                    cuda.nanosleep(1000)

            self.hold = hold
            hold[1, 1](1)
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            hold[1, 1](2000)
            e1.record()
            e1.synchronize()
            self.ms_per_iter = max(e0.elapsed_time(e1) / 2000, 1e-4)

    def time(self, fn, target_s=0.04, repeats=3) -> dict:
        cuda = self.cuda
        for _ in range(2):                    # warm-up: compiles, cuDNN's autotuning, caches
            fn()
        cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        one = time.perf_counter() - t0
        reps = int(min(200, max(5, target_s / max(one, 1e-6))))
        devs, hosts, gapped = [], [], False
        for _ in range(repeats):
            h0, e0, e1 = cuda.event(), cuda.event(), cuda.event()
            h0.record()
            if self.hold is not None:
                ms = min(1.5 * reps * one * 1e3 + 2.0, 800.0)
                self.hold[1, 1](int(ms / self.ms_per_iter))
            e0.record()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            host = time.perf_counter() - t0
            e1.record()
            e1.synchronize()
            held = h0.elapsed_time(e0)
            gapped = gapped or host * 1e3 > held
            devs.append(e0.elapsed_time(e1) / reps)
            hosts.append(host * 1e3 / reps)
        return {"device_ms": float(np.median(devs)), "host_ms": float(np.median(hosts)),
                "device_ms_min": float(min(devs)), "reps": reps, "gapped": gapped}


def _rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def sweep_matmul_rows(clock, cp, sizes, variants) -> list[dict]:
    from numba import cuda

    from pserver.kernels import cuda as K
    from pserver.kernels import cuda_gemm as G
    rows = []
    for n in sizes:
        rng = np.random.default_rng(n)
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        da, db, dc = cuda.to_device(a), cuda.to_device(b), cuda.device_array((n, n), np.float32)
        fns = {}
        for v in variants:
            if v in K.BLOCKED_VARIANTS:
                fns[v] = lambda v=v: K.matmul_tiled(da, db, dc, False, False, v)
            else:
                fns[v] = lambda v=v: G.matmul(da, db, dc, False, False, v)
        if cp is not None:
            ca, cb, cc = cp.asarray(a), cp.asarray(b), cp.empty((n, n), cp.float32)
            want = cp.asnumpy(cp.matmul(ca, cb))
            fns["cublas"] = lambda: cp.matmul(ca, cb, out=cc)
        else:
            want = a @ b
        for name, fn in fns.items():
            err = 0.0
            if name != "cublas":
                dc.copy_to_device(np.full((n, n), np.nan, np.float32))
                fn()
                err = _rel(dc.copy_to_host(), want)
                if not err < 1e-5:
                    rows.append({"kind": "sweep-matmul", "size": n, "variant": name,
                                 "skipped": f"wrong: relative error {err:.2e}"})
                    print(f"  sweep matmul {n} {name}: WRONG ({err:.2e})", file=sys.stderr, flush=True)
                    continue
            r = {"kind": "sweep-matmul", "size": n, "variant": name, "rel_error": err,
                 **clock.time(fn)}
            r["gflops"] = 2 * n ** 3 / r["device_ms"] / 1e6
            rows.append(r)
            print(f"  sweep matmul {n} {name}: {json.dumps(r)}", file=sys.stderr, flush=True)
    return rows


def _conv_case(torch, spec, rng):
    """Host arrays, our device arrays and a torch closure for one convolution shape, and the
    wanted results (cuDNN's, else the NumPy twins')."""
    from pserver.kernels import conv_output, reference
    name, n, hw, c, f, k, pad, with_dx = spec
    oh, top = conv_output(hw, k, 1, pad)
    x = rng.standard_normal((n, hw, hw, c), dtype=np.float32)
    w = (rng.standard_normal((k, k, c, f)) / np.sqrt(k * k * c)).astype(np.float32)
    b = rng.standard_normal(f).astype(np.float32)
    dy = rng.standard_normal((n, oh, oh, f), dtype=np.float32)
    want = {"out": np.empty(dy.shape, np.float32), "dw": np.empty_like(w), "db": np.empty_like(b),
            "dx": np.empty_like(x) if with_dx else None}
    theirs = None
    if torch is not None:
        dev = torch.device("cuda")
        xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).to(dev).requires_grad_(with_dx)
        wt = torch.from_numpy(w.transpose(3, 2, 0, 1).copy()).to(dev).requires_grad_(True)
        bt = torch.from_numpy(b).to(dev).requires_grad_(True)
        dyt = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy()).to(dev)

        def theirs():
            for t in (xt, wt, bt):
                t.grad = None
            yt = torch.nn.functional.conv2d(xt, wt, bt, padding=top)
            yt.backward(dyt)
            return yt

        def theirs_forward():
            with torch.no_grad():
                torch.nn.functional.conv2d(xt, wt, bt, padding=top)

        theirs.forward = theirs_forward
        yt = theirs()
        torch.cuda.synchronize()
        want["out"] = yt.detach().cpu().numpy().transpose(0, 2, 3, 1)
        want["dw"] = wt.grad.cpu().numpy().transpose(2, 3, 1, 0)
        want["db"] = bt.grad.cpu().numpy()
        if with_dx:
            want["dx"] = xt.grad.cpu().numpy().transpose(0, 2, 3, 1)
    else:
        reference.conv2d_forward(x, w, b, want["out"], 1, 1, top, top, False)
        reference.conv2d_backward(x, w, dy, want["dx"], want["dw"], want["db"], 1, 1, top, top)
    flops = (3 if with_dx else 2) * 2 * n * oh * oh * f * k * k * c
    return (x, w, b, dy, top), want, theirs, flops


def sweep_conv_rows(clock, torch, specs, variants) -> list[dict]:
    from numba import cuda

    from pserver.kernels import cuda as K
    from pserver.kernels import cuda_gemm as G
    rows = []
    for spec in specs:
        name = spec[0]
        (x, w, b, dy, top), want, theirs, flops = _conv_case(torch, spec, np.random.default_rng(spec[1]))
        xd, wd, bd, dyd = (cuda.to_device(a) for a in (x, w, b, dy))
        bufs = {k: cuda.device_array(v.shape, np.float32) for k, v in want.items() if v is not None}
        dx = bufs.get("dx")
        for v in variants:
            K.CONV_KERNEL = v

            def fwd():
                K.conv2d_forward(xd, wd, bd, bufs["out"], 1, 1, top, top, False)

            def bwd():
                K.conv2d_backward(xd, wd, dyd, dx, bufs["dw"], bufs["db"], 1, 1, top, top)

            def both():
                fwd()
                bwd()

            for buf in bufs.values():
                buf.copy_to_device(np.full(buf.shape, np.nan, np.float32))
            both()
            errs = {k: _rel(buf.copy_to_host(), want[k]) for k, buf in bufs.items()}
            row = {"kind": "sweep-conv", "layer": name, "size": spec[1], "variant": v, "rel_error": errs}
            if not max(errs.values()) < 1e-4:
                rows.append({**row, "skipped": f"wrong: {errs}"})
                print(f"  sweep conv {name} {v}: WRONG {errs}", file=sys.stderr, flush=True)
                continue
            row.update(clock.time(both))
            row["gflops"] = flops / row["device_ms"] / 1e6
            parts = {"forward": fwd}
            if v != "direct":
                parts["weight_grad"] = lambda v=v: G.conv2d_weight_grad(
                    xd, dyd, bufs["dw"], bufs["db"], 1, 1, top, top, v)
                if dx is not None:
                    parts["input_grad"] = lambda v=v: G.conv2d_input_grad(wd, dyd, dx, 1, 1, top, top, v)
            row["parts_device_ms"] = {k: clock.time(fn, repeats=2)["device_ms"] for k, fn in parts.items()}
            rows.append(row)
            print(f"  sweep conv {name} {v}: {json.dumps(row)}", file=sys.stderr, flush=True)
        K.CONV_KERNEL = "igemm"
        if theirs is not None:
            row = {"kind": "sweep-conv", "layer": name, "size": spec[1], "variant": "cudnn",
                   **clock.time(theirs)}
            row["gflops"] = flops / row["device_ms"] / 1e6
            row["parts_device_ms"] = {"forward": clock.time(theirs.forward, repeats=2)["device_ms"]}
            rows.append(row)
            print(f"  sweep conv {name} cudnn: {json.dumps(row)}", file=sys.stderr, flush=True)
    return rows


def gpu_sweep_rows(args) -> list[dict]:
    st = gpu_status()
    if st["cuda"]:
        return [{"kind": "gpu-sweep", "skipped": st["cuda"]}]
    torch, why = torch_gpu_status() if not st["simulator"] else (None, "simulator")
    cp = None if isinstance(st["cupy"], str) or st["simulator"] else st["cupy"]
    clock = DeviceClock()
    specs = SWEEP_CONVS
    if st["simulator"]:   # a smoke run: the same code on shapes the simulator gets through
        specs = tuple((nm, 2, 5, min(c, 3), min(f, 4), k, pad, dx) for nm, _, _, c, f, k, pad, dx in specs)
    rows = sweep_matmul_rows(clock, cp, args.sizes, args.sweep_matmul)
    rows += sweep_conv_rows(clock, torch, specs, args.sweep_conv)
    for r in rows:
        base = next((b for b in rows if b["kind"] == r["kind"] and b.get("size") == r.get("size")
                     and b.get("layer") == r.get("layer") and b["variant"] in ("cublas", "cudnn")
                     and "device_ms" in b), None)
        if base and "device_ms" in r:
            r["vs_baseline"] = base["device_ms"] / r["device_ms"]
    return rows


def run_gpu_sweep_alone(args) -> list[dict]:
    extra = ["--sizes", ",".join(map(str, args.sizes)), "--sweep-matmul", ",".join(args.sweep_matmul),
             "--sweep-conv", ",".join(args.sweep_conv)]
    return _section_in_child(args, "--child-gpu-sweep-json", {}, "gpu-sweep", extra)


def render_gpu_sweep(rows: list[dict]) -> str:
    if rows and "skipped" in rows[0] and "variant" not in rows[0]:
        return f"  skipped: {rows[0]['skipped']}"
    out = []
    for r in rows:
        what = r.get("layer") or f"matmul {r['size']}"
        if "skipped" in r:
            out.append([what, r["variant"], r["skipped"][:60], "", "", "", "", ""])
            continue
        parts = "/".join(f"{v:.3f}" for v in r.get("parts_device_ms", {}).values())
        out.append([what, r["variant"], f"{r['device_ms']:.3f}", f"{r['host_ms']:.3f}", f"{r['gflops']:,.0f}",
                    f"{r['vs_baseline']:.2f}x" if "vs_baseline" in r else "-", parts,
                    f"{r['reps']}{' gapped' if r['gapped'] else ''}"])
    return table(["what", "variant", "device ms", "host ms", "GFLOP/s", "vs cuBLAS|cuDNN",
                  "fwd/wgrad/dgrad ms", "reps"], out, left=2)


# -- report ------------------------------------------------------------------------------------

def run_rows(kind: str, sizes, st: dict, args) -> list[dict]:
    rows, build = [], matmul_row if kind == "matmul" else mlp_row
    for n in track(sizes, f"{kind} sizes"):
        for backend in args.backends:
            made = build(backend, n, st, np.random.default_rng(n))
            row = {"kind": kind, "size": n, "backend": backend}
            if isinstance(made, str):
                rows.append({**row, "skipped": made})
                continue
            row.update(measure(*made, args))
            if hasattr(made[0], "rel_error"):
                row["rel_error_vs_numpy"] = made[0].rel_error
            row.update(step_split(made[0], args))
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
                "--sections", ",".join(args.sections), *_timing_argv(args), "--child-json", str(out)]
        # cpu1: the CPU kernels on one core (every library one thread), the baseline
        # for a GPU step.
        r = subprocess.run(argv, env={**os.environ, **(ONE_THREAD if backend == "cpu1" else {})})
        if r.returncode != 0:     # its traceback is above; the other backends' rows still count
            why = f"{backend}: the measuring process exited with {r.returncode}"
            return [{"kind": kind, "size": n, "backend": backend, "skipped": why}
                    for kind, sizes in (("matmul", args.sizes), ("mlp", args.batches))
                    if kind in args.sections for n in sizes]
        return json.loads(out.read_text())


def _timing_argv(args) -> list[str]:
    return ["--warmup", str(args.warmup), "--warmup-seconds", str(args.warmup_seconds),
            "--min-runs", str(args.min_runs), "--min-seconds", str(args.min_seconds)]


def child(args) -> int:
    """--child-json: measure args.backends here, write the rows, print nothing on stdout."""
    st = gpu_status() if any(b.startswith(("cuda", "cupy", "torch")) for b in args.backends) else {}
    forced = [b[len("cuda-"):] for b in args.backends if b.startswith("cuda-")]
    if forced and not st.get("cuda"):
        from pserver.kernels import cuda as kernels
        # one backend per child process
        kernels.FORCE_TILE = int(forced[0][1:]) if forced[0].startswith("t") else forced[0]
    rows = [r for kind, sizes in (("matmul", args.sizes), ("mlp", args.batches))
            if kind in args.sections for r in run_rows(kind, sizes, st, args)]
    Path(args.child_json).write_text(json.dumps(rows))
    return 0


def add_ratios(rows: list[dict], metric: str) -> None:
    for r in rows:
        for ref in ("numpy", "cpu1", "cupy"):
            base = next((b for b in rows if b["size"] == r["size"] and b["backend"] == ref
                         and metric in b), None)
            if base and metric in r:
                r[f"vs_{ref}"] = r[metric] / base[metric]


def render(rows: list[dict], metric: str, label: str, sim: bool) -> str:
    """The table, with each distinct reason for a skipped row once, as a note below it."""
    out, notes = [], []
    for r in rows:
        name = r["backend"] + (" (simulator)" if sim and r["backend"].startswith("cuda") else "")
        if "skipped" in r:
            if r["skipped"] not in notes:
                notes.append(r["skipped"])
            out.append([str(r["size"]), name, f"skipped [{notes.index(r['skipped']) + 1}]",
                        "", "", "", "", "", ""])
            continue
        ratio = [f"{r[k]:.2f}x" if k in r else "-" for k in ("vs_numpy", "vs_cpu1", "vs_cupy")]
        out.append([str(r["size"]), name, f"{r['seconds'] * 1e3:.3f}", f"{r[metric]:,.1f}",
                    *ratio, split_text(r.get("split_ms")),
                    str(r["runs"])])
    text = table(["size", "backend", "ms (median)", label, "vs numpy", "vs cpu1", "vs cupy",
                  "h2d/compute/d2h ms", "runs"], out, left=2)
    return "\n".join([text, *(f"  [{i}] {n}" for i, n in enumerate(notes, 1))])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_json:
        return child(args)
    if args.child_cnn_json:
        Path(args.child_cnn_json).write_text(json.dumps(cnn_rows(args)))
        return 0
    if args.child_gpu_cnn_json:
        Path(args.child_gpu_cnn_json).write_text(json.dumps(gpu_cnn_rows(args)))
        return 0
    if args.child_gpu_sweep_json:
        Path(args.child_gpu_sweep_json).write_text(json.dumps(gpu_sweep_rows(args)))
        return 0
    check_xp_step()
    st = gpu_status()
    host = machine(("numpy", "numba", "numba-cuda", "cupy-cuda12x", "cupy-cuda13x", "torch"))
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
    rows = [r for b in args.backends if {"matmul", "mlp"} & set(args.sections) and b != "torch"
            for r in run_backend_alone(b, args)]
    rows.sort(key=lambda r: (r["size"], BACKENDS.index(r["backend"])))
    mm, mlp = ([r for r in rows if r["kind"] == kind] for kind in ("matmul", "mlp"))
    add_ratios(mm, "gflops")
    add_ratios(mlp, "samples_per_second")
    if mm:
        print("\nmatrix product C = A @ B, n x n float32 (size = n)")
        print(render(mm, "gflops", "GFLOP/s", st["simulator"]))
    if mlp:
        print(f"\nMLP {'-'.join(map(str, MLP_WIDTHS))} forward + backward, one loss_and_grad "
              f"(size = batch)")
        print(render(mlp, "samples_per_second", "samples/s", st["simulator"]))
    cnn = run_cnn_alone(args) if "cnn" in args.sections else []
    if cnn:
        print("\nreference CNN (Conv2D 32x3x3 relu, MaxPool 2, Dense 64 relu, Dense 10) forward + "
              "backward on one thread (size = batch; medians of wall and CPU time per step)")
        print(render_cnn(cnn))
    sweep = run_gpu_sweep_alone(args) if "gpu-sweep" in args.sections else []
    if sweep:
        print("\nthe GPU sweep: each variant's device time (CUDA events, calls queued back to back) "
              "and host time per call (dispatch), against cuBLAS (CuPy) and cuDNN (PyTorch), fp32")
        print(render_gpu_sweep(sweep))
    gcnn = run_gpu_cnn_alone(args) if "gpu-cnn" in args.sections else []
    if gcnn:
        print("\nthe CNN on the GPU: one Conv2D layer forward + backward (GFLOP/s), and the reference "
              "CNN's whole training step (samples/s), against PyTorch with cuDNN (fp32, TF32 off)")
        print(render_gpu_cnn(gcnn))
    baselines = gpu_baselines() if not st["cuda"] and not st["simulator"] else {}
    if baselines:
        print(f"GPU reference libraries: {json.dumps(baselines)}")
    doc = {"machine": host, "blas": blas_name(), "gpu": gpu, "simulator": st["simulator"],
           "gpu_baselines": baselines,
           "timing": {"warmup": args.warmup, "warmup_seconds": args.warmup_seconds,
                      "min_runs": args.min_runs,
                      "min_seconds": args.min_seconds, "statistic": "median"},
           "rows": mm + mlp + cnn + sweep + gcnn}
    path = result_path(args.json, "kernels.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def _names(text: str, choices) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or set(names) - set(choices):
        raise argparse.ArgumentTypeError(f"'{text}': choose from {','.join(choices)}")
    return names


def _backends(text: str) -> list[str]:
    return _names(text, BACKENDS)


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _sections(text: str) -> list[str]:
    return _names(text, SECTIONS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive_ints, default=[1024, 2048, 4096],
                   help="matmul n (default 1024,2048,4096)")
    p.add_argument("--batches", type=positive_ints, default=[256, 4096],
                   help="MLP batch sizes (default 256,4096)")
    p.add_argument("--backends", type=_backends, default=list(BACKENDS),
                   help=f"which rows (default {','.join(BACKENDS)})")
    p.add_argument("--cnn-batches", type=positive_ints, default=[64, 256],
                   help="reference CNN batch sizes (default 64,256)")
    p.add_argument("--sections", type=_sections, default=list(DEFAULT_SECTIONS),
                   help=f"which tables: {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)})")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per row, at least (default 2)")
    p.add_argument("--warmup-seconds", type=float, default=0.5,
                   help="untimed seconds per row, at least (default 0.5)")
    p.add_argument("--min-runs", type=int, default=3, help="timed runs per row, at least (default 3)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="timed seconds per row, at least (default 1)")
    p.add_argument("--json", metavar="PATH", help="write every row (and the machine) as JSON here "
                                                  "(default results/kernels.json)")
    p.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--child-cnn-json", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--child-gpu-cnn-json", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--child-gpu-sweep-json", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--sweep-matmul", type=_list, default=list(SWEEP_MATMUL),
                   help=f"gpu-sweep's product variants (default {','.join(SWEEP_MATMUL)})")
    p.add_argument("--sweep-conv", type=_list, default=list(SWEEP_CONV),
                   help=f"gpu-sweep's convolution kernels (default {','.join(SWEEP_CONV)})")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
