"""One rule picks the state of a checkpoint directory that restore, reshard, inspect, export and
evaluate read (pserver.persist.checkpoint_dir.newest_usable): the newest usable state across the
shapes a directory holds, never a newer file that belongs to no consistent cut; a file whose
name and meta disagree does not load; a file pruned while it is read is skipped as gone; the
tools answer in one line. Real checkpoint files, written as a shard writes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pserver import models
from pserver.api import export_checkpoints, load_model
from pserver.cli import main
from pserver.config import ServerConfig
from pserver.data import load_dataset
from pserver.errors import ConfigError
from pserver.persist import checkpoint, checkpoint_dir, export, model_file, reshard
from pserver.server.checkpoint import Checkpointer
from pserver.server.shard import Shard
from pserver.wire.sharding import shard_ranges

# The model `pserver export --model logreg --dataset synthetic --features 20` builds.
MODEL = {"model": "logreg", "dataset": "synthetic", "samples": 600, "features": 20}
FLAGS = ["--model", "logreg", "--dataset", "synthetic", "--samples", "600", "--features", "20"]


@pytest.fixture(scope="module")
def layout():
    ds = load_dataset("synthetic", seed=0, samples=600, features=20, task="classification")
    return models.make_model("logreg", ds.sample_shape, ds.num_classes, backend="reference").layout


def weights(layout, version: int) -> np.ndarray:
    """The model's whole vector at a version: each version's values differ."""
    return (np.arange(layout.total, dtype=np.float32) + 1000 * version).astype(np.float32)


def write(d: str, layout, num_shards: int, version: int, shards=None, run=None) -> None:
    """The files `num_shards` shards of one sync job write at `version` (`shards`: only these),
    of run `run`."""
    w = weights(layout, version)
    for j, (start, end) in enumerate(shard_ranges(layout.total, num_shards)):
        if shards is None or j in shards:
            checkpoint.save(d, checkpoint.Checkpoint(path="", version=version, shard=j,
                                                     num_shards=num_shards, signature=layout.signature(),
                                                     total=layout.total, start=start, end=end,
                                                     optimizer="momentum", params=w[start:end].copy(),
                                                     state={"v": w[start:end] * 2}, clocks={0: version},
                                                     positions={0: (1, 10)}), run=run)


def restore(d: str, num_shards: int, mode: str = "sync") -> list[Shard]:
    return [Shard(ServerConfig(shard=j, num_shards=num_shards, mode=mode, optimizer="momentum", restore=d))
            for j in range(num_shards)]


def test_a_job_restored_onto_three_shards_restarts_from_its_own_newer_cut_not_the_orphan(tmp_path, layout):
    """Issue 45.2: 2 sync shards checkpoint 12, 15 and 18, shard 1 dies before its v18; 3 shards
    restore the cut 15, train, write v17. Every reader takes the 3-shard v17 (main restored 15
    again, resharded from 2: newest_shape took the orphan's 18 for the 2-shard state's)."""
    d = str(tmp_path / "ck")
    for v in (12, 15):
        write(d, layout, 2, v)
    write(d, layout, 2, 18, shards={0})                 # shard 1 died before its v18
    write(d, layout, 3, 17)                             # the 3-shard job's own checkpoint
    want = weights(layout, 17)
    for s in (3, 2, 1):                                 # its own shape, back to the old one, another
        shards = restore(d, s)
        assert [x.store.version for x in shards] == [17] * s
        assert np.concatenate([x.store.params for x in shards]).tobytes() == want.tobytes()
    assert [c.version for c in checkpoint_dir.newest_shape(d, "sync").ckpts] == [17, 17, 17]
    report = checkpoint_dir.inspect(d)
    assert report["restores"] == {"num_shards": 3, "version": 17, "versions": [17, 17, 17]}
    flat, versions = checkpoint_dir.load_weights(d, layout)
    assert flat.tobytes() == want.tobytes() and versions == [17, 17, 17]
    out = str(tmp_path / "model.npz")
    result = export_checkpoints(d, out, MODEL)
    assert (result["num_shards"], result["version"]) == (3, 17)
    assert load_model(out).weights.tobytes() == want.tobytes()
    paths = reshard.reshard_directory(d, str(tmp_path / "to4"), 4, "sync")
    assert {checkpoint.load(p).version for p in paths} == {17}


def test_a_consistent_cut_wins_over_a_newer_file_of_no_cut_and_async_takes_each_shards_newest(tmp_path,
                                                                                          layout):
    """3 shards' cut at 10 against 2 shards whose cut is 8 and whose shard 0 alone reached 12:
    sync and backup read 10 (main: the 2-shard cut 8); async reads the 2 shards' 12 and 8 -> 12."""
    d = str(tmp_path)
    write(d, layout, 2, 8)
    write(d, layout, 2, 12, shards={0})
    write(d, layout, 3, 10)
    assert [x.store.version for x in restore(d, 3)] == [10, 10, 10]
    for mode in ("sync", "backup"):
        choice = checkpoint_dir.newest_usable(d, mode)
        assert (choice.best.num_shards, choice.best.version) == (3, 10)
        assert [c.version for c in checkpoint_dir.newest_shape(d, mode).ckpts] == [10, 10, 10]
    choice = checkpoint_dir.newest_usable(d, "async")
    assert (choice.best.num_shards, [c.version for c in choice.best.ckpts]) == (2, [12, 8])
    # the 3-shard v10 of shard 2 does not load: no 3-shard state, the 2-shard cut 8 is the newest
    with open(os.path.join(d, checkpoint.file_name(2, 3, 10)), "r+b") as f:
        f.seek(300)
        f.write(b"\0" * 64)
    assert [x.store.version for x in restore(d, 3)] == [8, 8, 8]


def test_a_file_whose_name_and_meta_disagree_does_not_load(tmp_path, layout):
    """Issue 45.4: shard 0's v15 and v18 bases swapped by name (main combined shard 0's 15 with
    shard 1's 18 and called it 18), and shard 1's file copied under shard 0's name: refused,
    the reason saying which field disagrees; a restore goes back to the cut that is whole."""
    d = str(tmp_path / "ck")
    for v in (12, 15, 18):
        write(d, layout, 2, v)
    a, b = (os.path.join(d, checkpoint.file_name(0, 2, v)) for v in (15, 18))
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(ValueError, match="name and its meta disagree: the name says version 18 "
                                         r"\(its meta: 15\)"):
        checkpoint.load(b)
    assert [c.version for c in checkpoint_dir.newest_shape(d, "sync", shape=2).ckpts] == [12, 12]
    assert [x.store.version for x in restore(d, 2)] == [12, 12]
    files = {f["file"]: f for s in checkpoint_dir.inspect(d)["sets"] for f in s["files"]}
    assert not files[os.path.basename(a)]["loads"] and "disagree" in files[os.path.basename(a)]["why"]
    e = str(tmp_path / "shards")
    write(e, layout, 2, 5)
    one = os.path.join(e, checkpoint.file_name(1, 2, 5))
    shutil.copy(one, os.path.join(e, checkpoint.file_name(0, 2, 5)))
    with pytest.raises(ValueError, match=r"the name says shard 0 \(its meta: 1\)"):
        checkpoint.load(os.path.join(e, checkpoint.file_name(0, 2, 5)))
    with pytest.raises(ConfigError, match="disagree"):
        checkpoint_dir.load_weights(e, layout)


def test_a_file_pruned_between_the_listing_and_its_reading_is_skipped_as_gone(tmp_path, layout):
    """A running job prunes while inspect reads (main: FileNotFoundError from inspect, most
    tries): a thread writes as a shard does, keeping the three newest, while inspect runs; then,
    exactly, the listing taken, a file removed, the directory read from that listing."""
    live = str(tmp_path / "live")
    write(live, layout, 1, 1)
    stop = threading.Event()

    def shard_writing():
        v = 2
        while not stop.is_set():
            write(live, layout, 1, v)
            v += 1

    writer = threading.Thread(target=shard_writing)
    writer.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            report = checkpoint_dir.inspect(live)
            assert all(f["loads"] for f in report["sets"][0]["files"])     # gone ones left out
    finally:
        stop.set()
        writer.join()
    d = str(tmp_path)
    for v in (3, 6):
        write(d, layout, 2, v)
    listing = checkpoint.scan(d)
    gone = os.path.join(d, checkpoint.file_name(1, 2, 6))
    os.remove(gone)
    with pytest.raises(checkpoint.Gone):
        checkpoint.load(gone)
    report = checkpoint_dir.inspect(d, found=listing)
    (only,) = report["sets"]
    assert [f["file"] for f in only["files"]] == [checkpoint.file_name(j, 2, v) for j, v in ((0, 6), (0, 3),
                                                                                            (1, 3))]
    assert all(f["loads"] for f in only["files"]) and only["consistent_cuts"] == [3]
    assert report["restores"]["version"] == 3
    listing = checkpoint.scan(d)
    os.remove(os.path.join(d, checkpoint.file_name(0, 2, 6)))
    choice = checkpoint_dir.newest_usable(d, "async", found=listing)
    assert [c.version for c in choice.best.ckpts] == [3, 3]


def test_a_directory_pruned_of_every_file_listed_is_listed_again(tmp_path, layout, monkeypatch):
    """CI at b80ea20 (tests/e2e/test_serving_a_job.py): `export --follow` of a job checkpointing
    faster than a state loads died ("its base ... is missing; ...: gone (removed after it was
    listed)"), every file it had listed pruned while it read them. Exactly: the listing taken,
    its files removed and a newer version written: newest_shape reads the newer one (main:
    ConfigError); a directory that is pruned under every listing is refused after RESCANS."""
    d = str(tmp_path / "ck")
    for v in (3, 4):
        write(d, layout, 2, v)
    stale = checkpoint.scan(d)
    for files in stale[2].values():
        for _, path in files:
            os.remove(path)
    write(d, layout, 2, 7)
    real, listings = checkpoint_dir.scan, [stale]
    monkeypatch.setattr(checkpoint_dir, "scan",
                        lambda directory: listings.pop() if listings else real(directory))
    assert [c.version for c in checkpoint_dir.newest_shape(d, "sync").ckpts] == [7, 7]
    listings = [stale] * checkpoint_dir.RESCANS
    with pytest.raises(ConfigError, match="removed after it was listed"):
        checkpoint_dir.newest_shape(d, "sync")
    assert listings == []


def test_an_export_of_a_state_read_already_is_that_state_though_the_job_pruned_it(tmp_path, layout):
    """export_checkpoints(state=...), as DeltaChain.step calls it: the state it chose (and named
    its delta after) is what is written, though the job has pruned its files and written a
    newer version since (main: the directory was read a second time, the name from one reading
    and the delta from the other; a reading of every file pruned meanwhile killed the follow)."""
    d = str(tmp_path / "ck")
    write(d, layout, 2, 7)
    state = checkpoint_dir.newest_shape(d, "sync")
    for j in range(2):
        os.remove(os.path.join(d, checkpoint.file_name(j, 2, 7)))
    write(d, layout, 2, 9)
    out = str(tmp_path / "model.npz")
    result = export.export_checkpoints(d, out, MODEL, state=state)
    assert result["version"] == 7
    assert load_model(out).weights.tobytes() == weights(layout, 7).tobytes()
    assert export_checkpoints(d, out, MODEL)["version"] == 9


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pserver", *args], capture_output=True, text=True,
                          timeout=120)


def test_inspect_and_export_answer_in_one_line_with_their_exit_codes(tmp_path, layout, capsys):
    """inspect: 0 with a usable state; 1 with every file's reason when none is usable (main: 0);
    2 for a missing directory (the real CLI in a process of its own, then cli.main). export --out
    under a regular file: one line, exit 2 (main: a traceback), nothing read or written."""
    d = str(tmp_path / "ck")
    write(d, layout, 2, 4)
    with open(os.path.join(d, checkpoint.file_name(1, 2, 4)), "r+b") as f:
        f.seek(300)
        f.write(b"\0" * 64)
    r = cli("checkpoint", "inspect", d)
    assert r.returncode == 1, r
    assert "DOES NOT LOAD" in r.stdout and "reads: nothing" in r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "no state a restore" in r.stderr, r.stderr
    write(d, layout, 2, 5)
    assert main(["checkpoint", "inspect", d]) == 0
    assert "a restore (mode sync) reads: version 5 of 2 shard(s)" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not a directory" in err
    good = str(tmp_path / "good")
    write(good, layout, 2, 4)
    regular = tmp_path / "regular"
    regular.write_text("keep")
    assert main(["export", "--restore", good, *FLAGS, "--out", str(regular / "model")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not a directory" in err, err
    assert regular.read_text() == "keep"
    assert main(["export", "--restore", good, *FLAGS, "--out", str(tmp_path / "m"),
                 "--keep-deltas", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--keep-deltas: only with --follow" in err, err


def test_a_model_without_sparse_tables_follows_its_job_by_deltas_too(tmp_path, layout):
    """export --since of a dense model (main: refused as "written before deltas existed"; export
    --follow waited for ever, and the chief's --export-every exported the model once and never
    again): each delta a single file of the dense weights at its version, which a server
    following the directory applies in order, serving what a fresh export serves; a delta
    written since another export is not applied and the version served stays."""
    from pserver.persist import model_file
    from pserver.serving.model import ServedModel
    d, out = str(tmp_path / "ck"), str(tmp_path / "deltas")
    write(d, layout, 2, 3)
    model = str(tmp_path / "model.npz")
    export_checkpoints(d, model, MODEL)
    served, chain = ServedModel.load(model), export.DeltaChain(d, model, out, MODEL)
    x = load_dataset("synthetic", seed=0, samples=600, features=20, task="classification").x_test[:16]
    assert chain.step() is None
    for v in (5, 8):
        write(d, layout, 2, v)
        result = chain.step()
        assert (result["version"], result["since"]) == (v, 3 if v == 5 else 5)
        assert os.path.isfile(result["path"])                   # one file, as the model is
        assert served.follow_once(out, say=lambda *_: None) == 0      # not settled at its first look
        assert served.follow_once(out, say=lambda *_: None) == 1 and served.version == v
        fresh = str(tmp_path / f"fresh{v}.npz")
        export_checkpoints(d, fresh, MODEL)
        assert served.predict({"": x})[0].tobytes() == load_model(fresh).predict(x).tobytes()
    stray = os.path.join(out, "delta-v000000009")               # written since another export
    export.export_checkpoints(d, stray, MODEL, since=model)
    said = []
    served.follow_once(out, say=said.append)
    served.follow_once(out, say=said.append)
    assert served.version == 8 and not any("applied" in line for line in said)
    assert model_file.read(stray, arrays=False)[0]["delta"]["base_version"] == 3


def test_a_server_behind_the_deltas_kept_takes_up_the_model_they_make(tmp_path, layout):
    """export --follow --keep-deltas 2: the older deltas go once newer ones are written, so the
    directory stays bounded (main: every delta kept for ever). A server that follows applies each
    delta and never takes anything up; one started later from the first model, whose next delta is
    gone, takes up OUT/.base: it serves what a fresh export serves, its model file becomes that
    version, and it follows the next delta as usual. A delta pruned while read is not refused."""
    from pserver.errors import Pruned
    from pserver.serving.model import ServedModel
    d, out = str(tmp_path / "ck"), str(tmp_path / "deltas")
    write(d, layout, 2, 3)
    model, late = str(tmp_path / "model.npz"), str(tmp_path / "late.npz")
    export_checkpoints(d, model, MODEL)
    shutil.copy(model, late)
    with pytest.raises(ConfigError, match="--keep-deltas: -1"):
        export.DeltaChain(d, model, out, MODEL, keep=-1)
    chain = export.DeltaChain(d, model, out, MODEL, keep=2)
    follower = ServedModel.load(model)
    x = load_dataset("synthetic", seed=0, samples=600, features=20, task="classification").x_test[:16]
    quiet = []
    for v in (5, 8, 11, 14):
        write(d, layout, 2, v)
        chain.step()
        follower.follow_once(out, say=quiet.append)
        follower.follow_once(out, say=quiet.append)
        assert follower.version == v
    assert sorted(os.listdir(out)) == [".base", "delta-v000000011", "delta-v000000014"]
    assert follower.taken_up == 0 and follower.refused == 0
    said = []
    behind = ServedModel.load(late)
    assert behind.follow_once(out, say=said.append) == 1 and behind.version == 14 and behind.taken_up == 1
    assert "took up" in said[-1] and late in said[-1], said
    fresh = str(tmp_path / "fresh.npz")
    export_checkpoints(d, fresh, MODEL)
    want = load_model(fresh).predict(x).tobytes()
    assert behind.predict({"": x})[0].tobytes() == want == follower.predict({"": x})[0].tobytes()
    assert load_model(late).predict(x).tobytes() == want                    # its file, rewritten
    assert behind.follow_once(out, say=said.append) == 0                    # caught up: nothing more
    write(d, layout, 2, 17)
    chain.step()
    for served in (behind, follower):
        served.follow_once(out, say=said.append)
        assert served.follow_once(out, say=said.append) == 1 and served.version == 17
    assert behind.taken_up == 1 and follower.taken_up == 0
    other_ds = load_dataset("synthetic", seed=0, samples=600, features=12, task="classification")
    other_layout = models.make_model("logreg", other_ds.sample_shape, other_ds.num_classes,
                                     backend="reference").layout
    o = str(tmp_path / "other")                          # another job (another layout) at version 3
    for j, (start, end) in enumerate(shard_ranges(other_layout.total, 1)):
        checkpoint.save(o, checkpoint.Checkpoint(
            path="", version=3, shard=j, num_shards=1, signature=other_layout.signature(),
            total=other_layout.total, start=start, end=end, optimizer="momentum",
            params=np.zeros(end - start, np.float32), state={}, clocks={0: 3}, positions={0: (1, 10)}))
    other = str(tmp_path / "other.npz")
    export_checkpoints(o, other, {**MODEL, "features": 12})
    stranger = ServedModel.load(other)
    assert stranger.follow_once(out, say=said.append) == 0 and stranger.version == 3 and not stranger.taken_up
    gone = os.path.join(out, "delta-v000000014")
    os.remove(gone)
    with pytest.raises(Pruned):
        follower.apply(gone)
    assert follower.refused == 0
    import zipfile
    base = os.path.join(out, ".base")                    # a damaged .base: not taken up, said once
    with zipfile.ZipFile(base) as z:
        member = next(i for i in z.infolist() if not i.filename.startswith("pserver_model"))
    data = bytearray(open(base, "rb").read())
    data[member.header_offset + 30 + len(member.filename) + member.file_size // 2] ^= 0xFF
    open(base, "wb").write(bytes(data))
    late2 = str(tmp_path / "late2.npz")
    shutil.copy(model, late2)
    said, again = [], ServedModel.load(late2)
    for _ in range(3):
        assert again.follow_once(out, say=said.append) == 0
    assert again.version == 3 and not again.taken_up
    assert len([line for line in said if "could not take up" in line]) == 1, said


def test_a_delta_renamed_as_a_base_does_not_load(tmp_path):
    """A shard's delta (v2 of the chain from 1) under a base's name: refused, not read as a
    base with its unchanged rows missing."""
    from pserver import sparse
    from pserver.optim import make_optimizer
    from pserver.server.store import ShardStore
    from pserver.sparse.merge import RowGrads
    store = ShardStore(0, 1, lambda n: make_optimizer("sgd", n, lr=0.1))
    with store.cond:
        store.configure("sig", 4, 0, 4, [sparse.TableConfig("emb", 2, "adagrad")])
        store.version = 0
    cfg = ServerConfig(optimizer="sgd", full_every=3, checkpoint_dir=str(tmp_path))
    writer = Checkpointer(str(tmp_path), "--checkpoint-dir", store, cfg)
    for ids in (np.arange(1000), np.arange(5)):              # a base, then a small delta
        ids = ids.astype(np.uint64)
        with store.cond:
            store.apply([np.ones(4, np.float32)], [1], [(RowGrads("emb", ids, np.ones((ids.shape[0], 2),
                                                                                       np.float32)), 1)])
        writer.request()
    delta = os.path.join(str(tmp_path), checkpoint.file_name(0, 1, 2, base=1))
    assert checkpoint.load(delta).version == 2
    renamed = os.path.join(str(tmp_path), checkpoint.file_name(0, 1, 2))
    os.rename(delta, renamed)
    with pytest.raises(ValueError, match=r"kind base \(its meta: delta\)"):
        checkpoint.load(renamed)
    assert checkpoint_dir.newest_usable(str(tmp_path), "sync").best.version == 1


def test_a_file_of_another_run_copied_in_is_never_mixed_into_a_cut(tmp_path, layout):
    """Run a's directory (its RUN file) with run b's shard-1 file of version 18 copied in beside
    a's own shard-0 v18: restore, export and evaluate read the cut 15 of run a alone, and say why
    18 was passed over (an adversarial pass: they combined a's shard 0 with b's shard 1)."""
    d = str(tmp_path / "ck")
    os.makedirs(d)
    assert checkpoint_dir.claim(d, None, "a" * 32) == "a" * 32
    for v in (12, 15):
        write(d, layout, 2, v, run="a" * 32)
    write(d, layout, 2, 18, shards={0}, run="a" * 32)
    write(d, layout, 2, 18, shards={1}, run="b" * 32)
    assert [x.store.version for x in restore(d, 2)] == [15, 15]
    choice = checkpoint_dir.newest_usable(d, "sync")
    assert choice.best.version == 15
    assert any("written by run " + "b" * 32 in f and "never mixed in" in f for f in choice.failures), \
        choice.failures


def test_an_unreadable_run_file_is_refused_before_anything_starts(tmp_path, layout):
    """RUN not JSON (an adversarial pass): a restart took it, wrote its files under the run id
    '<unreadable RUN file: ...>', and never pruned the old run's files again."""
    d = str(tmp_path / "ck")
    write(d, layout, 2, 12)
    with open(os.path.join(d, checkpoint_dir.RUN_FILE), "w") as f:
        f.write("garbage")
    for args in ((d, d), (None, d), (d, None)):
        with pytest.raises(ConfigError, match=r"/RUN does not read \(Expecting value.*\): it names the run"):
            checkpoint_dir.check_start(*args)


def test_export_of_a_dense_model_takes_the_runs_seed_from_its_checkpoints(tmp_path, layout):
    """export's help says the seed defaults to the checkpoints'; for a dense model it did not: a
    --seed 1 run exported with seed 0 recorded, and `evaluate --model-file` then regenerated the
    synthetic data of seed 0 (accuracy 0.06 against 0.89, an adversarial pass). Its workers'
    positions hold the run's seed (write: data order (1, 10)); a --seed given still wins."""
    d = str(tmp_path / "ck")
    write(d, layout, 2, 12)
    for options, seed in ((MODEL, 1), ({**MODEL, "seed": 7}, 7)):
        out = str(tmp_path / f"m{seed}.npz")
        export_checkpoints(d, out, options)
        assert model_file.read(out, arrays=False)[0]["dataset"]["seed"] == seed


def test_export_never_writes_over_its_since_model_or_a_users_file(tmp_path, layout):
    """`export --since M --out M` replaced the model with a delta of itself (evaluate then said
    "a delta, not a model"), and --out naming a text file replaced it (an adversarial pass).
    Both refused before anything is read or written; a model at --out is still replaced."""
    d = str(tmp_path / "ck")
    write(d, layout, 2, 12)
    model = str(tmp_path / "m.npz")
    export_checkpoints(d, model, MODEL)
    before = open(model, "rb").read()
    with pytest.raises(ConfigError, match="--out: .* is the --since model"):
        export_checkpoints(d, model, MODEL, since=model)
    with pytest.raises(ConfigError, match="--out: .* is the --since model"):
        export.DeltaChain(d, model, model, MODEL)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="--out: .* is a file that is not a pserver model"):
        export_checkpoints(d, str(notes), MODEL)
    assert open(model, "rb").read() == before and notes.read_text() == "mine"
    write(d, layout, 2, 15)
    export_checkpoints(d, model, MODEL)                   # a model there: replaced, as before
    assert model_file.read(model, arrays=False)[0]["origin"]["version"] == 15
