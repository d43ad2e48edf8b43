"""The chief's replacement of a shard's dense values (AssignWeights: Keras's EarlyStopping(
restore_best_weights=True) at the end of fit): the values replaced, the optimizer's state kept,
the version advanced (status's assigned_version), a waiting pull answered; refused, changing
nothing, from another worker, while another worker is live, for a payload of the wrong size or
with a non-finite value, and once the shard's version moved past the one the chief read."""

from __future__ import annotations

import numpy as np
import pytest

from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.models.layout import Layout
from tests.support.pushes import fill_with, push_all
from tests.support.shards import make_cluster

LAYOUT = Layout.of([("w", (4,))])
BEST = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


def _trained(tmp_path=None):
    """A sync adam shard after one step of both workers (version 1, adam's slots non-zero),
    worker 1 then gone as at the end of fit."""
    extra = {"checkpoint_dir": str(tmp_path)} if tmp_path is not None else {}
    shard = make_cluster(LAYOUT, np.zeros(4, np.float32), 1, 2, mode="sync", optimizer="adam", lr=0.1,
                         **extra)[0]
    for r in range(2):
        push_all([shard], r, [0], np.ones(4, np.float32))
    shard.leave(1)
    return shard


def test_the_values_are_replaced_and_the_optimizer_state_kept():
    """Fails if the slots are reset (Keras keeps the optimizer's state), the version does not
    advance (a pull waiting past the version before would never see the values), or status does
    not say it (the other workers wait for assigned_version)."""
    shard = _trained()
    slots = {k: v.copy() for k, v in shard.store.optimizer.state.items()}
    assert shard.status()["assigned_version"] == -1
    assert shard.assign(0, 1, 4, "float32", fill_with(BEST)) == 2
    assert np.array_equal(shard.store.params, BEST)
    assert all(np.array_equal(shard.store.optimizer.state[k], v) for k, v in slots.items())
    assert shard.status()["assigned_version"] == 2 and shard.status()["version"] == 2
    version, params, _ = shard.pull(1, 0, 1, 0, timeout=1.0)
    assert version == 2 and np.array_equal(params, BEST)


@pytest.mark.parametrize("rank, expected, size, values, error, match", [
    (1, 1, 4, BEST, FailedPrecondition, "worker 1 is not the chief"),
    (0, 0, 4, BEST, FailedPrecondition, "at version 1, not 0"),
    (0, 2, 4, BEST, FailedPrecondition, "at version 1, not 2"),
    (0, 1, 5, np.ones(5, np.float32), InvalidArgument, "num_elements: 5 does not match"),
    (0, 1, 4, np.array([1.0, np.nan, 0.0, 0.0], np.float32), InvalidArgument, "non-finite value"),
])
def test_a_bad_assign_is_refused_and_changes_nothing(rank, expected, size, values, error, match):
    """Catches: a non-chief's assign taken, an assign over a version the chief did not read (an
    update in between lost), a wrong-sized or non-finite payload written in part."""
    shard = _trained()
    before = shard.store.params.copy()
    with pytest.raises(error, match=match):
        shard.assign(rank, expected, size, "float32", fill_with(values))
    assert np.array_equal(shard.store.params, before)
    assert shard.status()["version"] == 1 and shard.status()["assigned_version"] == -1


def test_refused_while_another_worker_is_live():
    """Worker 1 still live could push for the open step, which would then land on the assigned
    values: the chief assigns only once every other worker left."""
    shard = make_cluster(LAYOUT, np.zeros(4, np.float32), 1, 2, mode="sync", optimizer="sgd", lr=0.1)[0]
    with pytest.raises(FailedPrecondition, match=r"worker\(s\) \[1\] still live"):
        shard.assign(0, 0, 4, "float32", fill_with(BEST))
    assert np.array_equal(shard.store.params, np.zeros(4)) and shard.status()["version"] == 0
