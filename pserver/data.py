"""Datasets and the per-rank slices that workers train on.

    load_dataset("synthetic" | "mnist" | "path.npz") -> Dataset   (float32 x, int32 labels or float32 targets)
    load_dataset("criteo:PATH" | "criteo-synthetic")              (click-through data: pserver.criteo)
    epoch_indices / iterate_batches                                 (rank r's disjoint block of one epoch)

Every epoch is one permutation of the training set drawn from `seed + epoch`, the same on every
worker; rank r takes the r-th of `num_workers` equal blocks, so the ranks never overlap and all run
the same number of steps (the `num_train % num_workers` left-over samples sit that epoch out).

MNIST comes from the four IDX files in `--data-dir` (.gz or not), by default a directory in the
user's cache (default_mnist_dir), created when missing. Missing files are fetched from the
mirrors in MNIST_MIRRORS, one after the other, or from the comma-separated base URLs in
$PSERVER_MNIST_MIRRORS (set it empty to never download), and kept only if their sha256 matches.
Every problem with the data raises DataError, every bad option ConfigError, with one line that names
the file, key or flag and the value.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import math
import os
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pserver.errors import ConfigError, DataError

DATASETS = ("synthetic", "mnist", "criteo-synthetic")  # plus criteo:PATH and any path ending in .npz
TASKS = ("classification", "regression")

# Distance between two class centres of `synthetic`, in units of the (unit) noise. 5.5 puts the
# Bayes accuracy near 0.975 for 10 classes, and one epoch of SGD on a linear model gets ~0.97 on
# the default 60000 x 784, so a run that learns shows it but nothing reaches a trivial 1.0.
SYNTHETIC_SEPARATION = 5.5
SYNTHETIC_REGRESSION_NOISE = 0.1  # target noise std; the signal's std is ~1
HOLDOUT_FRACTION = 0.1  # of an .npz without x_test/y_test

MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/",
                 "http://yann.lecun.com/exdb/mnist/")
MNIST_MIRRORS_ENV = "PSERVER_MNIST_MIRRORS"
DOWNLOAD_TIMEOUT_S = 10.0  # per socket operation, so a dead mirror costs seconds, not minutes
# name -> (bytes, sha256) of the original .gz files, as every mirror above serves them.
MNIST_FILES = {
    "train-images-idx3-ubyte": (9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
    "train-labels-idx1-ubyte": (28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
    "t10k-images-idx3-ubyte": (1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
    "t10k-labels-idx1-ubyte": (4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
}
_NPZ_KEYS = ("x", "y", "x_test", "y_test")


@dataclass(frozen=True, eq=False)  # eq=False: comparing ndarrays with == has no single truth value
class Dataset:
    name: str  # "synthetic", "mnist" or the .npz path
    x_train: np.ndarray  # (n, *sample_shape) float32, C-contiguous: (n, d), or images (n, h, w, c)
    y_train: np.ndarray  # (n,) int32 labels (classification) or float32 targets (regression)
    x_test: np.ndarray  # (m, *sample_shape) float32, C-contiguous
    y_test: np.ndarray  # (m,)
    num_classes: int  # 0 for regression

    def __post_init__(self):
        # The worker's kernels rely on these; checking once here beats a wrong answer later.
        y_dtype = np.float32 if self.num_classes == 0 else np.int32
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.ndim < 2 or x.dtype != np.float32 or not x.flags.c_contiguous:
                raise DataError(f"{self.name}: x_{split} must be C-contiguous float32 of shape "
                                f"(samples, ...), got {x.dtype} {x.shape}")
            if y.shape != (len(x),) or y.dtype != y_dtype:
                raise DataError(f"{self.name}: y_{split} must be {np.dtype(y_dtype)} of shape "
                                f"({len(x)},), got {y.dtype} {y.shape}")
            if len(x) == 0:
                raise DataError(f"{self.name}: the {split} set is empty")
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise DataError(f"{self.name}: x_test has samples of shape {self.x_test.shape[1:]}, "
                            f"x_train {self.x_train.shape[1:]}")

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape: (features,), or (height, width, channels) for images."""
        return tuple(self.x_train.shape[1:])

    @property
    def features(self) -> int:
        """Values per sample."""
        return math.prod(self.sample_shape)

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    @property
    def num_test(self) -> int:
        return len(self.x_test)

    @property
    def task(self) -> str:
        return "regression" if self.num_classes == 0 else "classification"

    def steps(self, num_workers: int, batch_size: int) -> int:
        return steps_per_epoch(self.num_train, num_workers, batch_size)

    def epoch(self, rank: int, num_workers: int, batch_size: int, seed: int,
              epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iterate_batches(self, rank, num_workers, batch_size, seed, epoch)


@dataclass(frozen=True, eq=False)
class Stream:
    """One worker's training data as (x, y) batches from Python, for data larger than memory.

    `source` is an iterable of batches, or a function returning one: it is called each epoch,
    so a generator that reads the user's files starts over. Each worker is given its own
    batches (the split by rank is the caller's, as with TensorFlow's per-worker datasets);
    in sync mode every worker should yield the same number per epoch. x_test/y_test are the
    chief's evaluation set, or None (no evaluation).
    """
    name: str
    source: object
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    num_classes: int = 0

    def steps(self, num_workers: int, batch_size: int) -> int:
        return 0   # unknown until the source runs out

    def epoch(self, rank: int, num_workers: int, batch_size: int, seed: int,
              epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        batches = self.source() if callable(self.source) else self.source
        if epoch > 0 and iter(batches) is batches and not callable(self.source):
            raise DataError(f"{self.name}: an iterator runs out after one epoch; for --epochs > 1 "
                            "pass a function that returns a fresh one")
        for i, batch in enumerate(batches):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise DataError(f"{self.name}: batch {i} is a {type(batch).__name__}, not an (x, y) pair")
            yield np.asarray(batch[0]), np.asarray(batch[1])


def describe(ds) -> str:
    """One line for the worker's log: what it trains on."""
    if not isinstance(ds, (Dataset, Stream)):   # Criteo data (pserver.criteo) describes itself
        return ds.describe()
    if isinstance(ds, Stream):
        test = "no test set" if ds.x_test is None else f"{len(ds.x_test)} test samples"
        return f"dataset {ds.name}: batches from Python, {test}"
    kind = "regression" if ds.num_classes == 0 else f"{ds.num_classes} classes"
    shape = (f"{ds.features} features" if len(ds.sample_shape) == 1
             else f"samples of shape {ds.sample_shape}")
    return f"dataset {ds.name}: {ds.num_train} train / {ds.num_test} test samples, {shape}, {kind}"


def load_dataset(spec: str, *, data_dir: str | None = None, seed: int = 0, task: str = "classification",
                 samples: int = 60000, test_samples: int = 10000, features: int = 784,
                 classes: int = 10):
    """Load `spec`: "synthetic", "mnist", a path ending in .npz (each a Dataset), or Criteo data:
    "criteo:PATH" (a TSV file, plain or .gz, streamed) or "criteo-synthetic" (see pserver.criteo).

    samples/test_samples/features/classes shape `synthetic` only, samples/test_samples also
    `criteo-synthetic`; test_samples caps the test set held out of a Criteo file. seed generates
    both synthetic kinds and shuffles an .npz's held-out test set. task="regression" asks for float targets: synthetic
    then draws a linear-regression task, and integer labels (mnist, .npz) become float32 targets.
    A float `y` in an .npz is always regression.
    """
    if task not in TASKS:
        raise ConfigError(f"--task: unknown task {task!r}; choose classification or regression")
    _check_int("--seed", seed, 0)
    if spec == "synthetic":
        return _synthetic(seed, task, samples, test_samples, features, classes)
    if spec == "mnist":
        return as_task(_load_mnist(data_dir), task)
    if spec == "criteo-synthetic" or spec.startswith("criteo:"):
        return _load_criteo(spec, seed, task, samples, test_samples)
    if spec.lower().endswith(".npz"):
        return as_task(_load_npz(spec, seed), task)
    raise ConfigError(f"--dataset: unknown dataset {spec!r}; choose synthetic, mnist, criteo-synthetic, "
                      "criteo:PATH (a Criteo TSV file) or a path to a .npz file")


def _load_criteo(spec: str, seed: int, task: str, samples: int, test_samples: int):
    from pserver import criteo   # imports this module: here, not at the top
    if task != "classification":
        raise ConfigError(f"--dataset {spec}: click-through data is binary classification, not {task}")
    if spec == "criteo-synthetic":
        return criteo.load_synthetic(seed, samples, test_samples)
    path = spec[len("criteo:"):]
    if not path:
        raise ConfigError("--dataset criteo:PATH: the path is empty (e.g. criteo:train.txt or criteo:day_0.gz)")
    return criteo.load_file(os.path.expanduser(path), test_samples)


def _check_int(flag: str, value: int, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{flag}: must be an integer >= {low}, got {value!r}")


def as_task(ds: Dataset, task: str) -> Dataset:
    """Integer labels as float targets when regression was asked for (float y is already)."""
    if task == "classification" or ds.num_classes == 0:
        return ds
    return Dataset(ds.name, ds.x_train, ds.y_train.astype(np.float32), ds.x_test,
                   ds.y_test.astype(np.float32), 0)


def from_arrays(x, y, x_test=None, y_test=None, *, name: str = "arrays", seed: int = 0) -> Dataset:
    """A Dataset from arrays in memory (pserver.train): checked as an .npz's arrays are,
    with a seeded held-out test set when x_test/y_test are not given."""
    arrays = {"x": np.asarray(x), "y": np.asarray(y)}
    if (x_test is None) != (y_test is None):
        raise DataError(f"{name}: give both x_test and y_test, or neither")
    if x_test is not None:
        arrays.update(x_test=np.asarray(x_test), y_test=np.asarray(y_test))
    return _dataset(name, arrays, seed)


# ---------------------------------------------------------------- per-rank slices of an epoch

def steps_per_epoch(num_train: int, num_workers: int, batch_size: int) -> int:
    """Steps every worker runs per epoch: full batches from its equal share of the data."""
    _check_int("--num-workers", num_workers, 1)
    _check_int("--batch-size", batch_size, 1)
    per_worker = num_train // num_workers
    steps = per_worker // batch_size
    if steps == 0:
        raise ConfigError(f"--batch-size: {batch_size} is larger than each worker's slice of {per_worker} "
                          f"samples ({num_train} training samples / {num_workers} workers)")
    return steps


def epoch_indices(num_train: int, rank: int, num_workers: int, seed: int, epoch: int) -> np.ndarray:
    """Rank's block of this epoch's permutation of range(num_train), length num_train // num_workers."""
    _check_int("--num-workers", num_workers, 1)
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_workers:
        raise ConfigError(f"--rank: must be in [0, {num_workers}) for {num_workers} workers, got {rank!r}")
    _check_int("--seed", seed, 0)
    _check_int("epoch", epoch, 0)
    _check_int("num_train", num_train, 0)
    per_worker = num_train // num_workers
    # Every rank draws the same permutation (same seed), so the blocks partition it.
    order = np.random.default_rng(seed + epoch).permutation(num_train)
    return order[rank * per_worker:(rank + 1) * per_worker].copy()  # copy: don't pin the whole order


def iterate_batches(ds: Dataset, rank: int, num_workers: int, batch_size: int, seed: int,
                    epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Exactly steps_per_epoch(...) batches (x, y) of batch_size rows from this rank's block."""
    # Validate now, not at the first next(): a bad flag should fail where it is passed.
    steps = steps_per_epoch(ds.num_train, num_workers, batch_size)
    order = epoch_indices(ds.num_train, rank, num_workers, seed, epoch)
    return _batches(ds, order, steps, batch_size)


def _batches(ds: Dataset, order: np.ndarray, steps: int, batch_size: int):
    for step in range(steps):
        take = order[step * batch_size:(step + 1) * batch_size]
        yield ds.x_train[take], ds.y_train[take]  # fancy indexing: fresh C-contiguous copies


# ---------------------------------------------------------------- synthetic

def _synthetic(seed: int, task: str, samples: int, test_samples: int, features: int,
               classes: int) -> Dataset:
    _check_int("--samples", samples, 1)
    _check_int("--test-samples", test_samples, 1)
    _check_int("--features", features, 1)
    if task == "classification":
        _check_int("--classes", classes, 2)
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


# ---------------------------------------------------------------- mnist

def default_mnist_dir() -> str:
    """Where MNIST goes without --data-dir: $XDG_CACHE_HOME/pserver/mnist, ~/.cache by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pserver", "mnist")


def _load_mnist(data_dir: str | None) -> Dataset:
    data_dir = default_mnist_dir() if data_dir is None else data_dir
    root = os.path.expanduser(data_dir)
    _make_dir(root, data_dir)
    paths = _mnist_paths(root)
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        why = _download_missing(root, missing)
        paths = _mnist_paths(root)
        if why is not None:
            raise DataError(_missing_message(data_dir, paths, why))
    x_train, y_train = _mnist_split(paths["train-images-idx3-ubyte"], paths["train-labels-idx1-ubyte"])
    x_test, y_test = _mnist_split(paths["t10k-images-idx3-ubyte"], paths["t10k-labels-idx1-ubyte"])
    if x_test.shape[1:] != x_train.shape[1:]:
        raise DataError(f"mnist: {paths['t10k-images-idx3-ubyte']} has {math.prod(x_test.shape[1:])} pixels "
                        f"per image, {paths['train-images-idx3-ubyte']} {math.prod(x_train.shape[1:])}")
    return Dataset("mnist", x_train, y_train, x_test, y_test, 10)


def _make_dir(root: str, data_dir: str) -> None:
    """The directory exists afterwards (made here if need be), ready for the files."""
    if os.path.isdir(root):
        return
    if os.path.exists(root):
        raise DataError(f"mnist: --data-dir {data_dir} is not a directory")
    try:
        os.makedirs(root)
    except OSError as e:
        raise DataError(f"mnist: cannot create --data-dir {data_dir} ({e.strerror or e})") from None


def _missing_message(data_dir: str, paths: dict, why: str) -> str:
    """One line: what is missing, why the download failed, how to put the files there by hand."""
    missing = [name for name, path in paths.items() if path is None]  # some may have come
    have_not = ", ".join(f"{name}(.gz)" for name in missing)
    get = ", ".join(f"{name}.gz" for name in missing)
    return (f"mnist: {data_dir} has no {have_not}; download failed ({why}); download {get} by hand "
            f"from any of {', '.join(MNIST_MIRRORS)} and put them in {data_dir} (or give --data-dir "
            f"a directory that holds them)")


def _mnist_paths(root: str) -> dict[str, str | None]:
    """Each file's path, uncompressed preferred (no inflating), or None when neither is there."""
    found = {}
    for name in MNIST_FILES:
        candidates = [os.path.join(root, name + ext) for ext in ("", ".gz")]
        found[name] = next((p for p in candidates if os.path.isfile(p)), None)
    return found


def _mnist_split(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
    images = _read_idx(images_path, 3)
    labels = _read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels but {images_path} has {len(images)} images")
    if len(labels) and labels.max() > 9:
        i = int(np.argmax(labels > 9))
        raise DataError(f"{labels_path}: label {labels[i]} at index {i} is not a digit 0-9")
    # (n, 28, 28, 1): channels-last images; a dense model's input takes them flat (a view).
    x = np.divide(images[..., None], 255, dtype=np.float32)
    return x, labels.astype(np.int32)


def _read_idx(path: str, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `ndim` dimensions, checked strictly, as a uint8 array."""
    data = _read_bytes(path)
    magic = 0x0800 + ndim  # 0x08: unsigned bytes; low byte: number of dimensions
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, need {header})")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise DataError(f"{path}: IDX magic number is {found}, expected {magic} "
                        f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, 4))
    size = math.prod(dims)
    if len(data) - header != size:
        what = "truncated" if len(data) - header < size else "trailing bytes"
        raise DataError(f"{path}: {what}: the header says {' x '.join(map(str, dims))} = {size} bytes "
                        f"of data, the file has {len(data) - header}")
    return np.frombuffer(data, np.uint8, size, header).reshape(dims)


def _read_bytes(path: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut stream an EOFError
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None


def _mirrors() -> list[str]:
    env = os.environ.get(MNIST_MIRRORS_ENV)
    bases = MNIST_MIRRORS if env is None else [u.strip() for u in env.split(",") if u.strip()]
    return [u if u.endswith("/") else u + "/" for u in bases]


def _download_missing(root: str, missing: list[str]) -> str | None:
    """Fetch each missing .gz from the first mirror that has it; why it failed, or None."""
    mirrors = _mirrors()
    if not mirrors:
        return f"no mirrors: ${MNIST_MIRRORS_ENV} is empty"
    for name in missing:
        reasons = []
        for base in mirrors:
            url = base + name + ".gz"
            print(f"mnist: downloading {url} into {root}", flush=True)   # stderr: errors only
            try:
                _download(url, root, name)
                break
            except (OSError, http.client.HTTPException, ValueError, DataError) as e:
                reasons.append(f"{url}: {_one_line(e)}")
        else:
            # Give up at the first file no mirror has: with no network, that is all of them,
            # and trying the rest would only multiply the wait.
            return "; ".join(reasons)
    return None


def _download(url: str, root: str, name: str) -> None:
    """url -> root/name.gz, written to a temporary file and renamed only once its sha256 matches."""
    size, sha256 = MNIST_FILES[name]
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}.", suffix=".part")
        try:
            digest, got = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out:
                # Read at most one byte more than expected: enough to tell, never unbounded.
                while got <= size and (chunk := response.read(min(1 << 20, size + 1 - got))):
                    digest.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            if got != size or digest.hexdigest() != sha256:
                raise DataError(f"got {got} bytes with sha256 {digest.hexdigest()[:16]}..., "
                                f"expected {size} bytes with sha256 {sha256[:16]}...")
            os.replace(tmp, os.path.join(root, name + ".gz"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a wrong or partial download must never be taken for the file
            raise


def _one_line(e: BaseException) -> str:
    """The exception as one line; for a failed connection just its reason ("Name or service not known")."""
    network = isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError)
    reason = e.reason if network else e
    return " ".join(str(reason).split()) or type(e).__name__


# ---------------------------------------------------------------- .npz

def _load_npz(path: str, seed: int) -> Dataset:
    return _dataset(path, _read_npz(path), seed)


def _dataset(path: str, arrays: dict[str, np.ndarray], seed: int) -> Dataset:
    x = _features(path, "x", arrays["x"])
    y = _targets(path, "y", arrays["y"], "x", len(x))
    if "x_test" in arrays:
        x_test = _features(path, "x_test", arrays["x_test"])
        y_test = _targets(path, "y_test", arrays["y_test"], "x_test", len(x_test))
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: x_test has samples of shape {x_test.shape[1:]}, x {x.shape[1:]}")
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
        raise DataError(f"{path}: not a readable .npz file ({_one_line(e)})") from None
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
                raise DataError(f"{path}: array {key!r} is unreadable ({_one_line(e)})") from None
        return arrays


def _features(path: str, key: str, a: np.ndarray) -> np.ndarray:
    """(n, ...) numeric -> float32 of the same shape, C-contiguous and finite."""
    if a.dtype.kind not in "biuf":
        raise DataError(f"{path}: {key} has dtype {a.dtype}; it must be numeric")
    if a.ndim < 2 or a.shape[0] == 0 or math.prod(a.shape[1:]) == 0:
        raise DataError(f"{path}: {key} has shape {a.shape}; it must be (samples, features...) with both > 0")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, which the check names
        x = np.ascontiguousarray(a, dtype=np.float32)
    _check_finite(path, key, x)  # after the cast, so float64 values beyond float32's range count too
    return x


def _targets(path: str, key: str, a: np.ndarray, x_key: str, n: int) -> np.ndarray:
    """Integer labels -> int32 (>= 0), float targets -> float32 (finite)."""
    if a.ndim != 1 or len(a) != n:
        raise DataError(f"{path}: {key} has shape {a.shape}; it must be ({n},), one value per row of {x_key}")
    if a.dtype.kind in "biu":
        if a.min() < 0 or a.max() > np.iinfo(np.int32).max:
            bad = int(np.argmax((a < 0) | (a > np.iinfo(np.int32).max)))
            raise DataError(f"{path}: {key}[{bad}] = {a[bad]}; class labels must be in [0, 2**31)")
        return a.astype(np.int32)
    if a.dtype.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            y = a.astype(np.float32)
        _check_finite(path, key, y)
        return y
    raise DataError(f"{path}: {key} has dtype {a.dtype}; it must be integer labels or float targets")


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
