"""Checkpoint directories that fail under a real shard: full, read-only, unwritable from the
start, littered by a killed writer, holding only corrupt files.

A full or read-only disk is a small tmpfs of the test's own (tests run as root here and in
CI, where chmod stops no write). Where mount is not permitted, the directory's path is
replaced by a regular file instead: every write then fails with an OSError as well."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from pserver.models.layout import Layout
from pserver.persist import checkpoint
from pserver.worker.client import PSClient
from tests.support.processes import LOGREG, free_port, run, wait_until

pytestmark = pytest.mark.e2e

FAILED_LINE = "not written to"          # the shard's one log line per failed write


class Disk:
    """A directory on its own small tmpfs, which the test fills up or makes read-only."""

    def __init__(self, path, size: str = "1m", read_only: bool = False) -> None:
        self.path = path
        path.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                                      capture_output=True).returncode == 0
        if read_only and not self.mounted:
            self.replace_by_file()

    def fill(self) -> None:
        """ENOSPC from now on (a ballast file takes every free block)."""
        if not self.mounted:
            return self.replace_by_file()
        with open(self.path / "ballast", "wb", buffering=0) as f:   # nothing left to flush at close
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass

    def make_read_only(self) -> None:
        if not self.mounted:
            return self.replace_by_file()
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def replace_by_file(self) -> None:
        if self.path.is_dir():
            self.path.rename(self.path.with_name(self.path.name + ".away"))
        self.path.write_text("in the way of the checkpoint directory")

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def disks(tmp_path):
    made = []

    def make(name: str, **kw) -> Disk:
        made.append(Disk(tmp_path / name, **kw))
        return made[-1]

    yield make
    for d in made:
        d.close()


def train_through(procs, tmp_path, disk: Disk, break_disk):
    """A shard checkpointing every 10 steps and two workers; the disk breaks once the first
    checkpoint is on it. Returns (shard, chief, summary, the shard's counters)."""
    shard = procs("serve", "--port", "0", "--num-workers", "2", "--optimizer", "sgd", "--lr", "0.1",
                  "--checkpoint-dir", str(disk.path), "--checkpoint-every", "10")
    addr = shard.address()
    summary = tmp_path / "summary.json"
    train = [*LOGREG, "--delay", "fixed:0.005"]
    chief = procs("worker", "--ps", addr, "--rank", "0", "--num-workers", "2", *train,
                  "--summary-json", str(summary))
    other = procs("worker", "--ps", addr, "--rank", "1", "--num-workers", "2", *train)
    assert wait_until(lambda: list(disk.path.glob("*.ckpt"))), shard.output
    break_disk()
    assert chief.wait() == 0, chief.output[-3000:]
    assert other.wait() == 0, other.output[-3000:]
    status = run("status", "--ps", addr, "--json")
    assert status.returncode == 0, status.stderr
    counters = json.loads(status.stdout)["shards"][0]["counters"]
    with open(summary) as f:
        return shard, chief, json.load(f), {k: int(v) for k, v in counters.items()
                                            if k.startswith("checkpoints")}


@pytest.mark.parametrize("breakage", ["full", "read-only"])
def test_a_disk_that_fails_mid_run_never_stops_training(procs, tmp_path, disks, breakage):
    disk = disks("ckpt", size="256k")
    shard, chief, summary, counters = train_through(
        procs, tmp_path, disk, disk.fill if breakage == "full" else disk.make_read_only)
    assert summary["test_accuracy"] >= 0.9, summary
    assert counters["checkpoints_written"] >= 1 and counters["checkpoints_failed"] >= 3, counters
    assert summary["checkpoints_failed"] >= 1                 # the run summary reports them too
    # one line per failed write, never a traceback; the chief's requests got the reason
    assert wait_until(lambda: shard.output.count(FAILED_LINE) == counters["checkpoints_failed"], 10), \
        (counters, shard.output[-3000:])
    assert "Traceback" not in shard.output and "INTERNAL" not in chief.output
    assert ("checkpoint: shard 0 could not write version" in chief.output
            and "training goes on" in chief.output)
    if disk.mounted:
        assert not list(disk.path.glob("*.tmp")), os.listdir(disk.path)
        newest = checkpoint.load_latest(str(disk.path), 0, 1)     # what was written before still loads
        assert newest is not None and newest.version >= 10


def exit_code_before_listening(p, timeout: float = 60):
    """The exit code of a process that stops at start, or None if it starts listening."""
    p.port_seen.wait(timeout)
    return None if p.port else p.wait(10)


def test_an_unwritable_checkpoint_directory_is_refused_at_start(procs, disks):
    disk = disks("ckpt", read_only=True)
    shard = procs("serve", "--port", "0", "--checkpoint-dir", str(disk.path))
    assert exit_code_before_listening(shard) == 2, shard.output
    lines = shard.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"pserver serve: error: --checkpoint-dir: cannot write checkpoints to {disk.path}"), lines
    launched = run("launch", "--ps", "1", "--workers", "1", *LOGREG, "--checkpoint-dir", str(disk.path))
    lines = launched.stderr.strip().splitlines()
    assert launched.returncode == 2 and len(lines) == 1 and lines[0].startswith(
        f"pserver launch: error: --checkpoint-dir: cannot write checkpoints to {disk.path}"), launched
    assert "pserver launch: 1 shard(s)" not in launched.stdout             # refused before starting any


def test_temporary_files_of_a_killed_writer_are_removed_at_start(procs, tmp_path):
    # pids no process has (pid_max is at most 2**22): their writers were killed
    mine = tmp_path / f"shard0-of1-v000000000030.ckpt.{(1 << 22) + 42}.tmp"
    other = tmp_path / f"shard0-of2-v000000000030.ckpt.{(1 << 22) + 43}.tmp"   # another shape: not ours
    for f in (mine, other):
        f.write_bytes(b"the first half of a checkpoint")
    shard = procs("serve", "--port", "0", "--checkpoint-dir", str(tmp_path))
    shard.address()
    assert not mine.exists() and other.exists()
    assert "removed 1 temporary file(s)" in shard.output


def test_restore_with_only_corrupt_checkpoints_refuses_to_start_unless_asked(procs, tmp_path):
    (tmp_path / "shard0-of1-v000000000040.ckpt").write_bytes(b"PK\x03\x04 torn")
    (tmp_path / "shard0-of1-v000000000020.ckpt").write_bytes(b"")
    refused = procs("serve", "--port", "0", "--restore", str(tmp_path))
    assert exit_code_before_listening(refused) == 2, refused.output
    error = [line for line in refused.output.splitlines() if line.startswith("pserver serve: error:")]
    assert len(error) == 1 and "Traceback" not in refused.output, refused.output
    for name in ("shard0-of1-v000000000040.ckpt: unreadable", "shard0-of1-v000000000020.ckpt: unreadable",
                 "--restore-fresh-if-corrupt"):
        assert name in error[0], error[0]
    fresh = procs("serve", "--port", "0", "--restore", str(tmp_path), "--restore-fresh-if-corrupt")
    assert exit_code_before_listening(fresh) is None, fresh.output
    assert "starting fresh as --restore-fresh-if-corrupt asks" in fresh.output


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) // 1024


def test_concurrent_checkpoint_rpcs_hold_one_snapshot_of_memory(procs, tmp_path):
    size = 1 << 20
    snapshot_mb = 3 * size * 4 >> 20              # adam: params, m and v
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--optimizer", "adam",
                  "--checkpoint-dir", str(tmp_path))
    client = PSClient([shard.address()], rank=0, num_workers=1, rpc_deadline=300)
    try:
        client.connect(30)
        client.register(Layout.of([("w", (size,))]))
        client.init(np.ones(size, np.float32))
        client.checkpoint()                       # the first write's memory is in the heap now
        before, peak, done = rss_mb(shard.popen.pid), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(shard.popen.pid))
                done.wait(0.005)

        answers = []
        callers = [threading.Thread(target=lambda: answers.append(client.shards[0].checkpoint(0, 300)))
                   for _ in range(60)]
        sampler = threading.Thread(target=sample)
        for t in [sampler, *callers]:
            t.start()
        for t in callers:
            t.join()
        done.set()
        sampler.join()
    finally:
        client.close()
    assert len(answers) == 60 and all(checkpoint.load(path).version == v == 0 for path, v in answers)
    assert peak[0] - before < 2 * snapshot_mb, f"RSS {before} MB -> {peak[0]} MB: over two snapshots' worth"


DELTA_TMP = re.compile(r"^shard0-of1-v\d{12}\.d\d{12}\.ckpt\.\d+\.tmp$")   # a delta being written


def test_a_shard_killed_while_writing_a_delta_restores_the_newest_whole_chain(procs, tmp_path):
    """SIGKILL while a delta's temporary file is open (caught by watching the directory, killed
    at once, retried until a kill left one behind): every file under a final name still loads,
    the restarted shard restores the newest of them (base + its deltas), removes the torn
    temporary file, and training goes on to the end. Catches: a delta renamed before it is
    whole, a torn delta that restore takes or stumbles on, a temporary file left after start, a
    restarted shard that extends the old chain without its in-memory parent (its first file
    must be a base)."""
    ckpt, port = tmp_path / "ckpt", free_port()
    serve = ["serve", "--port", str(port), "--num-workers", "1", "--optimizer", "adam", "--lr", "0.001",
             "--checkpoint-every", "1", "--full-every", "5", "--restore", str(ckpt)]
    shard = procs(*serve)
    shard.address()
    worker = procs("worker", "--ps", f"127.0.0.1:{port}", "--rank", "0", "--num-workers", "1",
                   "--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", "9000",
                   "--test-samples", "1000", "--batch-size", "64", "--row-lr", "0.05", "--seed", "5",
                   "--epochs", "1", "--rpc-deadline", "60")
    torn, tries = None, 0
    deadline = time.monotonic() + 60
    while torn is None and time.monotonic() < deadline and worker.popen.poll() is None:
        names = os.listdir(ckpt) if ckpt.is_dir() else []
        seen = [n for n in names if DELTA_TMP.match(n)]
        if not seen or not any(checkpoint.NAME.match(n) and ".d" not in n for n in names):
            time.sleep(0.0005)
            continue
        shard.popen.send_signal(signal.SIGKILL)
        shard.popen.wait()
        tries += 1
        left = [n for n in os.listdir(ckpt) if DELTA_TMP.match(n)]
        if left:
            torn = left[0]
        else:                                       # the write finished first: again
            shard = procs(*serve)
            shard.address()
    assert torn is not None, f"no kill landed inside a delta write in {tries} tries"
    files = checkpoint.candidates(str(ckpt), 0, 1)
    newest = files[0][0]
    for v, path in files:                           # every file under a final name is whole
        assert checkpoint.load(path).version == v
    shard = procs(*serve)
    shard.address()
    assert worker.wait(120) == 0, worker.output[-3000:]
    log = shard.output
    assert f"restored version {newest} from {ckpt / os.path.basename(files[0][1])}" in log, log[-3000:]
    assert "removed 1 temporary file(s)" in log and torn not in os.listdir(ckpt)
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
    after = checkpoint.candidates(str(ckpt), 0, 1)
    assert after[0][0] > newest                     # training went on, and wrote on
    # the restarted shard's chains start at its own bases, never at the old run's files
    assert all((checkpoint.base_of(p) or v) > newest for v, p in after if v > newest), after
    assert checkpoint.load(after[0][1]).version == after[0][0]
