"""Incremental checkpoints (docs/semantics.md, "Checkpoints"): a base, then deltas of the rows
changed since the file before; a delta loads as the whole state at its version; a broken file
ends its chain; pruning keeps whole chains; a checkpoint is written from the live state with
the rows a push changes meanwhile copied aside, never a second copy of the whole state."""

from __future__ import annotations

import os
import shutil
import threading
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pserver.config import ServerConfig
from pserver.errors import ConfigError
from pserver.optim import make_optimizer
from pserver.persist import checkpoint, checkpoint_dir, reshard
from pserver.server import checkpoint as shard_checkpoint
from pserver.server.checkpoint import Checkpointer
from pserver.server.store import ShardStore
from pserver.sparse import RowState, TableConfig
from pserver.sparse.merge import RowGrads

DIM, DENSE = 4, 6
UNIVERSE = np.arange(1, 41, dtype=np.uint64)


def make_store(optimizer="adagrad", max_rows=12, full_every=4, directory=None):
    store = ShardStore(0, 1, lambda n: make_optimizer("adam", n, lr=0.01))
    table = TableConfig("emb", DIM, optimizer=optimizer, lr=0.1, seed=3, max_rows=max_rows)
    with store.cond:
        store.configure("sig", DENSE, 0, DENSE, [table])
        store.version = 0
    cfg = ServerConfig(optimizer="adam", full_every=full_every, checkpoint_dir=directory)
    return store, Checkpointer(directory, "--checkpoint-dir", store, cfg)


def push(store, ids, seed):
    rng = np.random.default_rng(seed)
    grads = rng.standard_normal((ids.shape[0], DIM)).astype(np.float32)
    with store.cond:
        store.apply([rng.standard_normal(DENSE).astype(np.float32)], [1],
                    [(RowGrads("emb", np.ascontiguousarray(ids), grads), 1)])


def rows_of(state: RowState) -> dict:
    """A table's state as {id: (row bytes, slot bytes, last update)}: order-free."""
    state = state.arrays()
    slots = [k for k in state if k.startswith("slot_")]
    return {int(i): (state["rows"][k].tobytes(), tuple(state[s][k].tobytes() for s in slots),
                     int(state["last_update"][k]), int(state["steps"][k]) if "steps" in state else 0)
            for k, i in enumerate(state["ids"])}


def plain(store) -> tuple:
    """The plain model of a store: everything a checkpoint must give back."""
    t = store.tables["emb"].state()
    return (store.version, store.params.tobytes(),
            {k: v.tobytes() for k, v in store.optimizer.state.items()}, rows_of(t),
            t.pending_ids.tobytes(), t.counters.tobytes())


def restored(ckpt: checkpoint.Checkpoint) -> tuple:
    t = ckpt.rows["emb"]
    return (ckpt.version, ckpt.params.tobytes(), {k: v.tobytes() for k, v in ckpt.state.items()},
            rows_of(t), t.pending_ids.tobytes(), t.counters.tobytes())


def chain_of(files: list, path: str) -> set[int]:
    """The versions of the files a file needs: itself, its base, the deltas between."""
    version = next(v for v, p in files if p == path)
    base = checkpoint.base_of(path)
    if base is None:
        return {version}
    return {version, base} | {v for v, p in files if checkpoint.base_of(p) == base and v < version}


class Chains(RuleBasedStateMachine):
    """Pushes (with evictions: 12 rows at most out of 40 ids), checkpoints (bases and deltas by
    --full-every 3), damaged files and restores, against a plain record of the state at each
    version written."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="pserver-chains-")
        self.store, self.ckpt = make_store(full_every=3, directory=self.dir)
        self.written: dict[int, tuple] = {}       # version -> the plain state then
        self.broken: set[int] = set()             # versions whose own file was damaged
        self.seed = 0

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(ids=st.lists(st.integers(0, 39), min_size=1, max_size=10, unique=True))
    def push(self, ids):
        self.seed += 1
        push(self.store, UNIVERSE[np.array(ids)], self.seed)

    @rule()
    def write(self):
        path, version = self.ckpt.request()
        self.written[version] = plain(self.store)
        assert os.path.basename(path) in os.listdir(self.dir)

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def damage(self, data):
        files = checkpoint.candidates(self.dir, 0, 1)
        version, path = data.draw(st.sampled_from(files))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        self.broken.add(version)

    @invariant()
    def every_file_loads_as_its_version_or_its_chain_is_broken(self):
        files = checkpoint.candidates(self.dir, 0, 1)
        for version, path in files:
            try:
                got = checkpoint.load(path)
            except ValueError:
                assert chain_of(files, path) & self.broken, \
                    f"version {version} does not load, though no file of its chain broke"
                continue
            # (a damaged byte outside the arrays, in a zip header's date, changes nothing)
            assert restored(got) == self.written[version]

    @invariant()
    def the_newest_versions_are_kept_with_their_chains(self):
        files = checkpoint.candidates(self.dir, 0, 1)
        assert [v for v, _ in files][:checkpoint.KEEP] == sorted(self.written, reverse=True)[:checkpoint.KEEP]
        names = {os.path.basename(p) for _, p in files}
        for _, path in files[:checkpoint.KEEP]:
            base = checkpoint.base_of(path)
            if base is not None:
                assert checkpoint.file_name(0, 1, base) in names

    @invariant()
    def restore_takes_the_newest_that_loads(self):
        if not self.written:
            return
        ckpt = checkpoint.load_latest(self.dir, 0, 1, fresh_if_corrupt=True)
        if ckpt is not None:
            assert restored(ckpt) == self.written[ckpt.version]


Chains.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestChains = Chains.TestCase


def test_a_delta_holds_only_the_rows_changed_and_the_ids_evicted_since(tmp_path):
    store, ckpt = make_store(max_rows=300, directory=str(tmp_path))
    push(store, np.arange(1, 301, dtype=np.uint64), 1)
    base, _ = ckpt.request()
    push(store, np.array([3, 4], np.uint64), 2)                # two rows change
    push(store, np.array([1021, 1022], np.uint64), 3)         # two new rows: the two oldest go
    delta, version = ckpt.request()
    assert checkpoint.base_of(delta) == 1 and version == 3
    meta, arrays = checkpoint.read(delta)
    assert (meta["kind"], meta["base"], meta["parent"]) == ("delta", 1, 1)
    assert sorted(arrays["rows.0.entries"]["id"].tolist()) == [3, 4, 1021, 1022]
    evicted = sorted(arrays["rows.0.evicted"].tolist())
    assert evicted == [1, 2]                          # the least recently updated, ties by id
    assert os.path.getsize(delta) < os.path.getsize(base) / 5
    assert restored(checkpoint.load(delta)) == plain(store)


def test_a_base_every_full_every_files_and_when_the_deltas_reach_half_the_base(tmp_path):
    store, ckpt = make_store(max_rows=0, full_every=3, directory=str(tmp_path / "a"))
    push(store, np.arange(100, 400, dtype=np.uint64), 0)
    kinds = []
    for t in range(7):
        push(store, UNIVERSE[t:t + 1], t)
        path, _ = ckpt.request()
        kinds.append("delta" if checkpoint.base_of(path) is not None else "base")
    assert kinds == ["base", "delta", "delta", "base", "delta", "delta", "base"]
    # every row changes each time: a delta is as big as the base, so each file is a base
    store, ckpt = make_store(max_rows=0, full_every=10, directory=str(tmp_path / "b"))
    kinds = []
    for t in range(4):
        push(store, np.arange(100, 400, dtype=np.uint64), t)
        path, _ = ckpt.request()
        kinds.append("delta" if checkpoint.base_of(path) is not None else "base")
    assert kinds == ["base", "delta", "base", "delta"]


def test_full_every_one_writes_bases_only_and_bad_values_are_refused(tmp_path):
    store, ckpt = make_store(full_every=1, directory=str(tmp_path))
    for t in range(3):
        push(store, UNIVERSE[:3], t)
        assert checkpoint.base_of(ckpt.request()[0]) is None
    assert not store.tables["emb"].track
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="--full-every: must be an integer >= 1"):
            ServerConfig(full_every=bad)


def test_the_same_version_asked_again_is_the_file_already_written(tmp_path):
    store, ckpt = make_store(directory=str(tmp_path))
    push(store, UNIVERSE[:3], 1)
    first = ckpt.request()
    push(store, UNIVERSE[:3], 2)
    second = ckpt.request()
    assert ckpt.request() == second and second != first    # no empty delta that names itself its parent
    assert len(checkpoint.candidates(str(tmp_path), 0, 1)) == 2


def test_a_broken_delta_ends_its_chain_and_restore_says_where(tmp_path, caplog):
    store, ckpt = make_store(max_rows=0, directory=str(tmp_path))
    states = {}
    for t in range(4):
        push(store, np.arange(1, 901 if t == 0 else 16, dtype=np.uint64) + 7 * t, t)
        path, version = ckpt.request()
        states[version] = (path, plain(store))
    middle = states[2][0]
    data = bytearray(open(middle, "rb").read())
    with zipfile.ZipFile(middle) as z:           # a byte of its rows (the file's middle may be a header's)
        entries = z.getinfo("rows.0.entries.npy")
    data[entries.header_offset + 200 + entries.file_size // 2] ^= 0xFF
    open(middle, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="the delta .*v000000000002.* before it: (checksum|unreadable)"):
        checkpoint.load(states[4][0])
    got = checkpoint.load_latest(str(tmp_path), 0, 1)
    assert got.version == 1 and restored(got) == states[1][1]
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 3                            # versions 4, 3 and 2, each with why
    os.remove(os.path.join(tmp_path, checkpoint.file_name(0, 1, 1)))
    with pytest.raises(ValueError, match="its base shard0-of1-v000000000001.ckpt is missing") as e:
        checkpoint.load(states[3][0])
    assert not isinstance(e.value, checkpoint.Gone)           # the delta is there: its chain is broken


def test_a_delta_pruned_with_its_chain_after_the_listing_is_gone_not_broken(tmp_path):
    """CI at b80ea20: export --follow listed a delta, the job pruned it with its base, and the
    delta's reading said "its base ... is missing", a damaged directory, not a file gone (main:
    ValueError)."""
    store, ckpt = make_store(max_rows=0, full_every=10, directory=str(tmp_path))
    paths = {}
    for t in range(4):
        push(store, np.arange(1, 901 if t == 0 else 16, dtype=np.uint64) + 7 * t, t)
        path, version = ckpt.request()
        paths[version] = path
    assert [checkpoint.base_of(paths[v]) for v in (2, 3, 4)] == [1, 1, 1]
    os.remove(paths[1])                           # the base, then the delta listed: as prune does
    os.remove(paths[2])
    with pytest.raises(checkpoint.Gone, match="removed after it was listed"):
        checkpoint.load(paths[2])
    with pytest.raises(ValueError, match="its base .* is missing") as e:
        checkpoint.load(paths[3])                 # still there: broken
    assert not isinstance(e.value, checkpoint.Gone)


def test_a_delta_removed_after_the_listing_is_gone_not_the_state_before_it(tmp_path):
    """The delta listed went, its base and the delta before it stayed (a prune between two
    reads): its reading is Gone, never the chain up to the file before it passed off as it
    (the version asked for silently older)."""
    store, ckpt = make_store(max_rows=0, full_every=10, directory=str(tmp_path))
    paths = {}
    for t in range(3):
        push(store, np.arange(1, 901 if t == 0 else 16, dtype=np.uint64) + 7 * t, t)
        path, version = ckpt.request()
        paths[version] = path
    assert [checkpoint.base_of(paths[v]) for v in (2, 3)] == [1, 1]
    os.remove(paths[3])
    with pytest.raises(checkpoint.Gone, match="removed after it was listed"):
        checkpoint.load(paths[3])
    assert checkpoint.load(paths[2]).version == 2


def test_reshard_and_inspect_read_chains(tmp_path):
    store, ckpt = make_store(max_rows=0, directory=str(tmp_path / "src"))
    push(store, np.arange(100, 400, dtype=np.uint64), 0)
    for t in range(3):
        push(store, UNIVERSE[5 * t:5 * t + 8], t)
        ckpt.request()
    want = plain(store)
    paths = reshard.reshard_directory(str(tmp_path / "src"), str(tmp_path / "dst"), 3, "sync")
    parts = [checkpoint.load(p) for p in paths]
    rows = {}
    for p in parts:
        rows.update(rows_of(p.rows["emb"]))
    assert rows == want[3] and np.concatenate([p.params for p in parts]).tobytes() == want[1]
    report = checkpoint_dir.inspect(str(tmp_path / "src"))
    files = report["sets"][0]["files"]
    assert [f["loads"] for f in files] == [True] * 3 and report["sets"][0]["consistent_cuts"] == [4, 3, 2]
    assert [f["kind"] for f in files] == ["delta", "delta", "base"]


@pytest.mark.parametrize("bucket", [None, 4])
def test_pushes_during_a_write_change_the_live_rows_not_the_file(tmp_path, monkeypatch, bucket):
    """Copy-on-write: a write of version V that pushes overtake (changing rows, creating rows,
    evicting rows) still holds V exactly, and keeps aside only the rows they changed. bucket 4:
    the copies spread over many buckets, each over chunks of 1 and 2 rows (catches a stripe
    that takes a copy from the wrong bucket or chunk, or a row of a chunk's unfilled room)."""
    if bucket:
        from pserver.sparse import table as table_module
        monkeypatch.setattr(table_module._Dump, "BUCKET", bucket)
        monkeypatch.setattr(table_module._Dump, "FIRST", 1)
        monkeypatch.setattr(table_module._Dump, "CHUNK", 2)
    store, ckpt = make_store(max_rows=200, directory=str(tmp_path))
    ids = np.arange(1, 201, dtype=np.uint64)
    push(store, ids, 1)
    ckpt.request()
    push(store, ids[:50], 2)
    want = plain(store)
    gate, started = threading.Event(), threading.Event()
    write = shard_checkpoint.write

    def slow_write(directory, name, parts, meta):
        parts = list(parts)
        rows = next(p for p in parts if p.name == "rows.0.entries")
        chunks = rows.chunks

        def gated():                      # the first stripe is read, then pushes overtake
            it = iter(chunks())
            yield next(it)
            started.set()
            gate.wait(30)
            yield from it

        rows.chunks = gated
        return write(directory, name, parts, meta)

    monkeypatch.setattr(shard_checkpoint, "write", slow_write)
    monkeypatch.setattr(shard_checkpoint, "STRIPE_BYTES", 256)
    result = []
    writer = threading.Thread(target=lambda: result.append(ckpt.request()))
    writer.start()
    assert started.wait(30)
    push(store, ids[11:41:2], 3)               # rows of the delta change
    push(store, ids[10:40:2], 5)               # others between them (parts interleave)
    push(store, np.arange(500, 560, dtype=np.uint64), 4)   # 60 new rows: the 60 oldest evicted
    gate.set()
    writer.join()
    path, version = result[0]
    assert version == want[0] and checkpoint.base_of(path) is not None
    assert restored(checkpoint.load(path)) == want
    entry = store.tables["emb"].entry_dtype().itemsize
    assert 0 < ckpt.aside_peak <= 60 * (entry + 8) + store.params.nbytes * 3


def test_rows_kept_aside_are_filled_in_place_never_merged_by_a_copy(tmp_path):
    """The memory a write under pushes takes is the copies kept aside, not twice them: 300
    pushes of 100 rows into one bucket (as a push spreads over every bucket of a big table)
    keep each row once, in chunks filled in place. Catches aside storage that grows or merges
    a bucket by concatenation (the old and the merged arrays alive at once: a save's traced
    peak passes the bucket's bytes), and rows copied aside twice."""
    import tracemalloc
    store, _ = make_store(max_rows=0, directory=str(tmp_path))
    push(store, np.arange(1, 30_001, dtype=np.uint64), 1)
    table = store.tables["emb"]
    rng = np.random.default_rng(0)
    table.begin_dump(False)
    dump, entry = table._dump, table.entry_dtype().itemsize
    kept = np.zeros(30_000, bool)
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(300):
            positions = rng.choice(30_000, 100, replace=False)
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            with table._lock:
                dump.save(table, positions)
            peaks.append(tracemalloc.get_traced_memory()[1] - start)
            kept[positions] = True
    finally:
        tracemalloc.stop()
        table.end_dump()
    # a save's own arrays (100 rows) and the chunks it adds (2 of 256 rows at most), nothing else
    assert sorted(peaks)[-5] <= 100 * (entry + 64) + 512 * (entry + 8), sorted(peaks)[-10:]
    rows = sum(filled for chunks in dump.buckets.values() for _, _, filled in chunks)
    assert rows == kept.sum()                          # each row once
    assert dump.peak <= 2 * rows * (entry + 8) + 256 * (entry + 8) + 30_000 // 8 + 1


def test_a_dense_step_during_a_write_keeps_only_the_unread_rest_aside(tmp_path, monkeypatch):
    store, ckpt = make_store(max_rows=0, directory=str(tmp_path))
    push(store, UNIVERSE[:2], 1)
    want = plain(store)
    dump = store.begin_dump(False)
    first = dump.read("params", 0, 2)
    push(store, UNIVERSE[:2], 2)               # the step changes every dense element
    rest = dump.read("params", 2, DENSE)
    assert np.concatenate([first, rest]).tobytes() == want[1]
    assert dump.aside_bytes == sum((DENSE - (2 if k == "params" else 0)) * 4 for k in dump.dense)
    store.end_dump()


def test_more_evictions_than_a_delta_records_make_the_next_file_a_base(tmp_path, monkeypatch):
    from pserver.sparse import table as table_module
    monkeypatch.setattr(table_module, "REMOVED_MAX", 5)
    store, ckpt = make_store(max_rows=300, directory=str(tmp_path))
    push(store, np.arange(1, 301, dtype=np.uint64), 1)
    ckpt.request()
    push(store, np.arange(1001, 1004, dtype=np.uint64), 2)       # 3 evicted: a delta records them
    assert checkpoint.base_of(ckpt.request()[0]) is not None
    push(store, np.arange(2001, 2007, dtype=np.uint64), 3)       # 6 evicted: past the bound
    assert store.tables["emb"]._removed == []                    # not kept growing
    path, _ = ckpt.request()
    assert checkpoint.base_of(path) is None and restored(checkpoint.load(path)) == plain(store)


def test_a_run_writing_again_into_a_directory_never_chains_onto_the_old_runs_deltas(tmp_path):
    """A shard started fresh (or restored from an older version) in a directory holding another
    run's chain: its base, written under the old base's name, must not be extended by the old
    run's later deltas (catches: deltas matched to a base by version alone, which loads the old
    v3 delta on the new base as a state no run had), and a version it writes is its own file
    only (catches: the old run's delta at that version left beside the new base, preferred)."""
    d = str(tmp_path)
    old, ck = make_store(max_rows=0, full_every=10, directory=d)
    for t in range(3):                                   # the old run: base v1, deltas v2, v3
        push(old, np.arange(100, 400, dtype=np.uint64) if t == 0 else UNIVERSE[5 * t:5 * t + 10], 100 + t)
        ck.request()
    assert [checkpoint.base_of(p) for _, p in checkpoint.candidates(d, 0, 1)] == [1, 1, None]
    new, ck = make_store(max_rows=0, full_every=10, directory=d)
    states = {}
    for t in range(2):                                   # a new run: base v1, delta v2, other rows
        push(new, np.arange(500, 800, dtype=np.uint64) if t == 0 else UNIVERSE[20:26], 200 + t)
        ck.request()
        states[new.version] = plain(new)
    got = checkpoint.load_latest(d, 0, 1)
    assert restored(got) == states[2]                    # not the old v3 on top of the new v1, v2
    with pytest.raises(ValueError, match="chain broken: .*v000000000003.* extends another writing"):
        checkpoint.load(checkpoint.candidates(d, 0, 1)[0][1])

    # A restore of the new run's v1 writes a base at v2: the delta at v2 goes.
    again, ck = make_store(max_rows=0, full_every=10, directory=d)
    again.restore(checkpoint.load(os.path.join(d, checkpoint.file_name(0, 1, 1))))
    push(again, UNIVERSE[30:35], 300)
    path, version = ck.request()
    assert version == 2 and checkpoint.base_of(path) is None
    assert [p for v, p in checkpoint.candidates(d, 0, 1) if v == 2] == [path]
    assert restored(checkpoint.load(path)) == plain(again)
