"""Sequence data the recurrent tests train on (keras.io's examples, made here)."""

from __future__ import annotations

import numpy as np


def addition_data(n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """keras.io's addition_rnn data: "a+b" of numbers of 1 to 3 digits, padded to 7 characters and
    reversed, one-hot over "0123456789+ "; the answer padded to 4 characters, one class each."""
    chars = "0123456789+ "
    x, y = np.zeros((n, 7, 12), np.float32), np.zeros((n, 4), np.int64)
    for i in range(n):
        a, b = (int("".join(rng.choice(list("0123456789"), rng.integers(1, 4)))) for _ in range(2))
        x[i, np.arange(7), [chars.index(c) for c in f"{a}+{b}".ljust(7)[::-1]]] = 1
        y[i] = [chars.index(c) for c in str(a + b).ljust(4)]
    return x, y
