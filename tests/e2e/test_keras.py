"""The MNIST convnet script (bench/keras_mnist_convnet.py: the model of keras.io's example, in
the Keras API) under `pserver run --ps 2 --workers 4`, sync, for 2 of its 15 epochs (a copy of the
script with `epochs = 2`, nothing else changed): the test accuracy it prints is >= 0.975.
Catches, besides a loop that does not learn: a softmax last layer not fused into the loss (the
loss of probabilities would be taken as logits), one-hot labels misread, a global batch not
split (4x the steps), validation_split taking the wrong rows, a worker's exit code lost."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e]

SCRIPT = Path(__file__).parents[2] / "bench" / "keras_mnist_convnet.py"


@pytest.mark.mnist
def test_the_keras_mnist_convnet_example_trains_to_975_in_2_epochs_under_pserver_run(tmp_path, mnist_dir):
    import subprocess
    text = SCRIPT.read_text()
    assert "import pserver.keras as keras" in text and "\nepochs = 15\n" in text
    script = tmp_path / "convnet.py"
    script.write_text(text.replace("\nepochs = 15\n", "\nepochs = 2\n"))
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "2", "--workers", "4", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=400,
                       env=env_with({"PSERVER_MNIST_DIR": str(mnist_dir)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    # Only the chief prints (each line with its prefix): one table, one test accuracy, two Keras
    # epoch lines.
    out = re.sub(r"^\[worker0\] ", "", out, flags=re.M)
    assert out.count("Test accuracy:") == 1 and out.count('Model: "sequential"') == 1, out
    assert "Total params: 34,826" in out                   # keras.io's summary for the model
    lines = re.findall(r"^(\d+)/\1 - \d+s - loss: \S+ - accuracy: \S+ - val_loss: \S+ - val_accuracy: (\S+)$",
                       out, re.M)
    assert len(lines) == 2, out
    assert int(lines[0][0]) == -(-54000 // 128)   # 422 (the last 112), as Keras: batch 128 on 4 workers
    accuracy = float(re.search(r"^Test accuracy: (\S+)$", out, re.M).group(1))
    assert accuracy >= 0.975, out[-2000:]


# -- every worker agrees: the chief's logs and stop decision (docs/guide/keras.md) ----------------------

SAME_LOGS = """
import json, os
import numpy as np
import pserver.keras as keras
from pserver.keras import layers
rank = int(os.environ["PSERVER_RUN_RANK"])
out = os.environ["OUT_DIR"]

class Record(keras.callbacks.Callback):
    def __init__(self, stop=False):
        super().__init__()
        self.seen, self.stop = [], stop
    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([epoch, dict(logs)])
        if self.stop and rank == 0:           # the chief's decision only
            self.model.stop_training = True

rng = np.random.default_rng(0)
x = rng.normal(size=(320, 4)).astype("float32"); y = (x[:, 0] > 0).astype(int)
model = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
for name, epochs, stop in (("same", 2, False), ("stop", 4, True)):
    record = Record(stop)
    h = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, validation_split=0.2, callbacks=[record])
    if name == "same":
        print("val_accuracy", h.history["val_accuracy"], flush=True)     # on every rank, as Keras
    with open(os.path.join(out, f"{name}{rank}.json"), "w") as f:
        json.dump({"epoch": h.epoch, "history": h.history, "callback": record.seen}, f)
"""


def test_every_worker_gets_the_chief_s_logs_and_stops_with_it(tmp_path):
    """Two fits under pserver run, two workers. Catches: a worker other than the chief with no
    val_* in its History and callback logs (history.history["val_accuracy"] raised KeyError on
    rank 1), or logs of its own; and stop_training set on the chief stopping only the chief
    (rank 1 trained the other 3 epochs alone on the shared weights)."""
    import json
    import subprocess
    script = tmp_path / "same.py"
    script.write_text(SAME_LOGS)
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=env_with({"OUT_DIR": str(tmp_path)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chief, other = (json.loads((tmp_path / f"same{k}.json").read_text()) for k in range(2))
    assert chief["epoch"] == [0, 1]
    assert list(chief["history"]) == ["loss", "accuracy", "val_loss", "val_accuracy"]
    assert other == chief                     # History and every callback's logs, value for value
    chief, other = (json.loads((tmp_path / f"stop{k}.json").read_text()) for k in range(2))
    assert chief["epoch"] == [0] and other["epoch"] == [0]     # the chief stopped after epoch 1 of 4
    assert other == chief
