"""Keras's metrics over a `pserver run --ps 1 --workers 2` cluster: each epoch's training logs are
the metric over every worker's samples, exactly (shard 0 adds the sums each push carries)."""

from __future__ import annotations

import json
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
x = rng.normal(size=(384, 4)).astype("float32"); y = (x[:, 0] + x[:, 1] > 0.3).astype("float32")
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(1, activation="sigmoid")])
made = lambda: [keras.metrics.Precision(), keras.metrics.Recall(thresholds=0.4),
                keras.metrics.AUC(num_thresholds=50), keras.metrics.RootMeanSquaredError()]
# A learning rate too small to move a float32 weight: every batch sees the same model, so the
# epoch's metric over all samples is the metric of predict(x).
model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-30), loss="binary_crossentropy",
              metrics=made() + ["mse"])
h = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
p = model.predict(x, verbose=0)
whole = {}
for m in made() + [keras.metrics.MeanSquaredError(name="mse")]:
    m.update_state(y, p)
    whole[m.name] = float(m.result())
with open(os.path.join(out, f"h{rank}.json"), "w") as f:
    json.dump({"history": h.history, "whole": whole}, f)
"""


def test_each_epoch_s_metrics_are_over_every_worker_s_samples(tmp_path):
    """Both workers' History hold, for each epoch, the metric of all 384 samples (each worker
    trained about half). Catches a worker logging its own batches' metric, a state averaged
    instead of summed, sums lost on the data plane or in shard 0's epoch sums."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads((tmp_path / f"h{rank}.json").read_text()) for rank in range(2)]
    assert runs[0]["history"] == runs[1]["history"]
    history, whole = runs[0]["history"], runs[0]["whole"]
    for name in ("precision", "recall", "auc"):        # counts: exact
        assert history[name] == [whole[name]] * 2, name
    for name in ("mse", "root_mean_squared_error"):     # float32 outputs summed in float64
        assert history[name] == pytest.approx([whole[name]] * 2, rel=1e-6), name
