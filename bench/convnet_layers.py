"""Where a training step of keras.io's mnist_convnet spends its time, layer by layer: pserver's
CPU kernels against TensorFlow's (oneDNN) on the same shapes, one thread each, in one run.

The model (bench/keras_mnist_convnet.py): Conv2D(32, 3, relu) on 28x28x1, MaxPooling2D(2),
Conv2D(64, 3, relu), MaxPooling2D(2), Flatten, Dropout(0.5), Dense(10) with softmax
cross-entropy. Each layer's forward and its backward (the weights' gradients and, but for the
first layer, its input's) are timed alone on the batch size given, warm, as the median of
--runs; GFLOP/s counts a convolution's or a dense layer's multiply-adds as 2 flops (backward:
twice the forward's, one product for the weights and one for the input). A backward is timed
as a training step runs it: right after its own forward pass (not timed), so a convolution
starts from the im2col matrix that pass kept.

    python bench/convnet_layers.py --tf-python /path/to/tf-venv/bin/python --json out.json
    python bench/convnet_layers.py --baseline /tmp/old-pserver --rounds 5    # old kernels beside

The TensorFlow side runs in that interpreter, in a process of its own, the layers as
tf.keras layers under a tf.function each (forward alone; forward and tape.gradient for the
backward, whose forward part is subtracted), with TF_NUM_INTRAOP_THREADS=1 and one inter-op
thread; pserver's side with NUMBA_NUM_THREADS=1 and one BLAS thread, in a process of its own
too, importing pserver from this checkout or, for the --baseline side, from the directory
given (another checkout: a change's before and after, measured in turn). With --rounds N the
sides take turns N times, so load from elsewhere falls on all of them; a layer's time is then
the median of its rounds' medians. Each side's instruction set: pserver's numba targets this
CPU (cpu_id.isa), oneDNN's is what ONEDNN_VERBOSE reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ONE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in ONE_THREAD.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | ONE_THREAD)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_lines, table  # noqa: E402

# (name, forward multiply-adds per sample): the layers in order.
LAYERS = [("conv2d 1->32", 26 * 26 * 32 * 9 * 1), ("max_pooling2d", 0),
          ("conv2d 32->64", 11 * 11 * 64 * 9 * 32), ("max_pooling2d_1", 0), ("flatten", 0),
          ("dropout", 0), ("dense 1600->10", 1600 * 10)]

PARTS = ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s")

TF_SIDE = r"""
import json, os, sys, time
import numpy as np
import tensorflow as tf
batch, runs = int(sys.argv[1]), int(sys.argv[2])
L = tf.keras.layers
layers = [L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(2), L.Conv2D(64, 3, activation="relu"),
          L.MaxPooling2D(2), L.Flatten(), L.Dropout(0.5), L.Dense(10)]
x = tf.random.uniform((batch, 28, 28, 1))
ins = []
for layer in layers:
    ins.append(x)
    x = layer(x, training=True)
def median_time(fn):
    for _ in range(5):
        fn()
    times, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
    return float(np.median(times)), float(np.median(cpu))
out = []
for i, (layer, inp) in enumerate(zip(layers, ins)):
    fwd = tf.function(lambda inp=inp, layer=layer: layer(inp, training=True))
    @tf.function
    def both(inp=inp, layer=layer, first=(i == 0)):
        with tf.GradientTape() as tape:
            tape.watch(inp)
            y = layer(inp, training=True)
            s = tf.reduce_sum(y * y)
        return tape.gradient(s, layer.trainable_weights + ([] if first else [inp]))
    (f, fc), (fb, fbc) = median_time(lambda: fwd().numpy()), median_time(lambda: [g.numpy() for g in both()])
    out.append({"forward_s": f, "backward_s": max(fb - f, 0.0),
                "forward_cpu_s": fc, "backward_cpu_s": max(fbc - fc, 0.0)})
print(json.dumps({"tensorflow": tf.__version__, "layers": out}))
"""


def pserver_side(batch: int, runs: int) -> list[dict]:
    """Each layer's forward and backward seconds (medians) with pserver's cpu kernels."""
    from pserver.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D
    from pserver.layers.base import Pass
    from pserver.models.sequential import Sequential

    model = Sequential([Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), MaxPooling2D(2),
                        Conv2D(64, 3, activation="relu"), MaxPooling2D(2), Flatten(), Dropout(0.5),
                        Dense(10)]).build()
    rng = np.random.default_rng(0)
    w = model.init_params(0)
    grad = np.zeros_like(w)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    model.loss_and_grad(w, x, y, grad)                  # compiles and fills every buffer
    params = model._per_layer(model.layout.views(w))
    grads = model._per_layer(model.layout.views(grad))
    plan, model_bufs = model._plan(True), model._buffers(batch, w.dtype)
    vals = model._forward(params, x, model_bufs, Pass(training=True, seed=1))
    bufs, k, out = model_bufs.of(plan), model.kernels, []
    for i, step in enumerate(plan.steps):          # the layers in order (a chain)
        layer, li = plan.layers[step.layer], step.layer
        if layer.reshapes_only:
            out.append(dict.fromkeys(PARTS, 0.0))
            continue
        inp, act = vals[step.ins[0]], vals[step.out]
        dout = rng.random(act.shape, dtype=np.float32)
        dx = bufs.dx(i, 0) if plan.needs_grad[step.ins[0]] else None
        fwd = lambda: layer.forward(k, params[li], inp, act, bufs.scratch[i], Pass(True, 1))  # noqa: E731
        grad_in = dout.copy()                 # the backward may overwrite it (a ReLU's mask)
        bwd = lambda: layer.backward(k, params[li], grads[li], inp, act, grad_in, dx,  # noqa: E731
                                     bufs.scratch[i])
        (f, fc) = median_time(fwd, runs)
        (b, bc) = median_time(bwd, runs, before=lambda: (fwd(), np.copyto(grad_in, dout)))
        out.append({"forward_s": f, "backward_s": b, "forward_cpu_s": fc, "backward_cpu_s": bc})
    return out


def median_time(fn, runs: int, before=None) -> tuple[float, float]:
    """fn's median seconds over `runs` calls, warm, by the clock and in this process's CPU time
    (on a shared machine the clock also counts the time others had the core); `before` runs
    ahead of each call, not timed."""
    times, cpu = [], []
    for run in range(5 + runs):
        if before is not None:
            before()
        t, c = time.perf_counter(), time.process_time()
        fn()
        if run >= 5:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return float(np.median(times)), float(np.median(cpu))


def run_side(argv: list[str], env: dict, what: str) -> dict:
    """A side's child process; its last line of output is its JSON."""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode:
        sys.exit(f"the {what} side failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def pserver_argv(batch: int, runs: int) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--side-only", "--batch", str(batch),
            "--runs", str(runs)]


def rounds_of_sides(args) -> tuple[dict, str]:
    """{side: per-layer times, each the median over the rounds}, and TensorFlow's version."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"pserver": (pserver_argv(args.batch, args.runs), here)}
    if args.baseline:
        sides["baseline"] = (pserver_argv(args.batch, args.runs), os.path.abspath(args.baseline))
    if args.tf_python:
        sides["tensorflow"] = ([args.tf_python, "-c", TF_SIDE, str(args.batch), str(args.runs)], None)
    seen: dict = {name: [] for name in sides}
    tf_version = ""
    for _ in range(args.rounds):
        for name, (argv, root) in sides.items():
            env = os.environ | ({"PYTHONPATH": root} if root else {"TF_CPP_MIN_LOG_LEVEL": "2"})
            result = run_side(argv, env, name)
            seen[name].append(result["layers"])
            tf_version = result.get("tensorflow", tf_version)
    merged = {name: [{part: float(np.median([r[j][part] for r in rounds]))
                      for part in PARTS} for j in range(len(LAYERS))]
              for name, rounds in seen.items()}
    return merged, tf_version


def onednn_isa(tf_python: str) -> str:
    probe = ("import tensorflow as tf; "
             "tf.nn.conv2d(tf.ones((1, 8, 8, 4)), tf.ones((3, 3, 4, 8)), 1, 'VALID')")
    r = subprocess.run([tf_python, "-c", probe], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"ONEDNN_VERBOSE": "1", "TF_CPP_MIN_LOG_LEVEL": "0"})
    for line in (r.stdout + r.stderr).splitlines():
        if ",info,cpu,isa:" in line:
            return line.split("isa:", 1)[1].strip()
    return "none reported"


def report(sides: dict, batch: int) -> list[dict]:
    """Print each side's layers, by the clock (with GFLOP/s) and in CPU time; the JSON's records."""
    shown = [(name, label) for name, label in (("pserver", "ps"), ("baseline", "base"), ("tensorflow", "tf"))
             if name in sides]
    rows, cpu_rows, records = [], [], []
    for j, (name, macs) in enumerate(LAYERS):
        gf = lambda s, mult: f"{2 * mult * macs * batch / s / 1e9:.1f}" if macs and s else ""  # noqa: E731
        row, cpu_row = [name], [name]
        for side, _ in shown:
            t = sides[side][j]
            row += [f"{t['forward_s'] * 1e3:.3f}", f"{t['backward_s'] * 1e3:.3f}",
                    gf(t["forward_s"], 1), gf(t["backward_s"], 2)]
            cpu_row += [f"{t['forward_cpu_s'] * 1e3:.3f}", f"{t['backward_cpu_s'] * 1e3:.3f}"]
        rows.append(row)
        cpu_rows.append(cpu_row)
        records.append({"layer": name, "forward_macs_per_sample": macs, "tensorflow": None,
                        **{side: sides[side][j] for side, _ in shown}})
    print(table(["layer"] + [f"{label} {what}" for _, label in shown
                             for what in ("fwd ms", "bwd ms", "fwd GF/s", "bwd GF/s")], rows))
    print("CPU time (this process's, all its threads):")
    print(table(["layer"] + [f"{label} {what}" for _, label in shown for what in ("fwd ms", "bwd ms")],
                cpu_rows))
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="samples per step on one worker (default 64: "
                   "keras.io's 128 split over 2 workers)")
    p.add_argument("--runs", type=int, default=50, help="timed runs per layer and side (median)")
    p.add_argument("--rounds", type=int, default=1, help="times the sides take turns (default 1)")
    p.add_argument("--tf-python", default="",
                   help="a Python with tensorflow; without it, no TensorFlow side")
    p.add_argument("--baseline", default="",
                   help="a directory holding another pserver package (e.g. a git worktree of the "
                        "commit before a change): timed as a side of its own, 'base'")
    p.add_argument("--json", default="", help="write the results here too")
    p.add_argument("--side-only", action="store_true", help=argparse.SUPPRESS)  # a side's child
    args = p.parse_args()
    if args.side_only:
        print(json.dumps({"layers": pserver_side(args.batch, args.runs)}))
        return
    m = machine(("numpy", "numba"))
    print("\n".join(machine_lines(m)))
    sides, tf_version = rounds_of_sides(args)
    isa = onednn_isa(args.tf_python) if args.tf_python else ""
    records = report(sides, args.batch)
    total = lambda side: sum(r[side]["forward_s"] + r[side]["backward_s"] for r in records)  # noqa: E731
    line = f"batch {args.batch}: pserver {total('pserver') * 1e3:.2f} ms per step of layers"
    if "baseline" in sides:
        line += f", baseline {total('baseline') * 1e3:.2f} ms"
    if "tensorflow" in sides:
        line += (f", TensorFlow {tf_version} {total('tensorflow') * 1e3:.2f} ms (oneDNN ISA: {isa}); "
                 f"TensorFlow / pserver = {total('tensorflow') / total('pserver'):.2f}")
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "batch": args.batch, "runs": args.runs, "rounds": args.rounds,
                       "baseline": os.path.abspath(args.baseline) if args.baseline else None,
                       "threads": ONE_THREAD, "pserver_isa": m["cpu_id"].get("isa"), "onednn_isa": isa,
                       "tensorflow": tf_version, "layers": records, "summary": line,
                       "load_avg_1m_end": round(os.getloadavg()[0], 2)}, f, indent=1)


if __name__ == "__main__":
    main()
