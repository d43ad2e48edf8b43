"""Byte ranges of a line file (pserver.data.ranges) and the Criteo file's leased batches built on
them: every line exactly once per epoch whatever the file and the range size; .gz files through a
seek index built once; bad input refused in one line."""

from __future__ import annotations

import gzip
import io
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.data import load_dataset
from pserver.data.criteo import generate, hash_categorical
from pserver.data.ranges import LineFile, gzip_index, open_lines
from pserver.errors import DataError
from tests.support.criteo import line, write


def pieces(data: bytes, span: int, max_line: int = 1 << 20) -> list[tuple[int, bytes]]:
    f = LineFile("mem", io.BytesIO(data), len(data), max_line)
    return [f.lines_in(k * span, (k + 1) * span) for k in range(math.ceil(len(data) / span))]


def line_starts(start: int, text: bytes) -> list[int]:
    """Where each line of `text` (read at `start`) starts."""
    if not text:
        return []
    cuts = [i + 1 for i, c in enumerate(text) if c == 10 and i + 1 < len(text)]
    return [start] + [start + c for c in cuts]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200).map(lambda b: bytes(10 if c < 60 else 97 + c % 3 for c in b)),
       st.integers(1, 40))
def test_byte_ranges_give_every_line_once_for_any_content_and_range_size(data, span):
    """Catches: a line that starts exactly at a range's first byte given to the range before (or to
    both), a line longer than a range lost or repeated, the last line without a newline dropped,
    empty lines ("\\n\\n") merged."""
    got = pieces(data, span)
    assert b"".join(text for _, text in got) == data           # in order, none lost, none twice
    for k, (start, text) in enumerate(got):
        for s in line_starts(start, text):                      # each line is its range's
            assert k * span <= s < (k + 1) * span, (k, s)
            assert s == 0 or data[s - 1] == 10                   # and starts a line


def test_a_line_longer_than_the_limit_is_refused_naming_its_byte():
    data = b"ab\n" + b"x" * 50 + b"\ncd\n"
    with pytest.raises(DataError, match=r"mem: the line at byte 3 is longer than 20 bytes"):
        pieces(data, 8, max_line=20)


def criteo_file(tmp_path, n=400, gz=False, bad=()):
    lines = [line(i, label=i % 2) for i in range(n)]
    for k in bad:
        lines[k] = "1\t2\t3"                                   # too few columns
    lines[5] = lines[5] + "\t" + "f" * 5000 if 5 not in bad else lines[5]   # long and malformed
    return write(tmp_path / ("day.gz" if gz else "day.txt"), lines, gz=gz), lines


def line_ids(x: np.ndarray, n: int) -> list[int]:
    lookup = dict(zip(hash_categorical(0, np.arange(n)).tolist(), range(n)))
    return [lookup[v] for v in x["cat"][:, 0].tolist()]


def training_lines(n: int, test_samples: int, bad) -> set[int]:
    return {i for i in range(n) if not (i % 10 == 9 and i < 10 * test_samples) and i not in bad}


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 70), chunk=st.integers(1, 5), gz=st.booleans())
def test_a_criteo_files_leased_batches_hold_every_training_line_once(tmp_path_factory, batch, chunk, gz):
    """The batches of an epoch, read a chunk at a time as leases read them, hold every training line
    once: not the held-out (every 10th of the first 10 * test_samples) nor the malformed ones.
    Catches a held-out line trained on, a line lost at a range's edge, a chunk read from the
    wrong byte of a .gz (its seek index)."""
    tmp = tmp_path_factory.mktemp("f")
    path, _ = criteo_file(tmp, gz=gz, bad=(7, 200))
    ds = load_dataset(f"criteo:{path}", test_samples=8)
    data = ds.leased_batches(batch, 0, chunk, cache_dir=str(tmp / "cache"))
    seen = []
    for b in range(data.num_batches):
        x, y = data.batch(0, b)
        assert len(x) == len(y)
        seen += line_ids(x, 400)
    want = training_lines(400, 8, bad={5, 7, 200})
    assert sorted(seen) == sorted(want)
    assert abs(data.num_batches - math.ceil(400 / batch)) <= max(2, 0.2 * 400 / batch)   # about batch lines


def test_a_gz_files_index_is_built_once_and_a_changed_or_cut_file_is_refused(tmp_path, monkeypatch):
    """Catches: an index rebuilt at every open (the cost leases must not pay per worker and epoch),
    a stale index used on a file that changed (wrong bytes trained on), a truncated .gz trained
    up to its cut (indexed_gzip alone reads a cut stream to its end without a word)."""
    cache = tmp_path / "cache"
    path, lines = criteo_file(tmp_path, n=3000, gz=True)
    text = gzip.decompress(open(path, "rb").read())
    index, length = gzip_index(path, str(cache))
    assert length == len(text) and os.path.exists(index)
    built = os.stat(index).st_mtime_ns
    f = open_lines(path, str(cache))
    assert os.stat(index).st_mtime_ns == built                  # read from the cache, not rebuilt
    start, got = f.lines_in(len(text) // 2, len(text) // 2 + 1000)
    assert got and text[start - 1] == 10 and text[start:start + len(got)] == got
    write(path, lines[:-1], gz=True)                             # the file changes under its index
    with pytest.raises(DataError, match=rf"{path} changed since its seek index .*\.gzidx was built"):
        open_lines(path, str(cache))
    raw = gzip.compress(text)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DataError, match=rf"{cut}: not a whole gzip file"):
        open_lines(str(cut), str(cache))
    assert not [p for p in os.listdir(cache) if p.startswith("cut.gz")]   # nothing half-built is kept


def test_criteo_synthetic_leased_batches_are_the_samples_in_order_each_once():
    """Batch b is samples b * batch ... (b + 1) * batch - 1 whatever chunk it is read with (the
    chunk order is the shuffle); catches a batch read from its chunk's start, or the last short
    chunk (24 batches in chunks of 5) read past the end."""
    ds = load_dataset("criteo-synthetic", samples=1000, test_samples=100)
    data = ds.leased_batches(40, 0, 5)
    assert data.num_batches == 25 and data.fingerprint.startswith("1000:")
    x_all, y_all = generate(ds.seed, ds.bias, np.arange(1000, dtype=np.uint64))
    for b in (24, 3, 0, 21, 7):                                  # chunk by chunk, in any order
        x, y = data.batch(1, b)
        assert np.array_equal(x, x_all[40 * b:40 * (b + 1)]) and np.array_equal(y, y_all[40 * b:40 * (b + 1)])
    other = load_dataset("criteo-synthetic", seed=1, samples=1000, test_samples=100).leased_batches(40, 0, 5)
    assert other.fingerprint != data.fingerprint                 # other data: refused at LeaseData


def test_criteo_synthetic_trains_every_sample_once_the_last_batches_smaller():
    """samples not a multiple of the batch: leased, 1000 at 300 are 4 batches (the last 100); sliced
    for 2 workers at 200, each worker's 500 are 200, 200, 100, and the two take disjoint samples of
    the 1000; catches the last partial batch dropped or read past the training samples."""
    ds = load_dataset("criteo-synthetic", samples=1000, test_samples=100)
    x_all, _ = generate(ds.seed, ds.bias, np.arange(1000, dtype=np.uint64))
    data = ds.leased_batches(300, 0, 3)
    got = [data.batch(0, b)[0] for b in range(data.num_batches)]
    assert [len(x) for x in got] == [300, 300, 300, 100]
    assert np.array_equal(np.concatenate(got), x_all)
    sliced = [list(ds.epoch(r, 2, 200, 0, 0)) for r in range(2)]
    assert [[len(x) for x, _ in s] for s in sliced] == [[200, 200, 100]] * 2
    taken = np.concatenate([x for s in sliced for x, _ in s])
    assert len(np.unique(taken)) == 1000 and np.isin(taken, x_all).all()
