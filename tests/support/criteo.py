"""Criteo files written by tests: well-formed lines and plain or gzip files of them."""

from __future__ import annotations

import gzip


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
