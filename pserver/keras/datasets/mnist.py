"""keras.datasets.mnist.load_data(), through pserver's own MNIST loading (cache, checksums)."""

from __future__ import annotations

import os


def load_data(path: str | None = None):
    """((x_train, y_train), (x_test, y_test)): uint8 images (60000, 28, 28) and (10000, 28, 28),
    uint8 labels, as Keras's. The files come from $PSERVER_MNIST_DIR (the worker's --data-dir),
    else pserver's cache (downloaded once, checked against their SHA-256). Keras's `path` (a
    file name in its cache) is taken as the directory of the four IDX files."""
    from pserver.data.mnist import load_raw
    return load_raw(path or os.environ.get("PSERVER_MNIST_DIR"))


__all__ = ["load_data"]
