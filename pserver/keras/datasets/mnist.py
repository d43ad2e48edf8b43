"""keras.datasets.mnist.load_data(), through pserver's own MNIST loading (cache, checksums)."""

from __future__ import annotations


def load_data(path: str | None = None):
    """((x_train, y_train), (x_test, y_test)): uint8 images (60000, 28, 28) and (10000, 28, 28),
    uint8 labels, as Keras's. Keras's `path` (a file name in its cache) is taken as the directory
    of the four IDX files; without it they come from where every pserver command finds MNIST
    (pserver.data.mnist.mnist_dir: $PSERVER_MNIST_DIR, else pserver's cache, downloaded once and
    checked against their SHA-256)."""
    from pserver.data.mnist import load_raw
    return load_raw(path)


__all__ = ["load_data"]
