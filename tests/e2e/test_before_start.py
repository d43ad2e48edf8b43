"""What `pserver launch` and `pserver worker` catch before anything starts (a model file's
mistakes, each one line naming the file, the line and the code on it; exit 2 with no shard
started), and the line a first run says while numba compiles its kernels: real processes."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from tests.support.processes import run

pytestmark = pytest.mark.e2e

SMALL = ["--samples", "400", "--test-samples", "100", "--features", "8", "--classes", "3",
         "--batch-size", "16", "--epochs", "1"]

MODELS = """
import pserver
from pserver.layers import Dense

def typo(input_shape, num_classes):
    return pserver.Sequential([Dense(8, activaton="relu", input_shape=input_shape),
                               Dense(num_classes)])

def mlp(input_shape, num_classes):
    return pserver.Sequential([Dense(8, activation="relu", input_shape=input_shape), Dense(num_classes)])

def misspelt(input_shape, num_classes):
    return pserver.Sequential([Dense(num_classes, activation="softmaks", input_shape=input_shape)])

def linear(input_shape):
    return pserver.Sequential([Dense(3, input_shape=input_shape)])

def helper(x):
    return x + 1
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "models.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / "broken.py").write_text("import pserver\n\nscale = undefined_name * 2\n")
    (tmp_path / "syntax.py").write_text("def build(input_shape:\n    pass\n")
    return tmp_path


@pytest.mark.parametrize("spec, line", [
    ("models.py:typo", "--model {d}/models.py:typo: typo() raised TypeError: Layer.__init__() got an "
                       "unexpected keyword argument 'activaton', at {d}/models.py line 6: return "
                       "pserver.Sequential([Dense(8, activaton=\"relu\", input_shape=input_shape),"),
    ("broken.py:build", "--model {d}/broken.py:build: importing {d}/broken.py raised NameError: name "
                        "'undefined_name' is not defined, at {d}/broken.py line 3: "
                        "scale = undefined_name * 2"),
    ("syntax.py:build", "--model {d}/syntax.py:build: importing {d}/syntax.py raised SyntaxError: "),
    ("models.py", "--model {d}/models.py: give the function that builds the model, as "
                  "{d}/models.py:FUNCTION; in {d}/models.py, mlp, linear return one "
                  "(--model {d}/models.py:mlp)"),
    ("models.py:misspelt", "--model {d}/models.py:misspelt: Dense: unknown activation 'softmaks'; choose "
                           "one of linear, relu, sigmoid, tanh, softmax (or None)"),
])
def test_a_model_file_mistake_stops_launch_before_any_process_starts(files, spec, line):
    started = time.monotonic()
    r = run("launch", "--ps", "2", "--workers", "2", "--model", f"{files}/{spec}", *SMALL, timeout=60)
    took = time.monotonic() - started
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pserver launch: error: " + line.format(d=files)), lines
    # Nothing started: no shard said it listens, no worker said a word (it took 13-26 s before).
    assert "[ps" not in r.stdout and "[worker" not in r.stdout and "Traceback" not in r.stderr, r.stdout
    assert took < 20, took


def test_a_worker_checks_its_model_file_before_it_dials_a_shard(files):
    # No shard at that address: the model's mistake is what the worker says, at once.
    r = run("worker", "--ps", "127.0.0.1:1", "--model", f"{files}/models.py:misspelt", *SMALL,
            "--connect-timeout", "30", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"pserver worker: error: --model {files}/models.py:misspelt: Dense: unknown activation 'softmaks'; "
        "choose one of linear, relu, sigmoid, tanh, softmax (or None), at "
        f"{files}/models.py line 13: return pserver.Sequential([Dense(num_classes, "
        "activation=\"softmaks\", input_shape=input_shape)])"]


def test_a_first_run_says_it_compiles_the_kernels_and_the_next_does_not(tmp_path):
    cache = tmp_path / "numba-cache"
    args = ["launch", "--ps", "1", "--workers", "1", "--model", "logreg", *SMALL]
    first = run(*args, env={"NUMBA_CACHE_DIR": str(cache)}, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    said = [ln for ln in first.stdout.splitlines() if "numba kernel" in ln]
    assert len(said) == 1, first.stdout
    assert said[0].startswith("[worker0] compiled ") and f"cached in {cache} for the next runs" in said[0]
    assert os.listdir(cache)
    second = run(*args, env={"NUMBA_CACHE_DIR": str(cache)}, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    assert "numba kernel" not in second.stdout, second.stdout
