"""Compact rows (pserver.sparse.compact): float16 and bfloat16 tables, stochastic rounding, their
twins, checkpoints, the Register path and the budget's bytes per row."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver.errors import ConfigError
from pserver.layers import Embedding
from pserver.models.layout import Layout
from pserver.persist import checkpoint
from pserver.sparse import RowState, TableConfig, TableLookup, compact
from pserver.sparse.table import SparseTable
from pserver.wire import codec
from pserver.worker.client import PSClient

KINDS = [(r, s) for r in ("float16", "bfloat16") for s in ("float32", "row")]
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")
KEY = np.uint64(0x1234_5678_9ABC_DEF0)
NO_ROOTS, ROOT = np.zeros(0, np.bool_), np.ones(1, np.bool_)


def trained(config: TableConfig, backend: str, steps: int = 4) -> SparseTable:
    t = SparseTable(config, 1, backend=backend)
    rng = np.random.default_rng(0)
    for step in range(steps):
        ids = rng.choice(60, 24, replace=False).astype(np.uint64)
        t.apply(ids, rng.normal(size=(24, config.dim)).astype(np.float32), step)
    return t


def rows_of(t: SparseTable, n: int = 80) -> np.ndarray:
    out = np.empty((n, t.dim), np.float32)
    t.lookup(np.arange(n, dtype=np.uint64), out)
    return out


def bits(state: RowState) -> dict:
    return {k: (str(v.dtype), v.view(np.uint8).tobytes()) for k, v in state.arrays().items()}


# -- the kernels and their twins ------------------------------------------------------------------

@pytest.mark.parametrize("row, state", KINDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_numba_and_numpy_tables_agree_bit_for_bit(row, state, optimizer):
    """Catches a twin (widen, narrow, the draws, the initial rounding) that differs from its kernel
    in any bit, for every row rule and type: pushes, lookups (stored and unstored ids), state()."""
    config = TableConfig("t", 5, optimizer=optimizer, row_dtype=row, state_dtype=state, seed=3)
    a, b = trained(config, "numba"), trained(config, "numpy")
    np.testing.assert_array_equal(rows_of(a), rows_of(b))
    assert bits(a.state()) == bits(b.state())


@pytest.mark.parametrize("fmt, name", [(compact.BF16, "bfloat16"), (compact.F16, "float16")])
def test_every_16_bit_value_widens_as_numpy_reads_it(fmt, name):
    """widen's decoders (float16: its bits placed as a float32's, times 2**112) against NumPy's
    own conversions, over all 2**16 patterns but infinities and NaNs, and float16's as a root
    slot (its square): catches a wrong bias, a wrong subnormal scale, a lost sign, a root left
    unsquared."""
    words = np.arange(1 << 16, dtype=np.uint16)
    finite = np.isfinite(compact._from_storage(words.view(compact.STORAGE[name]), fmt))
    words = words[finite].reshape(-1, 1)
    idx = np.arange(words.shape[0], dtype=np.int64)
    got, want = (np.empty((words.shape[0], 1), np.float32) for _ in range(2))
    compact.widen(words, idx, 1, fmt, fmt, 0, NO_ROOTS, got)
    compact.widen_numpy(words, idx, 1, fmt, fmt, 0, NO_ROOTS, want)
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    if fmt != compact.F16:
        return
    # As a root slot (float16 state only; after a row of 0s): its square, exact in float32.
    entries = np.concatenate([np.zeros_like(words), words], axis=1)
    got2, want2 = (np.empty((words.shape[0], 2), np.float32) for _ in range(2))
    compact.widen(entries, idx, 1, fmt, fmt, 1, ROOT, got2)
    compact.widen_numpy(entries, idx, 1, fmt, fmt, 1, ROOT, want2)
    assert got2.view(np.uint32).tobytes() == want2.view(np.uint32).tobytes()
    assert np.array_equal(got2[:, 1].astype(np.float64), got[:, 0].astype(np.float64) ** 2)


values = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(x=st.lists(values, min_size=1, max_size=40), fmt=st.sampled_from([compact.BF16, compact.F16]),
       step=st.integers(0, 2**40), stochastic=st.booleans())
def test_rounding_kernel_and_twin_agree(x, fmt, step, stochastic):
    x = np.asarray(x, np.float32).reshape(1, -1)
    ids = np.array([7], np.uint64)
    a, b = np.empty_like(x), np.empty_like(x)
    compact.round_many(x, fmt, KEY, step, ids, stochastic, a)
    compact.round_many_numpy(x, fmt, KEY, step, ids, stochastic, b)
    assert a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()


@settings(max_examples=60, deadline=None)
@given(x=st.lists(values, min_size=6, max_size=6),
       g=st.lists(st.floats(0, 1e6, width=32), min_size=3, max_size=3),
       fmt=st.sampled_from([compact.BF16, compact.F16]), step=st.integers(0, 2**40), stochastic=st.booleans())
def test_narrow_and_its_twin_agree_over_every_range(x, g, fmt, step, stochastic):
    """narrow's per-format loops (the integer paths, float16's values below its normal range
    redone by _narrow_bits, the clip to the largest finite value, a root slot) against the twin,
    on values from every range: zeros, subnormals, normals, past float16's largest. Catches the
    float16 values below its normal range left to the integer path (they wrap)."""
    lo = np.array([1e-7, 3e-5, 6.1e-5, 7e4, 0.0, -2e-8], np.float32)
    rows = np.stack([np.asarray(x, np.float32), lo])                        # 2 entries of dim 6
    slot = np.concatenate([np.asarray(g, np.float32), [0.0, 1e-12, 5e9]]).astype(np.float32)
    work = np.concatenate([rows, np.stack([slot, slot[::-1].copy()])], axis=1)
    idx, ids = np.arange(2, dtype=np.int64), np.array([3, 9], np.uint64)
    a, b = (np.zeros((2, 12), np.uint16) for _ in range(2))
    compact.narrow(a, idx, ids, KEY, step, 6, fmt, fmt, 1, ROOT, work.copy(), stochastic)
    compact.narrow_numpy(b, idx, ids, KEY, step, 6, fmt, fmt, 1, ROOT, work.copy(), stochastic)
    assert a.tobytes() == b.tobytes()


def neighbours(x: float, fmt: int) -> tuple[float, float]:
    """The two values of fmt around x (equal when x is one), from NumPy's float16 / a float32's high half."""
    if fmt == compact.F16:
        h = np.float16(x)
        other = np.nextafter(h, np.float16(np.inf if float(h) < x else -np.inf))
        return tuple(sorted((float(h), float(other)))) if float(h) != x else (x, x)
    u = np.array([x], np.float32).view(np.uint32)[0] & np.uint32(0xFFFF0000)
    t = float(np.array([u], np.uint32).view(np.float32)[0])
    if t == x:
        return x, x
    step = float(np.array([u + np.uint32(0x10000)], np.uint32).view(np.float32)[0])
    return tuple(sorted((t, step)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=st.floats(min_value=-6e4, max_value=6e4, width=32, allow_subnormal=True),
       fmt=st.sampled_from([compact.BF16, compact.F16]))
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(x, fmt):
    """Over 20,000 ids the mean of the rounded values is x within 5 standard errors, each result
    is one of x's two neighbours in the type, and the same key gives the same bits. Catches a
    biased draw (u <= frac, a draw off by one ulp), a truncation, a rounding that skips a value."""
    n = 20_000
    xs = np.full((n, 1), x, np.float32)
    ids = np.arange(n, dtype=np.uint64)
    out = np.empty_like(xs)
    compact.round_many(xs, fmt, KEY, 5, ids, True, out)
    lo, hi = neighbours(float(np.float32(x)), fmt)
    assert set(np.unique(out).tolist()) <= {lo, hi}
    p = 0.0 if hi == lo else (float(np.float32(x)) - lo) / (hi - lo)
    se = (hi - lo) * np.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(out.astype(np.float64).mean() - float(np.float32(x))) <= 5 * se + 1e-12 * abs(x)
    again = np.empty_like(xs)
    compact.round_many(xs, fmt, KEY, 5, ids, True, again)
    assert out.tobytes() == again.tobytes()


def test_the_draws_depend_on_the_step_the_id_and_the_key():
    xs = np.full((4000, 1), 1.0 + 2**-8, np.float32)     # halfway between two bfloat16 values
    ids = np.arange(4000, dtype=np.uint64)
    outs = []
    for key, step in ((KEY, 1), (KEY, 2), (KEY ^ np.uint64(1), 1)):
        out = np.empty_like(xs)
        compact.round_many(xs, compact.BF16, key, step, ids, True, out)
        outs.append(out)
    assert 1500 < np.count_nonzero(outs[0] == 1.0) < 2500               # ids: about half each way
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[0], outs[2])


def test_round_to_nearest_loses_the_small_updates_that_stochastic_rounding_keeps():
    """The motivating case: w = 1 in bfloat16 stepped 500 times by -1e-3 (less than half its ulp,
    2**-8): round-to-nearest never moves; stochastic rounding ends near 0.5 on average, and so
    does a real bfloat16 table running sgd."""
    n, steps, delta = 400, 500, np.float32(1e-3)
    ids = np.arange(n, dtype=np.uint64)
    for stochastic in (False, True):
        w = np.ones((n, 1), np.float32)
        for step in range(steps):
            compact.round_many(w - delta, compact.BF16, KEY, step, ids, stochastic, w)
        if stochastic:
            assert abs(w.mean() - 0.5) < 0.02
        else:
            assert np.all(w == 1.0)
    t = SparseTable(TableConfig("t", 2, optimizer="sgd", lr=1.0, row_dtype="bfloat16", init_scale=0.0), 0)
    state = t.state()
    t.apply(ids, np.zeros((n, 2), np.float32), 0)      # creates the rows (at 0)
    state = t.state()
    state.rows[:] = 0x3F80                              # bfloat16 1.0
    t.load(state)
    for step in range(1, steps + 1):
        t.apply(ids, np.full((n, 2), delta, np.float32), step)
    assert abs(rows_of(t, n).mean() - 0.5) < 0.02


# -- options, checks, bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("row_dtype", "float8", "row_dtype: unknown row type 'float8'; choose one of float32, float16, bfloat16"),
    ("state_dtype", "float16", "state_dtype: unknown state type 'float16'; choose one of float32, row")])
def test_a_bad_row_or_state_type_is_one_clear_line(field, value, words):
    with pytest.raises(ConfigError, match=words) as e:
        TableConfig("t", 4, **{field: value})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=field):
        Embedding(None, 4, sparse=True, **{field: value})


def test_the_options_reach_the_table_from_embedding_ctr_models_register_and_the_cli():
    from pserver.models.ctr import ctr_model
    layer = Embedding(None, 4, sparse=True, row_dtype="bfloat16", state_dtype="row")
    assert (layer.table_config("e").row_dtype, layer.table_config("e").state_dtype) == ("bfloat16", "row")
    model = ctr_model("wide_deep", row_dtype="float16", embedding_dim=4)
    assert {(t.row_dtype, t.state_dtype) for t in model.sparse_tables} == {("float16", "float32")}
    c = TableConfig("emb", 3, optimizer="adam", row_dtype="bfloat16", state_dtype="row")
    assert codec.table_config(codec.table_spec(c)) == c
    assert TableConfig.from_dict(c.to_dict()) == c
    # A float32 table's signature is what it was before the fields existed (old checkpoints match).
    assert "row_dtype" not in TableConfig("emb", 3).signature() and "row_dtype" in c.signature()
    bad = subprocess.run([sys.executable, "-m", "pserver", "worker", "--ps", "x:1", "--row-dtype", "fp8"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'fp8'" in bad.stderr


@pytest.mark.parametrize("optimizer, row, state, want", [
    ("adagrad", "float32", "float32", 16 * 4 * 2), ("adagrad", "bfloat16", "float32", 16 * 2 + 16 * 4),
    ("adagrad", "float16", "row", 16 * 2 * 2), ("adam", "bfloat16", "row", 16 * 2 * 3),
    ("adam", "float16", "float32", 16 * 2 + 16 * 4 * 2)])
def test_the_budget_counts_the_real_bytes_per_row(optimizer, row, state, want):
    """entry_bytes (what the shard's memory budget charges per row) is the stored words: id 8,
    last update 8, [steps 8], then the row and slots in their types. Catches a table that still
    allocates float32 columns for compact rows."""
    config = TableConfig("t", 16, optimizer=optimizer, row_dtype=row, state_dtype=state)
    t = SparseTable(config, 0)
    fixed = 8 + 8 + (8 if optimizer == "adam" else 0)
    assert t._rows.entry_bytes == fixed + want == fixed + config.layout().bytes_per_row()
    t.apply(np.arange(1, 5001, dtype=np.uint64), np.ones((5000, 16), np.float32), 0)
    assert t._rows.arrays["data"].dtype == (np.float32 if row == "float32" else np.uint16)


# -- checkpoints and the wire -----------------------------------------------------------------------

@pytest.mark.parametrize("row, state", KINDS)
def test_a_checkpoint_keeps_each_column_in_its_type(row, state):
    """state() -> the file's entries -> state_of -> load gives back the same bits, through both the
    table's own dump (its words) and entries_of (a reshard's save); a float32 state into a
    compact table is refused naming the types."""
    config = TableConfig("t", 3, optimizer="adam", row_dtype=row, state_dtype=state)
    t = trained(config, "numba")
    st_ = t.state()
    assert st_.rows.dtype == compact.STORAGE[row]
    columns = t.columns
    small = {k: getattr(st_, k) for k in ("pending_ids", "pending_counts", "counters")}
    count, _ = t.begin_dump(False)
    dumped = t.read_dump(0, count)
    t.end_dump()
    assert dumped.tobytes() == checkpoint.entries_of(st_, columns).tobytes()
    back = checkpoint.state_of(dumped, columns, small, config)
    assert bits(back) == bits(st_)
    fresh = SparseTable(config, 1)
    fresh.load(back)
    np.testing.assert_array_equal(rows_of(fresh), rows_of(t))
    wide = dataclasses.replace(back, rows=np.zeros(back.rows.shape, np.float32))
    with pytest.raises(ConfigError, match=f"rows is float32.*the table stores {row}"):
        fresh.load(wide)


# -- float16 second moments as square roots ---------------------------------------------------------

def accumulator(t: SparseTable) -> np.ndarray:
    """A table's adagrad accumulator G as float32, from either form."""
    st_ = t.state().slots
    if "slot_accumulator.sqrt" in st_:
        return st_["slot_accumulator.sqrt"].astype(np.float32) ** 2
    return compact.to_float32(st_["slot_accumulator"], t.layout.state_dtype)


@pytest.mark.parametrize("optimizer, row, state, want", [
    ("adagrad", "float16", "row", ["slot_accumulator.sqrt"]),
    ("adam", "float16", "row", ["slot_m", "slot_v.sqrt"]),
    ("ftrl", "float16", "row", ["slot_z", "slot_n.sqrt"]),
    ("adagrad", "bfloat16", "row", ["slot_accumulator"]),
    ("adagrad", "float16", "float32", ["slot_accumulator"])])
def test_only_float16_slots_of_squared_gradients_are_kept_as_roots(optimizer, row, state, want):
    """state() and a checkpoint's columns name a slot held as sqrt(G) slot_<name>.sqrt: catches a
    second moment stored as G in float16, a root where G is meant (bfloat16 and float32 state,
    adam's m, ftrl's z) and a root left unnamed (an export or restore reading s as G)."""
    t = trained(TableConfig("t", 3, optimizer=optimizer, row_dtype=row, state_dtype=state), "numba")
    assert t.columns == ["rows", *want]
    assert sorted(t.state().slots) == sorted(want)


def test_float16_roots_keep_small_squared_gradients_that_g_in_float16_loses():
    """Gradients of 1e-4 (the size of a rare row's): after 40 pushes G = 4e-7, below float16's
    smallest normal (6.1e-5), where G itself keeps 1-3 bits and each g^2 = 1e-8 is a sixth of a
    subnormal step. Stored as its root (6e-4), G stays within 0.2% of the float32 table's on
    average (2400 values, the worst 0.8%: the stochastic rounding's walk). Catches the roots not
    used (G in float16: 28% on average, the worst 150%) and a root squared or rooted twice."""
    rng = np.random.default_rng(1)
    ids = np.arange(1, 301, dtype=np.uint64)
    tables = {s: SparseTable(TableConfig("t", 8, row_dtype="float16", state_dtype=s), 0)
              for s in ("float32", "row")}
    for step in range(40):
        g = (rng.choice([-1, 1], size=(300, 8)) * 1e-4).astype(np.float32)
        for t in tables.values():
            t.apply(ids, g, step)
    exact = accumulator(tables["float32"])
    np.testing.assert_allclose(exact, 40 * np.float32(1e-4) ** 2, rtol=1e-5)
    rel = np.abs(accumulator(tables["row"]) / exact - 1)
    assert rel.mean() < 0.005 and rel.max() < 0.02, (rel.mean(), rel.max())


def test_sqrt_form_state_restores_into_float32_state_and_back():
    """A float16-state table's state (slot_accumulator.sqrt, s) loads into a float32-state table as
    G = s^2 exactly, rows unchanged; a float32-state table's (G) loads into a float16-state table
    as s = sqrt(G) rounded to nearest (NumPy's float16 of float32's sqrt), and both push on alike.
    Catches s loaded as G (G off by sqrt), G loaded as s, and a conversion that rounds wrongly."""
    half = TableConfig("t", 4, row_dtype="float16", state_dtype="row", seed=2)
    wide = TableConfig("t", 4, row_dtype="float16", state_dtype="float32", seed=2)
    src = trained(half, "numba")
    s = src.state().slots["slot_accumulator.sqrt"]
    dst = SparseTable(wide, 1)
    dst.load(src.state())
    assert dst.state().slots["slot_accumulator"].tobytes() == (s.astype(np.float32) ** 2).tobytes()
    np.testing.assert_array_equal(rows_of(dst), rows_of(src))
    back = SparseTable(half, 1)
    G = trained(wide, "numba").state().slots["slot_accumulator"]
    back.load(trained(wide, "numba").state())
    got = back.state().slots["slot_accumulator.sqrt"]
    assert got.dtype == np.float16 and got.tobytes() == np.sqrt(G).astype(np.float16).tobytes()
    again = SparseTable(half, 1)
    again.load(src.state())                   # the same form: every bit kept
    assert bits(again.state()) == bits(src.state())


def test_a_checkpoint_from_before_the_roots_still_loads(tmp_path):
    """A file written when float16 state held G (column slot_accumulator, float16 values) restores
    into today's float16-state table as s = sqrt(G) (rounded to nearest), and a file of today's
    form loads back bit for bit: catches an old file refused, or its G read as s."""
    config = TableConfig("t", 4, row_dtype="float16", state_dtype="row", seed=5)
    t = trained(config, "numba")
    now = t.state()
    G = (now.slots["slot_accumulator.sqrt"].astype(np.float32) ** 2).astype(np.float16)  # what old files held
    old = dataclasses.replace(now, slots={"slot_accumulator": G})
    params = np.zeros(3, np.float32)
    for name, rows in (("old", old), ("now", now)):
        ckpt = checkpoint.Checkpoint(path="", version=1, shard=0, num_shards=1, signature="sig", total=3,
                                     start=0, end=3, optimizer="sgd", params=params, state={},
                                     tables=[config], rows={"t": rows})
        path = checkpoint.save(str(tmp_path / name), ckpt)
        loaded = checkpoint.load(path).rows["t"]
        fresh = SparseTable(config, 1)
        fresh.load(loaded)
        got = fresh.state()
        if name == "now":
            assert bits(got) == bits(now)
        else:
            assert "slot_accumulator" in loaded.slots and got.slots["slot_accumulator.sqrt"].tobytes() == \
                np.sqrt(G.astype(np.float32)).astype(np.float16).tobytes()
            np.testing.assert_array_equal(rows_of(fresh), rows_of(t))


def test_an_export_writes_a_compact_tables_rows_as_their_float32_values():
    """Catches bfloat16 words converted as integers (0x3F80 -> 16256.0) on the way to a model file."""
    from pserver.persist.model_file import _sorted_table
    for row in ("bfloat16", "float16"):
        config = TableConfig("t", 3, row_dtype=row)
        t = trained(config, "numba")
        st_ = t.state()
        ids, rows = _sorted_table(config, st_.ids, st_.rows)
        want = np.empty_like(rows)
        t.lookup(ids, want)
        np.testing.assert_array_equal(rows, want)


DIM = 4


@pytest.mark.parametrize("row", ["bfloat16", "float16"])
def test_a_compact_table_trains_over_grpc_checkpoints_and_refuses_another_row_type(shard_server, tmp_path,
                                                                                    row):
    """Real shards: a compact table's rows reach the worker as float32 (the stored values widened),
    survive a checkpoint and restore bit for bit (float16: its accumulator as a root, named so in
    the file and the restored state), and a worker declaring float32 rows against the restored
    shards is refused in one line naming both types."""
    table = TableConfig("emb", DIM, optimizer="adagrad", lr=0.1, init_scale=0.1, seed=7,
                        row_dtype=row, state_dtype="row")
    layout = Layout.of([("b", (3,))], [table])

    def client(servers, lay, init):
        c = PSClient([a for a, _ in servers], rank=0, num_workers=1, rpc_deadline=60, data_plane="grpc")
        c.connect(5)
        c.register(lay)
        if init:
            c.init(np.zeros(lay.total, np.float32))
        return c

    def pulled(c, ids):
        lk = TableLookup.of(np.asarray(ids, np.int64), DIM)
        c.pull_rows([lk], ["emb"])
        return lk.rows[lk.inverse]

    servers = [shard_server(shard=j, num_shards=2, optimizer="sgd", lr=1.0, checkpoint_dir=str(tmp_path))
               for j in range(2)]
    c = client(servers, layout, True)
    c.pull(np.empty(layout.total, np.float32))
    ids = np.arange(1, 40)
    lk = TableLookup.of(np.asarray(ids, np.int64), DIM)
    lk.grads[:] = 0.5
    c.push(np.zeros(layout.total, np.float32), num_samples=1, lookups=[lk], tables=["emb"])
    want = pulled(c, ids)
    if row == "bfloat16":
        assert np.all((want.view(np.uint32) & np.uint32(0xFFFF)) == 0)    # bfloat16 values, widened
    else:
        np.testing.assert_array_equal(want.astype(np.float16).astype(np.float32), want)
    assert all(s.store.tables["emb"].config == table for _, s in servers)
    c.checkpoint()
    restored = [shard_server(shard=j, num_shards=2, optimizer="sgd", lr=1.0, restore=str(tmp_path))
                for j in range(2)]
    np.testing.assert_array_equal(pulled(client(restored, layout, False), ids), want)
    for (_, before), (_, after) in zip(servers, restored):
        assert bits(after.store.tables["emb"].state()) == bits(before.store.tables["emb"].state())
        assert ("slot_accumulator.sqrt" in after.store.tables["emb"].state().slots) == (row == "float16")
    other = Layout.of([("b", (3,))], [TableConfig("emb", DIM, optimizer="adagrad", lr=0.1, init_scale=0.1,
                                                  seed=7)])
    with pytest.raises(Exception, match=f"stores its rows as {row} .state row.*declares float32") as e:
        client(restored, other, False)
    assert f"--row-dtype {row} --state-dtype row" in str(e.value)
