"""A keras.Model with two outputs (a softmax class head and a regression head on a shared
trunk, a dict of losses, loss_weights, metrics per output) under `pserver run --ps 1 --workers
2` in sync: every rank's History has Keras 3's per-output keys (a_loss, b_loss, a_accuracy and
their val_), and the chief's evaluation after training shows both heads learnt. Catches: the
targets not packed per sample (a worker's row slice taking another sample's labels: no
learning), a non-chief rank whose History lacks the per-output keys (the chief's logs not
shared), a worker's exit code lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import json, sys
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
from pserver.keras import cluster

rng = np.random.default_rng(0)
ya = rng.integers(0, 3, 1200)
x = (rng.normal(0, 2, (3, 6))[ya] + rng.normal(0, 1, (1200, 6))).astype(np.float32)
yb = (x @ rng.normal(size=6) / 4).astype(np.float32)
if sys.argv[2] == "functional":
    inp = keras.Input(shape=(6,))
    h = layers.Dense(32, activation="relu")(inp)
    model = keras.Model(inp, {"a": layers.Dense(3, activation="softmax")(h), "b": layers.Dense(1)(h)})
    losses = {"a": "sparse_categorical_crossentropy", "b": "mse"}
else:                 # subclassed: call returns a dict, with a third output that has no loss
    class Heads(keras.Model):
        def __init__(self):
            super().__init__()
            self.trunk = layers.Dense(32, activation="relu")
            self.a, self.b, self.c = layers.Dense(3, activation="softmax"), layers.Dense(1), layers.Dense(2)

        def call(self, inputs):
            h = self.trunk(inputs)
            return {"a": self.a(h), "b": self.b(h), "c": self.c(h)}

    model = Heads()
    losses = {"a": "sparse_categorical_crossentropy", "b": "mse", "c": None}
model.compile(optimizer=keras.optimizers.Adam(0.01), loss=losses,
              loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": ["accuracy"]})
history = model.fit(x, {"a": ya, "b": yb}, batch_size=64, epochs=3, verbose=2, validation_split=0.2)
final = model.evaluate(x, {"a": ya, "b": yb}, verbose=0, return_dict=True)
with open(f"{sys.argv[1]}/rank{getattr(cluster.current(), 'rank', 0)}.json", "w") as f:
    json.dump({"history": history.history, "final": final}, f)
"""

KEYS = ["loss", "a_loss", "b_loss", "a_accuracy", "val_loss", "val_a_loss", "val_b_loss", "val_a_accuracy"]


@pytest.mark.parametrize("form", ["functional", "subclassed"])
def test_a_two_output_model_trains_under_pserver_run_and_every_rank_s_history_has_each_output(tmp_path, form):
    """`subclassed`: a keras.Model subclass whose call returns a dict, with a third output
    compiled with loss None (predicted, not trained): the same keys, the same learning."""
    script = tmp_path / "two_outputs.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script), str(tmp_path), form], capture_output=True, text=True,
                       timeout=300, env=env_with({}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for got in ranks:
        assert list(got["history"]) == KEYS, got
        assert all(len(v) == 3 for v in got["history"].values()), got
    assert ranks[0]["history"] == ranks[1]["history"]          # the chief's logs, shared
    final = ranks[0]["final"]
    assert final["a_accuracy"] > 0.9 and final["b_loss"] < 0.1, final
    assert final["loss"] == pytest.approx(final["a_loss"] + 0.5 * final["b_loss"], rel=1e-5)
