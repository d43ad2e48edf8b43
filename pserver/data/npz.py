"""Arrays as a Dataset: an .npz file with x and y (and x_test, y_test, or a seeded held-out
split), or arrays in memory (from_arrays, for pserver.train), checked the same way."""

from __future__ import annotations

import math
import os
import zipfile
import zlib

import numpy as np

from pserver.data.dataset import Dataset, one_line
from pserver.errors import DataError

HOLDOUT_FRACTION = 0.1  # of an .npz without x_test/y_test
SCALE_UINT8 = ("auto", "none")  # auto: an .npz's uint8 features (0-255 pixels) are divided by 255
_NPZ_KEYS = ("x", "y", "x_test", "y_test")


def from_arrays(x, y, x_test=None, y_test=None, *, name: str = "arrays", seed: int = 0) -> Dataset:
    """A Dataset from arrays in memory (pserver.train): checked as an .npz's arrays are,
    with a seeded held-out test set when x_test/y_test are not given."""
    arrays = {"x": np.asarray(x), "y": np.asarray(y)}
    if (x_test is None) != (y_test is None):
        raise DataError(f"{name}: give both x_test and y_test, or neither")
    if x_test is not None:
        arrays.update(x_test=np.asarray(x_test), y_test=np.asarray(y_test))
    return _dataset(name, arrays, seed, columns=True)


def load(path: str, seed: int, scale_uint8: bool) -> Dataset:
    arrays = _read_npz(path)
    if scale_uint8:
        raw = [key for key in ("x", "x_test") if key in arrays and arrays[key].dtype == np.uint8]
        for key in raw:
            arrays[key] = np.divide(arrays[key], 255, dtype=np.float32)
        if raw:
            # Unscaled pixels train to nonsense (losses in the hundreds) without a word otherwise.
            print(f"{path}: {' and '.join(raw)} {'are' if len(raw) > 1 else 'is'} uint8: scaled from "
                  "0-255 to [0, 1] (--scale-uint8 none keeps the raw values)", flush=True)
    return _dataset(path, arrays, seed, columns=True)


def _dataset(path: str, arrays: dict[str, np.ndarray], seed: int, columns: bool = False) -> Dataset:
    """`columns`: arrays from Python, whose y may be a model's several outputs' labels."""
    x = _features(path, "x", arrays["x"])
    y = _targets(path, "y", arrays["y"], "x", len(x), columns)
    if "x_test" in arrays:
        x_test = _features(path, "x_test", arrays["x_test"])
        y_test = _targets(path, "y_test", arrays["y_test"], "x_test", len(x_test), columns)
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: x_test has samples of shape {x_test.shape[1:]}, x {x.shape[1:]}")
        if x_test.dtype != x.dtype:
            raise DataError(f"{path}: x_test has records {x_test.dtype}, x {x.dtype}")
        if (y_test.dtype == np.float32) != (y.dtype == np.float32):
            raise DataError(f"{path}: y is {arrays['y'].dtype} but y_test is {arrays['y_test'].dtype}; "
                            "both must be integer labels or both float targets")
    else:
        x, y, x_test, y_test = _hold_out(path, x, y, seed)
    if y.dtype == np.float32:
        return Dataset(path, x, y, x_test, y_test, 0)
    num_classes = int(max(y.max(), y_test.max())) + 1
    if num_classes < 2:
        raise DataError(f"{path}: every label in y is 0; classification needs at least 2 classes")
    return Dataset(path, x, y, x_test, y_test, num_classes)


def _read_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        npz = np.load(path, allow_pickle=False)  # never unpickle: a data file must not run code
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file ({one_line(e)})") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: holds a single .npy array, not an .npz archive with x and y")
    with npz:
        for key in ("x", "y"):
            if key not in npz.files:
                raise DataError(f"{path}: no array {key!r} (it has {', '.join(npz.files) or 'none'})")
        if ("x_test" in npz.files) != ("y_test" in npz.files):
            have, lack = ("x_test", "y_test") if "x_test" in npz.files else ("y_test", "x_test")
            raise DataError(f"{path}: has {have!r} but no {lack!r}; give both or neither")
        arrays = {}
        for key in (k for k in _NPZ_KEYS if k in npz.files):
            try:
                arrays[key] = npz[key]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
                raise DataError(f"{path}: array {key!r} is unreadable ({one_line(e)})") from None
        return arrays


def _features(path: str, key: str, a: np.ndarray) -> np.ndarray:
    """(n, ...) numeric -> float32 of the same shape, C-contiguous and finite; records (a model
    with sparse tables: a field per input) -> the same records, float fields float32."""
    if a.dtype.names:
        return _records(path, key, a)
    if a.dtype.kind not in "biuf":
        raise DataError(f"{path}: {key} has dtype {a.dtype}; it must be numeric")
    if a.ndim < 2 or a.shape[0] == 0 or math.prod(a.shape[1:]) == 0:
        raise DataError(f"{path}: {key} has shape {a.shape}; it must be (samples, features...) with both > 0")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, which the check names
        x = np.ascontiguousarray(a, dtype=np.float32)
    _check_finite(path, key, x)  # after the cast, so float64 values beyond float32's range count too
    return x


def _targets(path: str, key: str, a: np.ndarray, x_key: str, n: int, columns: bool = False) -> np.ndarray:
    """Integer labels -> int32 (>= 0), float targets -> float32 (finite). `columns`: (n, k)
    too: a model with several outputs' labels, float (pserver.models.outputs), or an output
    with steps' labels, each sample's flattened (Functional.labels)."""
    if not (a.ndim == 1 or columns and a.ndim == 2) or len(a) != n:
        raise DataError(f"{path}: {key} has shape {a.shape}; it must be ({n},), one value per row of {x_key}")
    if a.dtype.kind in "biu":
        if a.min() < 0 or a.max() > np.iinfo(np.int32).max:
            bad = int(np.argmax((a < 0) | (a > np.iinfo(np.int32).max)) // (a.size // len(a)))
            raise DataError(f"{path}: {key}[{bad}] = {a[bad]}; class labels must be in [0, 2**31)")
        return a.astype(np.int32)
    if a.dtype.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            y = a.astype(np.float32)
        _check_finite(path, key, y)
        return y
    raise DataError(f"{path}: {key} has dtype {a.dtype}; it must be integer labels or float targets")


def _records(path: str, key: str, a: np.ndarray) -> np.ndarray:
    """A 1-D array of records whose fields are integer ids or floats (float32 out, finite)."""
    if a.ndim != 1 or a.shape[0] == 0:
        raise DataError(f"{path}: {key} has shape {a.shape}; records must be a 1-D array of n >= 1")
    fields = []
    for name in a.dtype.names:
        base, shape = a.dtype[name].base, a.dtype[name].shape
        if base.kind not in "biuf":
            raise DataError(f"{path}: {key}[{name!r}] has dtype {base}; it must be numeric")
        fields.append((name, np.float32 if base.kind == "f" else base, shape))
    out = np.empty(len(a), fields)
    with np.errstate(over="ignore", invalid="ignore"):
        for name in a.dtype.names:
            out[name] = a[name]
            if out.dtype[name].base.kind == "f":
                _check_finite(path, f"{key}[{name!r}]", out[name])
    return out


def _check_finite(path: str, key: str, a: np.ndarray) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        first = int(np.argmax(bad.reshape(len(a), -1).any(axis=1)))
        raise DataError(f"{path}: {key} has {int(bad.sum())} non-finite values (NaN, Inf or beyond float32), "
                        f"the first in row {first}")


def _hold_out(path: str, x: np.ndarray, y: np.ndarray, seed: int):
    """A seeded shuffle, then the last HOLDOUT_FRACTION of it (at least one sample) is the test set."""
    n = len(x)
    if n < 2:
        raise DataError(f"{path}: x has {n} sample; holding out a test set needs 2 or more "
                        "(or give x_test and y_test)")
    n_test = max(1, int(n * HOLDOUT_FRACTION))
    order = np.random.default_rng(seed).permutation(n)
    train, test = order[:n - n_test], order[n - n_test:]
    return x[train], y[train], x[test], y[test]
