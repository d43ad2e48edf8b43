"""A Functional keras.Model with a layer of your own (keras.io's Linear) and a residual add,
under `pserver run --ps 1 --workers 2` in sync: each worker traces the same graph, so the layout
the shards serve is theirs; the chief's evaluation after training is > 0.9 on separable blobs.
Catches: a graph whose layout differs between workers (a Register mismatch), a traced layer's
weights not pushed (no learning), a worker's exit code lost."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import numpy as np
import pserver.keras as keras
from pserver.keras import layers, ops

class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros")
    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b

rng = np.random.default_rng(0)
y = rng.integers(0, 3, 1200)
x = (rng.normal(0, 2, (3, 8))[y] + rng.normal(0, 1, (1200, 8))).astype(np.float32)
inp = keras.Input(shape=(8,))
h = layers.add([ops.relu(Linear(16)(inp)), layers.Dense(16)(inp)])
model = keras.Model(inp, layers.Dense(3, activation="softmax")(h))
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs=4, verbose=2)
print("final accuracy", model.evaluate(x, y, verbose=0)[1])
"""


def test_a_functional_model_with_a_layer_of_your_own_trains_under_pserver_run(tmp_path):
    script = tmp_path / "functional.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=env_with({}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finals = re.findall(r"^\[worker0\] final accuracy (\S+)$", r.stdout, re.M)
    assert len(finals) == 1 and "[worker1] final" not in r.stdout, r.stdout[-3000:]
    assert float(finals[0]) > 0.9, r.stdout[-3000:]
