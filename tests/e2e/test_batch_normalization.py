"""BatchNormalization under `pserver run --ps 1 --workers 2` (docs/semantics.md,
"BatchNormalization"): the moving statistics are a table on the shard, so after fit both
workers hold the same moving mean and variance (the shard's, pulled), moved from their initial
values toward the data's by the workers' batches, and evaluate and predict the same."""

from __future__ import annotations

import json
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
rank = int(os.environ["PSERVER_RUN_RANK"])
rng = np.random.default_rng(0)
x = (rng.normal(size=(512, 3)) * 2 + 3).astype("float32"); y = (x[:, 0] > 3).astype(int)
model = keras.Sequential([keras.Input(shape=(3,)), layers.BatchNormalization(momentum=0.5),
                          layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs=2, verbose=0)
names = ["gamma", "beta", "moving_mean", "moving_variance"]
stats = dict(zip(names, (w.tolist() for w in model.get_weights()[:4])))
result = {"stats": stats, "evaluate": model.evaluate(x, y, verbose=0),
          "predict": model.predict(x[:16], verbose=0).tolist()}
with open(os.path.join(os.environ["OUT_DIR"], f"bn{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def test_both_workers_evaluate_with_the_shards_moving_statistics(tmp_path):
    """Catches moving statistics kept per worker (each would hold its own batches' and the two
    evaluations differ), statistics the shard never updates (still 0 and 1), and statistics the
    optimizer moves as if they were trained (adam would drag them by its step, not to the data's)."""
    script = tmp_path / "bn.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chief, other = (json.loads((tmp_path / f"bn{k}.json").read_text()) for k in range(2))
    assert other == chief                      # one table: the same values, the same evaluation
    mean, var = np.array(chief["stats"]["moving_mean"]), np.array(chief["stats"]["moving_variance"])
    # momentum 0.5 forgets the start within a few steps: the data's moments (3 and 4) per batch
    np.testing.assert_allclose(mean, 3, atol=0.6)
    np.testing.assert_allclose(var, 4, rtol=0.5)
