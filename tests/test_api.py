"""The public Python API: what `import pserver` exposes, pserver.train against real in-process
shards (arrays and streamed batches), user models loaded from files, and the README's example."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pserver
from pserver.errors import ConfigError, DataError
from pserver.layers import Conv2D, Dense, Dropout, Flatten, MaxPooling2D
from pserver.models import load_model, make_model
from tests.support import ROOT


def test_all_is_explicit_and_importable():
    assert {"Sequential", "Dense", "Conv2D", "MaxPooling2D", "AveragePooling2D", "Flatten",
            "Dropout", "Embedding", "serve", "train"} <= set(pserver.__all__)
    for name in pserver.__all__:
        assert hasattr(pserver, name), name


def blobs(n=800, seed=0):
    """Two well separated classes in 6 features: any working training reaches ~1.0."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = (rng.standard_normal((n, 6)) + np.where(y[:, None] == 1, 2.0, -2.0)).astype(np.float32)
    return x, y


def small_model():
    return pserver.Sequential([Dense(8, activation="relu", input_shape=(6,)), Dropout(0.1), Dense(2)])


def test_train_starts_its_own_shards():
    x, y = blobs()
    s = pserver.train(small_model(), x, y, ps=2, optimizer="adam", lr=1e-2, epochs=2,
                      batch_size=32, log_every=60)
    assert (s["num_shards"], s["num_workers"], s["mode"], s["optimizer"]) == (2, 1, "sync", "adam")
    assert s["steps"] == 2 * -(-720 // 32) and s["test_accuracy"] >= 0.97   # 22 batches of 32, one of 16


def test_train_streams_batches_against_a_served_shard(capsys):
    """A generator cannot be cut into chunks: with leases the default, the worker keeps its own
    batches (slices) and says so; catches a generator sent to the leased loop."""
    x, y = blobs()
    calls = []

    def batches():              # called once per epoch, like a generator over files
        calls.append(1)
        for i in range(0, 640, 32):
            yield x[i:i + 32], y[i:i + 32]

    with pserver.serve(optimizer="adam", lr=1e-2, num_workers=1) as shard:
        s = pserver.train(small_model(), batches, ps=[shard.address], epochs=3,
                          validation_data=(x[640:], y[640:]), log_every=60)
        assert shard.status()["version"] == 60
    assert len(calls) == 3 and s["steps"] == 60 and s["test_accuracy"] >= 0.97
    assert [e["epoch"] for e in s["per_epoch"]] == [1, 2, 3]
    assert ("worker 0: --data-assignment leases: batches cannot be cut into chunks (batches read in "
            "order); each rank reads its own batches (slices)") in capsys.readouterr().out


def test_train_against_shards_takes_the_token_from_the_environment_as_pserver_worker_does(monkeypatch):
    """Catches a Python or Keras worker (pserver run's fit) that ignores PSERVER_AUTH_TOKEN: shards
    started with the token in their environment refused every call ('the call carried none')."""
    token = "0123456789abcdef0123456789abcdef"
    x, y = blobs()
    with pserver.serve(optimizer="adam", lr=1e-2, num_workers=1, auth_token=token) as shard:
        monkeypatch.setenv("PSERVER_AUTH_TOKEN", token)
        s = pserver.train(small_model(), x, y, ps=[shard.address], epochs=1, log_every=60)
        assert s["steps"] > 0 and shard.status()["version"] == s["steps"]
        monkeypatch.setenv("PSERVER_AUTH_TOKEN", "f" * 32)
        with pytest.raises(pserver.errors.Unauthenticated, match="token does not match"):
            pserver.train(small_model(), x, y, ps=[shard.address], epochs=1, log_every=60)


def test_options_that_do_not_apply_are_named():
    x, y = blobs()
    with pytest.raises(ConfigError, match=r"optimizer: not an option here \(a worker option; shards at "
                                          r"addresses have their own settings"):
        pserver.train(small_model(), x, y, ps=["127.0.0.1:1"], optimizer="adam")
    with pytest.raises(ConfigError, match="epoch: not an option here"):
        pserver.train(small_model(), x, y, ps=1, epoch=3)


def test_an_iterator_is_one_epoch_only():
    x, y = blobs()
    with pserver.serve(num_workers=1) as shard, \
            pytest.raises(DataError, match="runs out after one epoch"):
        pserver.train(small_model(), iter([(x[:32], y[:32])]), ps=[shard.address], epochs=2,
                      log_every=60)


@pytest.mark.parametrize("change,match", [
    (lambda x, y: (np.where(np.arange(len(x))[:, None] == 7, np.nan, x), y),
     "x has 6 non-finite values"),
    (lambda x, y: (x[:, :5], y),
     r"x has shape \(\d+, 5\); layer dense \(Dense\) takes \(n >= 1, 6\)"),
    (lambda x, y: (x, y + 1), r"label out of range: y\[\d+\] = 2; the last layer \(layer dense_1"),
])
def test_bad_data_fails_before_training(change, match):
    x, y = change(*blobs())
    with pserver.serve(num_workers=1) as shard:
        with pytest.raises(DataError, match=match):
            pserver.train(small_model(), x, y, ps=[shard.address], log_every=60)
        assert shard.status()["version"] == -1    # never even initialised: no worker got that far


# -- user models from files ----------------------------------------------------------------

def write(tmp_path, code, name="model_file.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def test_build_gets_the_keywords_its_signature_takes(tmp_path):
    path = write(tmp_path, """
        import pserver
        from pserver.layers import Dense, Flatten
        seen = []
        def by_name(input_shape, num_classes):
            seen.append((input_shape, num_classes))
            return pserver.Sequential([Flatten(input_shape=input_shape), Dense(num_classes)])
        def by_kwargs(**kw):
            seen.append(kw)
            return pserver.Sequential([Flatten(input_shape=kw["input_shape"]), Dense(3)])
        def fixed():
            model = pserver.Sequential([Flatten(input_shape=(2, 2)), Dense(4)])
            return model.compile(loss="sparse_categorical_crossentropy")
    """)
    m = load_model(f"{path}:by_name", (4, 4, 1), 5)
    assert m.layout.describe() == "dense/kernel[16, 5], dense/bias[5]"
    load_model(f"{path}:by_kwargs", (3,), 0)
    assert load_model(f"{path}:fixed", (9,), 2).input_shape == (2, 2)
    # this file's module: an earlier test module may have loaded a user model of its own
    module = next(m for n, m in sys.modules.items()
                  if n.startswith("pserver_user_model_") and getattr(m, "__file__", None) == str(path))
    assert module.seen == [((4, 4, 1), 5), {"input_shape": (3,), "num_classes": 0}]


def test_a_protocol_object_is_a_model(tmp_path):
    path = write(tmp_path, """
        from pserver.models import make_model
        class Wrapped:       # not a Sequential: anything with the protocol's members
            def __init__(self):
                self.inner = make_model("logreg", 4, 2)
                self.layout = self.inner.layout
            def init_params(self, seed):
                return self.inner.init_params(seed)
            def loss_and_grad(self, w, x, y, g):
                return self.inner.loss_and_grad(w, x, y, g)
            def evaluate(self, w, x, y, batch_size=4096):
                return self.inner.evaluate(w, x, y, batch_size)
        def build():
            return Wrapped()
    """, "wrapped.py")
    model = make_model(f"{path}:build", (4,), 2)
    assert type(model).__name__ == "Wrapped" and model.layout.total == 10


@pytest.mark.parametrize("code,attr,match", [
    ("x = 1\n", "build", r"--model {p}:build: {p} has no attribute 'build'"),
    ("build = 3\n", "build", r"--model {p}:build: build is a int, not a function"),
    ("def build():\n    return [1, 2]\n", "build",
     r"--model {p}:build: build\(\) returned a list, not a Sequential or a model "
     r"\(it lacks layout, init_params"),
    ("def build():\n    raise RuntimeError('no GPU here')\n", "build",
     r"--model {p}:build: build\(\) raised RuntimeError: no GPU here"),
    ("import pserver\nfrom pserver.layers import Conv2D, Flatten, Dense\n"
     "def build():\n"
     "    return pserver.Sequential([Conv2D(2, 9, input_shape=(4, 4, 1)), Flatten(), Dense(2)])\n",
     "build", r"--model {p}:build: layer conv2d \(Conv2D\): kernel 9x9 is larger than its input \(4, 4, 1\)"),
    ("def build(:\n", "build", r"--model {p}:build: importing {p} raised SyntaxError"),
    # a script run at import: the command exited 0 having done nothing (an adversarial pass)
    ("import sys\nsys.exit(0)\n", "build",
     r"--model {p}:build: importing {p} raised SystemExit \(sys.exit\(0\)\): a model file is imported, "
     r"not run as a script; .*, at {p} line 2: sys.exit\(0\)"),
    ("def build():\n    raise SystemExit('bye')\n", "build",
     r"--model {p}:build: build\(\) raised SystemExit \(sys.exit\('bye'\)\)"),
    ("", "9x", r"--model {p}:9x: expected FILE.py:FUNCTION or package.module:FUNCTION"),
])
def test_user_model_mistakes_are_one_config_error(tmp_path, code, attr, match):
    path = write(tmp_path, code, f"m{abs(hash(code)) % 10**6}.py")
    with pytest.raises(ConfigError, match=match.format(p=re.escape(path))):
        make_model(f"{path}:{attr}", (4, 4, 1), 2)


def test_missing_module_and_file():
    with pytest.raises(ConfigError,
                       match=r"--model no_such_pkg.models:build: cannot import no_such_pkg.models"):
        make_model("no_such_pkg.models:build", (4,), 2)
    with pytest.raises(ConfigError, match=r"--model nowhere/m.py:build: no such file nowhere/m.py"):
        make_model("nowhere/m.py:build", (4,), 2)


def test_package_module_spec():
    # A module on sys.path, by dotted name: the built-in cnn definition itself.
    model = make_model("pserver.models.cnn:cnn", (12, 12, 1), 3)
    assert model.layout.describe().startswith("conv2d/kernel[3, 3, 1, 32]")


def test_cnn_model_trains_in_process():
    """The reference architecture learns a small image task through the whole stack."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 600)
    x = rng.normal(0, 0.3, (600, 10, 10, 1)).astype(np.float32)
    x[y == 1, :5, :, 0] += 1.0
    model = pserver.Sequential([Conv2D(4, 3, activation="relu", input_shape=(10, 10, 1)),
                                MaxPooling2D(), Flatten(), Dense(8, activation="relu"), Dense(2)])
    s = pserver.train(model, x, y, ps=1, optimizer="adam", lr=3e-3, epochs=2, batch_size=16, log_every=60)
    assert s["test_accuracy"] >= 0.95


# -- the README ----------------------------------------------------------------------------

def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_as_written(tmp_path):
    r = subprocess.run([sys.executable, "-c", readme_example()], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "test accuracy 1.0" in r.stdout or re.search(r"test accuracy 0\.9[5-9]", r.stdout)


@pytest.mark.parametrize("workers, assignment", [(1, "leases"), (2, "leases"), (2, "slices")])
def test_the_last_partial_batch_of_every_epoch_is_trained_as_keras_does(workers, assignment):
    """1,000 samples at batch 128, 2 epochs in sync against a real shard: 8 batches an epoch (7 of
    128 and one of 104), every sample trained once an epoch: 2,000 samples pushed; sliced for 2
    workers, 500 each: 4 steps of 128, 128, 128, 116. Fails if the last batch is dropped (896
    samples an epoch, 7 steps: the count on 3de5e7b)."""
    import threading
    x, y = blobs(1000)
    model = [small_model() for _ in range(workers)]
    summaries, errors = [None] * workers, []

    def worker(rank, address):
        try:
            summaries[rank] = pserver.train(model[rank], x, y, ps=[address], rank=rank, num_workers=workers,
                                            validation_data=(x[:50], y[:50]), epochs=2, batch_size=128,
                                            data_assignment=assignment, log_every=60)
        except BaseException as e:    # reported below, in the test's thread
            errors.append(e)

    with pserver.serve(optimizer="sgd", lr=0.1, num_workers=workers, mode="sync") as shard:
        threads = [threading.Thread(target=worker, args=(r, shard.address)) for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        s = summaries[0]
        assert s["samples_trained"] == 2 * 1000, s
        steps = 8 if assignment == "leases" else 4        # each step takes one batch from each worker
        if workers == 1 or assignment == "slices":       # (leased to 2, a step may carry an empty push)
            assert s["steps"] == 2 * steps and s["pushes_aggregated"] == 2 * steps * workers, s
        if workers == 1:
            assert s["chief"]["samples"] == 2000 and s["chief"]["steps"] == 16, s["chief"]
