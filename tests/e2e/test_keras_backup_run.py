"""Keras's BackupAndRestore on pserver's checkpoints: a `pserver run --checkpoint-dir` whose chief
(one worker) is killed after epoch 2 of 4, started again with --restore, resumes from the last epoch's end."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = """
import json, os, signal
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank, out = int(os.environ["PSERVER_RUN_RANK"]), os.environ["OUT_DIR"]
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
first = not os.path.exists(os.path.join(out, "killed"))
def die(epoch, logs):
    if first and epoch == 1:
        open(os.path.join(out, "killed"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
callbacks = [keras.callbacks.BackupAndRestore("backup"), keras.callbacks.LambdaCallback(on_epoch_end=die)]
h = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=callbacks)
with open(os.path.join(out, f"history{rank}.json"), "w") as f:
    json.dump(h.epoch, f)
"""


def _run(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "1",
                           "--checkpoint-dir", str(tmp_path / "ck"), *flags, "--",
                           sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True,
                          timeout=120, env=env_with({"OUT_DIR": str(tmp_path)}))


def test_a_fit_killed_and_started_again_resumes_from_the_last_epoch_s_end(tmp_path):
    """The second run restores the version the first checkpointed last (the end of epoch 2) and
    trains epochs 3 and 4 only, numbered so in History (one worker: the resume is the shards' and
    the data coordinator's). Catches: a rerun from scratch, a rerun that trains all 4 epochs
    again, or resumes mid-epoch."""
    (tmp_path / "s.py").write_text(SCRIPT)
    first = _run(tmp_path)
    assert first.returncode != 0 and "killed by signal 9" in first.stdout + first.stderr
    said = first.stdout + first.stderr
    written = [int(v) for v in re.findall(r"checkpoint at version (\d+) written", said)]
    again = _run(tmp_path, "--restore", str(tmp_path / "ck"))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    restored = re.findall(r"restored version (\d+)", again.stdout + again.stderr)
    assert written and restored == [str(max(written))]
    assert json.loads((tmp_path / "history0.json").read_text()) == [2, 3]
