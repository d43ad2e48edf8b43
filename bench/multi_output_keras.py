"""A two-output keras.Model (a shared trunk; a softmax class head, a sigmoid head and a linear
regression head: three outputs, three losses, loss_weights) on the same weights and the same
batch in pserver.keras and in Keras 3 (TensorFlow backend, the bench venv): evaluate's numbers
by Keras 3's names (loss, <output>_loss, <output>_accuracy) and the total loss's gradient per
weight. Prints each side's numbers and the largest relative difference; writes them as JSON.

    python bench/multi_output_keras.py [--keras-python bench/tf_baseline/.venv/bin/python] [--out FILE.json]

The Keras side is this file run by the Keras venv's Python with --keras-side (it imports no
pserver); the two differ only in which `keras` they import.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOSS = {"cls": "sparse_categorical_crossentropy", "click": "binary_crossentropy", "value": "mse"}
WEIGHTS = {"cls": 1.0, "click": 0.3, "value": 2.0}
METRICS = {"cls": ["accuracy"], "click": ["accuracy"]}


def build(keras):
    layers = keras.layers
    x = keras.Input(shape=(7,), name="x")
    trunk = layers.Dense(16, activation="relu", name="trunk")(x)
    branch = layers.Dense(8, activation="tanh", name="branch")(trunk)
    outs = {"cls": layers.Dense(4, activation="softmax", name="cls")(trunk),
            "click": layers.Dense(1, activation="sigmoid", name="click")(layers.concatenate([trunk, branch])),
            "value": layers.Dense(1, name="value")(branch)}
    model = keras.Model(x, outs)
    model.compile(optimizer="sgd", loss=LOSS, loss_weights=WEIGHTS, metrics=METRICS)
    return model


def batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 7)).astype(np.float32)
    y = {"cls": rng.integers(0, 4, n), "click": rng.integers(0, 2, n).astype(np.float32),
         "value": rng.normal(size=n).astype(np.float32)}
    return x, y


def keras_side(path: str) -> None:
    """Keras 3 on the weights in `path`: evaluate's dict and the total loss's gradient."""
    import keras
    import tensorflow as tf
    data = np.load(path)
    model = build(keras)
    for v in model.trainable_weights:         # by name ("trunk/kernel"): the orders differ
        v.assign(data[v.path])
    x, y = batch()
    ev = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    with tf.GradientTape() as tape:
        pred = model(x, training=False)
        # keras.losses.get(name) is the per-sample function: its mean is the loss compile takes
        total = sum(WEIGHTS[k] * tf.reduce_mean(keras.losses.get(LOSS[k])(
            y[k].reshape(len(x), -1) if k != "cls" else y[k], pred[k])) for k in LOSS)
    grads = tape.gradient(total, model.trainable_weights)
    print(json.dumps({"versions": {"keras": keras.__version__, "tensorflow": tf.__version__},
                      "evaluate": {k: float(v) for k, v in ev.items()}, "total": float(total),
                      "grads": {v.path: g.numpy().ravel().tolist()
                                for v, g in zip(model.trainable_weights, grads)}}))


def pserver_side(keras_python: str) -> dict:
    import pserver.keras as keras
    keras.utils.set_random_seed(1)
    model = build(keras)
    x, y = batch()
    ev = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    core, w = model._core, model._weights().astype(np.float64)
    g = np.zeros_like(w)
    total = core.loss_and_grad(w, x.astype(np.float64), core.loss.labels(y), g)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "weights.npz")
        views = core.layout.views(model._weights())
        np.savez(path, **{t.name: views[t.name] for t in core.layout.tensors})
        out = subprocess.run([keras_python, __file__, "--keras-side", path], capture_output=True, text=True,
                             check=True, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    views = core.layout.views(g)
    pairs = [(views[t.name].ravel(), np.asarray(theirs["grads"][t.name])) for t in core.layout.tensors]
    from _util import machine
    return {**machine(("numpy",)), "keras_side": {"python": keras_python, **theirs["versions"]},
            "pserver": {"evaluate": ev, "total": total},
            "keras": {k: theirs[k] for k in ("evaluate", "total")},
            "max_rel_diff": {"evaluate": max(_rel(ev[k], theirs["evaluate"][k]) for k in theirs["evaluate"]),
                             "total": _rel(total, theirs["total"]),
                             "gradient": max(_rel(a, b) for a, b in pairs)},
            "same_keys": set(ev) == set(theirs["evaluate"])}


def _rel(a, b) -> float:
    """The largest difference relative to the largest magnitude of Keras's side."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keras-python", default="bench/tf_baseline/.venv/bin/python")
    ap.add_argument("--keras-side", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.keras_side:
        keras_side(args.keras_side)
        return
    result = pserver_side(args.keras_python)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
