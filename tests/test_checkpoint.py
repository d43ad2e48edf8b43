"""Checkpoints: atomic files, the newest whole one restored, mismatches refused."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

from pserver.config import ServerConfig
from pserver.errors import ConfigError, FailedPrecondition
from pserver.models.layout import Layout
from pserver.persist import checkpoint, checkpoint_dir, reshard
from pserver.server import checkpoint as shard_checkpoint
from pserver.server.shard import Shard
from pserver.sparse import SparseTable, TableConfig
from tests.support.pushes import push_all
from tests.support.shards import make_cluster, shard_state, trained_shard

LAYOUT = Layout.of([("w", (50,))])


def test_checkpoint_round_trip_and_training_goes_on_identically(tmp_path):
    shard = trained_shard(tmp_path)
    path, version = shard.checkpoint(0)
    assert version == 4 and os.path.basename(path) == "shard0-of1-v000000000004.ckpt"
    restored = Shard(ServerConfig(num_workers=2, optimizer="adam", lr=0.01, restore=str(tmp_path)))
    assert shard_state(restored) == shard_state(shard)
    for r in range(2):                               # the workers join the restored shard
        restored.register(r, 2, 0, 1, LAYOUT)
    for s in (shard, restored):                      # one more step on each: same result
        for r in range(2):
            push_all([s], r, [4], np.full(50, 0.5, np.float32))
    assert shard_state(restored) == shard_state(shard)


def test_half_written_and_corrupt_files_are_never_loaded(tmp_path):
    shard = trained_shard(tmp_path, steps=2)
    good, _ = shard.checkpoint(0)
    push_all([shard], 0, [2], np.ones(50, np.float32))
    push_all([shard], 1, [2], np.ones(50, np.float32))
    newer, _ = shard.checkpoint(0)
    data = open(newer, "rb").read()
    # a crash mid-write leaves only a temporary file; a torn or corrupted final file fails
    # its checksum or does not unzip; either way the older, whole checkpoint is taken
    open(os.path.join(tmp_path, "shard0-of1-v000000000009.ckpt.123.tmp"), "wb").write(data[:100])
    open(newer, "wb").write(data[: len(data) // 2])
    assert checkpoint.load_latest(str(tmp_path), 0, 1).path == good
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0xFF
    open(newer, "wb").write(bytes(corrupt))
    assert checkpoint.load_latest(str(tmp_path), 0, 1).path == good


def test_only_the_newest_three_are_kept(tmp_path):
    shard = trained_shard(tmp_path, steps=0)
    for t in range(5):
        push_all([shard], 0, [t], np.ones(50, np.float32))
        push_all([shard], 1, [t], np.ones(50, np.float32))
        shard.checkpoint(0)
    assert [v for v, _ in checkpoint.candidates(str(tmp_path), 0, 1)] == [5, 4, 3]


def wait_for_writes(shard):
    """Until no checkpoint write is in flight."""
    while shard.checkpointer.busy:
        time.sleep(0.005)


def test_periodic_checkpoints_land_on_multiples_of_every(tmp_path):
    shard = trained_shard(tmp_path, steps=0, checkpoint_every=3, optimizer="sgd")
    for t in range(10):
        for r in range(2):
            push_all([shard], r, [t], np.ones(50, np.float32))
        wait_for_writes(shard)
    assert sorted(v for v, _ in checkpoint.candidates(str(tmp_path), 0, 1)) == [3, 6, 9]


def counting_writes(monkeypatch, shard, gate=None):
    """Instrument the real dump and write: how many dumps were begun, and the most alive at
    once (begun, not yet written: each keeps rows aside while pushes go on)."""
    seen = {"taken": 0, "alive": 0, "peak": 0}
    lock = threading.Lock()
    begin, write = shard.store.begin_dump, shard_checkpoint.write

    def counted_begin(delta):
        with lock:
            seen["taken"] += 1
            seen["alive"] += 1
            seen["peak"] = max(seen["peak"], seen["alive"])
        return begin(delta)

    def slow_write(directory, name, parts, meta):
        try:
            time.sleep(0.2)                       # a slow disk: requests pile up meanwhile
            if gate is not None:
                gate.wait(30)
            return write(directory, name, parts, meta)
        finally:
            with lock:
                seen["alive"] -= 1

    monkeypatch.setattr(shard.store, "begin_dump", counted_begin)
    monkeypatch.setattr(shard_checkpoint, "write", slow_write)
    return seen


def test_concurrent_checkpoint_requests_share_one_write_at_a_time(tmp_path, monkeypatch):
    shard = trained_shard(tmp_path, steps=2)
    seen = counting_writes(monkeypatch, shard)
    start, results = threading.Barrier(60), []

    def ask():
        start.wait()
        results.append(shard.checkpoint(0))

    threads = [threading.Thread(target=ask) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["peak"] == 1, f"{seen['peak']} snapshots were alive at once"
    assert seen["taken"] < 60, "every request took a snapshot of its own"
    assert len(results) == 60 and all(checkpoint.load(p).version == v == 2 for p, v in results)


def test_a_request_newer_than_the_write_in_flight_gets_the_next_write(tmp_path, monkeypatch):
    shard = trained_shard(tmp_path, steps=2)
    gate = threading.Event()
    seen = counting_writes(monkeypatch, shard, gate)
    first = []
    writer = threading.Thread(target=lambda: first.append(shard.checkpoint(0)))
    writer.start()
    while seen["taken"] == 0:
        time.sleep(0.01)
    for r in range(2):                            # version 3 while version 2 is being written
        push_all([shard], r, [2], np.ones(50, np.float32))
    later = []
    asker = threading.Thread(target=lambda: later.append(shard.checkpoint(0)))
    asker.start()
    gate.set()
    writer.join()
    asker.join()
    assert first[0][1] == 2 and later[0][1] == 3 and checkpoint.load(later[0][0]).version == 3
    assert seen["peak"] == 1


def test_an_unwritable_directory_is_refused_at_start(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="--checkpoint-dir: cannot write checkpoints to .*afile/ckpt"):
        Shard(ServerConfig(checkpoint_dir=str(tmp_path / "afile" / "ckpt")))


def test_a_failed_write_is_counted_and_the_next_one_is_tried(tmp_path, caplog):
    shard = trained_shard(tmp_path / "ckpt", steps=0, checkpoint_every=1, optimizer="sgd")
    for t in range(3):
        if t == 2:
            shutil.rmtree(tmp_path / "ckpt")
            (tmp_path / "ckpt").write_text("not a directory any more")
        for r in range(2):                        # the write at version 3 fails on its thread
            push_all([shard], r, [t], np.ones(50, np.float32))
        wait_for_writes(shard)
    with pytest.raises(FailedPrecondition, match="checkpoint: shard 0 could not write version 3 to .*ckpt"):
        shard.checkpoint(0)                       # the chief's request fails with a reason
    counters = shard.status()["counters"]
    assert counters["checkpoints_failed"] == 2
    failures = [r for r in caplog.records if r.name == "pserver.checkpoint" and r.levelname == "ERROR"]
    assert len(failures) == 2 and not any(r.exc_info for r in failures)   # a line each, no traceback
    os.remove(tmp_path / "ckpt")
    for r in range(2):                            # the directory is back: the next interval writes
        push_all([shard], r, [3], np.ones(50, np.float32))
    wait_for_writes(shard)
    assert [v for v, _ in checkpoint.candidates(str(tmp_path / "ckpt"), 0, 1)] == [4]
    assert shard.status()["counters"]["checkpoints_failed"] == 2


def test_orphan_temporary_files_of_this_shard_are_removed_at_start(tmp_path):
    mine = tmp_path / "shard0-of2-v000000000003.ckpt.4242.tmp"
    other = tmp_path / "shard1-of2-v000000000003.ckpt.4243.tmp"   # shard 1 may be writing it now
    for f in (mine, other):
        f.write_bytes(b"half a checkpoint")
    Shard(ServerConfig(num_shards=2, checkpoint_dir=str(tmp_path)))
    assert not mine.exists() and other.exists()


def test_mismatches_are_refused_with_a_clear_message(tmp_path):
    trained_shard(tmp_path).checkpoint(0)
    with pytest.raises(ConfigError, match="--optimizer adam"):
        Shard(ServerConfig(optimizer="sgd", restore=str(tmp_path)))
    restored = Shard(ServerConfig(num_workers=2, optimizer="adam", restore=str(tmp_path)))
    with pytest.raises(FailedPrecondition, match="restored from .*v000000000004"):
        restored.register(0, 2, 0, 1, Layout.of([("w", (51,))]))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        Shard(ServerConfig(restore=str(tmp_path / "afile")))


def test_restore_from_an_empty_or_missing_directory_starts_fresh(tmp_path):
    assert Shard(ServerConfig(restore=str(tmp_path))).store.version == -1
    assert Shard(ServerConfig(restore=str(tmp_path / "first-start"))).store.version == -1


def test_ssp_clocks_round_trip_and_files_without_them_still_load(tmp_path):
    ckpt = checkpoint.Checkpoint(path="", version=7, shard=0, num_shards=1, signature="sig", total=4,
                                 start=0, end=4, optimizer="sgd", params=np.arange(4, dtype=np.float32),
                                 state={}, clocks={0: 7, 3: 5})
    assert checkpoint.load(checkpoint.save(str(tmp_path / "new"), ckpt)).clocks == {0: 7, 3: 5}
    path = checkpoint.save(str(tmp_path / "old"), ckpt)
    with np.load(path) as z:                       # rewritten as files were before clocks existed
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    del meta["clocks"]
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    old = checkpoint.load(path)
    assert old.clocks == {} and old.version == 7


def as_written_by_another_version(path: str, layout: str) -> None:
    """Rewrite a checkpoint file as another version of pserver would have written it: its table's
    meta with a field this TableConfig does not know (one removed since) and without state_dtype
    (added since, with a default); `layout` "by name": as before deltas, an array per name
    (rows.0.<name>), no format, kind or columns."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    meta["tables"][0]["hash_buckets"] = 8
    del meta["tables"][0]["state_dtype"]
    if layout == "by name":
        rows = checkpoint.load(path).rows[meta["tables"][0]["name"]]
        arrays = {k: v for k, v in arrays.items() if not k.startswith("rows.")}
        arrays.update({f"rows.0.{k}": v for k, v in rows.arrays().items()})
        for k in ("format", "kind", "columns"):
            del meta[k]
    meta["sha256"] = checkpoint.digest(arrays)
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


@pytest.mark.parametrize("layout", ["entries", "by name"])
def test_a_file_whose_table_meta_another_version_wrote_still_loads_restores_and_reshards(tmp_path, layout):
    """A checkpoint's table meta is read at the file's edge as this version's TableConfig: a field
    it no longer knows is left out, one added since takes its default. Catches the meta read with
    TableConfig.from_dict's strict rule (an older file with a field since removed would not load,
    restore, reshard or export: 'unknown field'), a missing field not defaulted, and the rows of a
    file from before deltas (an array per name) not read as a RowState."""
    config = TableConfig("emb", 3, optimizer="adam", min_count=2, seed=4)
    table = SparseTable(config, 0)
    rng = np.random.default_rng(1)
    for step in range(4):
        ids = rng.choice(40, 25, replace=False).astype(np.uint64)
        table.apply(ids, rng.standard_normal((25, 3)).astype(np.float32), step)
    want = table.state()
    ckpt = checkpoint.Checkpoint(path="", version=4, shard=0, num_shards=1, signature="sig", total=4,
                                 start=0, end=4, optimizer="sgd", params=np.arange(4, dtype=np.float32),
                                 state={}, tables=[config], rows={"emb": want})
    path = checkpoint.save(str(tmp_path / "old"), ckpt)
    as_written_by_another_version(path, layout)
    old = checkpoint.load(path)
    assert old.tables == [config] and old.tables[0].state_dtype == "float32"
    assert {k: v.tobytes() for k, v in old.rows["emb"].arrays().items()} == \
        {k: v.tobytes() for k, v in want.arrays().items()}
    restored = SparseTable(old.tables[0], 0)
    restored.load(old.rows["emb"])                   # as a shard restores it
    probe = np.arange(50, dtype=np.uint64)
    got, expected = (np.empty((50, 3), np.float32) for _ in range(2))
    restored.lookup(probe, got)
    table.lookup(probe, expected)
    assert got.tobytes() == expected.tobytes()
    parts = [reshard.combine([old], 2, j) for j in range(2)]
    again = [checkpoint.load(checkpoint.save(str(tmp_path / "new"), p)) for p in parts]
    assert all(p.tables == [config] for p in again)
    assert sorted(np.concatenate([p.rows["emb"].ids for p in again]).tolist()) == sorted(want.ids.tolist())
    assert checkpoint_dir.inspect(str(tmp_path / "old"))["sets"][0]["files"][0]["loads"]


def test_a_table_meta_that_makes_no_config_does_not_load(tmp_path):
    """Catches a file whose table meta lacks a field without a default (dim) taken as loading
    (TypeError out of load, or a table of no width): it is skipped like a damaged file."""
    config = TableConfig("emb", 2)
    ckpt = checkpoint.Checkpoint(path="", version=1, shard=0, num_shards=1, signature="sig", total=1,
                                 start=0, end=1, optimizer="sgd", params=np.zeros(1, np.float32), state={},
                                 tables=[config], rows={"emb": SparseTable(config, 0).state()})
    path = checkpoint.save(str(tmp_path), ckpt)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    del meta["tables"][0]["dim"]
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    with pytest.raises(ValueError, match="its sparse tables' meta makes no table config"):
        checkpoint.load(path)


def test_restore_refuses_when_every_checkpoint_is_corrupt_unless_asked(tmp_path):
    shard = trained_shard(tmp_path, steps=2)
    path, _ = shard.checkpoint(0)
    torn = tmp_path / "shard0-of1-v000000000001.ckpt"
    torn.write_bytes(open(path, "rb").read()[:200])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ConfigError) as e:
        Shard(ServerConfig(num_workers=2, optimizer="adam", restore=str(tmp_path)))
    assert "shard0-of1-v000000000002.ckpt: unreadable (BadZipFile: Bad CRC-32" in str(e.value)
    assert "shard0-of1-v000000000001.ckpt: unreadable" in str(e.value)
    assert "--restore-fresh-if-corrupt" in str(e.value)
    fresh = Shard(ServerConfig(num_workers=2, optimizer="adam", restore=str(tmp_path),
                               restore_fresh_if_corrupt=True))
    assert fresh.store.version == -1


def hashes(directory):
    """Every file's bytes in a directory, by name (what a refused start must leave as it was)."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def test_a_directory_belongs_to_the_run_that_wrote_it_and_a_start_without_restoring_it_is_refused(tmp_path):
    """A second run writing into a finished run's directory (no --restore of it) is refused at
    start, naming what it found and the ways on, the files left byte for byte; a restart with
    --restore of it takes the run over (its id, the same RUN) and goes on (catches: a check
    on the id alone, on --restore alone, or a second RUN written by the restart)."""
    d = str(tmp_path / "ck")
    old = trained_shard(tmp_path / "ck")
    old.checkpoint(0)
    before = hashes(d)
    for cfg, words in ((dict(checkpoint_dir=d), "holds another run's checkpoints"),
                       (dict(checkpoint_dir=d, restore=str(tmp_path / "typo")), "typo does not exist")):
        with pytest.raises(ConfigError, match=words):
            Shard(ServerConfig(num_workers=2, optimizer="adam", **cfg))
        assert hashes(d) == before
    run = checkpoint_dir.run_of(d)
    assert run and checkpoint.meta_of(checkpoint.candidates(d, 0, 1)[0][1])["run"] == run
    os.mkdir(tmp_path / "a")
    with pytest.raises(ConfigError) as e:          # restoring another directory into this one
        Shard(ServerConfig(num_workers=2, optimizer="adam", checkpoint_dir=d, restore=str(tmp_path / "a")))
    assert f"--checkpoint-dir: {d} holds another run's checkpoints (1 file(s) of 1 shard(s) at versions " \
           f"4-4, run {run})" in str(e.value)
    assert f"--restore {d}" in str(e.value) and "another --checkpoint-dir" in str(e.value)
    assert hashes(d) == before
    again = Shard(ServerConfig(num_workers=2, optimizer="adam", lr=0.01, checkpoint_dir=d, restore=d))
    assert shard_state(again) == shard_state(old)
    for r in range(2):
        again.register(r, 2, 0, 1, LAYOUT)
        push_all([again], r, [4], np.ones(50, np.float32))
    path, version = again.checkpoint(0)
    assert version == 5 and checkpoint.meta_of(path)["run"] == run and checkpoint_dir.run_of(d) == run
    first = tmp_path / "new"                        # the restart idiom on a first start
    assert Shard(ServerConfig(checkpoint_dir=str(first), restore=str(first))).store.version == -1


def test_a_shard_never_prunes_nor_writes_over_another_runs_files(tmp_path):
    """Another run's files in the directory (one that started at the same moment) are left as
    they are: not counted among the newest kept, not pruned, a same-named one not written over
    (that write fails, counted, and training goes on). Catches pruning by name alone."""
    d, elsewhere = str(tmp_path / "ck"), tmp_path / "another"
    shard = trained_shard(tmp_path / "ck", steps=1, full_every=1)
    shard.checkpoint(0)
    other = trained_shard(elsewhere, steps=0, full_every=1)   # another run: its files at versions 0 and 3
    other.checkpoint(0)
    for t in range(3):
        for r in range(2):
            push_all([other], r, [t], np.full(50, 0.25, np.float32))
    other.checkpoint(0)
    foreign = {}
    for v in (0, 3):                               # older than the run's files, and one it reaches
        name = checkpoint.file_name(0, 1, v)
        foreign[v] = (elsewhere / name).read_bytes()
        shutil.copy(elsewhere / name, os.path.join(d, name))
    for t in range(1, 6):
        for r in range(2):
            push_all([shard], r, [t], np.ones(50, np.float32))
        try:
            shard.checkpoint(0)
        except FailedPrecondition as e:
            assert t == 2 and "another run's file" in str(e)
    assert shard.status()["counters"]["checkpoints_failed"] == 1
    assert [v for v, _ in checkpoint.candidates(d, 0, 1)] == [6, 5, 4, 3, 0]
    for v, data in foreign.items():
        assert open(os.path.join(d, checkpoint.file_name(0, 1, v)), "rb").read() == data


def test_a_directory_written_before_run_ids_is_restored_and_adopted(tmp_path):
    d = str(tmp_path)
    for v in (1, 2):
        c = checkpoint.Checkpoint(path="", version=v, shard=0, num_shards=1, signature=LAYOUT.signature(),
                                  total=50, start=0, end=50, optimizer="sgd",
                                  params=np.full(50, v, np.float32), state={})
        checkpoint.save(d, c)                     # no run in the meta, no RUN file
    with pytest.raises(ConfigError, match="written before run ids"):
        Shard(ServerConfig(num_workers=1, optimizer="sgd", checkpoint_dir=d))
    assert checkpoint_dir.run_of(d) is None
    shard = Shard(ServerConfig(num_workers=1, optimizer="sgd", lr=0.1, checkpoint_dir=d, restore=d,
                               checkpoint_every=1))
    assert shard.store.version == 2 and shard.store.params.tolist() == [2.0] * 50
    shard.register(0, 1, 0, 1, LAYOUT)
    for t in range(2, 4):
        push_all([shard], 0, [t], np.ones(50, np.float32))
        wait_for_writes(shard)
    # adopted
    assert checkpoint_dir.run_of(d) and [v for v, _ in checkpoint.candidates(d, 0, 1)] == [4, 3, 2]


def test_the_shards_of_one_run_take_one_id_whichever_writes_first(tmp_path):
    """Two shards (of one process: the same pid) writing their first files at once: one RUN, whose
    id both files carry, and no temporary file left (catches a temporary name shared by them)."""
    d = str(tmp_path)
    shards = make_cluster(LAYOUT, np.zeros(50, np.float32), 2, 1, optimizer="sgd", lr=0.1, checkpoint_dir=d)
    threads = [threading.Thread(target=s.checkpoint, args=(0,)) for s in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run = checkpoint_dir.run_of(d)
    files = [p for j in range(2) for _, p in checkpoint.candidates(d, j, 2)]
    assert run and {checkpoint.meta_of(p)["run"] for p in files} == {run}
    assert sorted(os.listdir(d)) == ["RUN", checkpoint.file_name(0, 2, 0), checkpoint.file_name(1, 2, 0)]
