"""sample_weight under `pserver run --ps 1 --workers 2` (sync): the weights go with their samples
to the worker that trains them, so zeroing half the samples trains as the other half alone."""

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
rank, out = int(os.environ["PSERVER_RUN_RANK"]), os.environ["OUT_DIR"]
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype("float32"); y = (x[:, 0] + x[:, 1] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(6, activation="tanh"),
                          layers.Dense(2, activation="softmax")])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR), loss="sparse_categorical_crossentropy")
np.savez(os.path.join(out, f"initial{rank}.npz"), *model.get_weights())
# every sample, the odd ones weighing 0 (the even 2: Keras divides by all n)
h = model.fit(x, y, batch_size=256, epochs=1, verbose=0, sample_weight=np.tile([2.0, 0.0], 128))
np.savez(os.path.join(out, f"final{rank}.npz"), *model.get_weights())
with open(os.path.join(out, f"loss{rank}.json"), "w") as f:
    json.dump(h.history["loss"], f)
"""
LR = 0.5


def _weights(path) -> list[np.ndarray]:
    f = np.load(path)
    return [f[f"arr_{i}"] for i in range(len(f.files))]


def _even_samples_alone(initial: list[np.ndarray]) -> tuple[list[np.ndarray], list[float]]:
    """The same model and data, plainly (one worker): the even samples alone, in one batch."""
    from pserver import keras
    from pserver.keras import layers
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(6, activation="tanh"),
                              layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR), loss="sparse_categorical_crossentropy")
    model.set_weights(initial)
    h = model.fit(x[::2], y[::2], batch_size=128, epochs=1, verbose=0)
    return model.get_weights(), h.history["loss"]


def test_a_weight_of_zero_on_half_the_samples_trains_as_the_other_half_alone(tmp_path):
    """One step: every sample at a global batch of 256 (two batches of 128, one per worker: with
    2 batches left and 2 workers each lease is one, docs/semantics.md), the even samples weighing
    2 and the odd 0, against the even samples alone in one batch, plainly: sum(w_i * l_i) / 256
    is their mean loss, the same step. (After the first step the leases pair batches by timing:
    a later epoch may run as two steps, so the runs would differ by how they grouped them.)
    Catches: a worker's batch losing its weights (or taking another batch's: the odd samples
    would train), weights applied to the loss and not the gradient, the epoch's loss not
    weighted."""
    (tmp_path / "s.py").write_text(SCRIPT.replace("LR", repr(LR)))
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    initial = _weights(tmp_path / "initial0.npz")
    half, loss_h = _even_samples_alone(initial)
    for rank in range(2):
        loss_w = json.loads((tmp_path / f"loss{rank}.json").read_text())
        weighted = _weights(tmp_path / f"final{rank}.npz")
        assert np.allclose(loss_w, loss_h, rtol=1e-5), (rank, loss_w, loss_h)
        assert all(np.allclose(w, h, rtol=1e-5, atol=1e-6) for w, h in zip(weighted, half)), rank
    assert not np.allclose(weighted[0], initial[0], atol=0.05)
