"""Criteo files written by tests: well-formed lines and plain or gzip files of them."""

from __future__ import annotations

import gzip

import numpy as np

from pserver.data.criteo import cat_columns, parse_line_python
from pserver.errors import DataError


def line(i: int, label: int = 0, ints=None, cats=None) -> str:
    """A well-formed line whose first categorical value is i, so a record tells its line."""
    ints = [str(i % 7), "", "-3", "12345678"] + [str(j * i) for j in range(9)] if ints is None else ints
    cats = [format(i, "x")] + ["", "DEADbeef", "0"] + [format(j * 1000003, "08x") for j in range(22)] \
        if cats is None else cats
    return "\t".join([str(label)] + ints + cats)


def write(path, lines, gz=False, end="\n"):
    data = "".join(text + end for text in lines).encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return str(path)


def assert_parsed_as_the_twin(block, texts, sizes=None) -> None:
    """Each line of a parsed block as parse_line_python reads its text: malformed in both, or the
    same label, dense features and ids (every list's, side by side, for multi-hot `sizes`)."""
    assert len(block.ok) == len(texts)
    cat = cat_columns(block.x)
    for k, text in enumerate(texts):
        try:
            label, dense, ids = parse_line_python(text, sizes)
        except DataError:
            assert not block.ok[k], text
            continue
        assert block.ok[k], text
        assert block.labels[k] == label
        np.testing.assert_array_equal(block.x["dense"][k], dense)
        np.testing.assert_array_equal(cat[k], ids)
