"""The chief's validation of keras.io's MNIST convnet on one thread and on several, interleaved:
the time of one Sequential.evaluate of the 6,000 images fit(validation_split=0.1) holds out,
as the worker loop runs it at an epoch's end (pserver.worker.loop.eval_threads picks the
threads: every core when the other workers wait for the chief, as in sync mode).

    .venv/bin/python bench/keras_eval_threads.py --threads 2 --rounds 7 \\
        --json bench/results/keras/eval-threads.json

The weights are the model's initial ones (the time does not depend on them); the images are
MNIST's last 6,000 training images when PSERVER_MNIST_DIR (or --data-dir) has them, else
random ones of the same shape. Each round times threads=1, then threads=N; the table shows
the best and the median of the rounds, and the load average before them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")      # as a launched worker has it

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from _util import machine, result_path  # noqa: E402

import pserver.keras as keras  # noqa: E402
from pserver.keras import layers  # noqa: E402


def validation_images(data_dir: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    if data_dir:
        os.environ["PSERVER_MNIST_DIR"] = data_dir
    if os.environ.get("PSERVER_MNIST_DIR"):
        (x, y), _ = keras.datasets.mnist.load_data()
        x = np.expand_dims(x[-6000:].astype("float32") / 255, -1)
        return x, keras.utils.to_categorical(y[-6000:], 10), "mnist's last 6,000 training images"
    rng = np.random.default_rng(0)
    return (rng.random((6000, 28, 28, 1), np.float32),
            keras.utils.to_categorical(rng.integers(0, 10, 6000), 10), "6,000 random images")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--data-dir", help="MNIST's directory (default: PSERVER_MNIST_DIR)")
    ap.add_argument("--json", help="where to write the rounds (default: results/eval-threads.json)")
    args = ap.parse_args()
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(), layers.Dropout(0.5), layers.Dense(10, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    core = model._core
    x, y, what = validation_images(args.data_dir)
    x, y = model._arrays(x, y, "bench")
    w = core.init_params(0)
    sides = {1: [], args.threads: []}
    results = {t: core.evaluate(w, x, y, threads=t) for t in sides}     # warm-up: compile, buffers
    if len({json.dumps(r, sort_keys=True) for r in results.values()}) != 1:
        raise SystemExit(f"the results differ: {results}")
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for t, times in sides.items():
            started = time.perf_counter()
            core.evaluate(w, x, y, threads=t)
            times.append(time.perf_counter() - started)
    best = {t: min(v) for t, v in sides.items()}
    med = {t: statistics.median(v) for t, v in sides.items()}
    for t in sides:
        print(f"threads={t}: best {best[t]:.3f} s, median {med[t]:.3f} s over {args.rounds} rounds")
    one, many = 1, args.threads
    print(f"{what}, load {load:.2f} before: threads={many} is {best[one] / best[many]:.2f}x faster "
          f"(best), {med[one] / med[many]:.2f}x (median); the same result bit for bit")
    path = result_path(args.json, "eval-threads.json")
    path.write_text(json.dumps({
        "what": "keras.io mnist_convnet, Sequential.evaluate of 6,000 images, threads=1 against "
                f"threads={many}, interleaved", "images": what, "load_before": round(load, 2),
        "seconds": {str(t): [round(s, 4) for s in v] for t, v in sides.items()},
        "best": {str(t): round(v, 4) for t, v in best.items()},
        "median": {str(t): round(v, 4) for t, v in med.items()},
        "speedup_best": round(best[one] / best[many], 3), "speedup_median": round(med[one] / med[many], 3),
        "machine": machine()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
