"""keras.utils: to_categorical, set_random_seed, pad_sequences, PyDataset (pserver.keras.data)."""

from __future__ import annotations

import os
import random

import numpy as np

from pserver.errors import ConfigError
from pserver.keras._names import missing as _missing
from pserver.keras.data import PyDataset
from pserver.launch.run import SEED


def to_categorical(x, num_classes: int | None = None) -> np.ndarray:
    """Integer classes as one-hot float32 rows, as keras.utils.to_categorical: (n,) -> (n,
    num_classes); num_classes defaults to max + 1."""
    y = np.asarray(x)
    if y.ndim > 1 and y.shape[-1] == 1:
        y = y.reshape(y.shape[:-1])
    if y.size and (y.dtype.kind not in "iu" and not np.all(y == np.floor(y)) or y.min() < 0):
        raise ConfigError("to_categorical: takes non-negative integer classes")
    y = y.astype(np.int64)
    n = int(y.max()) + 1 if num_classes is None and y.size else int(num_classes or 0)
    if y.size and y.max() >= n:
        raise ConfigError(f"to_categorical: class {int(y.max())} >= num_classes={n}")
    out = np.zeros((y.size, n), dtype=np.float32)
    out[np.arange(y.size), y.ravel()] = 1
    return out.reshape((*y.shape, n))


def set_random_seed(seed: int) -> None:
    """keras.utils.set_random_seed: one seed for what is random in the script's run, the model's
    initial weights, dropout and the order of the data (read when the model first needs its
    weights, so call it first, as Keras scripts do), and Python's `random` and NumPy's global
    generator, as Keras seeds them. Under `pserver run` every rank makes the same call, so the
    workers agree; it takes the place of `pserver run --seed`."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
        raise ConfigError(f"set_random_seed: the seed must be an integer in [0, 2**32), got {seed!r}")
    os.environ[SEED] = str(int(seed))          # what pserver.keras.cluster.seed() reads
    random.seed(int(seed))
    np.random.seed(int(seed))


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

def pad_sequences(sequences, maxlen: int | None = None, dtype="int32", padding: str = "pre",
                  truncating: str = "pre", value=0.0) -> np.ndarray:
    """keras.utils.pad_sequences: lists of ids as one (n, maxlen) array (maxlen defaults to the
    longest); a shorter sequence is padded with `value`, a longer one cut, before ("pre", Keras's
    default) or after ("post")."""
    for what, given in (("padding", padding), ("truncating", truncating)):
        if given not in ("pre", "post"):
            raise ConfigError(f"pad_sequences: {what} must be 'pre' or 'post', got {given!r}")
    seqs = [np.asarray(s) for s in sequences]
    width = max((len(s) for s in seqs), default=0) if maxlen is None else int(maxlen)
    out = np.full((len(seqs), width), value, dtype=dtype)
    for row, s in zip(out, seqs):
        kept = (s[-width:] if truncating == "pre" else s[:width]) if width else s[:0]
        if padding == "pre":
            row[width - len(kept):] = kept
        else:
            row[:len(kept)] = kept
    return out


__all__ = ["to_categorical", "set_random_seed", "pad_sequences", "PyDataset"]
