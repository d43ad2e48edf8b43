"""The scripts in bench/keras_io/ (keras.io guides' models, written here) under `pserver run --ps 1
--workers 2` (sync) and plainly on Keras 3 (TensorFlow backend, the bench venv), the two differing
only in their import lines, for seeds 1,2,3 interleaved (pserver seed 1, Keras seed 1, pserver seed 2, ...):
each run's test accuracy, wall time and speed; the median of the seeds per side and the
difference in points.

    nice -n 10 python bench/keras_io/compare.py --out bench/results/keras_io/ [--scripts toy_resnet]
        [--seeds 1,2,3] [--train-samples 10000 --epochs 1] [--keras-python /work/tfvenv/bin/python]

--train-samples/--epochs (toy_resnet only) rewrite the guide's `x_train[:1000]`, `y_train[:1000]`
and `epochs=1` in both sides' copies alike, for a setting less noisy than the guide's 1000
samples and 1 epoch; the result's name and "setting" say so. MNIST: $PSERVER_MNIST_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from _util import machine, machine_lines, positive_ints, table  # noqa: E402

HERE = Path(__file__).parent
SCRIPTS = ("subclassing", "toy_resnet", "text_transformer")
# The only lines the two sides differ in: pserver's imports -> Keras's
IMPORTS = ((re.compile(r"^import pserver\.keras as keras$", re.M), "import keras"),
           (re.compile(r"^from pserver\.keras import ", re.M), "from keras import "))
CHIEF = r"^(?:\[worker0\] )?"       # `pserver run` prefixes the chief's lines
ACCURACY = re.compile(CHIEF + r"Test accuracy: (\S+)$", re.M)
FIT = re.compile(CHIEF + r"Fit: ([\d.]+) s", re.M)
SUMMARY = re.compile(CHIEF + r"\d+ steps in \S+ s: ([\d,.]+) train samples/s$", re.M)


def sized(text: str, samples: int | None, epochs: int | None) -> str:
    """The toy ResNet's fit on its first `samples` for `epochs` (the guide: 1000, 1)."""
    for old, new in (("x_train[:1000],", f"x_train[:{samples}],"),
                     ("y_train[:1000],", f"y_train[:{samples}],"),
                     ("    epochs=1,\n", f"    epochs={epochs},\n")):
        if (samples if "train" in old else epochs) is None:
            continue
        if text.count(old) != 1:
            raise SystemExit(f"toy_resnet.py: the guide's {old.strip()!r} is not there once")
        text = text.replace(old, new)
    return text


def copies(name: str, samples: int | None, epochs: int | None, tmp: Path) -> dict[str, Path]:
    """pserver's script (its imports) and Keras's (the imports swapped back), otherwise equal."""
    text = (HERE / f"{name}.py").read_text()
    if samples or epochs:
        text = sized(text, samples, epochs)
    keras = text
    for pattern, repl in IMPORTS:
        keras, n = pattern.subn(repl, keras)
        assert n == 1, f"{name}.py: import line {pattern.pattern} not there once"
    paths = {"pserver": tmp / f"{name}.py", "keras": tmp / f"{name}_keras.py"}
    paths["pserver"].write_text(text)
    paths["keras"].write_text(keras)
    shutil.copy(HERE / "_ours.py", tmp / "_ours.py")       # what both copies import
    return paths


def run_one(side: str, script: Path, seed: int, keras_python: str, timeout: int) -> dict:
    env = {**os.environ, "KERAS_IO_SEED": str(seed), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if side == "pserver":
        cmd = [sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--mode", "sync",
               "--seed", str(seed), "--", sys.executable, str(script)]
    else:
        cmd = [keras_python, str(script)]
    load = round(os.getloadavg()[0], 2)
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.monotonic() - started
    if out.returncode != 0 or not ACCURACY.search(out.stdout):
        raise SystemExit(f"{side} seed {seed}: exit {out.returncode}\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    speed = SUMMARY.findall(out.stdout)
    return {"side": side, "seed": seed, "test_accuracy": float(ACCURACY.findall(out.stdout)[-1]),
            "wall_seconds": round(wall, 1), "fit_seconds": float(FIT.findall(out.stdout)[-1]),
            "train_samples_per_second": float(speed[-1].replace(",", "")) if speed else None,
            "load_avg_1m_start": load, "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "command": " ".join(["nice -n 10", *(["python", *cmd[1:]] if side == "pserver" else cmd)])}


def keras_version(python: str) -> str:
    code = "import keras, tensorflow as tf; print(keras.__version__, tf.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    keras, tf = out.stdout.split()[-2:]
    return f"keras {keras}, tensorflow {tf} (backend tensorflow, CPU)"


def compare(name: str, args, tmp: Path) -> dict:
    paths = copies(name, args.train_samples, args.epochs, tmp)
    runs = []
    for seed in args.seeds:                      # interleaved: pserver, Keras, next seed
        for side in ("pserver", "keras"):
            r = run_one(side, paths[side], seed, args.keras_python, args.timeout)
            runs.append(r)
            print(f"{name} {side} seed {seed}: test accuracy {r['test_accuracy']:.4f}, "
                  f"fit {r['fit_seconds']:.1f} s, wall {r['wall_seconds']:.0f} s, "
                  f"load {r['load_avg_1m_start']}", flush=True)
    med = {side: statistics.median(r["test_accuracy"] for r in runs if r["side"] == side)
           for side in ("pserver", "keras")}
    setting = "the guide's" if not (args.train_samples or args.epochs) else (
        f"fit on the first {args.train_samples or 1000} samples for {args.epochs or 1} epoch(s)")
    if os.environ.get("KERAS_IO_SAMPLES"):        # _ours.py's data limit, which both sides read
        setting += f", data cut to {os.environ['KERAS_IO_SAMPLES']} samples ($KERAS_IO_SAMPLES)"
    fit = {side: statistics.median(r["fit_seconds"] for r in runs if r["side"] == side)
           for side in ("pserver", "keras")}
    return {"script": f"bench/keras_io/{name}.py", "setting": setting, "seeds": args.seeds, "runs": runs,
            "median_test_accuracy": med, "median_fit_seconds": fit,
            "difference_points": round(100 * (med["pserver"] - med["keras"]), 2)}


def markdown(result: dict) -> str:
    m = result["machine"]
    rows = []
    for c in result["comparisons"]:
        acc, fit = c["median_test_accuracy"], c["median_fit_seconds"]
        rows.append([c["script"], c["setting"], f"{100 * acc['pserver']:.2f}",
                     f"{100 * acc['keras']:.2f}", f"{c['difference_points']:+.2f}",
                     f"{fit['pserver']:.1f}", f"{fit['keras']:.1f}"])
    lines = [f"# keras.io guides: pserver run --ps 1 --workers 2 (sync) vs {result['keras']}", "",
             *[f"- {line}" for line in machine_lines(m)], "",
             "Median of seeds " + ",".join(map(str, result["comparisons"][0]["seeds"])) +
             " (interleaved); accuracy in %, difference in points (pserver - Keras); "
             "fit: seconds of `fit`.", "", "```",
             table(["script", "setting", "pserver", "keras", "diff", "fit pserver", "fit keras"], rows, 2),
             "```", "", "Each run (the JSON beside this file holds the commands):", "", "```"]
    runs = [[c["script"].split("/")[-1], r["side"], str(r["seed"]), f"{100 * r['test_accuracy']:.2f}",
             f"{r['fit_seconds']:.1f}", f"{r['wall_seconds']:.0f}", str(r["load_avg_1m_start"])]
            for c in result["comparisons"] for r in c["runs"]]
    lines += [table(["script", "side", "seed", "acc %", "fit s", "wall s", "load"], runs, 2), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--seeds", type=positive_ints, default=[1, 2, 3])
    ap.add_argument("--train-samples", type=int, help="toy_resnet: fit on the first N samples (guide: 1000)")
    ap.add_argument("--epochs", type=int, help="toy_resnet: epochs (guide: 1)")
    ap.add_argument("--keras-python", default="/work/tfvenv/bin/python")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--out", default="results/keras_io/", help="directory for the JSON and .md")
    args = ap.parse_args()
    names = args.scripts.split(",")
    if (args.train_samples or args.epochs) and names != ["toy_resnet"]:
        ap.error("--train-samples/--epochs resize the toy ResNet's fit: give --scripts toy_resnet")
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    result = {"what": "bench/keras_io scripts under pserver run vs Keras 3", "machine": m,
              "keras": keras_version(args.keras_python)}
    with tempfile.TemporaryDirectory() as tmp:
        result["comparisons"] = [compare(name, args, Path(tmp)) for name in names]
    for c in result["comparisons"]:
        acc = c["median_test_accuracy"]
        print(f"{c['script']} ({c['setting']}): median test accuracy pserver {acc['pserver']:.4f}, "
              f"Keras {acc['keras']:.4f}: {c['difference_points']:+.2f} points")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join(names) + (f"-{args.train_samples or 1000}samples-{args.epochs or 1}ep"
                              if args.train_samples or args.epochs else "")
    stem += f"-data{os.environ['KERAS_IO_SAMPLES']}" if os.environ.get("KERAS_IO_SAMPLES") else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
