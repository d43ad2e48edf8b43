"""Multi-hot Criteo (issue 50): a TSV list column (comma-separated values, up to MLPerf DLRMv2's
sizes), criteo-synthetic-multi-hot, and the CTR built-ins over list features."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.data import criteo, load_dataset
from pserver.data.criteo import MLPERF_MULTI_HOT, NUM_CAT, NUM_DENSE, PADDING, parse_block, parse_line_python
from pserver.errors import ConfigError, DataError
from pserver.models import make_model
from pserver.models.ctr import CTR_MODELS
from tests.support.criteo import assert_parsed_as_the_twin, line, write
from tests.support.ctr import pull

SIZES = MLPERF_MULTI_HOT


def multi_line(i: int, lists, label: int = 0) -> str:
    """line(i)'s label and integer features, with categorical field j the values lists[j]."""
    cols = line(i, label).split("\t")[:1 + NUM_DENSE]
    return "\t".join(cols + [",".join(format(v, "x") for v in values) for values in lists])


# ---------------------------------------------------------------- the TSV list column

_VALUE = st.one_of(st.integers(0, (1 << 32) - 1).map(lambda v: format(v, "x")),
                   st.sampled_from(["", "xyz", "123456789", "FFFFFFFF"]))
_LIST = st.one_of(st.lists(_VALUE, min_size=1, max_size=4).map(",".join),
                  st.sampled_from(["", ",", "a,", ",a", "a,,b", "1,2,3,4,5,6,7,8,9,10,11,12,13"]))


@st.composite
def multi_hot_lines(draw):
    base = line(draw(st.integers(0, 1000)), draw(st.sampled_from([0, 1]))).split("\t")[:1 + NUM_DENSE]
    return "\t".join(base + draw(st.lists(_LIST, min_size=NUM_CAT, max_size=NUM_CAT)))


@settings(max_examples=80, deadline=None)
@given(st.lists(multi_hot_lines(), min_size=1, max_size=6))
def test_the_numba_parser_reads_lists_as_the_python_twin(texts):
    """Lists shorter than their size (padded), as long, longer (malformed), empty values inside
    a list (malformed), an empty field (the missing id, then padding), bad hex: the kernel and
    the twin agree on every line and every id."""
    block = parse_block(np.frombuffer(("\n".join(texts) + "\n").encode(), np.uint8), 0, sizes=SIZES)
    assert criteo.cat_columns(block.x).shape == (len(texts), sum(SIZES))
    assert_parsed_as_the_twin(block, texts, SIZES)


def test_a_list_is_its_values_ids_in_order_then_padding_and_too_long_a_list_is_named():
    lists = [[7]] * NUM_CAT
    lists[0], lists[20] = [1, 2, 1], [5] * 100           # field 0 full (3), field 20 full (100)
    lists[1], lists[4] = [], [0xdeadbeef]                # empty: the missing id; one of 6
    _, _, ids = parse_line_python(multi_line(0, lists), SIZES)
    x = parse_block(np.frombuffer((multi_line(0, lists) + "\n").encode(), np.uint8), 0, sizes=SIZES).x
    assert x["cat_0"][0].tolist() == criteo.hash_categorical(0, [1, 2, 1]).tolist()
    assert x["cat_1"][0].tolist() == [criteo.hash_categorical(1, [-1])[0], PADDING]
    assert x["cat_4"][0].tolist() == [criteo.hash_categorical(4, [0xdeadbeef])[0]] + [PADDING] * 5
    assert x["cat_20"][0].tolist() == criteo.hash_categorical(20, [5] * 100).tolist()
    np.testing.assert_array_equal(criteo.cat_columns(x)[0], ids)
    lists[2] = [1, 2]                                    # field 2 holds one id
    with pytest.raises(DataError, match="categorical feature 3 is '1,2', not a hex value"):
        parse_line_python(multi_line(0, lists), SIZES)
    lists[2], lists[3] = [1], [1, 2, 3]
    with pytest.raises(DataError, match="categorical feature 4 has 3 values, more than its 2"):
        parse_line_python(multi_line(0, lists), SIZES)


def test_no_hashed_id_is_the_padding():
    """Ids are splitmix64(field * 2**33 + value + 1), a bijection: the one key that hashes to
    -1 (PADDING), found by inverting it, is no (field, value) pair."""
    mask = (1 << 64) - 1
    z = PADDING & mask
    z ^= z >> 31 ^ z >> 62                                            # undo x ^= x >> 31
    z = z * pow(0x94D049BB133111EB, -1, 1 << 64) & mask
    z ^= z >> 27 ^ z >> 54
    z = z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64) & mask
    z ^= z >> 30 ^ z >> 60
    key = z - 0x9E3779B97F4A7C15 & mask
    assert int(criteo.splitmix64(np.array([key], np.uint64))[0]) == PADDING & mask
    field, value_plus_1 = divmod(key, 1 << 33)
    assert not (field < NUM_CAT and value_plus_1 <= 1 << 32)


def test_a_one_hot_file_read_as_multi_hot_has_the_same_ids_then_padding(tmp_path):
    path = write(tmp_path / "day.tsv", [line(i, i % 2) for i in range(300)])
    one, multi = load_dataset(f"criteo:{path}", test_samples=20), load_dataset(f"criteo-multi-hot:{path}",
                                                                                test_samples=20)
    assert multi.name == f"criteo-multi-hot:{path}" and multi.sizes == SIZES
    assert multi.x_test.dtype == criteo.record(SIZES) and "list features" in multi.describe()
    x1 = np.concatenate([x for x, _ in one.epoch(0, 1, 50, 0, 0)])
    xm = np.concatenate([x for x, _ in multi.epoch(0, 1, 50, 0, 0)])
    assert len(x1) == len(xm) == 250
    np.testing.assert_array_equal(xm["dense"], x1["dense"])
    for j, size in enumerate(SIZES):
        assert xm[f"cat_{j}"][:, 0].tolist() == x1["cat"][:, j].tolist()
        assert (xm[f"cat_{j}"][:, 1:] == PADDING).all()
    for b in range(multi.leased_batches(50, 0, 2).num_batches):   # --data-assignment leases: the same
        (xb, yb), = multi.leased_batches(50, 0, 2).read(0, b, b + 1)
        (x1b, y1b), = one.leased_batches(50, 0, 2).read(0, b, b + 1)
        assert xb["cat_0"][:, 0].tolist() == x1b["cat"][:, 0].tolist() and yb.tolist() == y1b.tolist()


def test_a_multi_hot_files_bad_lines_are_skipped_and_named(tmp_path, capsys):
    good = [[1]] * NUM_CAT
    bad = [[1]] * 3 + [[1, 2, 3]] + [[1]] * (NUM_CAT - 4)
    path = write(tmp_path / "day.tsv", [multi_line(i, bad if i == 3 else good, i % 2) for i in range(40)])
    ds = load_dataset(f"criteo-multi-hot:{path}", test_samples=2)
    batches = list(ds.epoch(0, 1, 10, 0, 0))
    assert sum(len(x) for x, _ in batches) == 30                # 40 - 2 held out - 1 bad, in rounds of 10
    err = capsys.readouterr().err
    assert "line 4: categorical feature 4 has 3 values, more than its 2; skipped" in err


# ---------------------------------------------------------------- criteo-synthetic-multi-hot

@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 1 << 45), min_size=1, max_size=40), st.integers(0, 5))
def test_the_expansion_kernel_equals_its_numpy_twin(index, seed):
    index = np.array(index, np.uint64)
    first, _ = criteo.generate(seed, 0.0, index)
    x, _ = criteo.generate_multi_hot(seed, 0.0, index, SIZES)
    want = criteo.expand_numpy(seed, index, first["cat"], SIZES)
    np.testing.assert_array_equal(criteo.cat_columns(x), want)


def test_synthetic_multi_hot_extends_criteo_synthetic_with_zipf_lists():
    ds = load_dataset("criteo-synthetic-multi-hot", samples=4000, test_samples=3000)
    one = load_dataset("criteo-synthetic", samples=4000, test_samples=3000)
    x = ds.x_test
    np.testing.assert_array_equal(x["dense"], one.x_test["dense"])
    for j, size in enumerate(SIZES):
        lists = x[f"cat_{j}"]
        assert lists.shape == (3000, size) and (lists != PADDING).all()     # full lists, as MLPerf's
        assert lists[:, 0].tolist() == one.x_test["cat"][:, j].tolist()
    # field 20's 100 ids: Zipf over its vocabulary, so the top id is common and ids repeat in a list
    top = np.unique(x["cat_20"], return_counts=True)[1].max() / x["cat_20"].size
    assert 0.01 < top < 0.5
    assert np.mean([len(np.unique(r)) < 100 for r in x["cat_20"][:200]]) > 0.5
    assert 0.2 < ds.y_test.mean() < 0.3 and ds.best_auc > 0.8          # labels follow the lists
    assert abs(ds.best_auc - ds.linear_auc) < 0.05
    # the labels depend on the whole lists: the planted model over the first ids alone ranks worse
    assert criteo.planted(ds.seed, one.x_test["cat"]).std() > 0
    from pserver.models.metrics import auc
    assert auc(criteo.planted(ds.seed, one.x_test["cat"]), ds.y_test) < ds.best_auc - 0.03


def test_planted_lists_of_one_id_is_the_one_hot_planted_model_and_padding_counts_in_no_mean():
    one = load_dataset("criteo-synthetic", samples=10, test_samples=200).x_test["cat"]
    ones = (1,) * NUM_CAT
    np.testing.assert_allclose(criteo.planted_lists(0, one, ones), criteo.planted(0, one), rtol=1e-12)
    sizes = (3,) * NUM_CAT
    padded = np.full((len(one), 3 * NUM_CAT), PADDING, np.int64)
    padded[:, ::3] = one
    np.testing.assert_allclose(criteo.planted_lists(0, padded, sizes), criteo.planted(0, one), rtol=1e-12)
    twice = padded.copy()
    twice[:, 1::3] = one                                               # [a, a, pad]: the mean is a's
    np.testing.assert_allclose(criteo.planted_lists(0, twice, sizes), criteo.planted(0, one), rtol=1e-12)


@pytest.mark.parametrize("sizes,match", [((1,) * 25, "26 integers"), ((0,) + (1,) * 25, "26 integers"),
                                         ((True,) * 26, "26 integers")])
def test_bad_multi_hot_sizes_are_refused(sizes, match):
    with pytest.raises(ConfigError, match=match):
        criteo.record(sizes)


def test_an_empty_multi_hot_path_is_a_config_error():
    with pytest.raises(ConfigError, match="criteo-multi-hot:PATH: the path is empty"):
        load_dataset("criteo-multi-hot:")


# ---------------------------------------------------------------- the built-ins over lists

SMALL = dict(dense_features=3, fields=4, embedding_dim=5)
LISTS = (3, 1, 2, 4)


@pytest.mark.parametrize("name", list(CTR_MODELS))
def test_a_multi_hot_model_is_the_one_hot_model_on_each_lists_mean_row(name):
    """Every built-in over lists equals the same built-in over one id per field whose row is
    the list's mean row (empty lists: zeros): the same loss and dense gradients, and each list's
    ids get their share (1 / the list's length) of that row's gradient, summed over lists."""
    rng = np.random.default_rng(3)
    multi = make_model(name, (), 2, hidden=(6, 7), backend="reference", multi_hot=LISTS, **SMALL)
    one = make_model(name, (), 2, hidden=(6, 7), backend="reference", **SMALL)
    assert [t.name for t in multi.layout.tensors] == [t.name for t in one.layout.tensors]
    assert [t.name for t in multi.sparse_tables] == [t.name for t in one.sparse_tables]
    assert {layer.padding for layer in multi.layers if getattr(layer, "sparse", False)} == {PADDING}
    n = 11
    xm = np.zeros(n, multi.record)
    xm["dense"] = rng.random((n, 3)) * 2
    for j, size in enumerate(LISTS):
        ids = rng.integers(0, 5, (n, size)) + 100 * j
        ids[rng.random((n, size)) < 0.3] = PADDING            # shorter lists, some empty
        xm[f"cat_{j}"] = ids
    y = rng.integers(0, 2, n).astype(np.float64)
    tables = [{int(u): rng.standard_normal(t.dim) for u in np.unique(criteo.cat_columns(xm)) if u != PADDING}
              for t in multi.sparse_tables]
    xo = np.zeros(n, one.record)
    xo["dense"] = xm["dense"]
    xo["cat"] = np.arange(n * 4).reshape(n, 4) + 10_000              # one virtual id per (sample, field)
    virtual = [{} for _ in tables]
    for t, rows in enumerate(tables):
        for i in range(n):
            for j in range(4):
                kept = [u for u in xm[f"cat_{j}"][i] if u != PADDING]
                virtual[t][int(xo["cat"][i, j])] = (np.mean([rows[int(u)] for u in kept], axis=0) if kept
                                                    else np.zeros(multi.sparse_tables[t].dim))
    w = rng.standard_normal(multi.layout.total) * 0.4
    lm = pull(multi, multi.batch_ids(xm), tables, dtype=np.float64)
    lo = pull(one, one.batch_ids(xo), virtual, dtype=np.float64)
    gm, go = np.zeros_like(w), np.zeros_like(w)
    assert multi.loss_and_grad(w, xm, y, gm, sparse=lm) == pytest.approx(
        one.loss_and_grad(w, xo, y, go, sparse=lo), rel=1e-12)
    np.testing.assert_allclose(gm, go, rtol=1e-10, atol=1e-14)
    for t in range(len(tables)):
        want = {int(u): np.zeros(multi.sparse_tables[t].dim) for u in lm[t].uniq}
        vgrad = dict(zip(lo[t].uniq.tolist(), lo[t].grads))
        for i in range(n):
            for j in range(4):
                kept = [int(u) for u in xm[f"cat_{j}"][i] if u != PADDING]
                for u in kept:
                    want[u] += vgrad[int(xo["cat"][i, j])] / len(kept)
        got = dict(zip(lm[t].uniq.tolist(), lm[t].grads))
        assert set(got) == set(want) and PADDING not in got
        for u in want:
            np.testing.assert_allclose(got[u], want[u], rtol=1e-10, atol=1e-14)


def test_the_built_ins_take_the_multi_hot_records_the_reader_gives():
    for name in CTR_MODELS:
        model = make_model(name, (), 2, backend="reference", multi_hot=SIZES)
        assert model.record == criteo.record(SIZES)
    with pytest.raises(ConfigError, match="multi_hot has 3 list sizes for 26 fields"):
        make_model("dlrm", (), 2, backend="reference", multi_hot=(1, 2, 3))
