"""Checkpoints restored onto another number of shards (pserver.persist.reshard): every element
and every row lands on the shard that owns it now, bit for bit, with its optimizer state."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver import cli, sparse
from pserver.config import ServerConfig
from pserver.errors import ConfigError
from pserver.optim import make_optimizer
from pserver.persist import checkpoint, checkpoint_dir, reshard
from pserver.server.checkpoint import Checkpointer
from pserver.server.shard import Shard
from pserver.server.store import ShardStore
from pserver.sparse.merge import RowGrads
from pserver.wire.sharding import shard_ranges

DENSE_STATE = {"sgd": (), "momentum": ("v",), "adam": ("m", "v")}


def old_set(directory, total, num_shards, optimizer, tables, seed, versions=None):
    """S real checkpoint files of one run: the dense vector and its state cut by range, each
    table's rows trained on the shard their id hashes to. Returns (files' Checkpoints, the
    global dense arrays, {table: {id: per-row arrays}}, {table: summed counters})."""
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(total).astype(np.float32)
    state = {k: rng.standard_normal(total).astype(np.float32) for k in DENSE_STATE[optimizer]}
    configs = [sparse.TableConfig(name, dim, opt, min_count=mc) for name, dim, opt, mc in tables]
    ids = {c.name: rng.choice(1 << 40, size=int(rng.integers(0, 60)), replace=False).astype(np.uint64)
           for c in configs}
    ckpts = []
    for j, (start, end) in enumerate(shard_ranges(total, num_shards)):
        rows = {}
        for i, c in enumerate(configs):
            table = sparse.SparseTable(c, i)
            mine = ids[c.name][sparse.shard_of(ids[c.name], num_shards) == j]
            for step in range(3):       # a few pushes: rows, slots, last updates, admissions
                pick = mine[rng.random(mine.shape[0]) < 0.7]
                table.apply(pick, rng.standard_normal((pick.shape[0], c.dim)).astype(np.float32), step)
            rows[c.name] = table.state()
        version = 5 if versions is None else versions[j]
        ckpts.append(checkpoint.Checkpoint(path="", version=version, shard=j, num_shards=num_shards,
                                           signature="sig", total=total, start=start, end=end,
                                           optimizer=optimizer, params=params[start:end].copy(),
                                           state={k: v[start:end].copy() for k, v in state.items()},
                                           clocks={0: 9 + j, 1: 4 - (j % 2)},
                                           tables=configs, rows=rows,
                                           positions={0: (7, 30), 1: (7, 30)}))
        checkpoint.save(directory, ckpts[-1])
    return ckpts, params, state


def by_id(states: list[sparse.RowState]) -> dict:
    """{id: (row, slots..., last_update, steps)} over shards' states of one table, and the
    pending ids' counts."""
    rows, pending = {}, {}
    for s in (s.arrays() for s in states):
        for n, i in enumerate(s["ids"].tolist()):
            assert i not in rows, f"id {i} on two shards"
            rows[i] = tuple(s[k][n].tobytes() for k in sorted(s) if k not in ("ids", "counters")
                            and not k.startswith("pending_"))
        for n, i in enumerate(s["pending_ids"].tolist()):
            assert i not in pending
            pending[i] = int(s["pending_counts"][n])
    return rows, pending


TABLE = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 4), st.sampled_from(sparse.ROW_OPTIMIZERS),
                  st.sampled_from([0, 2]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(total=st.integers(1, 40), old=st.integers(1, 6), new=st.integers(1, 6),
       optimizer=st.sampled_from(sorted(DENSE_STATE)), mode=st.sampled_from(["sync", "async"]),
       tables=st.lists(TABLE, max_size=2, unique_by=lambda t: t[0]), seed=st.integers(0, 2**16))
def test_any_set_restored_onto_any_number_of_shards_keeps_every_value_bit_for_bit(
        tmp_path_factory, total, old, new, optimizer, mode, tables, seed):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    versions = None if mode == "sync" else [3 + (j * 5) % 7 for j in range(old)]
    ckpts, params, state = old_set(directory, total, old, optimizer, tables, seed, versions)
    chosen = checkpoint_dir.newest_shape(directory, mode, shape=old).ckpts
    parts = [reshard.combine(chosen, new, j) for j in range(new)]
    assert [(p.start, p.end) for p in parts] == shard_ranges(total, new)
    assert np.concatenate([p.params for p in parts]).tobytes() == params.tobytes()
    for k, v in state.items():
        assert np.concatenate([p.state[k] for p in parts]).tobytes() == v.tobytes()
    for i, t in enumerate(ckpts[0].tables):
        name = t.name
        assert by_id([p.rows[name] for p in parts]) == by_id([c.rows[name] for c in ckpts])
        for j, p in enumerate(parts):       # each row on the shard its id hashes to now
            assert (sparse.shard_of(p.rows[name].ids, new) == j).all()
            assert (sparse.shard_of(p.rows[name].pending_ids, new) == j).all()
            table = sparse.SparseTable(t, i)
            table.load(p.rows[name])        # a state the table accepts as its own
        summed = sum(c.rows[name].counters for c in ckpts)
        assert parts[0].rows[name].counters.tolist() == summed.tolist()
        assert all(not p.rows[name].counters.any() for p in parts[1:])
    assert {p.version for p in parts} == {max(c.version for c in ckpts)}
    assert all(p.clocks == {0: 9, 1: 3 if old > 1 else 4} for p in parts)    # the smallest: no data skipped
    assert all(p.positions == {0: (7, 30), 1: (7, 30)} for p in parts)


def test_sync_takes_the_newest_version_every_old_shard_has_and_async_each_ones_newest(tmp_path):
    d = str(tmp_path)
    old_set(d, 10, 2, "sgd", [("a", 2, "adagrad", 0)], 1)                       # version 5 on both
    old_set(d, 10, 2, "sgd", [("a", 2, "adagrad", 0)], 1, versions=[8, 8])
    os.remove(os.path.join(d, checkpoint.file_name(1, 2, 8)))
    # shard 1 has no version 8 any more: sync goes back to 5, async takes 8 and 5 -> 8
    assert [c.version for c in checkpoint_dir.newest_shape(d, "sync", shape=2).ckpts] == [5, 5]
    assert [c.version for c in checkpoint_dir.newest_shape(d, "async", shape=2).ckpts] == [8, 5]
    made = reshard.combine(checkpoint_dir.newest_shape(d, "async", shape=2).ckpts, 3, 1)
    assert (made.version, made.shard, made.num_shards, made.signature, made.total) == (8, 1, 3, "sig", 10)
    assert made.positions == {0: (7, 30), 1: (7, 30)} and made.clocks == {0: 9, 1: 3}
    assert made.optimizer == "sgd" and made.path.endswith("(resharded)")
    # a file of the newest cut that does not load: the cut before it
    old_set(d, 10, 2, "sgd", [("a", 2, "adagrad", 0)], 1, versions=[9, 9])
    with open(os.path.join(d, checkpoint.file_name(0, 2, 9)), "r+b") as f:
        f.seek(200)
        f.write(b"\0" * 64)
    assert [c.version for c in checkpoint_dir.newest_shape(d, "backup", shape=2).ckpts] == [5, 5]


def test_sets_that_cannot_be_combined_are_refused_naming_why(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    old_set(a, 10, 2, "sgd", [], 1)
    os.remove(os.path.join(a, checkpoint.file_name(1, 2, 5)))
    with pytest.raises(ConfigError, match=r"none of shard\(s\) 1"):
        checkpoint_dir.newest_shape(a, "sync", shape=2).ckpts
    old_set(b, 10, 2, "sgd", [], 1, versions=[5, 6])
    with pytest.raises(ConfigError, match="versions found: shard 0: 5; shard 1: 6"):
        checkpoint_dir.newest_shape(b, "sync", shape=2).ckpts
    ckpts = old_set(c, 10, 2, "sgd", [], 1)[0]
    other = ckpts[1]
    other.signature, other.optimizer = "another", "adam"
    checkpoint.save(c, other)
    with pytest.raises(ConfigError, match="layout signature .*two runs"):
        checkpoint_dir.newest_shape(c, "sync", shape=2).ckpts


def test_a_shard_restores_a_set_of_another_shape_and_refuses_one_with_its_own_file_missing(tmp_path):
    d = str(tmp_path)
    ckpts, params, _ = old_set(d, 11, 3, "adam", [("a", 2, "adam", 0)], 4)
    for j, (start, end) in enumerate(shard_ranges(11, 2)):
        s = Shard(ServerConfig(shard=j, num_shards=2, optimizer="adam", restore=d))
        assert s.store.version == 5 and s.store.params.tobytes() == params[start:end].tobytes()
        assert s.store.restored_from.endswith("(resharded)")
    # its own shape's files win over another shape's; one of them missing is refused
    checkpoint.save(d, reshard.combine(ckpts, 2, 0))
    why = (r"shards 0 of 2 \(up to version 5\) but none of shard 1: .* if none does \(shard 1 stopped "
           r"before its first checkpoint\), .* start the job afresh with another --checkpoint-dir")
    with pytest.raises(ConfigError, match=why):
        Shard(ServerConfig(shard=1, num_shards=2, optimizer="adam", restore=d))


def test_offline_reshard_and_inspect(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    old_set(src, 12, 2, "momentum", [("a", 3, "ftrl", 2)], 2)
    paths = reshard.reshard_directory(src, dst, 4, "sync")
    assert sorted(os.path.basename(p) for p in paths) == [checkpoint.file_name(j, 4, 5) for j in range(4)]
    report = checkpoint_dir.inspect(dst)
    (only,) = report["sets"]
    assert only["num_shards"] == 4 and only["consistent_cuts"] == [5] and only["missing_shards"] == []
    assert all(f["loads"] and len(f["sha256"]) == 64 for f in only["files"])
    assert len({f["sha256"] for f in only["files"]}) == 4
    assert only["layout"]["optimizer"] == "momentum" and only["layout"]["tables"][0]["dim"] == 3
    with open(paths[2], "r+b") as f:
        f.seek(100)
        f.write(b"\1" * 32)
    (only,) = checkpoint_dir.inspect(dst)["sets"]
    assert only["consistent_cuts"] == [] and [f["loads"] for f in only["files"]].count(False) == 1
    with pytest.raises(ConfigError, match="no checkpoint"):
        reshard.reshard_directory(str(tmp_path / "empty"), dst, 2, "sync")


def test_inspect_prints_each_files_kind_base_or_delta_even_when_it_does_not_load(tmp_path, capsys):
    """`pserver checkpoint inspect` names each file's kind and a delta's chain (catches: kind
    left out of the text, or shown only for files that load)."""
    store = ShardStore(0, 1, lambda n: make_optimizer("sgd", n, lr=0.1))
    with store.cond:
        store.configure("sig", 4, 0, 4, [sparse.TableConfig("emb", 2, "adagrad")])
        store.version = 0
    ckpt = Checkpointer(str(tmp_path), "--checkpoint-dir", store,
                                   ServerConfig(optimizer="sgd", full_every=3, checkpoint_dir=str(tmp_path)))
    for ids in (np.arange(1000), np.arange(5), np.arange(3, 8)):   # a base, then two small deltas
        ids = ids.astype(np.uint64)
        grads = np.ones((ids.shape[0], 2), np.float32)
        with store.cond:
            store.apply([np.ones(4, np.float32)], [1], [(RowGrads("emb", ids, grads), 1)])
        ckpt.request()
    newest = checkpoint.candidates(str(tmp_path), 0, 1)[0][1]
    with open(newest, "r+b") as f:            # the newest delta no longer loads
        f.seek(os.path.getsize(newest) // 2)
        f.write(b"\xff" * 16)
    assert cli.main(["checkpoint", "inspect", str(tmp_path)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ".ckpt" in ln]
    assert len(lines) == 3
    assert "v000000000003.d000000000001.ckpt  delta of the chain from version 1  " in lines[0]
    assert "DOES NOT LOAD" in lines[0]
    assert "v000000000002.d000000000001.ckpt  delta of the chain from version 1  " in lines[1]
    assert "loads" in lines[1] and "v000000000001.ckpt  base  " in lines[2]
    (only,) = checkpoint_dir.inspect(str(tmp_path))["sets"]
    assert [(f["kind"], f.get("base")) for f in only["files"]] == [("delta", 1), ("delta", 1), ("base", None)]


def restored(d, s, mode, optimizer="sgd"):
    return [Shard(ServerConfig(shard=j, num_shards=s, mode=mode, optimizer=optimizer, restore=d)).store
            for j in range(s)]


def test_a_whole_sync_job_restarts_from_one_version_or_is_refused_naming_the_versions(tmp_path):
    """Shards' files at different versions in one directory: sync and backup take the newest
    version every shard's file loads at, async each shard's newest; no such version in sync is
    refused, not papered over with each shard's own newest."""
    d = str(tmp_path)
    old_set(d, 10, 2, "sgd", [], 1, versions=[5, 5])
    old_set(d, 10, 2, "sgd", [], 1, versions=[9, 9])
    with open(os.path.join(d, checkpoint.file_name(1, 2, 9)), "r+b") as f:   # shard 1's newest is damaged
        f.seek(200)
        f.write(b"\0" * 64)
    assert [s.version for s in restored(d, 2, "sync")] == [5, 5]     # shard 0's good v9 is not taken
    assert [s.version for s in restored(d, 2, "async")] == [9, 5]
    e = str(tmp_path / "e")
    old_set(e, 10, 2, "sgd", [], 1, versions=[4, 7])     # no common version: one shard restarted while
    assert [s.version for s in restored(e, 2, "sync")] == [4, 7]     # the other went on: its own newest
    f = str(tmp_path / "f")
    old_set(f, 10, 2, "sgd", [], 1, versions=[6, 6])
    for j in range(2):                                   # versions every shard has, none of which loads
        with open(os.path.join(f, checkpoint.file_name(j, 2, 6)), "r+b") as fh:
            fh.seek(200)
            fh.write(b"\0" * 64)
    with pytest.raises(ConfigError, match="no version that every one of its 2 shards .*"
                                          "shard 0: 6; shard 1: 6"):
        Shard(ServerConfig(shard=0, num_shards=2, mode="backup", backup_workers=1, num_workers=2,
                           optimizer="sgd", restore=f))


def test_the_newest_shape_wins_when_a_job_goes_back_to_its_old_number_of_shards(tmp_path):
    d = str(tmp_path)
    ckpts, params, _ = old_set(d, 12, 2, "sgd", [("a", 2, "adagrad", 0)], 1)   # 2 shards, version 5
    for j in range(3):                                                        # then 3 shards, version 8
        part = reshard.combine(ckpts, 3, j)
        part.version = 8
        part.params = part.params + 1
        checkpoint.save(d, part)
    back = restored(d, 2, "sync")
    assert [s.version for s in back] == [8, 8]
    assert np.concatenate([s.params for s in back]).tobytes() == (params + 1).tobytes()


def test_evaluate_reads_the_newest_shape_of_a_directory_a_job_resharded_in(tmp_path):
    from pserver.models.layout import Layout
    layout = Layout.of([("w", (7,))])
    d, w = str(tmp_path), np.arange(7, dtype=np.float32)
    for s, version, shift in ((2, 5, 0.0), (3, 9, 1.0), (1, 4, 2.0)):
        for j, (start, end) in enumerate(shard_ranges(7, s)):
            part = checkpoint.Checkpoint(path="", version=version, shard=j, num_shards=s,
                                         signature=layout.signature(), total=7, start=start, end=end,
                                         optimizer="sgd", params=w[start:end] + shift, state={})
            checkpoint.save(d, part)
    flat, versions = checkpoint_dir.load_weights(d, layout)
    assert flat.tolist() == (w + 1).tolist() and versions == [9, 9, 9]


def files(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def one_line(capsys, *words):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    for w in words:
        assert w in err[0], err[0]


def test_an_offline_reshard_writes_only_into_a_target_of_its_own_and_never_prunes(tmp_path, capsys):
    """`pserver checkpoint reshard` into a target that holds newer files of S' shards (another
    run's) is refused before anything is written (it used to write, prune its own files as
    the oldest and say it wrote them); a path that cannot be a directory and a shard count
    above the parameter count are one line, exit 2; a reshard killed mid-write is run again
    over its own files, and the temporary file it left is removed."""
    src, dst, ok = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "ok")
    old_set(src, 12, 2, "sgd", [], 1)                      # version 5, 2 shards
    for v in (6, 7, 8):                                    # another run's 3-shard files, newer
        old_set(dst, 12, 3, "sgd", [], 2, versions=[v] * 3)
    before = files(dst)

    def reshard_cli(to, n=3):
        return cli.main(["checkpoint", "reshard", "--from", src, "--to", to, "--num-shards", str(n)])

    assert reshard_cli(dst) == 2
    one_line(capsys, f"--to: {dst} holds another run's checkpoints (shard0-of3-v000000000006.ckpt",
             "choose an empty --to directory")
    assert files(dst) == before
    (tmp_path / "afile").write_text("x")
    assert reshard_cli(str(tmp_path / "afile")) == 2
    one_line(capsys, "is a file, not a directory")
    assert reshard_cli(str(tmp_path / "afile" / "sub")) == 2
    one_line(capsys, "--to: cannot write checkpoints")
    assert reshard_cli(ok, 1_000_000) == 2
    one_line(capsys, "--num-shards: 1,000,000 is more than the model's 12 parameters")
    assert not os.path.exists(ok)
    assert reshard_cli(ok) == 0
    written = files(ok)
    assert sorted(written) == ["RUN"] + [checkpoint.file_name(j, 3, 5) for j in range(3)]
    os.remove(os.path.join(ok, checkpoint.file_name(2, 3, 5)))   # killed while writing shard 2's
    stale = os.path.join(ok, checkpoint.file_name(2, 3, 5) + f".{1 << 22}.tmp")   # of a pid no process has
    with open(stale, "wb") as f:
        f.write(b"half a file")
    assert reshard_cli(ok) == 0
    assert not os.path.exists(stale) and sorted(files(ok)) == sorted(written)
    assert [s.version for s in restored(ok, 3, "sync")] == [5, 5, 5]
