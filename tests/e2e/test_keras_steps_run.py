"""An output with steps (n, steps, classes) over a `pserver run --ps 1 --workers 2` cluster: its
labels travel with their samples to both workers, and each epoch's training accuracy is over every
element of every worker's samples (shard 0 sums each sample's fraction of steps right)."""

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
x = rng.normal(size=(256, 5, 3)).astype("float32")
y = keras.utils.to_categorical((x[..., 0] > 0).astype("int64") + (x[..., 1] > 0.5), 4)   # (256, 5, 4)
inputs = keras.Input(shape=(5, 3))
model = keras.Model(inputs, layers.Dense(4, activation="softmax")(layers.Dense(8, activation="tanh")(inputs)))
# A learning rate too small to move a float32 weight: every batch sees the same model, so the
# epoch's accuracy over all samples is the accuracy of predict(x) over every step.
model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-30), loss="categorical_crossentropy",
              metrics=["accuracy"])
h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
p = model.predict(x, verbose=0)
whole = {"accuracy": float(np.mean(p.argmax(-1) == y.argmax(-1))),
         "loss": float(-np.mean(np.log(np.sum(p * y, axis=-1)))), "shape": list(p.shape)}
with open(os.path.join(out, f"h{rank}.json"), "w") as f:
    json.dump({"history": h.history, "whole": whole}, f)
"""


def test_each_epoch_s_accuracy_is_over_every_step_of_every_worker_s_samples(tmp_path):
    """Both workers' History hold, for each epoch, the accuracy and loss over all 256 x 5 steps
    (each worker trained about half the samples). Catches correct steps divided by the samples
    (5 times too large), one-hot labels not decoded per step or lost on their way to a worker,
    a worker logging its own batches only, and a loss averaged per sample instead of per step."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads((tmp_path / f"h{rank}.json").read_text()) for rank in range(2)]
    assert runs[0]["history"] == runs[1]["history"]
    history, whole = runs[0]["history"], runs[0]["whole"]
    assert whole["shape"] == [256, 5, 4]
    assert 0.2 < whole["accuracy"] < 0.9        # neither all nor none: a wrong count shows
    assert history["accuracy"] == pytest.approx([whole["accuracy"]] * 2, rel=1e-9)
    assert history["loss"] == pytest.approx([whole["loss"]] * 2, rel=1e-5)
