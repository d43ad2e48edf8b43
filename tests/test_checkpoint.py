"""Checkpoints: atomic files, the newest whole one restored, mismatches refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pserver.config import ServerConfig
from pserver.errors import ConfigError, FailedPrecondition
from pserver.models.layout import Layout
from pserver.server import checkpoint
from pserver.server.shard import Shard
from tests.test_modes import make_cluster, push_all

LAYOUT = Layout.of([("w", (50,))])


def trained_shard(tmp_path, steps=4, optimizer="adam", **cfg):
    shard = make_cluster(LAYOUT, np.linspace(-1, 1, 50, dtype=np.float32), 1, 2,
                         optimizer=optimizer, lr=0.01, checkpoint_dir=str(tmp_path), **cfg)[0]
    rng = np.random.default_rng(0)
    for t in range(steps):
        for r in range(2):
            push_all([shard], r, [t], rng.standard_normal(50).astype(np.float32))
    return shard


def state(shard):
    s = shard.store
    return s.version, s.params.tobytes(), {k: v.tobytes() for k, v in s.optimizer.state.items()}


def test_checkpoint_round_trip_and_training_goes_on_identically(tmp_path):
    shard = trained_shard(tmp_path)
    path, version = shard.checkpoint(0)
    assert version == 4 and os.path.basename(path) == "shard0-of1-v000000000004.ckpt"
    restored = Shard(ServerConfig(num_workers=2, optimizer="adam", lr=0.01, restore=str(tmp_path)))
    assert state(restored) == state(shard)
    for s in (shard, restored):                      # one more step on each: same result
        for r in range(2):
            s.register(r, 2, 0, 1, LAYOUT)
            push_all([s], r, [4], np.full(50, 0.5, np.float32))
    assert state(restored) == state(shard)


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


def test_periodic_checkpoints_every_n_steps(tmp_path):
    shard = trained_shard(tmp_path, steps=6, checkpoint_every=2)
    shard.checkpointer.lock.acquire()                # wait for a background write to end
    shard.checkpointer.lock.release()
    assert checkpoint.candidates(str(tmp_path), 0, 1), "no periodic checkpoint was written"


def test_mismatches_are_refused_with_a_clear_message(tmp_path):
    trained_shard(tmp_path).checkpoint(0)
    with pytest.raises(ConfigError, match="--optimizer adam"):
        Shard(ServerConfig(optimizer="sgd", restore=str(tmp_path)))
    with pytest.raises(ConfigError, match="another number of shards"):
        Shard(ServerConfig(shard=1, num_shards=2, optimizer="adam", restore=str(tmp_path)))
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
    ckpt = checkpoint.Checkpoint("", 7, 0, 1, "sig", 4, 0, 4, "sgd", np.arange(4, dtype=np.float32), {},
                                 clocks={0: 7, 3: 5})
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
