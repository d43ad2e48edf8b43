"""FeatureCross and DotInteraction (pserver.layers.interaction) against Keras-RS's own layers on
the same weights and inputs: prints the largest absolute difference per case.

Keras-RS needs Keras 3 and a backend, which pserver's environment does not have, so the script
runs twice: in pserver's environment it computes pserver's outputs (float32, model.predict),
writes the weights and inputs to a file, and runs itself with `--python` (an environment with
keras-rs, TensorFlow's in bench/tf_baseline by default) to compute Keras-RS's on them:

    bench/tf_baseline/.venv/bin/pip install keras-rs
    .venv/bin/python bench/keras_rs_layers_check.py [--python bench/tf_baseline/.venv/bin/python]

Keras-RS's weights are set in the order its layer lists them (down-projection kernel, kernel,
bias: pserver's layout order), their shapes checked.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np

TF_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_baseline", ".venv", "bin", "python")


def cross_cases():
    """(name, FeatureCross options, input shape without the batch, whether x is given)."""
    shapes = [(6,), (3, 6)]
    for projection_dim, diag_scale, use_bias, act, shape, two in itertools.product(
            [None, 3], [0.0, 0.7, None], [True, False], [None, "relu", "sigmoid", "tanh", "softmax"],
            shapes, [False, True]):
        options = dict(projection_dim=projection_dim, diag_scale=diag_scale, use_bias=use_bias,
                       pre_activation=act)
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        name = f"FeatureCross({given}) on {shape}{' with x' if two else ''}"
        yield name, options, shape, two


def dot_cases():
    for f, self_interaction, skip_gather in itertools.product([2, 3, 4, 6], [False, True], [False, True]):
        options = dict(self_interaction=self_interaction, skip_gather=skip_gather)
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        yield f"DotInteraction({given}) on {f} features", options, f


# -- pserver's side ---------------------------------------------------------------------------------

def ours(rng) -> dict:
    """Inputs, weights (by Keras's path) and pserver's outputs for every case, as npz entries."""
    from pserver import keras
    from pserver.layers.interaction import DotInteraction, FeatureCross
    data = {}
    for i, (_, options, shape, two) in enumerate(cross_cases()):
        inputs = [keras.Input(shape=shape) for _ in range(2 if two else 1)]
        model = keras.Model(inputs if two else inputs[0], FeatureCross(**options)(*inputs))
        names = [t.name for t in model._core.layout.tensors]
        weights = [rng.normal(0, 0.5, t.shape).astype(np.float32) for t in model._core.layout.tensors]
        model.set_weights(weights)
        xs = [rng.normal(size=(5, *shape)).astype(np.float32) for _ in inputs]
        data[f"cross{i}/out"] = model.predict(xs if two else xs[0], verbose=0)
        for k, x in enumerate(xs):
            data[f"cross{i}/x{k}"] = x
        data[f"cross{i}/names"] = np.asarray([name.split("/", 1)[1] for name in names])
        for name, w in zip(data[f"cross{i}/names"], weights):
            data[f"cross{i}/w/{name}"] = w
    for i, (_, options, f) in enumerate(dot_cases()):
        xs = [rng.normal(size=(5, 4)).astype(np.float32) for _ in range(f)]
        data[f"dot{i}/out"] = DotInteraction(**options)(xs)
        for k, x in enumerate(xs):
            data[f"dot{i}/x{k}"] = x
    return data


# -- Keras-RS's side (run with --keras-rs IN OUT in an environment with keras-rs) ---------------------

def theirs(path_in: str, path_out: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras_rs
    data = dict(np.load(path_in))
    out = {}
    for i, (_, options, _, two) in enumerate(cross_cases()):
        xs = [data[f"cross{i}/x{k}"] for k in range(2 if two else 1)]
        layer = keras_rs.layers.FeatureCross(**options)
        layer(*xs)                                         # builds its Dense sublayers
        given = [data[f"cross{i}/w/{name}"] for name in data[f"cross{i}/names"]]
        if [tuple(v.shape) for v in layer.weights] != [w.shape for w in given]:
            raise SystemExit(f"case cross{i}: Keras-RS's weights {[v.path for v in layer.weights]}, "
                             f"pserver's {list(data[f'cross{i}/names'])} {[w.shape for w in given]}")
        for v, w in zip(layer.weights, given):
            v.assign(w)
        out[f"cross{i}/out"] = np.asarray(layer(*xs))
    for i, (_, options, f) in enumerate(dot_cases()):
        xs = [data[f"dot{i}/x{k}"] for k in range(f)]
        out[f"dot{i}/out"] = np.asarray(keras_rs.layers.DotInteraction(**options)(xs))
    out["version"] = np.asarray(keras_rs.__version__)
    np.savez(path_out, **out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=TF_PYTHON, help="a Python with keras-rs (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keras-rs", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.keras_rs:
        theirs(*args.keras_rs)
        return
    data = ours(np.random.default_rng(args.seed))
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(path_in, **data)
        subprocess.run([args.python, os.path.abspath(__file__), "--keras-rs", path_in, path_out], check=True,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})     # TensorFlow's start-up lines
        keras_rs = dict(np.load(path_out))
    print(f"keras-rs {keras_rs.pop('version')} ({args.python}) against pserver, float32, max |difference|:")
    worst = 0.0
    names = [c[0] for c in cross_cases()] + [c[0] for c in dot_cases()]
    keys = ([f"cross{i}" for i, _ in enumerate(cross_cases())]
            + [f"dot{i}" for i, _ in enumerate(dot_cases())])
    for name, key in zip(names, keys):
        a, b = data[f"{key}/out"], keras_rs[f"{key}/out"]
        diff = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
        worst = max(worst, diff)
        print(f"  {diff:.2e}  {name}" + ("" if a.shape == b.shape else f"  SHAPES {a.shape} vs {b.shape}"))
    print(f"largest over {len(names)} cases: {worst:.2e}")


if __name__ == "__main__":
    sys.exit(main())
