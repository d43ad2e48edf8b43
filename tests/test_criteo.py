"""pserver.data.criteo on real files written here (plain and gzip) and on criteo-synthetic's generator."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pserver.data import criteo, describe, load_dataset
from pserver.data.criteo import (
    COLUMNS,
    NUM_CAT,
    NUM_DENSE,
    RECORD,
    REPORTED_LINES,
    SYNTHETIC_VOCABS,
    ZIPF_EXPONENT,
    hash_categorical,
    parse_block,
    parse_line_python,
)
from pserver.errors import ConfigError, DataError
from pserver.models.metrics import auc
from tests.support.criteo import assert_parsed_as_the_twin, line, write
from tests.support.twins import splitmix64_python

MASK64 = (1 << 64) - 1


def line_of(x: np.ndarray, lines: int) -> np.ndarray:
    """The line numbers of records written by line(i): from the first categorical id."""
    lookup = dict(zip(hash_categorical(0, np.arange(lines)).tolist(), range(lines)))
    return np.array([lookup[v] for v in x["cat"][:, 0].tolist()], np.int64)


def all_batches(ds, rank, workers, batch, epoch=0):
    return list(ds.epoch(rank, workers, batch, 0, epoch))


# ---------------------------------------------------------------- hashing

def test_hash_categorical_is_splitmix64_of_field_and_value_and_never_collides():
    values = np.array([-1, 0, 1, 2, 0xFFFFFFFF, 0x1234ABCD])
    ids = np.stack([hash_categorical(f, values) for f in range(NUM_CAT)])
    assert ids.dtype == np.int64
    assert len(np.unique(ids)) == ids.size            # across fields, missing (-1) included
    for f in (0, 7, 25):
        for v in values.tolist():
            expected = splitmix64_python((f << 33) + v + 1, 1)[0]
            assert int(hash_categorical(f, [v])[0]) & MASK64 == expected
    assert np.array_equal(hash_categorical(3, values), hash_categorical(3, values))


@pytest.mark.parametrize("field,value", [(0, -2), (0, 1 << 32), (26, 0), (-1, 0)])
def test_hash_categorical_refuses_values_out_of_range(field, value):
    with pytest.raises(DataError, match="categorical field"):
        hash_categorical(field, [5, value])


# ---------------------------------------------------------------- parsing

def test_a_well_formed_line_is_parsed_as_the_python_twin_and_by_hand(tmp_path):
    text = line(5, label=1)
    label, dense, cat = parse_line_python(text)
    assert label == 1.0
    # ints: 5 % 7 = 5, empty, -3 (negative: 0), 12345678, then 0, 5, 10, ...
    expected = np.log1p(np.array([5, 0, 0, 12345678] + [5 * j for j in range(9)],
                                 np.float64)).astype(np.float32)
    np.testing.assert_array_equal(dense, expected)
    assert cat[0] == hash_categorical(0, [5])[0] and cat[1] == hash_categorical(1, [-1])[0]
    assert cat[2] == hash_categorical(2, [0xDEADBEEF])[0] and cat[3] == hash_categorical(3, [0])[0]
    block = parse_block(np.frombuffer((text + "\n").encode(), np.uint8), 0)
    assert block.ok.tolist() == [True] and block.labels.tolist() == [1.0]
    np.testing.assert_array_equal(block.x["dense"][0], dense)
    np.testing.assert_array_equal(block.x["cat"][0], cat)


# A field of each kind: well formed or not (the twin decides which).
_INT_TEXT = st.one_of(st.sampled_from(["", "0", "-1", "-", "65535", "65536", "1e3", " 7", "+4",
                                       "99999999999999999", "999999999999999999",
                                       "9999999999999999999", "٣"]),
                      st.integers(0, 10 ** 9).map(str))
_HEX_TEXT = st.one_of(st.sampled_from(["", "0", "ffffffff", "FFFFFFFF", "123456789", "xyz",
                                       "0x12", "é", "g"]),
                      st.integers(0, (1 << 32) - 1).map(lambda v: format(v, "x")))


@st.composite
def lines_of_fields(draw):
    label = draw(st.sampled_from(["0", "1", "2", "", "01", "1.0"]))
    cols = [label] + draw(st.lists(_INT_TEXT, min_size=NUM_DENSE, max_size=NUM_DENSE)) \
        + draw(st.lists(_HEX_TEXT, min_size=NUM_CAT, max_size=NUM_CAT))
    cut = draw(st.sampled_from([COLUMNS, COLUMNS, COLUMNS, COLUMNS - 1, COLUMNS + 1, 1]))
    cols = (cols + ["5"])[:cut]
    return "\t".join(cols) + draw(st.sampled_from(["", "\r"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(lines_of_fields(), min_size=1, max_size=8), st.booleans())
def test_the_numba_parser_agrees_with_the_python_twin(texts, final_newline):
    # An empty last text with no newline after it is no line at all: the data ends with the
    # newline before it, as a file of one line fewer would (found by hypothesis in a fresh run).
    assume(final_newline or texts[-1] != "")
    data = "\n".join(texts) + ("\n" if final_newline else "")
    assert_parsed_as_the_twin(parse_block(np.frombuffer(data.encode(), np.uint8), 0), texts)


@pytest.mark.parametrize("gz", [False, True])
def test_a_file_streams_every_training_line_in_order_and_holds_out_every_tenth(tmp_path, gz):
    lines = [line(i, label=i % 2) for i in range(95)]
    # CRLF line endings are read as LF ones.
    path = write(tmp_path / ("d.tsv.gz" if gz else "d.tsv"), lines, gz=gz, end="\r\n")
    ds = load_dataset(f"criteo:{path}", test_samples=4)
    assert ds.num_classes == 2 and ds.x_test.dtype == RECORD and ds.y_test.dtype == np.float32
    assert line_of(ds.x_test, 95).tolist() == [9, 19, 29, 39]     # i % 10 == 9, capped at 4
    assert ds.y_test.tolist() == [1.0, 1.0, 1.0, 1.0]
    batches = all_batches(ds, 0, 1, 10)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    training = [i for i in range(95) if i not in (9, 19, 29, 39)]       # 91 lines: 9 batches of 10
    assert line_of(x, 95).tolist() == training[:90]
    assert y.tolist() == [float(i % 2) for i in training[:90]]
    expected = np.stack([parse_line_python(lines[i])[1] for i in training[:90]])
    np.testing.assert_array_equal(x["dense"], expected)
    # Another epoch reads the file again: the same batches.
    again = all_batches(ds, 0, 1, 10, epoch=1)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(batches, again))
    assert "4 test samples" in describe(ds) and path in describe(ds)


def test_blocks_smaller_than_the_file_split_it_between_lines(tmp_path):
    lines = [line(i) for i in range(50)]
    path = str(tmp_path / "d.tsv")
    with open(path, "w") as f:
        f.write("\n".join(lines))                      # no final newline
    blocks = list(criteo.read_blocks(path, block_bytes=1000))
    assert len(blocks) > 5
    assert [b.first for b in blocks] == list(np.cumsum([0] + [len(b.ok) for b in blocks[:-1]]))
    x = np.concatenate([b.x for b in blocks])
    assert all(b.ok.all() for b in blocks) and line_of(x, 50).tolist() == list(range(50))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(12, 140), st.sets(st.integers(0, 139), max_size=15))
def test_worker_parts_are_disjoint_equal_and_cover_every_complete_round(workers, batch, n, bad):
    lines = [("garbage\t" if i in bad else "") + line(i) for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write(os.path.join(tmp, "d.tsv"), lines)
        if all(i in bad for i in (9, 19, 29) if i < n):
            with pytest.raises(DataError, match="no well-formed held-out line"):
                load_dataset(f"criteo:{path}", test_samples=3)
            return
        ds = load_dataset(f"criteo:{path}", test_samples=3)
        training = [i for i in range(n) if i not in bad and not (i % 10 == 9 and i < 30)]
        rounds = len(training) // (workers * batch)
        if rounds == 0:
            with pytest.raises(ConfigError, match="--batch-size"):
                all_batches(ds, 0, workers, batch)
            return
        parts = [all_batches(ds, r, workers, batch) for r in range(workers)]
    assert {len(p) for p in parts} == {rounds}                 # the same steps on every worker
    assert all(len(x) == batch and len(y) == batch for p in parts for x, y in p)
    got = [line_of(np.concatenate([x for x, _ in p]), n) for p in parts]
    for r, g in enumerate(got):
        assert g.tolist() == training[r:rounds * workers * batch:workers]   # line j -> worker j % N
    assert sorted(np.concatenate(got).tolist()) == training[:rounds * workers * batch]


def test_malformed_lines_are_skipped_counted_and_the_first_few_reported_by_line_number(tmp_path, capsys):
    lines = [line(i) for i in range(40)]
    broken = {2: "\t".join(["1"] + ["1"] * 12), 5: line(5).replace("\t12345678\t", "\t12x\t"),
              6: "7" + line(6)[1:], 11: line(11) + "\tffff", 12: line(12).replace("DEADbeef", "DEADbeefa"),
              20: "", 33: line(33).replace("DEADbeef", "zz")}
    for i, text in broken.items():
        lines[i] = text
    path = write(tmp_path / "d.tsv", lines)
    ds = load_dataset(f"criteo:{path}", test_samples=2)
    capsys.readouterr()
    x = np.concatenate([b[0] for b in all_batches(ds, 0, 1, 1)])
    got = line_of(x, 40).tolist()
    assert not set(got) & set(broken) and len(got) == 40 - len(broken) - 2   # 9 and 19 held out
    err = capsys.readouterr().err.splitlines()
    assert err[:REPORTED_LINES] == [
        f"warning: {path} line 3: 13 tab-separated columns, expected 40; skipped",
        f"warning: {path} line 6: integer feature 4 is '12x', not an integer; skipped",
        f"warning: {path} line 7: label '7' is not 0 or 1; skipped",
        f"warning: {path} line 12: 41 tab-separated columns, expected 40; skipped",
        f"warning: {path} line 13: categorical feature 3 is 'DEADbeefa', "
        "not a hex value of at most 8 digits; "
        "skipped"]
    assert err[REPORTED_LINES:] == [f"warning: {path}: skipped 7 malformed line(s) of 40"]
    all_batches(ds, 1, 2, 1)                       # another worker, or another epoch: no repeat
    all_batches(ds, 0, 1, 1, epoch=1)
    assert capsys.readouterr().err == ""


def test_an_empty_file_one_without_a_valid_line_and_a_missing_one_are_data_errors(tmp_path):
    empty = write(tmp_path / "empty.tsv", [])
    with pytest.raises(DataError, match=f"{empty}: the file is empty"):
        load_dataset(f"criteo:{empty}")
    gz_empty = write(tmp_path / "empty.gz", [], gz=True)
    with pytest.raises(DataError, match=f"{gz_empty}: the file is empty"):
        load_dataset(f"criteo:{gz_empty}")
    junk = write(tmp_path / "junk.tsv", ["a\tb", "1\t2\t3", ""])
    with pytest.raises(DataError, match=f"{junk}: no well-formed line among its first 3"):
        load_dataset(f"criteo:{junk}")
    short = write(tmp_path / "short.tsv", [line(i) for i in range(9)])   # no 10th line
    with pytest.raises(DataError, match=f"{short}: no well-formed held-out line"):
        load_dataset(f"criteo:{short}")
    with pytest.raises(DataError, match="nothing.tsv: cannot read"):
        load_dataset(f"criteo:{tmp_path / 'nothing.tsv'}")
    binary = tmp_path / "binary.bin"        # no newline for megabytes: never held in memory whole
    binary.write_bytes(b"\x00" * (criteo.MAX_LINE_BYTES + 10))
    with pytest.raises(DataError, match=f"{binary}: line 1 is longer than {criteo.MAX_LINE_BYTES} bytes"):
        load_dataset(f"criteo:{binary}")


def test_a_cut_gzip_stream_is_a_data_error_naming_the_file(tmp_path):
    path = write(tmp_path / "d.tsv.gz", [line(i) for i in range(3000)], gz=True)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    blocks = []
    with pytest.raises(DataError, match=f"{path}: cannot read"):
        for block in criteo.read_blocks(path, block_bytes=4096):   # as an epoch reads it
            blocks.append(block)
    assert len(blocks) > 3 and all(b.ok.all() for b in blocks)


@pytest.mark.parametrize("spec,task,match", [("criteo:", "classification", "the path is empty"),
                                             ("criteo-synthetic", "regression", "binary classification")])
def test_bad_criteo_specs_are_config_errors(spec, task, match):
    with pytest.raises(ConfigError, match=match):
        load_dataset(spec, task=task)


# ---------------------------------------------------------------- criteo-synthetic

@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("criteo-synthetic", seed=7, samples=5000, test_samples=20000)


def test_synthetic_is_a_pure_function_of_seed_and_index(synthetic):
    again = load_dataset("criteo-synthetic", seed=7, samples=100, test_samples=20000)
    assert np.array_equal(again.x_test, synthetic.x_test) and np.array_equal(again.y_test, synthetic.y_test)
    other = load_dataset("criteo-synthetic", seed=8, samples=100, test_samples=20000)
    assert not np.array_equal(other.x_test["cat"], synthetic.x_test["cat"])
    assert not np.array_equal(other.x_test["dense"], synthetic.x_test["dense"])
    index = np.arange(100, dtype=np.uint64)
    x, y = criteo.generate(7, synthetic.bias, index)
    x2, y2 = criteo.generate(7, synthetic.bias, index[[5, 70, 3]])
    assert np.array_equal(x[[5, 70, 3]], x2) and np.array_equal(y[[5, 70, 3]], y2)


def test_synthetic_kernels_agree_with_their_numpy_twins(synthetic):
    index = np.concatenate([np.arange(3000), criteo.TEST_START + np.arange(50)]).astype(np.uint64)
    x, y = criteo.generate(7, synthetic.bias, index)
    x2, y2 = criteo.generate_numpy(7, synthetic.bias, index)
    assert np.array_equal(x["cat"], x2["cat"]) and np.array_equal(y, y2)
    np.testing.assert_allclose(x["dense"], x2["dense"], rtol=1e-6)
    for pairwise in (True, False):
        np.testing.assert_allclose(criteo.planted(7, x["cat"], pairwise),
                                   criteo.planted_numpy(7, x["cat"], pairwise), rtol=1e-12, atol=1e-12)


def test_worker_parts_of_synthetic_are_disjoint_and_cover_the_complete_rounds(synthetic):
    """5000 samples, 3 workers of 1666 at 64: 26 rounds of 64 each and a last round of 2 each (the
    last partial batch trained, as Keras trains it); samples 4998 and 4999 sit the epoch out."""
    workers, batch = 3, 64
    steps = synthetic.steps(workers, batch)
    assert steps == 27
    parts = [all_batches(synthetic, r, workers, batch) for r in range(workers)]
    assert all(len(p) == steps and [len(x) for x, _ in p] == [batch] * 26 + [2] for p in parts)
    x_all, y_all = criteo.generate(7, synthetic.bias, np.arange(5000, dtype=np.uint64))
    for r, part in enumerate(parts):
        for k, (x, y) in enumerate(part):
            start = (k * workers + r) * batch      # round k, the r-th batch of it
            if k == 26:
                start = 26 * workers * batch + r * 2
            assert (np.array_equal(x, x_all[start:start + len(x)])
                    and np.array_equal(y, y_all[start:start + len(x)]))
    with pytest.raises(ConfigError, match="--batch-size"):
        synthetic.steps(3, 5000)


def test_synthetic_has_a_quarter_positives_and_a_plausible_best_auc(synthetic):
    for ds in (synthetic, load_dataset("criteo-synthetic", seed=0, samples=100, test_samples=20000)):
        assert 0.23 < ds.y_test.mean() < 0.27
        assert 0.75 < ds.linear_auc < ds.best_auc < 0.95
        assert ds.best_auc == auc(ds.planted_logits(ds.x_test), ds.y_test)
        # The labels follow the planted probabilities: calibrated within sampling error.
        p = 1 / (1 + np.exp(-ds.planted_logits(ds.x_test)))
        assert abs(p.mean() - ds.y_test.mean()) < 4 * math.sqrt(0.25 * 0.75 / len(p))
    assert f"{synthetic.best_auc:.4f}" in describe(synthetic)


def test_synthetic_dense_features_are_log1p_of_counts(synthetic):
    dense = synthetic.x_test["dense"].astype(np.float64)
    counts = np.expm1(dense)
    assert dense.min() >= 0 and np.all(np.abs(counts - np.round(counts)) <= 1e-3 * (1 + counts))
    assert 0.05 < (dense == 0).mean() < 0.6     # floor(exp(N(1, 1.5^2))) is often 0 or 1


@pytest.mark.parametrize("field", [0, 12, NUM_CAT - 1])
def test_synthetic_ids_follow_the_zipf_law_of_their_field(synthetic, field):
    n = 60000
    x, _ = criteo.generate(3, synthetic.bias, np.arange(n, dtype=np.uint64))
    vocab = int(SYNTHETIC_VOCABS[field])
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    p = weights / weights.sum()
    top = 10
    counts = [(x["cat"][:, field] == hash_categorical(field, [k])[0]).sum() for k in range(top)]
    for k in range(top):          # value k is the (k + 1)-th most frequent id
        assert abs(counts[k] - n * p[k]) < 5 * math.sqrt(n * p[k] * (1 - p[k])) + 1, (k, counts[k], n * p[k])
    if vocab < 10 ** 5:           # every id is one of the field's vocabulary
        assert set(x["cat"][:, field].tolist()) <= set(hash_categorical(field, np.arange(vocab)).tolist())


def test_synthetic_vocabularies_span_10_to_10_million():
    assert SYNTHETIC_VOCABS[0] == 10 and SYNTHETIC_VOCABS[-1] == 10 ** 7 and len(SYNTHETIC_VOCABS) == NUM_CAT
    assert np.all(np.diff(np.log10(SYNTHETIC_VOCABS)) > 0.2)
