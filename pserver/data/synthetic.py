"""`synthetic`: Gaussian clusters (classification) or a noisy linear task (regression),
drawn from the seed; the test set stays the same whatever --samples is."""

from __future__ import annotations

import math

import numpy as np

from pserver.data.dataset import Dataset, check_int

# Distance between two class centres of `synthetic`, in units of the (unit) noise. 5.5 puts the
# Bayes accuracy near 0.975 for 10 classes, and one epoch of SGD on a linear model gets ~0.97 on
# the default 60000 x 784, so a run that learns shows it but nothing reaches a trivial 1.0.
SYNTHETIC_SEPARATION = 5.5
SYNTHETIC_REGRESSION_NOISE = 0.1  # target noise std; the signal's std is ~1


def generate(seed: int, task: str, samples: int, test_samples: int, features: int,
               classes: int) -> Dataset:
    check_int("--samples", samples, 1)
    check_int("--test-samples", test_samples, 1)
    check_int("--features", features, 1)
    if task == "classification":
        check_int("--classes", classes, 2)
    # Separate streams for the task, the train draw and the test draw: the test set (and the
    # task) stay the same whatever --samples is.
    task_ss, train_ss, test_ss = np.random.SeedSequence(seed).spawn(3)
    rng = np.random.default_rng(task_ss)
    if task == "classification":
        # Random centres at expected pairwise distance SYNTHETIC_SEPARATION, whatever the dimension.
        scale = np.float32(SYNTHETIC_SEPARATION / math.sqrt(2 * features))
        centres = rng.standard_normal((classes, features), dtype=np.float32) * scale
        x, y = _clusters(train_ss, samples, centres)
        x_test, y_test = _clusters(test_ss, test_samples, centres)
        return Dataset("synthetic", x, y, x_test, y_test, classes)
    w = rng.standard_normal(features, dtype=np.float32) / np.float32(math.sqrt(features))  # var(x @ w) ~ 1
    b = rng.standard_normal(dtype=np.float32)
    x, y = _linear(train_ss, samples, w, b)
    x_test, y_test = _linear(test_ss, test_samples, w, b)
    return Dataset("synthetic", x, y, x_test, y_test, 0)


def _clusters(ss: np.random.SeedSequence, n: int, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(ss)
    y = rng.integers(0, len(centres), n, dtype=np.int32)
    x = rng.standard_normal((n, centres.shape[1]), dtype=np.float32)
    # In chunks: centres[y] for all rows at once would be a second full-size temporary.
    for i in range(0, n, 8192):
        x[i:i + 8192] += centres[y[i:i + 8192]]
    return x, y


def _linear(ss: np.random.SeedSequence, n: int, w: np.ndarray,
            b: np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(ss)
    x = rng.standard_normal((n, len(w)), dtype=np.float32)
    noise = rng.standard_normal(n, dtype=np.float32) * np.float32(SYNTHETIC_REGRESSION_NOISE)
    return x, (x @ w + b + noise).astype(np.float32)
