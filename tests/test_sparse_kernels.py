"""pserver.sparse kernels: each numba kernel against its NumPy twin and against hand-computed
values; ids and their refusal; shard_of as a partition."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.errors import ConfigError, InvalidArgument
from pserver.sparse import (
    HASH_SEED,
    ROW_OPTIMIZERS,
    TableLookup,
    as_ids,
    dedupe,
    first_foreign,
    first_repeat,
    hashing,
    index,
    initial_rows,
    optim,
    segment_sum,
    shard_of,
    splitmix64,
    unique_inverse,
)
from tests.support.twins import splitmix64_python

FAST = settings(max_examples=30, deadline=None)

u64s = st.integers(0, 2**64 - 1)
seeds = st.integers(0, 2**32 - 1)


def u64_array(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


# -- splitmix64, shard_of ---------------------------------------------------------------------

@FAST
@given(st.lists(u64s, max_size=50))
def test_splitmix64_twins_and_the_published_generator(values):
    x = u64_array(values)
    got = splitmix64(x)
    assert got.dtype == np.uint64 and got.shape == x.shape
    assert (got == hashing.splitmix64_numpy(x)).all()
    # splitmix64(x) is the first output of the generator seeded with x.
    assert got.tolist() == [splitmix64_python(v, 1)[0] for v in values]


def test_splitmix64_keeps_the_shape():
    x = np.arange(12, dtype=np.uint64).reshape(3, 4)
    assert (splitmix64(x) == splitmix64(x.reshape(-1)).reshape(3, 4)).all()


@FAST
@given(st.lists(u64s, max_size=60), st.integers(1, 9))
def test_shard_of_is_the_documented_pure_function(values, shards):
    ids = u64_array(values)
    got = shard_of(ids, shards)
    assert got.dtype == np.int64
    assert (got == hashing.shard_of_numpy(ids, shards)).all()
    want = [splitmix64_python(v ^ HASH_SEED, 1)[0] % shards for v in values]
    assert got.tolist() == want
    # Pure: each id's shard depends on that id alone, not on its neighbours or their order.
    perm = np.random.default_rng(len(values)).permutation(len(values))
    assert (shard_of(ids[perm], shards) == got[perm]).all()
    assert [int(shard_of(ids[i:i + 1], shards)[0]) for i in range(len(values))] == want


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_shard_of_puts_every_id_on_exactly_one_shard_and_balances(shards):
    ids = np.arange(-50_000, 50_000).astype(np.int64).view(np.uint64)
    got = shard_of(ids, shards)
    parts = [ids[got == j] for j in range(shards)]
    assert sum(p.size for p in parts) == ids.size          # each id on one shard ...
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(ids))   # ... all of them
    # Consecutive ids spread evenly (a hash, not a modulus of the id).
    assert max(abs(p.size - ids.size / shards) for p in parts) < 0.02 * ids.size


@FAST
@given(st.lists(u64s, max_size=100), st.integers(1, 5), st.integers(0, 4))
def test_first_foreign_is_the_first_id_shard_of_sends_elsewhere(values, shards, shard):
    ids = u64_array(values)
    owner = shard_of(ids, shards).tolist()
    want = next((i for i, o in enumerate(owner) if o != shard), -1)
    assert first_foreign(ids, shards, shard) == want == hashing.first_foreign_numpy(ids, shards, shard)


def test_shard_of_refuses_a_bad_shard_count():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="num_shards"):
            shard_of(np.zeros(2, np.uint64), bad)


# -- as_ids -----------------------------------------------------------------------------------

@FAST
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=40))
def test_as_ids_maps_int64_bit_for_bit(values):
    x = np.array(values, dtype=np.int64)
    got = as_ids(x, "ids")
    assert got.dtype == np.uint64 and np.shares_memory(got, x) or x.size == 0
    assert (got.view(np.int64) == x).all()
    assert got.tolist() == [v % 2**64 for v in values]
    assert as_ids(values, "ids").tolist() == got.tolist()   # Python ints: the same ids


def test_as_ids_widens_and_keeps_shapes():
    assert as_ids(np.array([-1, -2**63], np.int64), "ids").tolist() == [2**64 - 1, 2**63]
    assert as_ids(np.array([-1, 5], np.int8), "ids").tolist() == [2**64 - 1, 5]
    assert as_ids(np.array([-2**31], np.int32), "ids").tolist() == [2**64 - 2**31]
    assert as_ids(np.array([255], np.uint8), "ids").tolist() == [255]
    big = np.array([2**64 - 1], np.uint64)
    assert as_ids(big, "ids") is big
    assert as_ids([[1, -1], [2**64 - 1, 0]], "ids").shape == (2, 2)
    assert as_ids(7, "ids").tolist() == 7


@pytest.mark.parametrize("x, shown, where", [
    (np.array([1.0, 2.0]), "1.0", "index 0"),
    (np.array([True]), "True", "index 0"),
    (np.array(["a"]), "'a'", "index 0"),
    ([3, 2**64], "18446744073709551616", "index 1"),
    ([5, -2**63 - 1], "-9223372036854775809", "index 1"),
    ([1, 2.5], "2.5", "index 1"),
    ([[1, 2], [3, True]], "True", r"index \(1, 1\)"),
    (np.array([1, None], dtype=object), "None", "index 1"),
])
def test_as_ids_refuses_what_is_not_a_64_bit_integer(x, shown, where):
    with pytest.raises(InvalidArgument, match=rf"^cat_ids: .*{shown} at {where}$"):
        as_ids(x, "cat_ids")


def test_as_ids_refuses_an_empty_float_array():
    with pytest.raises(InvalidArgument, match="cat_ids: .*float32"):
        as_ids(np.zeros(0, np.float32), "cat_ids")


# -- unique_inverse, segment_sum, TableLookup -------------------------------------------------

ids_lists = st.one_of(st.lists(st.integers(0, 30), max_size=200),
                      st.lists(u64s, max_size=200),
                      st.lists(st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**32]), max_size=50))


@FAST
@given(ids_lists)
def test_unique_inverse_twins(values):
    ids = u64_array(values)
    uniq, inverse = unique_inverse(ids)
    twin = dedupe.unique_inverse_numpy(ids)
    assert uniq.dtype == np.uint64 and inverse.dtype == np.int64
    assert uniq.tolist() == twin[0].tolist() and inverse.tolist() == twin[1].tolist()
    assert (uniq[inverse] == ids).all()
    assert uniq.tolist() == list(dict.fromkeys(values))   # distinct, by first appearance


def test_unique_inverse_through_many_rehashes():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**64, 20_000, dtype=np.uint64)[rng.integers(0, 20_000, 100_000)]
    uniq, inverse = unique_inverse(ids)
    assert uniq.tolist() == list(dict.fromkeys(ids.tolist()))
    assert (uniq[inverse] == ids).all()


@FAST
@given(ids_lists)
def test_first_repeat_twins(values):
    ids = u64_array(values)
    seen, want = set(), -1
    for i, v in enumerate(values):
        if v in seen:
            want = i
            break
        seen.add(v)
    assert first_repeat(ids) == want == dedupe.first_repeat_numpy(ids)


def test_first_repeat_in_a_large_batch():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 2**64, 70_000, dtype=np.uint64)   # distinct with near certainty
    assert first_repeat(ids) == -1 == dedupe.first_repeat_numpy(ids)
    ids[60_000] = ids[123]
    assert first_repeat(ids) == 60_000 == dedupe.first_repeat_numpy(ids)


def test_unique_inverse_refuses_other_dtypes():
    with pytest.raises(InvalidArgument, match="ids: needs a 1-D uint64"):
        unique_inverse(np.arange(3))


@FAST
@given(st.integers(0, 60), st.integers(1, 20), st.integers(1, 6), seeds)
def test_segment_sum_twins(n, u, dim, seed):
    rng = np.random.default_rng(seed)
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    inverse = rng.integers(0, u, n)
    got = segment_sum(grads, inverse, u)
    np.testing.assert_allclose(got, dedupe.segment_sum_numpy(grads, inverse, u), rtol=1e-5, atol=1e-6)
    by_hand = np.zeros((u, dim), np.float64)
    for i, k in enumerate(inverse):
        by_hand[k] += grads[i]
    np.testing.assert_allclose(got, by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [segment_sum, dedupe.segment_sum_numpy])
def test_segment_sum_refuses_an_inverse_outside_u(fn):
    with pytest.raises(ValueError, match=r"outside \[0, u\)"):
        fn(np.ones((2, 3), np.float32), np.array([0, 2]), 2)


def test_table_lookup_of_a_batch():
    ids = np.array([[5, -1, 5], [7, -1, 9]])
    look = TableLookup.of(ids, 4)
    assert look.uniq.tolist() == [5, 2**64 - 1, 7, 9]
    assert look.inverse.shape == (2, 3) and (look.uniq[look.inverse] == as_ids(ids, "ids")).all()
    assert look.rows.shape == look.grads.shape == (4, 4) and look.rows.dtype == np.float32
    with pytest.raises(InvalidArgument, match="user_ids"):
        TableLookup.of(np.array([1.5]), 4, "user_ids")


# -- the index's delete -----------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=120))
def test_index_insert_and_backward_shift_delete_match_a_set(ops):
    """16 slots for up to 8 of 13 keys: long probe runs and wrap-arounds (keys 1, 2, 8 and 12
    share a home slot), checked after every op."""
    bits, keys, n = index.MIN_BITS, np.zeros(8, np.uint64), 0
    slots = np.full(1 << bits, index.EMPTY, np.int32)
    model: set[int] = set()
    for insert, k in ops:
        pos, e = index.find(slots, keys, np.uint64(k), bits)
        if insert and e == index.EMPTY and n < 8:
            keys[n], slots[pos] = k, n
            n, _ = n + 1, model.add(k)
        elif not insert and e != index.EMPTY:
            index.delete_at(slots, keys, pos, bits)
            n -= 1
            if e != n:   # keep entries dense, as the table does
                index.repoint(slots, keys, keys[n], e, bits)
                keys[e] = keys[n]
            model.discard(k)
        found = np.empty(13, np.int64)
        index.find_many(slots, keys, np.arange(13, dtype=np.uint64), bits, found)
        assert {k for k in range(13) if found[k] != index.EMPTY} == model
        assert all(keys[found[k]] == k for k in model)
        assert sorted(slots[slots != index.EMPTY].tolist()) == list(range(n))   # no stale slot


# -- initial rows -----------------------------------------------------------------------------

@FAST
@given(st.lists(u64s, max_size=20), st.integers(1, 9), u64s, st.integers(0, 50),
       st.sampled_from([0.0, 0.05, 1.0, 3.5]))
def test_initial_rows_twins_bit_for_bit(values, dim, seed, table, scale):
    ids = u64_array(values)
    got, twin = (np.full((ids.size, dim), np.nan, np.float32) for _ in range(2))
    initial_rows(ids, dim, seed, table, scale, got)
    hashing.initial_rows_numpy(ids, dim, seed, table, scale, twin)
    assert got.tobytes() == twin.tobytes()
    assert ((got >= -scale) & (got <= scale)).all()


def test_initial_rows_are_uniform_and_depend_on_every_input():
    ids = np.arange(20_000, dtype=np.uint64)
    out = np.empty((ids.size, 8), np.float32)
    initial_rows(ids, 8, 0, 0, 0.5, out)
    assert abs(out.mean()) < 0.01 and abs(out.std() - 0.5 / np.sqrt(3)) < 0.01
    assert np.histogram(out, bins=10, range=(-0.5, 0.5))[0].min() > 0.09 * out.size
    rows = {}
    for key in [(0, 0, 1), (1, 0, 1), (0, 1, 1), (0, 0, 2)]:
        rows[key] = np.empty((1, 8), np.float32)
        initial_rows(u64_array([key[2]]), 8, key[0], key[1], 0.05, rows[key])
    assert len({r.tobytes() for r in rows.values()}) == 4
    zeros = np.ones((3, 4), np.float32)
    initial_rows(ids[:3], 4, 0, 0, 0.0, zeros)
    assert not zeros.any()


def test_initial_rows_are_the_same_in_another_process():
    code = ("import numpy as np; from pserver.sparse import initial_rows; "
            "o = np.empty((3, 5), np.float32); "
            "initial_rows(np.array([0, 7, 2**64 - 1], np.uint64), 5, 42, 3, 0.05, o); "
            "print(o.tobytes().hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = np.empty((3, 5), np.float32)
    initial_rows(u64_array([0, 7, 2**64 - 1]), 5, 42, 3, 0.05, here)
    assert other.stdout.strip() == here.tobytes().hex()


def test_initial_rows_refuses_a_wrong_out():
    with pytest.raises(InvalidArgument, match=r"out: needs a C-contiguous float32\[2, 3\]"):
        initial_rows(u64_array([1, 2]), 3, 0, 0, 0.1, np.empty((2, 3), np.float64))


# -- row optimizers ---------------------------------------------------------------------------

def random_state(rng, name, rows, dim):
    """A data matrix (rows with their slots) and step counts, with valid slot values."""
    width = dim * (1 + len(optim.SLOTS[name]))
    data = rng.standard_normal((rows, width)).astype(np.float32)
    if name in ("adagrad", "adam", "ftrl"):   # accumulators and second moments are >= 0
        data[:, -dim:] = np.abs(data[:, -dim:])
    return data, rng.integers(0, 5, rows).astype(np.int64)


params_for = {"sgd": st.just({}),
              "adagrad": st.fixed_dictionaries({"eps": st.sampled_from([1e-7, 0.1])}),
              "adam": st.fixed_dictionaries({"beta1": st.sampled_from([0.0, 0.9]),
                                             "beta2": st.sampled_from([0.5, 0.999])}),
              "ftrl": st.fixed_dictionaries({"l1": st.sampled_from([0.0, 0.01, 1.0]),
                                             "l2": st.sampled_from([0.0, 0.5]),
                                             "beta": st.sampled_from([0.0, 1.0]),
                                             "lr_power": st.sampled_from([-0.5, -0.3, 0.0])})}


@FAST
@given(st.sampled_from(ROW_OPTIMIZERS), st.data(), st.integers(1, 12), st.integers(1, 5), seeds,
       st.floats(0.01, 1.0), st.sampled_from([1.0, 0.25]))
def test_row_optimizers_twins(name, data, rows, dim, seed, lr, scale):
    rng = np.random.default_rng(seed)
    params = data.draw(params_for[name])
    state, steps = random_state(rng, name, rows, dim)
    n = data.draw(st.integers(0, rows))
    idx = rng.permutation(rows)[:n].astype(np.int64)
    idx[rng.random(n) < 0.3] = -1      # not admitted: skipped
    grads = rng.standard_normal((n, dim)).astype(np.float32)
    results = []
    for backend in ("numba", "numpy"):
        opt = optim.RowOptimizer(name, lr, params, backend)
        s, t = state.copy(), steps.copy()
        opt.step(s, t, idx, grads, scale)
        results.append((s, t))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=2e-5, atol=1e-6)
    assert (results[0][1] == results[1][1]).all()
    untouched = np.setdiff1d(np.arange(rows), idx)
    assert (results[0][0][untouched] == state[untouched]).all()
    assert (results[0][1][untouched] == steps[untouched]).all()


def one_step(name, w, slots, g, params=None, steps=0, scale=1.0, lr=0.1):
    """One kernel step on a single row of dim 1: (w, slots..., step count) after it."""
    data = np.array([[w, *slots]], np.float32)
    count = np.array([steps], np.int64)
    optim.RowOptimizer(name, lr, params or {}).step(data, count, np.array([0]),
                                                    np.array([[g]], np.float32), scale)
    return (*data[0].tolist(), int(count[0]))


def test_row_optimizers_against_hand_computed_steps():
    approx = pytest.approx
    assert one_step("sgd", 1.0, [], 2.0, scale=0.5) == approx((1.0 - 0.1 * 1.0, 0))
    # adagrad: a = 0.1 + 4 = 4.1; w -= 0.1 * 2 / (sqrt(4.1) + 1e-7)
    assert one_step("adagrad", 1.0, [0.1], 2.0) == approx((1 - 0.2 / (4.1 ** 0.5 + 1e-7), 4.1, 0))
    # adam, this row's second step: m = .9*.5 + .1*2, v = .999*.25 + .001*4, corrections t=2.
    m, v = 0.9 * 0.5 + 0.1 * 2, 0.999 * 0.25 + 0.001 * 4
    w = 1 - 0.1 * (m / (1 - 0.9**2)) / ((v / (1 - 0.999**2)) ** 0.5 + 1e-8)
    assert one_step("adam", 1.0, [0.5, 0.25], 2.0, steps=1) == approx((w, m, v, 2), rel=1e-5)
    # ftrl from z = n = 0 with w0 = 1, g = 2, lr = 0.1, beta = 1, l1 = 0.5, l2 = 0.2:
    # sigma = 2 / 0.1 = 20, z = 2 - 20 = -18, n = 4, w = (18 - 0.5) / ((1 + 2) / 0.1 + 0.2)
    got = one_step("ftrl", 1.0, [0.0, 0.0], 2.0, {"l1": 0.5, "l2": 0.2})
    assert got == approx((17.5 / 30.2, -18.0, 4.0, 0), rel=1e-6)
    # |z| <= l1: the weight is exactly 0
    assert one_step("ftrl", 1.0, [0.0, 0.0], 0.0, {"l1": 0.5})[0] == 0.0


def test_lazy_adam_steps_only_the_rows_it_touches():
    rng = np.random.default_rng(0)
    data, steps = random_state(rng, "adam", 4, 3)
    steps[:] = [0, 3, 7, 1]
    before = data.copy()
    opt = optim.RowOptimizer("adam", 0.01, {})
    for _ in range(3):
        opt.step(data, steps, np.array([2, 0]), rng.standard_normal((2, 3)).astype(np.float32), 1.0)
    assert steps.tolist() == [3, 3, 10, 1]
    assert (data[[1, 3]] == before[[1, 3]]).all()          # untouched: same weights, same m, v
    assert not (data[[0, 2]] == before[[0, 2]]).any()
    # Each row's bias correction uses its own count: row 0 (t = 1..3) and row 2 (t = 8..10)
    # move differently for the same gradients.
    d1, d2 = np.zeros((2, 9), np.float32), np.zeros((2, 9), np.float32)
    s1, s2 = np.array([0, 0]), np.array([0, 50])
    g = np.ones((2, 3), np.float32)
    opt.step(d1, s1, np.array([0, 1]), g, 1.0)
    opt.step(d2, s2, np.array([0, 1]), g, 1.0)
    assert d2[0, 0] == d1[0, 0] and d2[1, 0] != d1[1, 0]


@pytest.mark.parametrize("name, params, match", [
    ("rmsprop", {}, "unknown row optimizer 'rmsprop'"),
    ("sgd", {"eps": 1.0}, "sgd takes no parameter 'eps'"),
    ("adam", {"beta1": 1.0}, r"adam beta1 must be a finite number in \[0, 1\), got 1.0"),
    ("ftrl", {"lr_power": 0.5}, "ftrl lr_power must be a finite number <= 0"),
    ("adagrad", {"initial_accumulator": 0.0, "eps": 0.0}, "adagrad needs initial_accumulator > 0"),
    ("adagrad", {"eps": float("nan")}, "adagrad eps must be a finite number"),
])
def test_row_optimizer_parameters_are_checked(name, params, match):
    with pytest.raises(ConfigError, match=match):
        optim.RowOptimizer(name, 0.1, params, what="table 'emb'")
    with pytest.raises(ConfigError, match="table 'emb': adam lr must be a finite number > 0"):
        optim.RowOptimizer("adam", 0.0, {}, what="table 'emb'")
