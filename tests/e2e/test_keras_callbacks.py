"""Keras's built-in callbacks steering a `pserver run --ps 1 --workers 2` cluster (sync): every
worker stops after the same epoch (EarlyStopping, on the chief's logs), and the chief alone writes
the checkpoint, the CSV log and the TensorBoard event files, the checkpoint holding the weights fit
ends with."""

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
             keras.callbacks.CSVLogger(os.path.join(out, f"log{rank}.csv")),
             keras.callbacks.TensorBoard(os.path.join(out, f"tb{rank}"))]
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
    # TensorBoard: the chief's event files hold the CSV's epoch losses; the other rank writes none
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert not (tmp_path / "tb1").exists()
    columns = rows[0].split(",")
    for part, name in (("train", "loss"), ("validation", "val_loss")):
        events = EventAccumulator(str(tmp_path / "tb0" / part))
        events.Reload()
        logged = [float(row.split(",")[columns.index(name)]) for row in rows[1:]]
        assert [(e.step, e.value) for e in events.Scalars("epoch_loss")] == \
            [(0, pytest.approx(logged[0], rel=1e-6)), (1, pytest.approx(logged[1], rel=1e-6))]
    saved = keras.models.load_model(tmp_path / "ck0-02.keras").get_weights()
    first = keras.models.load_model(tmp_path / "ck0-01.keras").get_weights()
    for rank in range(2):
        final = np.load(tmp_path / f"final{rank}.npz")
        final = [final[f"arr_{i}"] for i in range(len(final.files))]
        assert all(np.array_equal(a, b) for a, b in zip(saved, final)), rank
    assert not all(np.array_equal(a, b) for a, b in zip(saved, first))


KILLED_CHIEF = """
import os, signal
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank = int(os.environ["PSERVER_RUN_RANK"])
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if rank == 0 and epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
h = model.fit(x, y, batch_size=32, epochs=8, verbose=0, validation_split=0.2,
              callbacks=[keras.callbacks.EarlyStopping(patience=100), Die()])
print(f"rank {rank} trained all {len(h.epoch)} epochs", flush=True)
"""


def test_a_chief_killed_mid_run_leaves_no_worker_training_alone(tmp_path):
    """The chief (whose logs steer every worker's callbacks) is SIGKILLed after epoch 2 of 8: the
    run stops the other worker and the shards, says why, and fails; the shard stopped within the
    third epoch (16 steps an epoch), not after rank 1 trained the other 6 epochs alone. Catches a
    runner that waits for the other ranks of a job whose chief died."""
    import re
    (tmp_path / "s.py").write_text(KILLED_CHIEF)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, timeout=120,
                       env=env_with({}))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "worker 0 (rank 0) was killed by signal 9; stopping the other workers and the shards" in out
    assert "trained all" not in out
    version = int(re.search(r"shard 0 stopped by SIGTERM at version (\d+)", out).group(1))
    assert 2 * 16 <= version < 3 * 16, out[-3000:]
