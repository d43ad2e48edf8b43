"""End-to-end training throughput with real processes, for each consistency mode, beside
the compute bound and TensorFlow's ParameterServerStrategy measured in the same run.

    .venv/bin/python bench/throughput.py [--modes sync,async,...] [--epochs 50] [--repeats 3] [--json PATH]

Runs `pserver launch --ps 1 --workers 2` (MLP 784-256-256-10, batch 256 per worker,
synthetic MNIST-shaped data, SGD) once per mode and repeat, and reports the run's
train samples/s as the chief's summary measures it: samples pushed to the shard
divided by the wall time from the first pull to the last worker's finish (process
start-up, data generation and one warm-up step that loads the compiled kernels are
excluded; every push and pull of training is inside it).

compute_bound: the same model, batch, data and SGD update in one process with one BLAS
thread and no server (pserver's own model and optimizer code), for --seconds, times the
workers that the cores can run at once (min(workers, cores)): what the workers would reach
if talking to the shard cost nothing. Each mode's row shows its ratio to it.

tf_pss: bench/tf_baseline/ps_mlp.py (the same model, batch, data and SGD under
tf.distribute.ParameterServerStrategy, 1 ps and 2 workers) for --seconds, run with the
Python of TensorFlow's own virtual environment (--tf-python; bench/tf_baseline/README.md
says how to make it). Without one there is no TensorFlow figure, and the bench says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import cpu_model, result_path  # noqa: E402

MODE_FLAGS = {"sync": [], "backup": ["--backup-workers", "1"], "async": [], "ssp": ["--staleness", "2"]}
WORKERS, BATCH, LR, SAMPLES, TEST_SAMPLES = 2, 256, 0.05, 60000, 1000
TF_PYTHON = Path(__file__).resolve().parent / "tf_baseline" / ".venv" / "bin" / "python"
MIN_SECONDS = 20.0        # of training under every figure
# where the workers' time goes; push_pull: a step's push and the pull after it, one exchange
# over the shared-memory data plane (push and pull: separate calls, as over gRPC)
SPLIT = ("compute", "push", "pull", "push_pull")


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, load average {load}"


def run_once(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.json")
        cmd = [sys.executable, "-m", "pserver", "launch", "--ps", "1", "--workers", str(WORKERS),
               "--mode", mode, *MODE_FLAGS[mode],
               "--model", "mlp", "--dataset", "synthetic", "--batch-size", str(BATCH),
               "--samples", str(SAMPLES), "--test-samples", str(TEST_SAMPLES),
               "--epochs", str(args.epochs), "--optimizer", "sgd", "--lr", str(LR), "--log-every", "100000",
               # each worker its own slice, as the committed figures were measured
               # (leases against slices: bench/modes.py --assignments)
               "--data-assignment", "slices", "--summary-json", path, *args.extra]
        started = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{mode}: pserver launch failed ({r.returncode}):\n"
                             f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
        s = json.load(open(path))
        return {"mode": mode, "train_samples_per_second": s["train_samples_per_second"],
                "wall_seconds": s["wall_seconds"], "steps": s["steps"],
                "launch_seconds": round(time.monotonic() - started, 2), "test_accuracy": s["test_accuracy"],
                "time_split": time_split(s["workers"])}


def time_split(workers: list[dict]) -> dict:
    """Where the workers' time went, as fractions of their wall time (mean over workers), and
    their compute seconds per step: beside the compute bound's, it says what sharing the
    cores with the shard cost."""
    split = {k: sum(w.get(f"{k}_seconds", 0.0) / w["wall_seconds"] for w in workers) / len(workers)
             for k in SPLIT}
    split["compute_ms_per_step"] = (1e3 * sum(w["compute_seconds"] / w["steps"] for w in workers)
                                    / len(workers))
    return split


def compute_once(args) -> dict:
    """One single-threaded process with no server: samples/s of compute alone, times the
    workers that the cores can run at once."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compute-child", str(args.seconds)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"compute bound failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    one = json.loads(r.stdout.strip().splitlines()[-1])
    parallel = min(WORKERS, os.cpu_count() or 1)
    return {"mode": "compute_bound", "train_samples_per_second": one["samples_per_second"] * parallel,
            "one_process_samples_per_second": one["samples_per_second"], "workers_at_once": parallel,
            "wall_seconds": one["seconds"], "steps": one["steps"],
            "time_split": {"compute": 1.0, "compute_ms_per_step": 1e3 * one["seconds"] / one["steps"]}}


def compute_child(seconds: float) -> None:
    """The worker's loop without the shard: loss_and_grad, then the shard's SGD update, on
    the dataset and model that `pserver launch` builds for these flags."""
    import numpy as np

    from pserver.data import load_dataset
    from pserver.models import make_model
    from pserver.optim import make_optimizer
    ds = load_dataset("synthetic", samples=SAMPLES, test_samples=TEST_SAMPLES)
    model = make_model("mlp", ds.sample_shape, ds.num_classes)
    w = model.init_params(0)
    g = np.empty_like(w)
    sgd = make_optimizer("sgd", w.size, lr=LR)
    steps, epoch, started = -1, 0, None           # step -1: the untimed warm-up
    while started is None or time.perf_counter() - started < seconds:
        for x, y in ds.epoch(0, WORKERS, BATCH, 0, epoch):
            model.loss_and_grad(w, x, y, g)
            sgd.step(w, g, max(steps, 0))
            steps += 1
            if started is None:
                started = time.perf_counter()
        epoch += 1
    elapsed = time.perf_counter() - started
    print(json.dumps({"samples_per_second": steps * BATCH / elapsed, "seconds": elapsed, "steps": steps}))


def tf_once(args) -> dict | None:
    """TensorFlow PSS on the same task, from its own virtual environment; None without one."""
    script = Path(__file__).resolve().parent / "tf_baseline" / "ps_mlp.py"
    r = subprocess.run([str(args.tf_python), str(script), "--seconds", str(args.seconds),
                        "--workers", str(WORKERS),
                        "--batch-size", str(BATCH), "--lr", str(LR), "--samples", str(SAMPLES)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tf_pss: {script.name} failed ({r.returncode}):\n"
                         f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return {"mode": "tf_pss", "train_samples_per_second": result["train_samples_per_second"],
            "wall_seconds": result["seconds"], "steps": result["steps"], "framework": result["framework"]}


def tf_available(args) -> bool:
    if args.no_tf:
        print("  tf_pss: not run (--no-tf)")
    elif not args.tf_python.is_file():
        print(f"  tf_pss: no TensorFlow figure: no Python at {args.tf_python} (make the virtual "
              f"environment as bench/tf_baseline/README.md says, or pass --tf-python)")
    else:
        return True
    return False


def median_row(runs: list[dict]) -> dict:
    rates = [r["train_samples_per_second"] for r in runs]
    best = sorted(runs, key=lambda r: r["train_samples_per_second"])[len(runs) // 2]
    return dict(best, min=min(rates), max=max(rates), repeats=len(runs))


def line(row: dict, bound: dict | None, tf: dict | None) -> str:
    rate = row["train_samples_per_second"]
    ratios = [f"{rate / ref['train_samples_per_second']:.2f}x {name}" for name, ref in
              (("compute bound", bound), ("TF PSS", tf)) if ref is not None and ref is not row]
    short = "  (< %g s of training)" % MIN_SECONDS if row["wall_seconds"] < MIN_SECONDS else ""
    split = row.get("time_split")
    where = "" if split is None else ("  time: " + ", ".join(
        f"{k.replace('_', '+')} {split[k]:.0%}" for k in SPLIT
        if k in split and (k == "compute" or split[k] >= 0.005))
        + f", {split['compute_ms_per_step']:.1f} ms compute/step")
    return (f"  {row['mode']:13s} {rate:>9,.0f} samples/s (min {row['min']:,.0f}, max {row['max']:,.0f})  "
            f"{row['steps']} steps in {row['wall_seconds']:.1f} s  {', '.join(ratios)}{short}{where}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,backup,async,ssp")
    p.add_argument("--epochs", type=int,
                   help="epochs of each pserver run (default: enough for --seconds at the compute bound, "
                        "so that no mode, which is slower, trains for less)")
    p.add_argument("--seconds", type=float, default=MIN_SECONDS,
                   help="timed training of the compute bound and of TensorFlow, each (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported")
    p.add_argument("--tf-python", type=Path, default=TF_PYTHON,
                   help="the Python of TensorFlow's virtual environment (default bench/tf_baseline/.venv)")
    p.add_argument("--no-tf", action="store_true", help="no TensorFlow row")
    p.add_argument("--json", metavar="PATH", help="write the {mode, train_samples_per_second, wall_seconds, "
                   "steps} rows here (default results/throughput.json)")
    p.add_argument("--compute-child", type=float, help=argparse.SUPPRESS)
    p.add_argument("extra", nargs="*", help="more flags for pserver launch (after --)")
    args = p.parse_args()
    if args.compute_child is not None:
        compute_child(args.compute_child)
        return
    print(f"pserver end-to-end throughput: 1 shard + {WORKERS} workers, MLP 784-256-256-10, batch "
          f"{BATCH}/worker, synthetic data, epochs of {SAMPLES:,} samples, median of {args.repeats}")
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M')}")
    have_tf = tf_available(args)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in ["compute_bound"] + ["tf_pss"] * have_tf + modes}
    for r in range(args.repeats):       # interleaved: the machine's load drifts over a run
        runs["compute_bound"].append(compute_once(args))
        if args.epochs is None:
            args.epochs = math.ceil(args.seconds * runs["compute_bound"][0]["train_samples_per_second"] * 1.2
                                    / SAMPLES)
            print(f"  pserver runs: {args.epochs} epochs ({args.epochs * SAMPLES:,} samples)", flush=True)
        if have_tf:
            runs["tf_pss"].append(tf_once(args))
        for mode in modes:
            runs[mode].append(run_once(mode, args))
        print(f"  repeat {r + 1} of {args.repeats} done; load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = [median_row(v) for v in runs.values()]
    bound, tf = rows[0], rows[1] if have_tf else None
    for row in rows:
        print(line(row, bound, tf))
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    path = result_path(args.json, "throughput.json")
    path.write_text(json.dumps(rows, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
