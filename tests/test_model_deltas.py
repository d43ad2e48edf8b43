"""A served sparse model's tables under deltas (pserver.persist.model_file: MappedTable.prepare/commit,
pages, merge_pages): what a lookup reads after any sequence of deltas is what a table rebuilt
from scratch reads, and a lookup racing an apply sees each row whole, before or after."""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import sparse
from pserver.persist.model_file import MappedTable, TableRows, _write_table, merge_pages

DIM = 3
CONFIG = sparse.TableConfig(name="t", dim=DIM, optimizer="sgd", lr=0.1, init_scale=0.5, seed=3)


def mapped(directory: str, ids: np.ndarray, rows: np.ndarray, config=CONFIG) -> MappedTable:
    """A table written as save() writes it and mapped read-only, as load() maps it."""
    _write_table(directory, config, TableRows.of(config, ids, rows))
    load = [np.load(os.path.join(directory, f"{config.name}.{w}.npy"), mmap_mode="r")
            for w in ("ids", "rows")]
    return MappedTable(config, 0, *load)


def initial(ids: np.ndarray) -> np.ndarray:
    out = np.empty((ids.shape[0], DIM), np.float32)
    sparse.initial_rows(ids, DIM, CONFIG.seed, 0, CONFIG.init_scale, out)
    return out


ids_sets = st.sets(st.integers(0, 60), max_size=40)


@settings(max_examples=60, deadline=None)
@given(shards=st.lists(st.tuples(ids_sets, st.integers(1, 7)), min_size=1, max_size=4))
def test_merged_shard_streams_are_the_sorted_union(shards):
    # Catches a merge that emits a page past another stream's smaller ids (out of order), or
    # that drops the tail of a page it split.
    seen, streams = set(), []
    for ids, page in shards:
        ids = np.array(sorted(set(ids) - seen), np.uint64)
        seen |= set(ids.tolist())
        rows = np.repeat(ids.astype(np.float32)[:, None], 2, axis=1)
        streams.append([(ids[a:a + page], rows[a:a + page]) for a in range(0, ids.shape[0], page)])
    out = list(merge_pages(streams))
    got = np.concatenate([i for i, _ in out]) if out else np.empty(0, np.uint64)
    assert got.tolist() == sorted(seen)
    assert all(np.array_equal(r[:, 0], i.astype(np.float32)) for i, r in out)


deltas = st.lists(st.tuples(st.sets(st.integers(0, 40), max_size=15),
                            st.sets(st.integers(0, 40), max_size=8)), max_size=5)


@settings(max_examples=60, deadline=None)
@given(base=st.sets(st.integers(0, 40), max_size=25), steps=deltas)
def test_any_sequence_of_deltas_reads_as_a_table_built_afresh(base, steps):
    # The reference is a dict: id -> row. Catches an id re-added after its removal that still
    # reads its initial value (a tombstone kept), an overlay row that outlives its removal or
    # its change, a changed base row not overwritten, and compact()'s pages disagreeing.
    universe = np.arange(45, dtype=np.uint64)
    with tempfile.TemporaryDirectory() as d:
        base_ids = np.array(sorted(base), np.uint64)
        rows = np.random.default_rng(0).normal(size=(base_ids.shape[0], DIM)).astype(np.float32)
        table = mapped(d, base_ids, rows)
        want = {int(i): r.copy() for i, r in zip(base_ids, rows)}
        for k, (changed, removed) in enumerate(steps):
            changed = np.array(sorted(changed - removed), np.uint64)
            removed = np.array(sorted(removed), np.uint64)
            new_rows = (k + 1 + changed[:, None] + np.zeros(DIM)).astype(np.float32)
            table.commit(table.prepare(changed, new_rows, removed))
            for i in removed.tolist():
                want.pop(i, None)
            want.update({int(i): r for i, r in zip(changed, new_rows)})
            out = np.empty((universe.shape[0], DIM), np.float32)
            table.lookup(universe, out)
            expect = initial(universe)
            for i, r in want.items():
                expect[i] = r
            assert out.tobytes() == expect.tobytes(), k
        count, pages = table.pages()
        pages = list(pages)
        ids = np.concatenate([i for i, _ in pages]) if pages else np.empty(0, np.uint64)
        assert count == len(want) and ids.tolist() == sorted(want)
        assert all(r.tobytes() == np.stack([want[int(j)] for j in i]).tobytes() for i, r in pages if len(i))
        assert np.load(os.path.join(d, "t.rows.npy")).tobytes() == rows.tobytes()     # the files unchanged


def test_a_lookup_racing_an_apply_sees_every_row_whole():
    # Rows of 16 floats all equal to one value; the apply writes value + 1 to every row. A lookup
    # that copied a row while it was half written would see two values in it. Catches in-place
    # writes without the lookups' lock (or a lock per page that a lookup does not take).
    config = sparse.TableConfig(name="wide", dim=16, optimizer="sgd", lr=0.1, init_scale=0.0, seed=1)
    n = 100_000
    with tempfile.TemporaryDirectory() as d:
        ids = np.arange(n, dtype=np.uint64) * np.uint64(3)
        table = mapped(d, ids, np.ones((n, 16), np.float32), config)
        plan = table.prepare(ids, np.full((n, 16), 2.0, np.float32), np.empty(0, np.uint64))
        stop, bad, reads = threading.Event(), [], [0]
        rng = np.random.default_rng(1)

        def predict():
            out = np.empty((512, 16), np.float32)
            while not stop.is_set():
                q = ids[rng.integers(0, n, 512)]
                table.lookup(q, out)
                reads[0] += 1
                whole = (out == out[:, :1]).all(axis=1) & np.isin(out[:, 0], (1.0, 2.0))
                if not whole.all():
                    bad.append(out[~whole][:2].copy())
        t = threading.Thread(target=predict)
        t.start()
        for value in (1.0, 2.0, 1.0):
            table.commit(plan, page=512)
            plan = table.prepare(ids, np.full((n, 16), value, np.float32), np.empty(0, np.uint64))
        stop.set()
        t.join()
        assert reads[0] > 0 and not bad, bad[:1]
        assert np.load(os.path.join(d, "wide.rows.npy"), mmap_mode="r")[0, 0] == 1.0    # copy-on-write
