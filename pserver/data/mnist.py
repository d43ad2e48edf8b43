"""MNIST from the four IDX files (.gz or not) in one directory, which mnist_dir chooses, in this
order: --data-dir (the `data_dir` argument), else $PSERVER_MNIST_DIR, else the user's cache
(default_mnist_dir: $XDG_CACHE_HOME/pserver/mnist); the chosen directory is created when missing.
Files missing from it are downloaded into it from the mirrors in MNIST_MIRRORS, one after the
other, or from the comma-separated base URLs in $PSERVER_MNIST_MIRRORS (set it empty to never
download), and kept only if their sha256 matches. Every loader of MNIST (the CLI, the Python API,
pserver.keras's keras.datasets.mnist, the tests and benches) goes through mnist_dir."""

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
import zlib

import numpy as np

from pserver.data.dataset import Dataset, one_line
from pserver.errors import DataError

MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/",
                 "http://yann.lecun.com/exdb/mnist/")
MNIST_MIRRORS_ENV = "PSERVER_MNIST_MIRRORS"
MNIST_DIR_ENV = "PSERVER_MNIST_DIR"   # the directory when no --data-dir is given
DOWNLOAD_TIMEOUT_S = 10.0  # per socket operation, so a dead mirror costs seconds, not minutes
# name -> (bytes, sha256) of the original .gz files, as every mirror above serves them.
MNIST_FILES = {
    "train-images-idx3-ubyte": (9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
    "train-labels-idx1-ubyte": (28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
    "t10k-images-idx3-ubyte": (1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
    "t10k-labels-idx1-ubyte": (4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
}


def default_mnist_dir() -> str:
    """Where MNIST goes without --data-dir: $XDG_CACHE_HOME/pserver/mnist, ~/.cache by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pserver", "mnist")


def mnist_dir(data_dir: str | None = None) -> tuple[str, str]:
    """(directory, what named it) for MNIST: `data_dir` (--data-dir) when given, else
    $PSERVER_MNIST_DIR when set and not empty, else the user's cache (default_mnist_dir). The
    first one named is the directory: files missing there are downloaded into it, never looked
    for further down the list (a directory a user names is the one meant)."""
    if data_dir is not None:
        return data_dir, "--data-dir"
    env = os.environ.get(MNIST_DIR_ENV)
    if env:
        return env, f"${MNIST_DIR_ENV}"
    return default_mnist_dir(), "the cache directory"


def load(data_dir: str | None) -> Dataset:
    paths = _checked_paths(data_dir)
    x_train, y_train = _mnist_split(paths["train-images-idx3-ubyte"], paths["train-labels-idx1-ubyte"])
    x_test, y_test = _mnist_split(paths["t10k-images-idx3-ubyte"], paths["t10k-labels-idx1-ubyte"])
    if x_test.shape[1:] != x_train.shape[1:]:
        raise DataError(f"mnist: {paths['t10k-images-idx3-ubyte']} has {math.prod(x_test.shape[1:])} pixels "
                        f"per image, {paths['train-images-idx3-ubyte']} {math.prod(x_train.shape[1:])}")
    return Dataset("mnist", x_train, y_train, x_test, y_test, 10)


def load_raw(data_dir: str | None) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)) as the IDX files hold them: uint8 images (n, 28, 28)
    and uint8 labels, as keras.datasets.mnist.load_data() returns them (the same cache,
    checksums and downloads as load)."""
    paths = _checked_paths(data_dir)
    out = []
    for images, labels in (("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                           ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")):
        x, y = _read_idx(paths[images], 3), _read_idx(paths[labels], 1)
        if len(x) != len(y):
            raise DataError(f"{paths[labels]}: {len(y)} labels but {paths[images]} has {len(x)} images")
        out.append((x, y))
    return out[0], out[1]


def _checked_paths(data_dir: str | None) -> dict[str, str]:
    """The four files' paths in the directory mnist_dir(data_dir) chooses, downloaded and checked."""
    data_dir, named = mnist_dir(data_dir)
    root = os.path.expanduser(data_dir)
    _make_dir(root, data_dir, named)
    paths = _mnist_paths(root)
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        why = _download_missing(root, missing)
        paths = _mnist_paths(root)
        if why is not None:
            raise DataError(_missing_message(data_dir, paths, why, named))
    return paths


def _make_dir(root: str, data_dir: str, named: str) -> None:
    """The directory exists afterwards (made here if need be), ready for the files."""
    if os.path.isdir(root):
        return
    if os.path.exists(root):
        raise DataError(f"mnist: {named} {data_dir} is not a directory")
    try:
        os.makedirs(root)
    except OSError as e:
        raise DataError(f"mnist: cannot create {named} {data_dir} ({e.strerror or e})") from None


def _missing_message(data_dir: str, paths: dict, why: str, named: str) -> str:
    """One line: what is missing, why the download failed, how to put the files there by hand."""
    missing = [name for name, path in paths.items() if path is None]  # some may have come
    have_not = ", ".join(f"{name}(.gz)" for name in missing)
    get = ", ".join(f"{name}.gz" for name in missing)
    return (f"mnist: {data_dir} ({named}) has no {have_not}; download failed ({why}); download {get} by "
            f"hand from any of {', '.join(MNIST_MIRRORS)} and put them in {data_dir} (or give --data-dir "
            f"or ${MNIST_DIR_ENV} a directory that holds them)")


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
        raise DataError(f"{path}: cannot read ({one_line(e)})") from None


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
                reasons.append(f"{url}: {one_line(e)}")
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
