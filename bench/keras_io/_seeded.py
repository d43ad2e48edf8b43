"""Runs a keras.io example file (compare.py --keras-io) as its own script, after the one thing
the example does not do: seeding. `KERAS_IO_SIDE=pserver` seeds pserver.keras (the example's
import lines were rewritten to it); otherwise Keras 3 is seeded, and `keras.datasets.mnist.load_data`
returns MNIST read from $PSERVER_MNIST_DIR's IDX files (the same bytes pserver reads), since Keras's
loader downloads, which this machine cannot. The seed and the loader are _ours.py's, which our own
scripts use: $KERAS_IO_SEED (default 1).

    python _seeded.py EXAMPLE.py
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from _ours import load_mnist, seed


def _keras_loads_local_mnist() -> None:
    import keras

    def load_data(path="mnist.npz"):
        return load_mnist()

    importlib.import_module("tensorflow.keras.datasets.mnist")        # the lazy alias the examples import
    for name, module in list(sys.modules.items()):
        if name.endswith("datasets.mnist") and hasattr(module, "load_data"):
            module.load_data = load_data
    seed(keras)


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if os.environ.get("KERAS_IO_SIDE") == "pserver":
        import pserver.keras as keras
        seed(keras)
    else:
        _keras_loads_local_mnist()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
