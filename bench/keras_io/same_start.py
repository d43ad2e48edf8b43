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

`--model dcn` asks the same of keras-rs's DCN on MovieLens-100K (dcn_movielens.py's model, data
and AdamW 0.01, batches of 1024, here without shuffling), whose 15-seed median RMSE was 1.5%
above Keras-on-JAX's: the Keras sides run on JAX, the second from the same weights each moved
one float32 ulp (XLA's sums do not change with its threads), `--epochs` (default 1,10) are the
rows, each side also reports its test RMSE, and `--seeds` repeats it from each seed's initial
weights, so each seed gives a paired difference:

    nice -n 10 .venv/bin/python bench/keras_io/same_start.py --model dcn --seeds 1,2,3,4,5 \
        --out bench/results/keras_rs/same-start-dcn.json   # $KERAS_IO_MOVIELENS: compare.py's .npz
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

# What every side's run begins with: its arguments (side, a count, the initial and the final
# weights' files, this directory, the seed), Keras or pserver's imports by side (OURS, THEIRS),
# the seed; and `start(model)`, which loads the initial weights (the first run saves them).
HEAD = r'''
import json, os, sys
import numpy as np
side, count, init, final = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if side == "pserver":
    import pserver.keras as keras
    OURS
else:
    import keras
    THEIRS
sys.path.insert(0, sys.argv[5])
keras.utils.set_random_seed(int(sys.argv[6]))


def start(model):
    if not os.path.exists(init):
        np.savez(init, *model.get_weights())
        return
    saved = np.load(init)
    weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    if side == "keras-nudged":     # each weight one float32 ulp up or down: only rounding differs
        rng = np.random.default_rng(0)
        weights = [np.nextafter(w, np.where(rng.random(w.shape) < 0.5, -np.inf, np.inf).astype(w.dtype))
                   for w in weights]
    model.set_weights(weights)
'''


def child(ours: str, theirs: str, body: str) -> str:
    return HEAD.replace("OURS", ours).replace("THEIRS", theirs) + body

# One side's run: build the toy ResNet (Dropout(0): no random masks to match), load or save the
# initial weights, fit `count` images in order, save the trained weights.
CHILD = child("from pserver.keras import layers", "from keras import layers", r'''
from _ours import load_mnist
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
start(model)
(xt, yt), _ = load_mnist()
xt = np.expand_dims(xt[:count], -1).astype("float32") / 255.0
yt = keras.utils.to_categorical(yt[:count], 10)
model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
              loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["acc"])
model.fit(xt, yt, batch_size=64, epochs=1, shuffle=False, verbose=0)
np.savez(final, *model.get_weights())
''')

# keras-rs's DCN on MovieLens (dcn_movielens.py's model and data): `epochs` over the 80,000 training
# ratings in order, then its test RMSE printed as JSON.
DCN_CHILD = child("import pserver.keras_rs as keras_rs", "import keras_rs", r'''
from _ours import load_movielens
features, ratings = load_movielens()
names = ["movie_id", "user_id", "user_gender", "bucketized_user_age", "user_zip_code", "user_occupation_text"]
vocab = {n: np.unique(features[n]) for n in names}
ids = {n: (np.searchsorted(vocab[n], features[n]) + 1).astype("int32") for n in names}
order = np.random.default_rng(int(sys.argv[6])).permutation(len(ratings))
train_x, test_x = ({n: x[part] for n, x in ids.items()} for part in (order[:80_000], order[80_000:]))
train_y, test_y = ratings[order[:80_000]], ratings[order[80_000:]]
inputs = {n: keras.Input(shape=(), dtype="int32", name=n) for n in names}
x = keras.ops.concatenate([keras.layers.Embedding(len(vocab[n]) + 1, 32)(inputs[n]) for n in names], axis=1)
x = keras_rs.layers.FeatureCross()(x)
for units in (192, 192):
    x = keras.layers.Dense(units, activation="relu")(x)
model = keras.Model(inputs=inputs, outputs=keras.layers.Dense(1)(x))
start(model)
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.01), loss=keras.losses.MeanSquaredError(),
              metrics=[keras.metrics.RootMeanSquaredError()])
model.fit(train_x, train_y, batch_size=1024, epochs=count, shuffle=False, verbose=0)
got = model.evaluate(test_x, test_y, batch_size=1024, return_dict=True, verbose=0)
np.savez(final, *model.get_weights())
print(json.dumps({"rmse": float(got["root_mean_squared_error"])}))
''')

SIDES = {"keras": {}, "keras-1thread": {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"},
         "pserver": {}}
# The DCN's Keras sides run on JAX, as the comparison of its RMSE did. XLA's CPU sums do not depend
# on its threads (a one-thread run gave the same weights bit for bit), so the second Keras side
# starts each weight one float32 ulp away instead: how far rounding alone takes a run.
DCN_SIDES = {"keras": {"KERAS_BACKEND": "jax"}, "keras-nudged": {"KERAS_BACKEND": "jax"}, "pserver": {}}
DCN_PAIRS = (("keras", "keras-nudged"), ("keras", "pserver"), ("keras-nudged", "pserver"))
PAIRS = (("keras", "keras-1thread"), ("keras", "pserver"), ("keras-1thread", "pserver"))


def run(side: str, steps: int, tmp: Path, args, seed: int) -> tuple[Path, dict]:
    """One side's run from tmp/init.npz (written by the first): its final weights, and what it
    printed (the DCN's test RMSE). `steps`: batches of the toy ResNet, epochs of the DCN."""
    final = tmp / f"{side}-{steps}.npz"
    python = sys.executable if side == "pserver" else args.keras_python
    dcn = args.model == "dcn"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(DCN_SIDES if dcn else SIDES)[side]}
    out = subprocess.run([python, "-c", DCN_CHILD if dcn else CHILD, side, str(steps if dcn else steps * 64),
                          str(tmp / "init.npz"), str(final), str(HERE), str(seed)],
                         env=env, check=True, timeout=1800, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return final, json.loads(lines[-1]) if lines else {}


def apart(a: Path, b: Path, init: Path) -> float:
    """Median over tensors of |w_a - w_b| / |w_a - w_0| (norms): 0 for equal runs."""
    wa, wb, w0 = np.load(a), np.load(b), np.load(init)
    return statistics.median(float(np.linalg.norm(wa[k] - wb[k]) / np.linalg.norm(wa[k] - w0[k]))
                             for k in wa.files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("toy_resnet", "dcn"), default="toy_resnet")
    ap.add_argument("--steps", type=positive_ints, default=[1, 5, 25, 100], help="toy_resnet: batches")
    ap.add_argument("--epochs", type=positive_ints, default=[1, 10], help="dcn: epochs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=positive_ints, default=None, help="dcn: each seed's start in turn")
    ap.add_argument("--keras-python", default="bench/tf_baseline/.venv/bin/python")
    ap.add_argument("--out", default="results/keras_io/same-start.json")
    args = ap.parse_args()
    rows, started = [], time.time()
    dcn = args.model == "dcn"
    sides, pairs = (DCN_SIDES, DCN_PAIRS) if dcn else (SIDES, PAIRS)
    for seed in (args.seeds or [args.seed]) if dcn else [args.seed]:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            run("keras", 1, tmp, args, seed)          # writes init.npz: every later run starts there
            for steps in args.epochs if dcn else args.steps:
                runs = {side: run(side, steps, tmp, args, seed) for side in sides}
                rows.append({**({"seed": seed, "epochs": steps} if dcn else {"steps": steps}),
                             **{f"{a} vs {b}": apart(runs[a][0], runs[b][0], tmp / "init.npz")
                                for a, b in pairs},
                             **({f"rmse {side}": r[1]["rmse"] for side, r in runs.items()} if dcn else {})})
                print(rows[-1], flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "load_at_start": os.getloadavg()[0], "seconds": round(time.time() - started),
              "measure": f"median over the {'9' if dcn else '18'} tensors of |w_a - w_b| / |w_a - w_0|",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(machine_lines(result["machine"])))
    keys = ["seed", "epochs"] if dcn else ["steps"]
    rmse = [f"rmse {side}" for side in sides] if dcn else []
    print(table([*keys, *[f"{a} vs {b}" for a, b in pairs], *rmse],
                [[*(str(r[k]) for k in keys), *[f"{r[f'{a} vs {b}']:.2e}" for a, b in pairs],
                  *(f"{r[k]:.4f}" for k in rmse)] for r in rows]))


if __name__ == "__main__":
    main()
