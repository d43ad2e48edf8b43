"""A user's model from a file, trained by real shard and worker processes; its mistakes are
one line and exit 2; a worker with a different model is refused by the shard."""

from __future__ import annotations

import re
import textwrap
import time

import numpy as np
import pytest

from tests.support.processes import read_json, run

pytestmark = pytest.mark.e2e

MODEL_FILE = """
import pserver
from pserver.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D

def build(input_shape, num_classes):
    return pserver.Sequential([
        Conv2D(4, 3, activation="relu", input_shape=input_shape),
        MaxPooling2D(),
        Flatten(),
        Dropout(0.1),
        Dense(num_classes),
    ], name="my_cnn")

def other(input_shape, num_classes):
    return pserver.Sequential([Flatten(input_shape=input_shape), Dense(num_classes)])

def not_a_model():
    return "model"
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    return path


@pytest.fixture
def images(tmp_path):
    """An .npz of 8x8 one-channel images whose class is where the bright rows are."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 480)
    x = rng.normal(0, 0.3, (480, 8, 8, 1)).astype(np.float32)
    for c in range(3):
        x[y == c, 3 * c:3 * c + 2, :, 0] += 1.0
    path = tmp_path / "images.npz"
    np.savez(path, x=x, y=y)
    return path


def test_launch_trains_a_model_from_a_file(model_file, images, tmp_path):
    summary = tmp_path / "s.json"
    r = run("launch", "--ps", "1", "--workers", "2", "--model", f"{model_file}:build",
            "--dataset", str(images), "--batch-size", "16", "--epochs", "3", "--optimizer", "adam",
            "--lr", "0.01", "--summary-json", str(summary), "--log-every", "10")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    s = read_json(summary)
    assert s["model"] == "my_cnn" and s["num_params"] == (3 * 3 * 1 * 4 + 4) + (3 * 3 * 4 * 3 + 3)
    # Leased data (the default): 27 batches of 16 an epoch, each trained once (2 chunks of 16).
    assert s["samples_trained"] == 3 * 27 * 16 and s["chunks_done"] == 3 * 2, s
    assert 3 * 14 <= s["steps"] <= 3 * 27 and s["test_accuracy"] >= 0.9, s
    # Both workers built the same model from the file: the shard took both registrations.
    assert "[worker1] worker rank 1/2 device cpu; model my_cnn 151 params" in r.stdout
    assert "samples of shape (8, 8, 1)" in r.stdout


@pytest.mark.parametrize("spec,message", [
    ("{f}:missing", "--model {f}:missing: {f} has no attribute 'missing'"),
    ("{f}:not_a_model", "--model {f}:not_a_model: not_a_model() returned a str, not a Sequential or a "
                        "model (it lacks layout, init_params, loss_and_grad, evaluate)"),
    ("{d}/nope.py:build", "--model {d}/nope.py:build: no such file {d}/nope.py"),
])
def test_user_model_mistakes_are_one_line_and_exit_2(model_file, images, spec, message):
    spec = spec.format(f=model_file, d=model_file.parent)
    r = run("worker", "--ps", "127.0.0.1:1", "--model", spec, "--dataset", str(images))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "pserver worker: error: " + message.format(f=model_file, d=model_file.parent)]


def test_data_that_does_not_fit_the_model_is_one_line(model_file, tmp_path):
    path = tmp_path / "flat.npz"
    np.savez(path, x=np.ones((20, 7, 5)), y=np.arange(20) % 2)
    r = run("worker", "--ps", "127.0.0.1:1", "--model", f"{model_file}:build", "--dataset", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.search(r"layer conv2d \(Conv2D\): needs an image \(height, width, channels\) input .* "
                     r"got \(7, 5\)", r.stderr), r.stderr


def test_the_shard_refuses_a_worker_with_another_model(procs, model_file, images):
    shard = procs("serve", "--port", "0", "--num-workers", "2")
    addr = shard.address()
    chief = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "2", "--model",
                  f"{model_file}:build", "--dataset", str(images), "--connect-timeout", "60")
    wait_for("worker rank 0/2", chief)          # registered: the shard's layout is fixed
    r = run("worker", "--ps", addr, "--rank", "1", "--num-workers", "2", "--model",
            f"{model_file}:other", "--dataset", str(images))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    # Both layouts, by signature and size: the other model's 195 against my_cnn's 151.
    assert re.search(r"layout: signature [0-9a-f]{16} \(195 params\) does not match this shard's "
                     r"[0-9a-f]{16} \(151 params\)", line), line


def wait_for(text: str, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output:
        assert proc.popen.poll() is None and time.monotonic() < deadline, proc.output
        time.sleep(0.1)
