"""Keras's LearningRateScheduler and ReduceLROnPlateau under `pserver run --ps 2 --workers 2`
(sync): the chief sets each new rate on both shards between two of its steps, so both shards
change at the same version, and every worker's History and optimizer say the same rates."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import json, os
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank, out = int(os.environ["PSERVER_RUN_RANK"]), os.environ["OUT_DIR"]
rng = np.random.default_rng(0)
x = rng.normal(size=(320, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
sched = keras.callbacks.LearningRateScheduler(lambda epoch: 0.2 / (epoch + 1))
plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10.0, patience=1, factor=0.5)
h = model.fit(x, y, batch_size=32, epochs=3, verbose=0, validation_split=0.2, callbacks=[sched, plateau])
with open(os.path.join(out, f"h{rank}.json"), "w") as f:
    json.dump({"lr": h.history["learning_rate"], "now": model.optimizer.learning_rate}, f)
"""
CHANGE = re.compile(r"^\[ps(\d)\] .*shard \d: learning rate (\S+) -> (\S+) from version (\d+) on", re.M)


def test_every_shard_takes_the_chief_s_rates_at_the_same_versions(tmp_path):
    """The scheduler sets 0.2, 0.1, 0.0667 at each epoch's beginning and the plateau (min_delta 10:
    no epoch counts as better) halves the rate after epoch 2 and 3. Catches: a change made on one
    shard only, at different steps on the two, not made at all (the shards' log says nothing), or
    a worker whose model does not follow the chief's decisions."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "2", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    changes = {j: [(float(b), float(a), int(v)) for s, b, a, v in CHANGE.findall(r.stdout) if int(s) == j]
               for j in range(2)}
    assert changes[0] == changes[1], changes
    rates = [a for _, a, _ in changes[0]]
    assert rates == pytest.approx([0.2, 0.1, 0.05, 0.2 / 3, 0.2 / 6]), changes
    versions = [v for _, _, v in changes[0]]
    assert versions[0] == 1 and versions == sorted(versions)
    chief, other = (json.loads((tmp_path / f"h{k}.json").read_text()) for k in range(2))
    assert chief == other and chief["now"] == pytest.approx(0.2 / 6)
    assert chief["lr"] == pytest.approx([0.2, 0.1, 0.2 / 3])
