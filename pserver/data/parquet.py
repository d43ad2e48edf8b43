"""A Parquet file as a Dataset of records: one field per column, the column "label" as y.

    load_dataset("PATH.parquet") -> Dataset   (records, for a model over named inputs)

A model over records (a Functional with dict inputs, `--model FILE.py:build`) reads each field
as the input of its name. The columns:

    integers               int64 field of shape () (an id: Input(shape=(), dtype="int64"))
    floats, booleans       float32 field of shape (1,) (a number: Input(shape=(1,)))
    a list of integers     int64 field (L,), L the longest list: a list feature. Shorter lists are
                           padded with -1, so the Embedding that reads it takes padding_id=-1
                           (Keras-RS's convention; a model that pads otherwise is refused at fit)
    a list of floats       float32 field (L,) padded with 0: a weighted list's weights
    label                  y: integers are classes, floats regression targets

A null list is an empty one; a null anywhere else is a DataError naming the column and the row.
Without a test set of its own, a seeded tenth of the rows is held out, as for an .npz. Reading
Parquet needs pyarrow (pip install 'pserver[recommenders]').
"""

from __future__ import annotations

import os

import numpy as np

from pserver.data import npz
from pserver.data.dataset import Dataset
from pserver.errors import DataError

LABEL = "label"
LIST_PADDING = -1      # pads a list of ids (an Embedding's padding_id)


def load(path: str, seed: int) -> Dataset:
    """The file's rows as records and labels, a seeded tenth held out (npz's checks apply)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: "
                        "pip install 'pserver[recommenders]'") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())})") from None
    if LABEL not in table.column_names:
        raise DataError(f"{path}: no column {LABEL!r} (the labels); it has {', '.join(table.column_names)}")
    features = [c for c in table.column_names if c != LABEL]
    if not features:
        raise DataError(f"{path}: no feature column beside {LABEL!r}")
    fields, padded = {}, []
    for name in features:
        fields[name], pads = _column(path, name, table.column(name), pa)
        if pads:
            padded.append(name)
    y = _scalars(path, LABEL, table.column(LABEL), pa)
    x = np.empty(len(y), [(name, a.dtype, a.shape[1:]) for name, a in fields.items()])
    for name, a in fields.items():
        x[name] = a
    ds = npz._dataset(path, {"x": x, "y": y}, seed)
    return Dataset(ds.name, ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.num_classes,
                   padded=tuple(padded))


def _column(path: str, name: str, column, pa) -> tuple[np.ndarray, bool]:
    """A feature column as an array (n,) or, a list column, (n, L) padded; and whether some list of
    ids was padded with LIST_PADDING."""
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        a = _scalars(path, name, column, pa)
        return (a if a.dtype.kind in "iu" else a.astype(np.float32).reshape(-1, 1)), False
    value = kind.value_type
    ids = pa.types.is_integer(value)
    if not (ids or pa.types.is_floating(value)):
        raise DataError(f"{path}: column {name!r} holds lists of {value}; lists hold integer ids or "
                        "float weights")
    lists = column.to_pylist()
    lengths = np.array([0 if a is None else len(a) for a in lists])
    width = max(1, int(lengths.max(initial=0)))
    out = np.full((len(lists), width), LIST_PADDING if ids else 0, np.int64 if ids else np.float32)
    for row, values in enumerate(lists):
        if values and any(v is None for v in values):
            raise DataError(f"{path}: column {name!r}, row {row}: a list with a null value")
        if values:
            out[row, :len(values)] = values
    return out, ids and bool((lengths < width).any())     # ids padded: the model must say -1


def _scalars(path: str, name: str, column, pa) -> np.ndarray:
    kind = column.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise DataError(f"{path}: column {name!r} holds {kind}; columns hold numbers, booleans or "
                        "lists of them")
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: column {name!r} has {column.null_count} null value(s), the first in "
                        f"row {row}")
    a = column.to_numpy()
    return a.astype(np.float32) if a.dtype.kind == "b" else a


__all__ = ["LABEL", "LIST_PADDING", "load"]
