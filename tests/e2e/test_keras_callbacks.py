"""Keras's built-in callbacks steering a `pserver run --ps 1 --workers 2` cluster (sync): every
worker stops after the same epoch (EarlyStopping, on the chief's logs), and the chief alone writes
the checkpoint and the CSV log, the checkpoint holding the weights fit ends with."""

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
x = rng.normal(size=(320, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
callbacks = [keras.callbacks.EarlyStopping(min_delta=10.0, patience=1),     # val_loss: never enough
             keras.callbacks.ModelCheckpoint(os.path.join(out, f"ck{rank}-{{epoch:02d}}.keras")),
             keras.callbacks.CSVLogger(os.path.join(out, f"log{rank}.csv"))]
h = model.fit(x, y, batch_size=32, epochs=6, verbose=0, validation_split=0.2, callbacks=callbacks)
np.savez(os.path.join(out, f"final{rank}.npz"), *model.get_weights())
with open(os.path.join(out, f"history{rank}.json"), "w") as f:
    json.dump({"epoch": h.epoch, "stopped": callbacks[0].stopped_epoch}, f)
"""


def test_early_stopping_stops_every_worker_and_the_chief_s_checkpoint_holds_the_final_weights(tmp_path):
    """EarlyStopping(min_delta=10, patience=1) on val_loss, the chief's evaluation: epoch 0 sets
    the best, epoch 1 does not beat it by 10: both workers stop after epoch 1 of 6. Catches: a
    worker going on alone, a checkpoint of the initial weights (the callbacks' model not given the
    epoch's weights), a non-chief writing files, a file load_model cannot read."""
    from pserver import keras
    (tmp_path / "s.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"history{rank}.json").read_text()) == {"epoch": [0, 1], "stopped": 1}
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".keras", ".csv"))
    assert written == ["ck0-01.keras", "ck0-02.keras", "log0.csv"]
    rows = (tmp_path / "log0.csv").read_text().splitlines()
    assert rows[0] == "epoch,accuracy,loss,val_accuracy,val_loss"
    assert [r[:2] for r in rows[1:]] == ["0,", "1,"]
    saved = keras.models.load_model(tmp_path / "ck0-02.keras").get_weights()
    first = keras.models.load_model(tmp_path / "ck0-01.keras").get_weights()
    for rank in range(2):
        final = np.load(tmp_path / f"final{rank}.npz")
        final = [final[f"arr_{i}"] for i in range(len(final.files))]
        assert all(np.array_equal(a, b) for a, b in zip(saved, final)), rank
    assert not all(np.array_equal(a, b) for a, b in zip(saved, first))
