"""MNIST as a new user gets it: no --data-dir, the files fetched into the user's cache from the
first mirror that answers (a real HTTP server here, after one that is down), checked, trained on."""

from __future__ import annotations

import shutil

import pytest

from pserver.data.mnist import MNIST_DIR_ENV, MNIST_FILES
from tests.support.processes import free_port, read_json, run

pytestmark = pytest.mark.e2e


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/"


@pytest.mark.mnist
def test_launch_without_data_dir_downloads_mnist_into_the_cache_and_trains(tmp_path, mirror, mnist_dir):
    served, url = mirror
    shutil.copytree(mnist_dir, served / "mnist")
    cache = tmp_path / "cache"
    # $PSERVER_MNIST_DIR (set by .ci/run) would come before the cache: empty, it counts as unset.
    env = {"XDG_CACHE_HOME": str(cache), "PSERVER_MNIST_MIRRORS": f"{dead_url()},{url}", MNIST_DIR_ENV: ""}
    r = run("launch", "--ps", "1", "--workers", "1", "--dataset", "mnist", "--model", "logreg",
            "--optimizer", "adam", "--lr", "0.001", "--batch-size", "64", "--max-steps", "200",
            "--summary-json", str(tmp_path / "s.json"), env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in (cache / "pserver" / "mnist").iterdir()) == sorted(
        name + ".gz" for name in MNIST_FILES)
    summary = read_json(tmp_path / "s.json")
    assert summary["dataset"] == "mnist" and summary["test_accuracy"] > 0.8
    assert "mnist: downloading" in r.stdout
    # A second run finds the files where the first put them: no mirror is needed any more.
    r = run("launch", "--ps", "1", "--workers", "1", "--dataset", "mnist", "--model", "logreg",
            "--max-steps", "5", env={**env, "PSERVER_MNIST_MIRRORS": ""})
    assert r.returncode == 0 and "downloading" not in r.stdout, r.stderr[-2000:]


@pytest.mark.mnist
def test_the_cli_reads_mnist_from_the_variable_with_an_empty_cache(tmp_path, mnist_dir):
    """$PSERVER_MNIST_DIR is where every command looks without --data-dir (before the cache): with
    an empty cache and no mirror, `pserver launch --dataset mnist` trains from it and downloads
    nothing (on main it read only the cache and failed: "download failed")."""
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache), "PSERVER_MNIST_MIRRORS": "", MNIST_DIR_ENV: str(mnist_dir)}
    r = run("launch", "--ps", "1", "--workers", "1", "--dataset", "mnist", "--model", "logreg",
            "--max-steps", "3", "--summary-json", str(tmp_path / "s.json"), env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert read_json(tmp_path / "s.json")["dataset"] == "mnist"
    assert "downloading" not in r.stdout and not (cache / "pserver" / "mnist").exists()
