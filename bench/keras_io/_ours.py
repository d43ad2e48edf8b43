"""What the keras.io scripts here add to the guides (their blocks marked "ours"), in one place:
the seed and a sample limit from the environment, and MNIST read from its IDX files.

compare.py copies this file beside the scripts it runs; run directly, a script finds it in its
own directory."""

from __future__ import annotations

import gzip
import os

import numpy as np

SEED = int(os.environ.get("KERAS_IO_SEED", "1"))
SAMPLES = int(os.environ.get("KERAS_IO_SAMPLES", "0"))  # 0: all of MNIST


def seed(keras) -> None:
    """keras.utils.set_random_seed on both sides (the runs committed in bench/results/keras_io/
    were made before pserver.keras had it: pserver was seeded by the same seed, `pserver run --seed`)."""
    keras.utils.set_random_seed(SEED)


def load_mnist():
    """keras.datasets.mnist.load_data()'s arrays, read from the IDX files in $PSERVER_MNIST_DIR
    (Keras's own loader downloads): the same bytes on both sides."""
    def read(name, offset):
        with gzip.open(os.path.join(os.environ["PSERVER_MNIST_DIR"], name)) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    x_train = read("train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    x_test = read("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    y_train, y_test = read("train-labels-idx1-ubyte.gz", 8), read("t10k-labels-idx1-ubyte.gz", 8)
    if SAMPLES:
        return (x_train[:SAMPLES], y_train[:SAMPLES]), (x_test[:SAMPLES], y_test[:SAMPLES])
    return (x_train, y_train), (x_test, y_test)
