"""fit on a keras.utils.PyDataset and on a generator under `pserver run --ps 1 --workers 2`:
the PyDataset's batches are shared between the workers without overlap, and each worker's
generator yields that worker's part."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
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
x = rng.normal(size=(280, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)

class Batched(keras.utils.PyDataset):
    def __init__(self):
        super().__init__()
        self.read, self.ends = [], 0
    def __len__(self):
        return 7            # 7 batches of 40 for 2 workers: one sits each epoch out
    def __getitem__(self, i):
        self.read.append(int(i))
        return x[40 * i:40 * (i + 1)], y[40 * i:40 * (i + 1)]
    def on_epoch_end(self):
        self.ends += 1

def own_part():            # a generator cannot be cut: each worker yields its own batches
    mine = range(rank, 7, 2)
    while True:
        for i in mine:
            yield x[40 * i:40 * (i + 1)], y[40 * i:40 * (i + 1)]

model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
ds = Batched()
h1 = model.fit(ds, epochs=2, verbose=0)
h2 = model.fit(own_part(), steps_per_epoch=3, epochs=2, verbose=0)
np.savez(os.path.join(out, f"final{rank}.npz"), *model.get_weights())
with open(os.path.join(out, f"run{rank}.json"), "w") as f:
    json.dump({"read": ds.read, "ends": ds.ends, "h1": h1.history, "h2": h2.history}, f)
"""


def test_a_pydataset_is_shared_between_the_workers_and_a_generator_is_each_one_s(tmp_path):
    """Catches: both workers training every batch (a PyDataset not cut), their parts overlapping
    (different shuffles), one worker given a step more (sync would stall), on_epoch_end not
    called per epoch, a generator's fit not finishing on both ranks (steps_per_epoch per worker),
    a step of the second fit made of one worker's gradient."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # every step averaged both workers' pushes: in the second fit the first worker to register
    # again trained alone until the other came (the shard still counted it as left)
    updates, pushes = map(int, re.search(r"(\d+) updates from (\d+) pushes", r.stdout + r.stderr).groups())
    assert pushes == 2 * updates, f"{updates} updates from {pushes} pushes"
    runs = [json.loads((tmp_path / f"run{rank}.json").read_text()) for rank in range(2)]
    reads = [run["read"][1:] for run in runs]      # after batch 0, which fit reads first to trace
    assert [run["read"][0] for run in runs] == [0, 0]
    assert [run["ends"] for run in runs] == [2, 2]
    for epoch in range(2):
        parts = [r[len(r) // 2 * epoch:len(r) // 2 * (epoch + 1)] for r in reads]
        assert [len(p) for p in parts] == [3, 3]
        assert len(set(parts[0]) | set(parts[1])) == 6
    # each worker's logs are its own batches' (docs/semantics.md): two epochs of them on each
    assert all(len(run[h]["loss"]) == 2 for run in runs for h in ("h1", "h2"))
    finals = [np.load(tmp_path / f"final{rank}.npz") for rank in range(2)]
    assert all(np.array_equal(finals[0][k], finals[1][k]) for k in finals[0].files)
