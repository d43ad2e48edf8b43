"""Keras's MNIST convnet example (bench/keras_mnist_convnet.py: keras.io's, only its imports
changed) under `pserver run --ps 2 --workers 4`, sync, for 2 of its 15 epochs (a copy of the
script with `epochs = 2`, nothing else changed): the test accuracy it prints is >= 0.975.
Catches, besides a loop that does not learn: a softmax last layer not fused into the loss (the
loss of probabilities would be taken as logits), one-hot labels misread, a global batch not
split (4x the steps), validation_split taking the wrong rows, a worker's exit code lost."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import env_with

pytestmark = [pytest.mark.e2e, pytest.mark.mnist]

SCRIPT = Path(__file__).parents[2] / "bench" / "keras_mnist_convnet.py"


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
    # Only the chief prints: one table, one test accuracy, two Keras epoch lines.
    assert out.count("Test accuracy:") == 1 and out.count('Model: "sequential"') == 1, out
    assert "Total params: 34,826" in out                   # keras.io's summary for the model
    lines = re.findall(r"^(\d+)/\1 - \d+s - loss: \S+ - accuracy: \S+ - val_loss: \S+ - val_accuracy: (\S+)$",
                       out, re.M)
    assert len(lines) == 2, out
    assert int(lines[0][0]) == -(-54000 // 128)   # 422 (the last 112), as Keras: batch 128 on 4 workers
    accuracy = float(re.search(r"^Test accuracy: (\S+)$", out, re.M).group(1))
    assert accuracy >= 0.975, out[-2000:]
