"""The chief's learning-rate change on the shards (SetLearningRate: Keras's ReduceLROnPlateau and
LearningRateScheduler): from the next update on, refused from anyone but the chief and for a
rate that is not a finite number > 0 (changing nothing), reported by status and Register, and
kept through a checkpoint and a reshard."""

from __future__ import annotations

import numpy as np
import pytest

from pserver.config import ServerConfig
from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.models.layout import Layout
from pserver.persist import checkpoint, reshard
from pserver.server.shard import Shard
from tests.support.pushes import push_all
from tests.support.shards import make_cluster

LAYOUT = Layout.of([("w", (4,))])


def _sgd(tmp_path=None, **cfg):
    extra = {"checkpoint_dir": str(tmp_path)} if tmp_path is not None else {}
    return make_cluster(LAYOUT, np.zeros(4, np.float32), 1, 2, mode="sync", optimizer="sgd", lr=0.1,
                        **extra, **cfg)[0]


def _step(shard, t: int) -> None:
    for r in range(2):
        push_all([shard], r, [t], np.ones(4, np.float32))


def test_a_new_rate_applies_from_the_next_update_on():
    """sgd with a gradient of ones: step 1 moves each weight by -0.1, then the chief sets 0.5 and
    step 2 moves it by -0.5. Fails if the change is ignored, applied to the step already taken,
    or if status and Register still say --lr."""
    shard = _sgd()
    _step(shard, 0)
    assert np.allclose(shard.store.params, -0.1)
    assert shard.set_lr(0, None, 0.5) == (1, 0.1)
    _step(shard, 1)
    assert np.allclose(shard.store.params, -0.6)
    assert shard.status()["lr"] == 0.5 and shard.settings(2)["lr"] == 0.5


@pytest.mark.parametrize("rank, lr, error, match", [
    (1, 0.5, FailedPrecondition, "worker 1 is not the chief"),
    (0, 0.0, InvalidArgument, "must be a finite number > 0, got 0.0"),
    (0, float("nan"), InvalidArgument, "got nan"),
    (0, -1.0, InvalidArgument, "got -1.0"),
    (0, True, InvalidArgument, "got True"),
])
def test_a_bad_change_is_refused_and_changes_nothing(rank, lr, error, match):
    shard = _sgd()
    with pytest.raises(error, match=match):
        shard.set_lr(rank, None, lr)
    _step(shard, 0)
    assert np.allclose(shard.store.params, -0.1) and shard.status()["lr"] == 0.1


def test_the_rate_is_kept_through_a_checkpoint_and_a_reshard(tmp_path):
    """A shard restored from a checkpoint taken after the change trains at the new rate (and
    says it), whatever --lr it is started with; a file from before any change keeps --lr; a
    change at a version already written writes that version again. Fails if the checkpoint
    forgets the chief's rate (a restarted job would train at --lr)."""
    shard = _sgd(tmp_path / "a")
    _step(shard, 0)
    before, _ = shard.checkpoint(0)
    assert checkpoint.load(before).lr_set is None
    shard.set_lr(0, None, 0.5)
    after, _ = shard.checkpoint(0)                 # the same version, written again with the rate
    assert checkpoint.load(after).lr_set == 0.5
    restored = Shard(ServerConfig(num_workers=2, mode="sync", optimizer="sgd", lr=0.1,
                                  restore=str(tmp_path / "a")))
    assert restored.status()["lr"] == 0.5 and restored.store.optimizer.lr == 0.5
    two = [reshard.combine([checkpoint.load(after)], 2, j) for j in range(2)]
    assert [c.lr_set for c in two] == [0.5, 0.5]
