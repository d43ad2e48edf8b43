"""The scripts in bench/keras_io/ (the models of keras.io guides, written here; see their headers)
under `pserver run --ps 1 --workers 2`, sync, on 256 samples (KERAS_IO_SAMPLES): each one builds,
trains and prints a test accuracy. Catches a guide's code that stops building or training under
pserver.keras (a layer subclass, ops in `call`, a subclassed Model, layers.add, the global
pooling); bench/keras_io/compare.py measures the accuracies against Keras's."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import env_with

pytestmark = [pytest.mark.e2e, pytest.mark.mnist]

BENCH = Path(__file__).parents[2] / "bench" / "keras_io"


def run_guide(name: str, mnist_dir) -> str:
    env = env_with({"PSERVER_MNIST_DIR": str(mnist_dir), "KERAS_IO_SAMPLES": "256"})
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--seed", "1",
                        "--", sys.executable, str(BENCH / f"{name}.py")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = re.sub(r"^\[worker0\] ", "", r.stdout, flags=re.M)
    assert 0 <= float(re.search(r"^Test accuracy: (\S+)$", out, re.M).group(1)) <= 1, out[-2000:]
    return out


def epoch_losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^\d+/\d+ - \d+s - loss: (\S+)", out, re.M)]


def test_the_subclassing_guide_s_layers_in_a_subclassed_model_train_under_pserver_run(mnist_dir):
    """Catches: Linear's weights (add_weight in build) or MLPBlock's inner layers getting no
    gradient (the loss would not fall over the 2 epochs)."""
    out = run_guide("subclassing", mnist_dir)
    losses = epoch_losses(out)
    assert len(losses) == 2 and losses[1] < losses[0], out[-2000:]


def test_the_functional_api_guide_s_toy_resnet_trains_under_pserver_run(mnist_dir):
    """Catches: a residual branch or layer left out of the traced graph (Keras's parameter count
    for this model on 28x28x1 is 222,666), validation_split dropped."""
    out = run_guide("toy_resnet", mnist_dir)
    assert "Total params: 222,666" in out, out[-3000:]
    assert len(epoch_losses(out)) == 1 and "val_accuracy" in out, out[-2000:]


def test_the_transformer_example_trains_under_pserver_run(mnist_dir):
    """keras.io's text_classification_with_transformer on 256 synthetic reviews: catches its
    layers of layers (MultiHeadAttention, a keras.Sequential, the position Embedding on
    ops.arange's constant) not building or not training on two workers in sync (two epochs of
    finite losses and a validation accuracy)."""
    out = run_guide("text_transformer", mnist_dir)
    losses = epoch_losses(out)
    assert len(losses) == 2 and all(0 < x < 5 for x in losses) and "val_accuracy" in out, out[-2000:]


def test_the_benches_can_resize_the_toy_resnet_s_fit():
    """compare.py's --train-samples/--epochs (and bench/tf_baseline's --model toy_resnet) rewrite
    the fit's lines, each of which must appear once in the script: a docstring that quoted one of
    them stopped both benches ("is not there once")."""
    spec = importlib.util.spec_from_file_location("keras_io_compare", BENCH / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    text = compare.sized((BENCH / "toy_resnet.py").read_text(), 500, 2)
    assert "x_train[:500]," in text and "y_train[:500]," in text and "    epochs=2,\n" in text


TINY_EXAMPLE = '''"""A small MNIST classifier written as keras.io's examples are (their import lines,
their data loading, their printed test accuracy), for compare.py --keras-io."""

import numpy as np
from tensorflow import keras
from tensorflow.keras import layers

(x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
x_train = np.expand_dims(x_train[:512].astype("float32") / 255, -1)
x_test = np.expand_dims(x_test[:256].astype("float32") / 255, -1)
y_train = keras.utils.to_categorical(y_train[:512], 10)
y_test = keras.utils.to_categorical(y_test[:256], 10)
model = keras.Sequential([keras.Input(shape=(28, 28, 1)), layers.Flatten(),
                          layers.Dense(10, activation="softmax")])
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=64, epochs=2, validation_split=0.1)
score = model.evaluate(x_test, y_test, verbose=0)
print("Test accuracy:", score[1])
'''


def test_compare_runs_a_keras_io_checkout_s_example_with_only_its_imports_changed(tmp_path, mnist_dir):
    """compare.py --keras-io: catches an import line left for Keras (the run would need
    TensorFlow), a change beyond the import lines, and a run whose accuracy is not read."""
    example = tmp_path / "keras-io" / "examples" / "vision" / "tiny_mnist.py"
    example.parent.mkdir(parents=True)
    example.write_text(TINY_EXAMPLE)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--keras-io", str(tmp_path / "keras-io"),
                        "--scripts", "vision/tiny_mnist", "--sides", "pserver", "--seeds", "1",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=env_with({"PSERVER_MNIST_DIR": str(mnist_dir)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "vision_tiny_mnist.json").read_text())
    (run,) = result["comparisons"][0]["runs"]
    assert run["side"] == "pserver" and 0.2 < run["test_accuracy"] <= 1, run      # chance: 0.1
    assert "pserver run" in run["command"] and "_seeded.py" in run["command"]
    spec = importlib.util.spec_from_file_location("keras_io_compare2", BENCH / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    (tmp_path / "copies").mkdir()
    paths = compare.example_copies("vision/tiny_mnist", tmp_path / "keras-io", tmp_path / "copies")
    ours, theirs = paths["pserver"].read_text().splitlines(), TINY_EXAMPLE.splitlines()
    changed = [(a, b) for a, b in zip(theirs, ours) if a != b]
    assert changed == [("from tensorflow import keras", "import pserver.keras as keras"),
                       ("from tensorflow.keras import layers", "from pserver.keras import layers")]
    assert paths["keras"].read_text() == TINY_EXAMPLE


ISSUE_49 = ("addition_rnn", "autoencoder", "mnist_convnet_bn", "timeseries_classification",
            "imbalanced_classification", "text_classification")


def load_compare(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare


@pytest.mark.parametrize("name", ISSUE_49)
def test_issue_49_s_keras_io_examples_train_under_pserver_run_and_print_what_compare_reads(name, mnist_dir):
    """Each of issue 49's example scripts (LSTM and RepeatVector, UpSampling2D and soft
    binary labels, BatchNormalization and the callbacks, Conv1D and ReLU with a checkpoint
    loaded back, class weights and Precision/Recall, TextVectorization) for one epoch on 256
    samples (the synthetic FordA and credit card data are not cut): catches one that stops
    building, training or printing the line compare.py compares ("Test accuracy" in [0, 1], or
    the autoencoder's finite "Test loss")."""
    env = env_with({"PSERVER_MNIST_DIR": str(mnist_dir), "KERAS_IO_SAMPLES": "256", "KERAS_IO_EPOCHS": "1"})
    r = subprocess.run([sys.executable, "-m", "pserver", "run", "--ps", "1", "--workers", "2", "--seed", "1",
                        "--", sys.executable, str(BENCH / f"{name}.py")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    compare = load_compare(f"keras_io_compare_{name}")
    printed = dict(compare.RESULT.findall(r.stdout))
    metric = next(m for m in compare.METRICS if m in printed)
    value = float(printed[metric])
    assert metric == ("loss" if name == "autoencoder" else "accuracy"), printed
    assert (0 < value < 1) if metric == "loss" else (0 <= value <= 1), printed


def test_compare_s_keras_copies_of_issue_49_s_scripts_import_keras_only(tmp_path):
    """compare.py's Keras copy of each script: every pserver import line swapped back
    (`from pserver.keras.layers import Conv2D` -> `from keras.layers import Conv2D` too), and
    nothing else changed. Catches a Keras side that would import pserver."""
    compare = load_compare("keras_io_compare_49")
    for name in ISSUE_49:
        paths = compare.copies(name, None, None, tmp_path)
        ours, theirs = paths["pserver"].read_text().splitlines(), paths["keras"].read_text().splitlines()
        changed = [(a, b) for a, b in zip(ours, theirs) if a != b]
        back = [a.replace("pserver.keras", "keras").replace("import keras as keras", "import keras")
                for a, _ in changed]
        assert changed and back == [b for _, b in changed], (name, changed)
        assert not [line for line in theirs if line.startswith(("import pserver", "from pserver"))], name
