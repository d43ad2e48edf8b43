"""Datasets and the per-rank slices that workers train on: one module per kind (synthetic,
mnist, npz, criteo), the Dataset and the slicing in dataset.

    load_dataset("synthetic" | "mnist" | "path.npz") -> Dataset   (float32 x, int32 labels or float32 targets)
    load_dataset("criteo:PATH" | "criteo-synthetic")              (click-through data: pserver.data.criteo)
    epoch_indices / iterate_batches                                 (rank r's disjoint block of one epoch)

Every epoch is one permutation of the training set drawn from `seed + epoch`, the same on every
worker; rank r takes the r-th of `num_workers` equal blocks, so the ranks never overlap and all run
the same number of steps (the `num_train % num_workers` left-over samples sit that epoch out).

MNIST comes from the four IDX files (.gz or not) in the directory mnist_dir chooses: `--data-dir`,
else $PSERVER_MNIST_DIR, else the user's cache (default_mnist_dir), created when missing. Missing
files are fetched from the mirrors in MNIST_MIRRORS, one after the other, or from the
comma-separated base URLs in $PSERVER_MNIST_MIRRORS (set it empty to never download), and kept
only if their sha256 matches.
Every problem with the data raises DataError, every bad option ConfigError, with one line that names
the file, key or flag and the value.
"""

from __future__ import annotations

import os

from pserver.data import criteo, mnist, npz, parquet, stream, synthetic
from pserver.data.dataset import (
    TASKS,
    Dataset,
    Stream,
    as_task,
    check_int,
    check_rank,
    describe,
    epoch_indices,
    iterate_batches,
    steps_per_epoch,
)
from pserver.data.mnist import default_mnist_dir, mnist_dir
from pserver.data.npz import from_arrays
from pserver.errors import ConfigError
from pserver.registry import Registry

# What --dataset takes: load_dataset dispatches on these; the last two take a path.
DATASETS = Registry("dataset", "--dataset")
DATASETS.add("synthetic", "separable Gaussian classes, or a linear-regression task (--samples, --features, "
             "--classes)")
DATASETS.add("mnist", "the MNIST digits from --data-dir (else $PSERVER_MNIST_DIR, else the cache), "
             "downloaded there when missing (sha256-checked)")
DATASETS.add("criteo-synthetic", "Criteo-shaped click records from a planted model (--samples)")
DATASETS.add("criteo-synthetic-multi-hot", "criteo-synthetic with list features of MLPerf DLRMv2's "
             "multi-hot sizes (1 to 100 ids per feature) and labels from a planted model over the lists")
DATASETS.add("criteo", "a Criteo TSV file, plain or .gz, streamed", form="criteo:PATH")
DATASETS.add("criteo-multi-hot", "a Criteo TSV file whose categorical columns hold lists of "
             "comma-separated values, up to MLPerf DLRMv2's multi-hot sizes", form="criteo-multi-hot:PATH")
DATASETS.add("stream", "a file of Criteo TSV lines that grows while the job trains, followed like tail -F "
             "and leased by line offset in windows of --window-batches (metrics progressive, no test set)",
             form="stream:PATH")
DATASETS.add("npz", "a path to a .npz with x and y (and x_test, y_test)", form="PATH.npz")
DATASETS.add("parquet", "a path to a Parquet file: a record field per column (lists of ids padded with -1), "
             "the column 'label' as y", form="PATH.parquet")


def load_dataset(spec: str, *, data_dir: str | None = None, seed: int = 0, task: str = "classification",
                 samples: int = 60000, test_samples: int = 10000, features: int = 784,
                 classes: int = 10, scale_uint8: str = "auto"):
    """Load `spec`: "synthetic", "mnist", a path ending in .npz (each a Dataset), or Criteo data:
    "criteo:PATH" (a TSV file, plain or .gz, streamed) or "criteo-synthetic" (see pserver.data.criteo).

    samples/test_samples/features/classes shape `synthetic` only, samples/test_samples also
    `criteo-synthetic`; test_samples caps the test set held out of a Criteo file. seed generates
    both synthetic kinds and shuffles an .npz's held-out test set. task="regression" asks for
    float targets: synthetic then draws a linear-regression task, and integer labels (mnist,
    .npz) become float32 targets. A float `y` in an .npz is always regression. An .npz's uint8
    features (images, 0-255) are divided by 255, saying so, unless scale_uint8 is "none".
    """
    if task not in TASKS:
        raise ConfigError(f"--task: unknown task {task!r}; choose classification or regression")
    check_int("--seed", seed, 0)
    if spec == "synthetic":
        return synthetic.generate(seed, task, samples, test_samples, features, classes)
    if spec == "mnist":
        return as_task(mnist.load(data_dir), task)
    if spec in ("criteo-synthetic", "criteo-synthetic-multi-hot") or spec.startswith(("criteo:",
                                                                                     "criteo-multi-hot:")):
        return _load_criteo(spec, seed, task, samples, test_samples)
    if spec.startswith("stream:"):
        if task != "classification":
            raise ConfigError(f"--dataset {spec}: click-through events are binary classification, not {task}")
        return stream.open_stream(spec)
    if spec.lower().endswith(".parquet"):
        return as_task(parquet.load(spec, seed), task)
    if spec.lower().endswith(".npz"):
        if scale_uint8 not in npz.SCALE_UINT8:
            raise ConfigError(f"--scale-uint8: {scale_uint8!r} is not one of {', '.join(npz.SCALE_UINT8)}")
        return as_task(npz.load(spec, seed, scale_uint8 == "auto"), task)
    named = ", ".join(f for f in DATASETS.forms() if f in DATASETS)   # those without a path
    raise ConfigError(f"--dataset: unknown dataset {spec!r}; choose {named}, "
                      "criteo:PATH (a Criteo TSV file), criteo-multi-hot:PATH (lists in its columns), "
                      "stream:PATH "
                      "(a growing one) or a "
                      "path to a .npz or .parquet file")


def _load_criteo(spec: str, seed: int, task: str, samples: int, test_samples: int):
    if task != "classification":
        raise ConfigError(f"--dataset {spec}: click-through data is binary classification, not {task}")
    sizes = criteo.MLPERF_MULTI_HOT if "multi-hot" in spec else None
    if spec.startswith("criteo-synthetic"):
        return criteo.load_synthetic(seed, samples, test_samples, sizes)
    kind, path = spec.split(":", 1)
    if not path:
        raise ConfigError(f"--dataset {kind}:PATH: the path is empty "
                          f"(e.g. {kind}:train.txt or {kind}:day_0.gz)")
    return criteo.load_file(os.path.expanduser(path), test_samples, sizes)


__all__ = ["DATASETS", "TASKS", "Dataset", "Stream", "as_task", "check_int", "check_rank", "describe",
           "default_mnist_dir", "epoch_indices", "from_arrays", "iterate_batches", "load_dataset",
           "mnist_dir", "steps_per_epoch"]
