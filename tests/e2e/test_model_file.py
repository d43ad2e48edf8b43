"""Getting the model out: `launch --save` writes it, `pserver evaluate` scores it (or the shards'
checkpoints) and `pserver.load_model` runs it, in processes of their own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.support.processes import LOGREG, env_with, read_json, run

pytestmark = pytest.mark.e2e

USER_MODEL = """
import pserver
from pserver.layers import Conv2D, Dense, Flatten

def build(input_shape, num_classes):
    return pserver.Sequential([Conv2D(2, 3, activation="relu", input_shape=input_shape), Flatten(),
                               Dense(num_classes)], name="tiny_cnn")
"""


def evaluate(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pserver", "evaluate", *args], capture_output=True,
                          text=True, env=env_with(None), cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 shards, 2 workers, sync: the chief saves the model; the shards checkpoint."""
    tmp = tmp_path_factory.mktemp("save")
    r = run("launch", "--ps", "2", "--workers", "2", *LOGREG, "--optimizer", "sgd", "--lr", "0.1",
            "--save", str(tmp / "model.npz"), "--checkpoint-dir", str(tmp / "ckpt"),
            "--summary-json", str(tmp / "s.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"saved the model (logreg, 410 parameters) to {tmp / 'model.npz'}" in r.stdout
    return tmp, read_json(tmp / "s.json")


def test_evaluate_a_saved_model_gives_the_chiefs_final_figures(saved):
    tmp, summary = saved
    r = evaluate("--model-file", str(tmp / "model.npz"), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert (result["model"], result["dataset"], result["test_samples"]) == ("logreg", "synthetic", 10000)
    # The same weights on the same test set as the chief's final evaluation: the same numbers.
    assert result["test_accuracy"] == summary["test_accuracy"] > 0.9
    assert result["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    line = evaluate("--model-file", str(tmp / "model.npz")).stdout.strip()
    assert line.startswith("logreg (410 parameters) with the weights of") and \
        f"test accuracy {summary['test_accuracy']:.4f}" in line


def test_evaluate_the_checkpoints_with_the_model_files_definition_or_flags(saved):
    tmp, summary = saved
    for args in (["--model-file", str(tmp / "model.npz")],
                 ["--model", "logreg", "--samples", "6000", "--features", "40"]):
        r = evaluate("--checkpoint", str(tmp / "ckpt"), *args, "--json")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        steps = summary["steps"]
        assert result["weights"] == f"{tmp / 'ckpt'} (shard versions {steps}, {steps})"
        assert result["test_accuracy"] == summary["test_accuracy"]


def test_evaluate_mistakes_are_one_line(saved, tmp_path):
    tmp, _ = saved
    cases = [([], "--model-file"),
             (["--checkpoint", str(tmp / "ckpt"), "--model", "mlp", "--samples", "6000", "--features", "40"],
              "is of another model"),
             (["--checkpoint", str(tmp_path)], "holds no checkpoint"),
             (["--model-file", str(tmp_path / "nope.npz")], "no such model file")]
    for args, words in cases:
        r = evaluate(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode in (1, 2) and len(lines) == 1 and words in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_a_users_model_file_is_rebuilt_from_anywhere(tmp_path):
    (tmp_path / "net.py").write_text(textwrap.dedent(USER_MODEL))
    x = np.random.default_rng(0).standard_normal((400, 5, 5, 1)).astype(np.float32)
    y = (x[:, 2, 2, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    (tmp_path / "out").mkdir()
    r = subprocess.run([sys.executable, "-m", "pserver", "launch", "--ps", "1", "--workers", "1",
                        "--model", "net.py:build", "--dataset", "data.npz", "--batch-size", "20",
                        "--epochs", "3", "--optimizer", "adam", "--lr", "0.01", "--save", "out/m.npz",
                        "--summary-json", "s.json"], cwd=tmp_path, env=env_with(None),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = read_json(tmp_path / "s.json")
    # Another directory: the definition points at net.py and data.npz by absolute paths.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = evaluate("--model-file", str(tmp_path / "out" / "m.npz"), "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["test_accuracy"] == summary["test_accuracy"]
    script = ("import pserver, numpy as np, json; m = pserver.load_model('../out/m.npz', safe_mode=False); "
              "z = np.load('../data.npz'); print(json.dumps([m.meta['model'], m.predict(z['x']).shape]))")
    r = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env_with(None),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [f"{tmp_path / 'net.py'}:build", [400, 2]]


def test_save_into_a_missing_directory_is_refused_before_anything_starts(tmp_path):
    r = run("launch", "--workers", "1", *LOGREG, "--save", str(tmp_path / "no" / "m.npz"), timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--save" in lines[0] and "does not exist" in lines[0]
    assert "Example: pserver evaluate" in evaluate("--help").stdout


KERAS_SAVE = """
import sys
import pserver.keras as keras
from pserver.keras import layers


@keras.saving.register_keras_serializable(package="mine")
class Shift(layers.Layer):
    def call(self, inputs):
        return inputs - 1.0


inp = keras.Input(shape=(8,))
h = layers.Dense(4)(inp)
model = keras.Model(inp, layers.Dense(3, activation="softmax")(Shift()(h) if sys.argv[2] == "custom" else h))
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.save(sys.argv[1])
"""


def test_a_keras_saved_model_is_evaluated_and_one_whose_layer_is_unknown_is_one_line(tmp_path):
    """Catches: pserver evaluate refusing every model.save file (built in Python), and a layer
    class the process has not registered surfacing as a traceback, or later than the file's
    reading, instead of one line naming the layer, its class and the file: exit 2 from the
    CLI, one line (ModelFileError) from load_model in Python."""
    (tmp_path / "save.py").write_text(KERAS_SAVE)
    for kind in ("plain", "custom"):
        r = subprocess.run([sys.executable, str(tmp_path / "save.py"), str(tmp_path / f"{kind}.npz"), kind],
                           env=env_with(None), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    data = ["--dataset", "synthetic", "--features", "8", "--classes", "3", "--samples", "300",
            "--test-samples", "200"]
    r = evaluate("--model-file", str(tmp_path / "plain.npz"), *data, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert (result["model"], result["num_params"], result["test_samples"]) == ("functional", 51, 200)
    r = evaluate("--model-file", str(tmp_path / "custom.npz"), *data)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and not r.stdout, r.stderr
    assert (f"--model-file: {tmp_path / 'custom.npz'}: layer shift: class 'Shift' is neither built in nor "
            "registered in this process (saved as mine>Shift of module __main__)") in lines[0]
    script = "import sys, pserver.keras as k; k.models.load_model(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "custom.npz")], env=env_with(None),
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith(f"pserver.errors.ModelFileError: {tmp_path / 'custom.npz'}: "
                                                 "layer shift: class 'Shift' is neither"), r.stderr
