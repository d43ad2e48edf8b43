"""The state on disk without the server (pserver.persist): the offline commands `pserver export`,
`pserver checkpoint inspect|reshard` and `pserver evaluate --checkpoint` do their work with no
module of pserver.server or pserver.worker loaded, and no gRPC; one atomic writer; a model's
task said once, by its registry entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pserver import models
from pserver.data import load_dataset
from pserver.persist import atomic, checkpoint
from pserver.wire.sharding import shard_ranges

# The model `--model logreg --dataset synthetic --samples 600 --features 20` builds.
FLAGS = ["--model", "logreg", "--dataset", "synthetic", "--samples", "600", "--features", "20"]

# Runs the CLI's main in a fresh interpreter, then prints which of the modules it must not need
# were loaded (and its exit code).
LOADED = """
import json, sys
from pserver.cli import main
code = main(sys.argv[1:])
unwanted = ("pserver.server", "pserver.worker", "pserver._proto")
print(json.dumps([code, sorted(m for m in sys.modules if m.split(".")[0] == "grpc"
                               or m.startswith(unwanted))]))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two sync shards' files of a logreg at version 7, as shards write them."""
    ds = load_dataset("synthetic", seed=0, samples=600, features=20, task="classification")
    layout = models.make_model("logreg", ds.sample_shape, ds.num_classes, backend="reference").layout
    d = str(tmp_path_factory.mktemp("persist") / "ck")
    w = np.arange(layout.total, dtype=np.float32)
    for j, (start, end) in enumerate(shard_ranges(layout.total, 2)):
        checkpoint.save(d, checkpoint.Checkpoint(path="", version=7, shard=j, num_shards=2,
                                                 signature=layout.signature(), total=layout.total,
                                                 start=start, end=end, optimizer="sgd",
                                                 params=w[start:end].copy(), state={}, clocks={0: 7},
                                                 positions={0: (1, 10)}))
    return d


def loaded(*argv: str) -> list[str]:
    """The server, worker and gRPC modules a CLI command loaded; it must have succeeded."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, env=env,
                       timeout=300)
    code, modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert code == 0, r.stderr
    return modules


@pytest.mark.parametrize("command", ["inspect", "reshard", "export", "evaluate"])
def test_the_offline_commands_load_no_server_worker_or_grpc_module(checkpoints, tmp_path, command):
    """Catches an import of the server or the worker (or of grpc, through them or the wire's
    security) creeping back into persist or into the CLI's path to it: `pserver export` loaded
    pserver.server.reshard and pserver.worker.loop before persist existed."""
    argv = {"inspect": ["checkpoint", "inspect", checkpoints],
            "reshard": ["checkpoint", "reshard", "--from", checkpoints, "--to", str(tmp_path / "to3"),
                        "--num-shards", "3"],
            "export": ["export", "--restore", checkpoints, *FLAGS, "--out", str(tmp_path / "m.npz")],
            "evaluate": ["evaluate", "--checkpoint", checkpoints, *FLAGS]}[command]
    assert loaded(*argv) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    """atomic.replace, the one writer: a write that raises midway leaves the previous file whole
    under its name and removes its temporary file (catches a writer that writes in place, or
    renames before the write is whole, or forgets its temporary file)."""
    path = str(tmp_path / "f")
    atomic.replace(path, lambda tmp: open(tmp, "w").write("old"))

    def broken(tmp: str) -> None:
        with atomic.synced(tmp) as f:
            f.write(b"half")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.replace(path, broken)
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f"]


DEAD = 1 << 22          # a pid no process has: pid_max is at most 2**22, pids are below it


def test_every_writer_uses_one_temporary_name_and_one_sweep_removes_every_name_ever_used(tmp_path):
    """atomic.temp_path is where a write goes (a checkpoint's, a model file's, RUN's), and
    atomic.sweep removes what a killed writer left under it (NAME.PID.tmp, NAME.PID.HEX8.tmp,
    NAME.PID.old) and under the names older versions used (a model directory's NAME.tmp-PID,
    NAME.old-PID), once its process is gone. Catches a writer with a name of its own that no sweep
    knows, a sweep that misses an older name (a killed older process's file kept for ever), one
    that removes a running writer's file, and one that takes another file's leftover for NAME's."""
    seen = []
    atomic.replace(str(tmp_path / "f"),
                   lambda tmp: seen.append(os.path.basename(tmp)) or open(tmp, "w").close())

    def chunks():                   # what the directory holds while a checkpoint is being written
        seen.extend(os.listdir(tmp_path / "c"))
        yield np.zeros(1, np.float32)

    name = checkpoint.file_name(0, 1, 3)
    part = checkpoint.Part("params", np.dtype(np.float32), (1,), chunks)
    checkpoint.write(str(tmp_path / "c"), name, [part], {})
    assert seen == [f"f.{os.getpid()}.tmp", f"{name}.{os.getpid()}.tmp"]
    assert atomic.temp_path("x", unique=True).startswith(f"x.{os.getpid()}.")
    live = os.getppid()
    gone = [f"m.{DEAD}.tmp", f"m.{DEAD}.0123abcd.tmp", f"m.{DEAD}.old", f"m.tmp-{DEAD}", f"m.old-{DEAD}"]
    kept = [f"m.{live}.tmp", f"m.tmp-{live}", f"m2.{DEAD}.tmp", f"m.x.{DEAD}.tmp", "m", f"m.{DEAD}"]
    d = tmp_path / "d"
    d.mkdir()
    for name in gone + kept:
        (d / name).mkdir() if name.endswith("old") else (d / name).write_bytes(b"half")
    assert sorted(atomic.remove_stale(str(d / "m"))) == sorted(str(d / n) for n in gone)
    assert sorted(os.listdir(d)) == sorted(kept)


def test_a_models_task_is_its_registry_entrys():
    """linreg trains for regression, every other built-in and a user's model for classification
    (their data says): catches a second rule that disagrees, or an entry that lost its task."""
    assert [models.task_of(m) for m in models.MODELS] == \
        ["regression" if m == "linreg" else "classification" for m in models.MODELS]
    assert models.task_of("my_model.py:build") == "classification"
