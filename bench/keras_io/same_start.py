"""Is the toy ResNet's accuracy gap to Keras in pserver's training or in chance? Train keras.io's
toy ResNet (toy_resnet.py's model, Dropout off) from ONE set of initial weights on the same
batches in order, three ways: Keras 3 with TensorFlow's default threads, Keras 3 with one thread
(`TF_NUM_INTRAOP_THREADS=1`: another order of float32 sums, the same maths), and pserver (fit on
its own machine, one worker). After each number of steps the script reports, per side pair, how
far the trained weights moved apart relative to how far they moved from the start (median over
the 18 tensors of |w_a - w_b| / |w_a - w_0|). If pserver's distance from Keras is the size of
Keras's distance from itself, the two run the same training and what remains between their
accuracies is the spread over seeds; if it is larger, pserver computes something else.

    nice -n 10 .venv/bin/python bench/keras_io/same_start.py --steps 1,5,25,100 \
        --out bench/results/keras_io/same-start.json [--keras-python bench/tf_baseline/.venv/bin/python]

MNIST from $PSERVER_MNIST_DIR; batch 64, RMSprop 1e-3, the guide's loss; the initial weights are
Keras's (glorot/zeros from --seed), which pserver loads with set_weights.
"""

from __future__ import annotations

import argparse
import json
import os
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

# One side's run: build the toy ResNet (Dropout(0): no random masks to match), load or save the
# initial weights, fit `samples` images in order, save the trained weights.
CHILD = r'''
import os, sys
import numpy as np
side, samples, init, final = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if side == "pserver":
    import pserver.keras as keras
    from pserver.keras import layers
else:
    import keras
    from keras import layers
sys.path.insert(0, sys.argv[5])
from _ours import load_mnist
keras.utils.set_random_seed(int(sys.argv[6]))
inputs = keras.Input(shape=(28, 28, 1), name="img")
x = layers.Conv2D(32, 3, activation="relu")(inputs)
x = layers.Conv2D(64, 3, activation="relu")(x)
b1 = layers.MaxPooling2D(3)(x)
x = layers.Conv2D(64, 3, activation="relu", padding="same")(b1)
x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
b2 = layers.add([x, b1])
x = layers.Conv2D(64, 3, activation="relu", padding="same")(b2)
x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
b3 = layers.add([x, b2])
x = layers.Conv2D(64, 3, activation="relu")(b3)
x = layers.GlobalAveragePooling2D()(x)
x = layers.Dense(256, activation="relu")(x)
x = layers.Dropout(0.0)(x)
model = keras.Model(inputs, layers.Dense(10)(x), name="toy_resnet")
if os.path.exists(init):
    saved = np.load(init)
    model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
else:
    np.savez(init, *model.get_weights())
(xt, yt), _ = load_mnist()
xt = np.expand_dims(xt[:samples], -1).astype("float32") / 255.0
yt = keras.utils.to_categorical(yt[:samples], 10)
model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
              loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["acc"])
model.fit(xt, yt, batch_size=64, epochs=1, shuffle=False, verbose=0)
np.savez(final, *model.get_weights())
'''

SIDES = {"keras": {}, "keras-1thread": {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"},
         "pserver": {}}
PAIRS = (("keras", "keras-1thread"), ("keras", "pserver"), ("keras-1thread", "pserver"))


def run(side: str, steps: int, tmp: Path, args) -> Path:
    final = tmp / f"{side}-{steps}.npz"
    python = sys.executable if side == "pserver" else args.keras_python
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **SIDES[side]}
    subprocess.run([python, "-c", CHILD, side, str(steps * 64), str(tmp / "init.npz"), str(final),
                    str(HERE), str(args.seed)], env=env, check=True, timeout=1800)
    return final


def apart(a: Path, b: Path, init: Path) -> float:
    """Median over tensors of |w_a - w_b| / |w_a - w_0| (norms): 0 for equal runs."""
    wa, wb, w0 = np.load(a), np.load(b), np.load(init)
    return statistics.median(float(np.linalg.norm(wa[k] - wb[k]) / np.linalg.norm(wa[k] - w0[k]))
                             for k in wa.files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=positive_ints, default=[1, 5, 25, 100])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keras-python", default="bench/tf_baseline/.venv/bin/python")
    ap.add_argument("--out", default="results/keras_io/same-start.json")
    args = ap.parse_args()
    rows, started = [], time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run("keras", 1, tmp, args)          # writes init.npz: every later run starts there
        for steps in args.steps:
            finals = {side: run(side, steps, tmp, args) for side in SIDES}
            rows.append({"steps": steps, **{f"{a} vs {b}": apart(finals[a], finals[b], tmp / "init.npz")
                                            for a, b in PAIRS}})
            print(rows[-1], flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "load_at_start": os.getloadavg()[0], "seconds": round(time.time() - started),
              "measure": "median over the 18 tensors of |w_a - w_b| / |w_a - w_0|", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(machine_lines(result["machine"])))
    print(table(["steps", *[f"{a} vs {b}" for a, b in PAIRS]],
                [[str(r["steps"]), *[f"{r[f'{a} vs {b}']:.2e}" for a, b in PAIRS]] for r in rows]))


if __name__ == "__main__":
    main()
