"""pserver.data on real files: the shared MNIST, IDX and .npz files written here, a local HTTP mirror."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.data import (
    Dataset,
    default_mnist_dir,
    describe,
    epoch_indices,
    iterate_batches,
    load_dataset,
    steps_per_epoch,
)
from pserver.data.mnist import MNIST_DIR_ENV, MNIST_FILES, MNIST_MIRRORS, MNIST_MIRRORS_ENV
from pserver.data.mnist import mnist_dir as find_mnist_dir
from pserver.errors import ConfigError, DataError
from tests.support.processes import free_port

# Label counts of the original MNIST, as published.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]



def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- real MNIST

@pytest.fixture(scope="module")
def mnist(mnist_dir) -> Dataset:
    return load_dataset("mnist", data_dir=str(mnist_dir))


@pytest.mark.mnist
def test_mnist_loads_with_the_published_shapes_and_label_counts(mnist):
    assert (mnist.name, mnist.task, mnist.num_classes, mnist.features) == ("mnist", "classification", 10, 784)
    # Channels-last images; a dense model's input takes them flat (data.shaped_for).
    assert mnist.x_train.shape == (60000, 28, 28, 1) and mnist.x_test.shape == (10000, 28, 28, 1)
    for x, y in ((mnist.x_train, mnist.y_train), (mnist.x_test, mnist.y_test)):
        assert x.dtype == np.float32 and x.flags.c_contiguous and y.dtype == np.int32
        assert x.min() == 0.0 and x.max() == 1.0
    assert np.bincount(mnist.y_train).tolist() == TRAIN_COUNTS
    assert np.bincount(mnist.y_test).tolist() == TEST_COUNTS
    assert mnist.y_train[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    # pixels / 255 exactly: every value is one of the 256 levels.
    assert np.isin(np.unique(mnist.x_test), np.arange(256, dtype=np.float32) / np.float32(255)).all()
    assert describe(mnist) == ("dataset mnist: 60000 train / 10000 test samples, "
                               "samples of shape (28, 28, 1), 10 classes")


@pytest.mark.mnist
def test_mnist_uncompressed_copy_parses_identically(mnist, mnist_dir, tmp_path):
    for name in MNIST_FILES:
        with gzip.open(mnist_dir / (name + ".gz"), "rb") as src:
            (tmp_path / name).write_bytes(src.read())
    raw = load_dataset("mnist", data_dir=str(tmp_path))
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(getattr(raw, field), getattr(mnist, field)), field


def test_mnist_as_regression_targets(tmp_path):
    small = write_small_mnist(tmp_path)
    ds = load_dataset("mnist", data_dir=str(small), task="regression")
    assert ds.num_classes == 0 and ds.task == "regression" and ds.y_train.dtype == np.float32


# ---------------------------------------------------------------- IDX parsing on small files

def idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def small_mnist_files(n_train=30, n_test=10, side=4) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    files = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        pixels = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
        files[f"{prefix}-images-idx3-ubyte"] = idx(2051, (n, side, side), pixels.tobytes())
        files[f"{prefix}-labels-idx1-ubyte"] = idx(2049, (n,), (np.arange(n) % 10).astype(np.uint8).tobytes())
    return files


def write_small_mnist(root, files=None, gz=("train-images-idx3-ubyte",)):
    """Writes the files (by default a valid tiny set), gzipping those named in `gz`."""
    for name, data in (files or small_mnist_files()).items():
        if name in gz:
            (root / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)
    return root


def test_small_idx_set_loads_with_any_image_size_and_mixed_compression(tmp_path):
    ds = load_dataset("mnist", data_dir=str(write_small_mnist(tmp_path)))
    assert ds.x_train.shape == (30, 4, 4, 1) and ds.x_test.shape == (10, 4, 4, 1)
    pixels = np.frombuffer(small_mnist_files()["train-images-idx3-ubyte"][16:], np.uint8)
    assert np.array_equal(ds.x_train.ravel(), pixels.astype(np.float32) / 255)
    assert ds.y_train.tolist() == [i % 10 for i in range(30)]


# case -> (file, how it is damaged, what the message says)
MALFORMED = {
    "bad magic": ("train-images-idx3-ubyte", lambda b: struct.pack(">I", 2049) + b[4:], "magic number"),
    "truncated data": ("t10k-images-idx3-ubyte", lambda b: b[:-5], "truncated"),
    "trailing bytes": ("t10k-labels-idx1-ubyte", lambda b: b + b"\0", "trailing bytes"),
    "short header": ("train-labels-idx1-ubyte", lambda b: b"\0\0\x08", "header"),
    "wrong count": ("train-labels-idx1-ubyte", lambda b: idx(2049, (29,), bytes(29)), "29 labels"),
    "label above 9": ("t10k-labels-idx1-ubyte", lambda b: idx(2049, (10,), bytes([12] * 10)), "label 12"),
    "image size differs": ("t10k-images-idx3-ubyte", lambda b: idx(2051, (10, 5, 5), bytes(250)),
                           "25 pixels"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_idx_names_the_file(tmp_path, case):
    culprit, damage, expected = MALFORMED[case]
    files = small_mnist_files()
    files[culprit] = damage(files[culprit])
    write_small_mnist(tmp_path, files, gz=())
    with pytest.raises(DataError) as err:
        load_dataset("mnist", data_dir=str(tmp_path))
    assert culprit in one_line(err) and expected in str(err.value)


@pytest.mark.parametrize("damage", [lambda gz: gz[:len(gz) // 2], lambda gz: b"not gzip at all"])
def test_broken_gzip_names_the_file(tmp_path, damage):
    write_small_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as err:
        load_dataset("mnist", data_dir=str(tmp_path))
    assert str(path) in one_line(err) and "cannot read" in str(err.value)


# ---------------------------------------------------------------- missing MNIST and downloads

def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/"


@pytest.mark.mnist
def test_missing_files_are_downloaded_checked_and_used(tmp_path, mirror, monkeypatch, mnist_dir):
    served, url = mirror
    shutil.copytree(mnist_dir, served / "mnist")
    monkeypatch.setenv(MNIST_MIRRORS_ENV, f"{closed_port_url()},{url}")  # the first mirror is down
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(mnist_dir / "t10k-labels-idx1-ubyte.gz", data)  # one already there
    ds = load_dataset("mnist", data_dir=str(data))
    assert ds.num_train == 60000 and np.bincount(ds.y_test).tolist() == TEST_COUNTS
    assert sorted(os.listdir(data)) == sorted(name + ".gz" for name in MNIST_FILES)  # no .part left
    for name, (size, sha256) in MNIST_FILES.items():
        assert hashlib.sha256((data / (name + ".gz")).read_bytes()).hexdigest() == sha256


def test_download_with_a_wrong_checksum_is_deleted(tmp_path, mirror, monkeypatch):
    served, url = mirror
    (served / "mnist").mkdir()
    (served / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"not mnist"))
    monkeypatch.setenv(MNIST_MIRRORS_ENV, url)
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(DataError) as err:
        load_dataset("mnist", data_dir=str(data))
    assert "sha256" in one_line(err) and "train-images-idx3-ubyte.gz" in str(err.value)
    assert os.listdir(data) == []


def test_missing_files_fail_in_one_line_naming_the_dir_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv(MNIST_MIRRORS_ENV, closed_port_url())
    write_small_mnist(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    with pytest.raises(DataError) as err:
        load_dataset("mnist", data_dir=str(tmp_path))
    message = one_line(err)
    assert str(tmp_path) in message and "t10k-labels-idx1-ubyte" in message and "download failed" in message
    assert "train-images" not in message  # only what is missing
    # How to do it by hand: every well-known mirror, the file, where to put it.
    assert "by hand" in message and all(url in message for url in MNIST_MIRRORS)
    assert "t10k-labels-idx1-ubyte.gz by hand" in message and f"put them in {tmp_path}" in message


@pytest.mark.mnist
def test_the_default_data_dir_is_the_users_cache_made_and_filled(tmp_path, mirror, monkeypatch, mnist_dir):
    served, url = mirror
    shutil.copytree(mnist_dir, served / "mnist")
    monkeypatch.setenv(MNIST_MIRRORS_ENV, f"{closed_port_url()},{url}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))      # does not exist yet
    monkeypatch.delenv(MNIST_DIR_ENV, raising=False)                    # it would come first
    ds = load_dataset("mnist")                                          # no data_dir
    assert ds.num_test == 10000 and np.bincount(ds.y_test).tolist() == TEST_COUNTS
    where = tmp_path / "cache" / "pserver" / "mnist"
    assert default_mnist_dir() == str(where)
    assert sorted(os.listdir(where)) == sorted(name + ".gz" for name in MNIST_FILES)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_mnist_dir() == str(tmp_path / "home" / ".cache" / "pserver" / "mnist")


def test_the_mnist_directory_is_data_dir_then_the_variable_then_the_cache(tmp_path, monkeypatch):
    """mnist_dir's order, on three real directories each holding a set of a different size: the
    --data-dir argument, else $PSERVER_MNIST_DIR (empty counts as unset), else the cache; a
    directory named first is the one used even when it lacks files (nothing falls through to the
    next), and an error names what chose it."""
    sizes = {"flag": 11, "env": 12, "cache": 13}
    for name, n in sizes.items():
        (tmp_path / name).mkdir()
        write_small_mnist(tmp_path / name, small_mnist_files(n_train=n))
    (tmp_path / "xdg" / "pserver").mkdir(parents=True)
    (tmp_path / "cache").rename(tmp_path / "xdg" / "pserver" / "mnist")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(MNIST_MIRRORS_ENV, "")                            # never download
    monkeypatch.setenv(MNIST_DIR_ENV, str(tmp_path / "env"))
    assert load_dataset("mnist", data_dir=str(tmp_path / "flag")).num_train == 11
    assert load_dataset("mnist").num_train == 12
    assert find_mnist_dir() == (str(tmp_path / "env"), f"${MNIST_DIR_ENV}")
    monkeypatch.setenv(MNIST_DIR_ENV, "")
    assert load_dataset("mnist").num_train == 13
    monkeypatch.delenv(MNIST_DIR_ENV)
    assert load_dataset("mnist").num_train == 13
    assert find_mnist_dir() == (str(tmp_path / "xdg" / "pserver" / "mnist"), "the cache directory")
    monkeypatch.setenv(MNIST_DIR_ENV, str(tmp_path / "empty"))           # named, made, but holds nothing
    with pytest.raises(DataError) as err:
        load_dataset("mnist")
    assert f"{tmp_path / 'empty'} (${MNIST_DIR_ENV}) has no" in one_line(err)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(MNIST_DIR_ENV, str(tmp_path / "file"))
    with pytest.raises(DataError, match=rf"\${MNIST_DIR_ENV} .*file is not a directory"):
        load_dataset("mnist")


def test_missing_files_with_the_real_mirrors_fail_fast_or_download(tmp_path, monkeypatch):
    monkeypatch.delenv(MNIST_MIRRORS_ENV, raising=False)
    start = time.monotonic()
    try:
        ds = load_dataset("mnist", data_dir=str(tmp_path))
    except DataError as err:  # no internet (the usual case here): it must say so quickly
        assert time.monotonic() - start < 30
        message = str(err)
        assert "\n" not in message and str(tmp_path) in message and "download failed" in message
        assert all(name in message for name in MNIST_FILES)
    else:  # a machine with internet: the files came and passed their checksums
        assert ds.num_train == 60000


def test_mnist_directory_problems(tmp_path, monkeypatch):
    monkeypatch.setenv(MNIST_MIRRORS_ENV, "")          # never download
    with pytest.raises(DataError) as err:               # a missing directory is made for the files
        load_dataset("mnist", data_dir=str(tmp_path / "new" / "mnist"))
    assert f"put them in {tmp_path / 'new' / 'mnist'}" in one_line(err)
    assert (tmp_path / "new" / "mnist").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="--data-dir .*file is not a directory"):
        load_dataset("mnist", data_dir=str(tmp_path / "file"))
    with pytest.raises(DataError, match="cannot create --data-dir"):
        load_dataset("mnist", data_dir=str(tmp_path / "file" / "below"))


# ---------------------------------------------------------------- epochs, ranks, batches

@settings(max_examples=150, deadline=None)
@given(num_train=st.integers(0, 3000), num_workers=st.integers(1, 40),
       seed=st.integers(0, 2**40), epoch=st.integers(0, 10_000))
def test_epoch_indices_partition_one_permutation(num_train, num_workers, seed, epoch):
    per = num_train // num_workers
    blocks = [epoch_indices(num_train, r, num_workers, seed, epoch) for r in range(num_workers)]
    joined = np.concatenate(blocks)
    assert all(len(b) == per for b in blocks)
    assert len(np.unique(joined)) == len(joined)  # pairwise disjoint
    assert ((joined >= 0) & (joined < num_train)).all()
    assert np.array_equal(epoch_indices(num_train, num_workers - 1, num_workers, seed, epoch), blocks[-1])
    if len(joined) >= 20:  # two orders of 20+ items agree by chance with probability < 1/20!
        following = [epoch_indices(num_train, r, num_workers, seed, epoch + 1) for r in range(num_workers)]
        assert not np.array_equal(np.concatenate(following), joined)


def test_epoch_indices_rejects_a_bad_rank_or_cluster():
    with pytest.raises(ConfigError, match="--rank"):
        epoch_indices(100, 4, 4, 0, 0)
    with pytest.raises(ConfigError, match="--rank"):
        epoch_indices(100, -1, 4, 0, 0)
    with pytest.raises(ConfigError, match="--num-workers"):
        epoch_indices(100, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match="--seed"):
        epoch_indices(100, 0, 1, -1, 0)


def test_steps_per_epoch():
    assert steps_per_epoch(60000, 4, 32) == 469            # 468 batches of 32 and one of 24 per worker
    assert steps_per_epoch(60000, 4, 15000) == 1
    assert steps_per_epoch(10, 3, 3) == 1
    assert steps_per_epoch(54000, 1, 128) == 422            # Keras's count: the last batch has 112
    with pytest.raises(ConfigError, match="--batch-size") as err:
        steps_per_epoch(100, 4, 26)
    assert "25" in one_line(err)
    with pytest.raises(ConfigError, match="--batch-size"):
        steps_per_epoch(100, 4, 0)


def test_iterate_batches_yields_the_ranks_whole_block_the_last_batch_smaller():
    """1003 samples, 3 ranks: blocks of 334 (one sample sits the epoch out), 8 batches of 40 and a
    last of 14 each, as Keras cuts an epoch; catches the last partial batch dropped."""
    ds = load_dataset("synthetic", samples=1003, test_samples=10, features=7, classes=3)
    seen = []
    for rank in range(3):
        batches = list(iterate_batches(ds, rank, 3, 40, seed=5, epoch=2))
        assert len(batches) == steps_per_epoch(1003, 3, 40) == 9
        assert [len(x) for x, _ in batches] == [40] * 8 + [14]
        for x, y in batches:
            assert x.shape[1:] == (7,) and x.dtype == np.float32 and x.flags.c_contiguous
            assert y.shape == (len(x),) and y.dtype == np.int32
        order = epoch_indices(1003, rank, 3, 5, 2)
        assert np.array_equal(np.concatenate([x for x, _ in batches]), ds.x_train[order])
        assert np.array_equal(np.concatenate([y for _, y in batches]), ds.y_train[order])
        seen.append(order)
    assert len(np.unique(np.concatenate(seen))) == 3 * 334


def test_leased_batches_cover_every_sample_once_the_last_smaller():
    """--data-assignment leases: 1,000 samples at 128 are 8 batches, the last of 104, every sample
    once (Keras's 8 steps); catches the last 104 samples dropped (7 batches, 896 samples)."""
    ds = load_dataset("synthetic", samples=1000, test_samples=10, features=7, classes=3)
    for shuffle in (True, False):
        data = ds.leased_batches(128, 5, 3, shuffle=shuffle)
        batches = [data.batch(1, b) for b in range(data.num_batches)]
        assert data.num_batches == 8 and [len(x) for x, _ in batches] == [128] * 7 + [104]
        x = np.concatenate([x for x, _ in batches])
        assert len(np.unique(x, axis=0)) == 1000 and len(np.unique(ds.x_train, axis=0)) == 1000
    with pytest.raises(ConfigError, match="--batch-size"):
        iterate_batches(ds, 0, 3, 335, seed=5, epoch=0)  # raises at the call, not at the first next()


# ---------------------------------------------------------------- synthetic

def logreg_accuracy(ds: Dataset, epochs: int, lr=0.1, batch=32) -> float:
    """Plain minibatch-SGD softmax regression, written out independently of pserver's kernels."""
    w = np.zeros((ds.features, ds.num_classes), np.float32)
    b = np.zeros(ds.num_classes, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = rng.permutation(ds.num_train)
        for i in range(0, ds.num_train - batch + 1, batch):
            x, y = ds.x_train[order[i:i + batch]], ds.y_train[order[i:i + batch]]
            z = x @ w + b
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(batch), y] -= 1  # d(cross-entropy)/dz
            w -= lr * x.T @ p / batch
            b -= lr * p.mean(axis=0)
    return float(((ds.x_test @ w + b).argmax(axis=1) == ds.y_test).mean())


def test_synthetic_is_learnable_but_not_trivial():
    ds = load_dataset("synthetic", seed=3, samples=4000, test_samples=1000, features=50, classes=10)
    assert 0.9 < logreg_accuracy(ds, epochs=3) < 1.0


def test_synthetic_is_deterministic_in_seed():
    kw = dict(samples=500, test_samples=100, features=20, classes=4)
    a, b, c = (load_dataset("synthetic", seed=s, **kw) for s in (1, 1, 2))
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
        assert not np.array_equal(getattr(a, field), getattr(c, field))
    # The test set does not depend on how many training samples were asked for.
    d = load_dataset("synthetic", seed=1, **{**kw, "samples": 77})
    assert np.array_equal(d.x_test, a.x_test) and np.array_equal(d.y_test, a.y_test)
    assert a.x_train.shape == (500, 20) and a.x_train.dtype == np.float32 and a.x_train.flags.c_contiguous
    assert a.y_train.dtype == np.int32 and set(np.unique(a.y_train)) == {0, 1, 2, 3} and a.num_classes == 4


def test_synthetic_regression_is_a_noisy_linear_task():
    ds = load_dataset("synthetic", task="regression", samples=2000, test_samples=500, features=30)
    assert ds.num_classes == 0 and ds.task == "regression"
    assert describe(ds).endswith("30 features, regression")
    assert ds.y_train.dtype == ds.y_test.dtype == np.float32
    design = np.hstack([ds.x_train, np.ones((ds.num_train, 1), np.float32)])
    coef = np.linalg.lstsq(design, ds.y_train, rcond=None)[0]
    pred = ds.x_test @ coef[:-1] + coef[-1]
    r2 = 1 - np.mean((pred - ds.y_test) ** 2) / np.var(ds.y_test)
    assert 0.95 < r2 < 1.0


@pytest.mark.parametrize("kwargs, flag", [
    ({"samples": 0}, "--samples"), ({"test_samples": 0}, "--test-samples"), ({"features": 0}, "--features"),
    ({"classes": 1}, "--classes"), ({"seed": -1}, "--seed"), ({"task": "ranking"}, "--task")])
def test_synthetic_rejects_bad_options(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        load_dataset("synthetic", **kwargs)


def test_unknown_dataset():
    with pytest.raises(ConfigError) as err:
        load_dataset("cifar")
    assert str(err.value) == ("--dataset: unknown dataset 'cifar'; choose synthetic, mnist, "
                              "criteo-synthetic, criteo-synthetic-multi-hot, criteo:PATH (a Criteo TSV "
                              "file), criteo-multi-hot:PATH (lists in its columns), stream:PATH (a "
                              "growing one) or a path to a .npz or .parquet file")


# ---------------------------------------------------------------- .npz

def test_npz_round_trip_with_test_arrays(tmp_path):
    rng = np.random.default_rng(0)
    x, x_test = rng.random((50, 2, 3)), rng.random((20, 2, 3))  # float64, N-D: kept N-D, 6 features
    y, y_test = rng.integers(0, 4, 50).astype(np.uint8), np.full(20, 6)
    path = str(tmp_path / "d.npz")
    np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test)
    ds = load_dataset(path)
    assert (ds.name, ds.num_classes, ds.features, ds.num_train, ds.num_test) == (path, 7, 6, 50, 20)
    assert np.array_equal(ds.x_train, x.astype(np.float32)) and ds.x_train.flags.c_contiguous
    assert np.array_equal(ds.y_train, y) and ds.y_train.dtype == np.int32
    assert np.array_equal(ds.x_test, x_test.astype(np.float32))
    reg = load_dataset(path, task="regression")
    assert reg.num_classes == 0 and np.array_equal(reg.y_test, np.full(20, 6.0, np.float32))


def test_npz_without_test_arrays_holds_out_a_seeded_tenth(tmp_path):
    x = np.arange(100, dtype=np.float32).reshape(50, 2)
    y = np.linspace(-1, 1, 50)  # float targets: regression
    path = str(tmp_path / "d.npz")
    np.savez_compressed(path, x=x, y=y)
    ds = load_dataset(path, seed=4)
    assert ds.task == "regression" and (ds.num_train, ds.num_test) == (45, 5)
    rows = np.concatenate([ds.x_train[:, 0], ds.x_test[:, 0]]) // 2
    assert sorted(rows.astype(int).tolist()) == list(range(50))  # every sample exactly once
    assert np.array_equal(ds.y_test, y[(ds.x_test[:, 0] // 2).astype(int)].astype(np.float32))
    assert np.array_equal(load_dataset(path, seed=4).x_test, ds.x_test)
    assert not np.array_equal(load_dataset(path, seed=5).x_test, ds.x_test)


def _good():
    return {"x": np.ones((10, 3)), "y": np.arange(10) % 2}


NPZ_ERRORS = {
    "no x": ({"y": np.arange(3)}, "'x'"),
    "no y": ({"x": np.ones((3, 2))}, "'y'"),
    "x_test without y_test": ({**_good(), "x_test": np.ones((2, 3))}, "'y_test'"),
    "y length": ({"x": np.ones((10, 3)), "y": np.arange(9)}, "y has shape (9,)"),
    "y_test length": ({**_good(), "x_test": np.ones((4, 3)), "y_test": np.arange(3)}, "y_test"),
    "x_test features": ({**_good(), "x_test": np.ones((4, 2)), "y_test": np.arange(4)},
                        "x_test has samples of shape (2,), x (3,)"),
    "NaN in x": ({**_good(), "x": np.where(np.eye(10, 3) > 0, np.nan, 1.0)}, "x has 3 non-finite"),
    "Inf in y": ({"x": np.ones((10, 3)), "y": np.r_[np.ones(9), np.inf]}, "y has 1 non-finite"),
    "too big for float32": ({**_good(), "x": np.full((10, 3), 1e300)}, "non-finite"),
    "negative label": ({"x": np.ones((3, 2)), "y": np.array([0, -1, 1])}, "y[1] = -1"),
    "1-D x": ({"x": np.ones(10), "y": np.arange(10)}, "x has shape (10,)"),
    "empty x": ({"x": np.ones((0, 3)), "y": np.arange(0)}, "x has shape (0, 3)"),
    "string x": ({"x": np.array([["a", "b"]]), "y": np.arange(1)}, "x has dtype <U1"),
    "3-D y": ({"x": np.ones((4, 2)), "y": np.ones((4, 1, 1))}, "y has shape (4, 1, 1)"),
    "one class": ({"x": np.ones((4, 2)), "y": np.zeros(4, int)}, "at least 2 classes"),
    "mixed label kinds": ({**_good(), "x_test": np.ones((2, 3)), "y_test": np.ones(2)}, "y_test is float64"),
    "one sample": ({"x": np.ones((1, 3)), "y": np.arange(1)}, "x has 1 sample"),
    "object array": ({**_good(), "x": np.array([{}, {}], dtype=object)}, "'x' is unreadable"),
}


@pytest.mark.parametrize("case", sorted(NPZ_ERRORS))
def test_npz_errors_name_the_file_and_key(tmp_path, case):
    arrays, expected = NPZ_ERRORS[case]
    path = str(tmp_path / "bad.npz")
    np.savez(path, **arrays)
    with pytest.raises(DataError) as err:
        load_dataset(path)
    assert path in one_line(err) and expected in str(err.value)


def test_an_npz_y_with_a_column_per_output_trains_a_model_with_several_outputs(tmp_path):
    """A file's 2-D y loads as it is and the model checks it: a column per output for a model
    with several (`pserver launch --model FILE:build --dataset y2.npz` trains it), one label
    per sample otherwise, said in one line. Catches the loader refusing any 2-D y, or a 2-D y
    reaching a one-output model unchecked."""
    from pserver.layers import Dense
    from pserver.models.functional import Functional
    from pserver.ops.core import Symbolic
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    path = str(tmp_path / "y2.npz")
    np.savez(path, x=x, y=np.stack([x[:, 0] > 0, x[:, 1]], axis=1).astype(np.float32))
    ds = load_dataset(path)
    assert ds.y_train.shape == (45, 2) and ds.y_train.dtype == np.float32
    inp = Symbolic((None, 4), name="x")
    h = Dense(8)(inp)
    two = Functional(inp, [Dense(2)(h), Dense(1)(h)])
    two.compile(loss=["sparse_categorical_crossentropy", "mse"])
    two.check_data(ds.x_train, ds.y_train)
    one = Functional(inp, Dense(2)(h))
    one.compile(loss="sparse_categorical_crossentropy")
    with pytest.raises(DataError) as err:
        one.check_data(ds.x_train, ds.y_train)
    assert "y has shape (45, 2); x has 45 rows; it takes one label per sample, (45,)" in one_line(err)


def test_npz_file_problems(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset(str(tmp_path / "missing.npz"))
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip archive")
    with pytest.raises(DataError, match="not a readable .npz") as err:
        load_dataset(str(garbage))
    one_line(err)
    single = tmp_path / "single.npz"
    with open(single, "wb") as f:
        np.save(f, np.ones(3))
    with pytest.raises(DataError, match="single .npy array"):
        load_dataset(str(single))


def test_uint8_npz_features_are_scaled_to_unit_range_unless_told_not_to(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (50, 6), dtype=np.uint8)
    path = str(tmp_path / "pixels.npz")
    np.savez(path, x=x, y=np.arange(50) % 2, x_test=x[:5], y_test=np.arange(5) % 2)
    ds = load_dataset(path)
    said = capsys.readouterr().out
    assert said == (f"{path}: x and x_test are uint8: scaled from 0-255 to [0, 1] "
                    "(--scale-uint8 none keeps the raw values)\n")
    np.testing.assert_array_equal(np.sort(ds.x_test, axis=0), np.sort(x[:5] / np.float32(255), axis=0))
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    raw = load_dataset(path, scale_uint8="none")
    assert capsys.readouterr().out == "" and raw.x_train.max() > 1.0
    np.testing.assert_array_equal(raw.x_test, x[:5].astype(np.float32))
    with pytest.raises(ConfigError, match="--scale-uint8: 'always'"):
        load_dataset(path, scale_uint8="always")


def test_a_stream_refuses_an_empty_batch_by_its_index():
    """Each push weighs its gradient by the samples behind it, and the shards refuse a push of
    none: an empty batch from the user's generator is named here, not as a refused push."""
    from pserver.data import Stream
    one = (np.ones((2, 3), np.float32), np.zeros(2, np.int32))
    empty = (np.ones((0, 3), np.float32), np.zeros(0, np.int32))
    batches = Stream("mine", [one, empty]).epoch(0, 1, 2, 0, 0)
    assert next(batches)[0].shape == (2, 3)
    with pytest.raises(DataError, match="mine: batch 1 is empty; a step trains on at least one sample"):
        next(batches)
