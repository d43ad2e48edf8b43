"""Normalization's statistics and the augmentation layers under `pserver run --ps 1 --workers 2`
(docs/semantics.md): the chief's adapted statistics are the ones every worker ends with, though
each worker adapted on different data, and augmentation in front of the model trains."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import os
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank, out = int(os.environ["PSERVER_RUN_RANK"]), os.environ["OUT_DIR"]
x = np.random.default_rng(0).normal(size=(256, 6, 6, 1)).astype("float32")
y = (x.mean(axis=(1, 2, 3)) > 0).astype(int)
norm = layers.Normalization(axis=None)
model = keras.Sequential([keras.Input(shape=(6, 6, 1)), norm, layers.RandomFlip(), layers.RandomRotation(0.1),
                          layers.Flatten(), layers.Dense(2, activation="softmax")])
norm.adapt(x * (rank + 1) + 10 * rank)          # each worker its own data: the chief's wins
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
np.savez(os.path.join(out, f"norm{rank}.npz"), *model.get_weights()[:3], loss=np.array(h.history["loss"]))
"""


def test_every_worker_ends_with_the_chief_s_adapted_statistics(tmp_path):
    """Worker 1 adapts on x * 2 + 10, the chief on x. Catches: a worker keeping its own
    statistics (its evaluations and saved model would differ from the chief's), statistics
    trained or averaged across workers, augmentation failing on a cluster."""
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    x = np.random.default_rng(0).normal(size=(256, 6, 6, 1)).astype(np.float64)
    for rank in range(2):
        saved = np.load(tmp_path / f"norm{rank}.npz")
        mean, var, count = (saved[f"arr_{i}"] for i in range(3))
        np.testing.assert_allclose(mean, x.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var, x.var(), rtol=1e-5)
        assert count == x.size
        assert np.all(np.isfinite(saved["loss"]))
