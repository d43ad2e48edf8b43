"""Checkpoints of one shard: its slice, optimizer state, version, the ssp workers' clocks and
the layout, in one file.

Written atomically (docs/semantics.md, "Checkpoints"): a temporary file in the same directory, fsync, rename
over the final name, then fsync of the directory, so a crash at any moment leaves either
the previous checkpoint or the new one, never a half-written file under a final name; a
write that fails removes its temporary file, and those a killed shard left are removed
when it starts again. Loading verifies a checksum over the arrays and skips (with a
warning) any file that does not load, falling back to the next older one; when none of a
shard's files loads, restoring refuses rather than start fresh unasked.

    shard{J}-of{S}-v{VERSION:012d}.ckpt     an .npz: params, opt.<name> arrays, meta (JSON), and
                                            rows.<T>.<name> arrays of sparse table T (meta["tables"][T])
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pserver.errors import ConfigError, FailedPrecondition
from pserver.observe.progress import Bar

log = logging.getLogger("pserver.checkpoint")
KEEP = 3                                   # newest checkpoints kept per shard
HASH_CHUNK = 64 << 20                      # bytes hashed between two progress updates
NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})\.ckpt$")
TMP_NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})\.ckpt\.\d+\.tmp$")   # a write in progress


@dataclass
class Checkpoint:
    path: str
    version: int
    shard: int
    num_shards: int
    signature: str
    total: int
    start: int
    end: int
    optimizer: str
    params: np.ndarray
    state: dict
    clocks: dict = field(default_factory=dict)   # rank -> steps taken in; older files have none
    tables: list = field(default_factory=list)   # sparse tables' configs (TableConfig.to_dict())
    rows: dict = field(default_factory=dict)     # table name -> its SparseTable.state() arrays
    positions: dict = field(default_factory=dict)  # rank -> (data_seed, steps_per_epoch) of its clock
    coordinator: dict | None = None   # shard 0's data coordinator (pserver.server.coordinator.state())


def file_name(shard: int, num_shards: int, version: int) -> str:
    return f"shard{shard}-of{num_shards}-v{version:012d}.ckpt"


def digest(arrays: dict, bar: Bar | None = None) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        # flat first (no copy): a memoryview will not cast a 2-D array with no rows, which an
        # empty table's rows are
        data = memoryview(np.ascontiguousarray(arrays[name]).reshape(-1)).cast("B")
        for i in range(0, len(data), HASH_CHUNK):
            h.update(data[i:i + HASH_CHUNK])
            if bar is not None:
                bar.update(min(HASH_CHUNK, len(data) - i))
    return h.hexdigest()


def save(directory: str, ckpt: Checkpoint) -> str:
    """Write atomically; returns the final path. Older checkpoints beyond KEEP are removed.
    An OSError (disk full, read-only or missing directory) leaves no temporary file behind."""
    os.makedirs(directory, exist_ok=True)
    arrays = {"params": ckpt.params, **{f"opt.{k}": v for k, v in ckpt.state.items()}}
    for i, t in enumerate(ckpt.tables):
        arrays.update({f"rows.{i}.{k}": v for k, v in ckpt.rows[t["name"]].items()})
    meta = {"tables": ckpt.tables,"version": ckpt.version, "shard": ckpt.shard, "num_shards": ckpt.num_shards,
            "signature": ckpt.signature, "total": ckpt.total, "start": ckpt.start, "end": ckpt.end,
            "optimizer": ckpt.optimizer, "clocks": {str(r): int(c) for r, c in ckpt.clocks.items()},
            "positions": {str(r): [int(v) for v in p] for r, p in ckpt.positions.items()},
            "coordinator": ckpt.coordinator, "sha256": digest(arrays)}
    final = os.path.join(directory, file_name(ckpt.shard, ckpt.num_shards, ckpt.version))
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:           # straight to the file: no second copy in memory
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(directory)
    prune(directory, ckpt.shard, ckpt.num_shards)
    return final


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass              # already gone, or the directory itself went away


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def candidates(directory: str, shard: int, num_shards: int) -> list[tuple[int, str]]:
    """(version, path) of this shard's checkpoints, newest first; temp files never match."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = NAME.match(name)
        if m and int(m.group(1)) == shard and int(m.group(2)) == num_shards:
            found.append((int(m.group(3)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def prune(directory: str, shard: int, num_shards: int) -> None:
    for _, path in candidates(directory, shard, num_shards)[KEEP:]:
        remove_quietly(path)


def load(path: str) -> Checkpoint:
    """Load and verify one file; ValueError (with why) if it is not a whole checkpoint. A large
    one shows its progress (pserver.observe.progress): reading, then checking, every byte."""
    try:
        with np.load(path, allow_pickle=False) as z, \
                Bar(f"restoring {os.path.basename(path)}", 2 * sum(i.file_size for i in z.zip.infolist()),
                    unit="B") as bar:
            arrays = {}
            for k in z.files:
                arrays[k] = z[k]
                bar.update(arrays[k].nbytes)
            meta = json.loads(arrays.pop("meta").tobytes()) if "meta" in arrays else None
            if meta is None or "params" not in arrays:
                raise ValueError("missing meta or params")
            if digest(arrays, bar) != meta.get("sha256"):
                raise ValueError("checksum mismatch")
    except ValueError:
        raise
    except Exception as e:  # a truncated zip raises several types
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
    tables = meta.get("tables", [])
    rows = {t["name"]: {k.split(".", 2)[2]: v for k, v in arrays.items() if k.startswith(f"rows.{i}.")}
            for i, t in enumerate(tables)}
    return Checkpoint(path, meta["version"], meta["shard"], meta["num_shards"], meta["signature"],
                      meta["total"], meta["start"], meta["end"], meta["optimizer"],
                      arrays["params"], state,
                      {int(r): int(c) for r, c in meta.get("clocks", {}).items()}, tables, rows,
                      {int(r): tuple(int(v) for v in p) for r, p in meta.get("positions", {}).items()},
                      meta.get("coordinator"))


def meta_of(path: str) -> dict:
    """A checkpoint file's JSON entry (version, layout, sha256 of its arrays...), read alone."""
    with np.load(path, allow_pickle=False) as z:
        return json.loads(z["meta"].tobytes())


def newest(directory: str, shard: int, num_shards: int) -> tuple[Checkpoint | None, list[str]]:
    """This shard's newest checkpoint that loads and verifies (None if none does), and
    "file: why" for each newer one that did not."""
    failures = []
    for _, path in candidates(directory, shard, num_shards):
        try:
            return load(path), failures
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            failures.append(f"{os.path.basename(path)}: {e}")
    return None, failures


def load_weights(directory: str, layout) -> tuple[np.ndarray, list[int]]:
    """The whole flat vector of `layout` from the newest checkpoint of every shard in directory
    (`pserver evaluate --checkpoint`), and each shard's version; ConfigError naming
    --checkpoint when a shard has none that loads or a file is of another model."""
    if not os.path.isdir(directory):
        raise ConfigError(f"--checkpoint: {directory} is not a directory")
    latest: dict[int, int] = {}                # number of shards -> its newest version
    for m in filter(None, map(NAME.match, os.listdir(directory))):
        latest[int(m.group(2))] = max(latest.get(int(m.group(2)), -1), int(m.group(3)))
    if not latest:
        raise ConfigError(f"--checkpoint: {directory} holds no checkpoint "
                          "(shard{J}-of{S}-v{VERSION}.ckpt files)")
    # A job resharded in this directory leaves the old shape's files: the newest shape is the model.
    counts = [max(latest, key=lambda s: (latest[s], s))]
    flat, versions = np.empty(layout.total, dtype=np.float32), []
    for j in range(counts[0]):
        ckpt, failures = newest(directory, j, counts[0])
        if ckpt is None:
            raise ConfigError(f"--checkpoint: {directory} has no checkpoint of shard {j} of {counts[0]} "
                              f"that loads" + (f" ({'; '.join(failures)})" if failures else ""))
        if (ckpt.signature, ckpt.total) != (layout.signature(), layout.total):
            raise ConfigError(f"--checkpoint: {ckpt.path} is of another model (layout {ckpt.signature}, "
                              f"{ckpt.total:,} parameters; this model's is {layout.signature()}, "
                              f"{layout.total:,}): check --model or --model-file")
        flat[ckpt.start:ckpt.end] = ckpt.params
        versions.append(ckpt.version)
    return flat, versions


def load_latest(directory: str, shard: int, num_shards: int,
                fresh_if_corrupt: bool = False) -> Checkpoint | None:
    """The newest checkpoint of this shard that loads and verifies, or None on a first start.
    When this shard has checkpoints and none of them loads, starting fresh would silently
    throw the trained state away: refused, naming each file and why, unless asked for."""
    if not os.path.exists(directory):
        return None                           # a first start: nothing to restore yet
    if not os.path.isdir(directory):
        raise ConfigError(f"--restore: {directory} is not a directory")
    ckpt, failures = newest(directory, shard, num_shards)
    if ckpt is not None:
        return ckpt
    if failures and not fresh_if_corrupt:
        raise ConfigError(f"--restore: no checkpoint of shard {shard} in {directory} loads, and starting "
                          f"fresh would lose the trained state ({'; '.join(failures)}); move them away "
                          f"or pass --restore-fresh-if-corrupt")
    if failures:
        log.warning("shard %d: every checkpoint in %s is corrupt; starting fresh as "
                    "--restore-fresh-if-corrupt asks", shard, directory)
        return None
    # Files of other shards, of this cluster or of another shape, are pserver.server.reshard's.
    return None


def write_directory(cfg) -> tuple[str, str] | None:
    """(directory, flag) where a shard writes its checkpoints: --checkpoint-dir, else the
    directory it restores from; None for neither."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir, "--checkpoint-dir"
    return (cfg.restore, "--restore") if cfg.restore else None


def check_directory(directory: str, flag: str) -> None:
    """The directory exists (made if need be) and takes a new file: an unwritable one is
    refused at start rather than after the first epoch."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".pserver-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write checkpoints to {directory} ({e.strerror or e})") from None


def prepare(directory: str, flag: str, shard: int, num_shards: int) -> None:
    """At start: the directory is writable, and the temporary files that a killed writer of
    this shard left behind are removed."""
    check_directory(directory, flag)
    orphans = [n for n in os.listdir(directory)
               if (m := TMP_NAME.match(n)) and (int(m.group(1)), int(m.group(2))) == (shard, num_shards)]
    for name in orphans:
        remove_quietly(os.path.join(directory, name))
    if orphans:
        log.info("shard %d: removed %d temporary file(s) an interrupted checkpoint write left in %s",
                 shard, len(orphans), directory)


class Checkpointer:
    """When and where one shard writes checkpoints: at versions K, 2K, 3K... (every K steps),
    every S seconds, and on request. At most one write is in flight (a bound on what a client
    can make it hold): it holds the one snapshot, taken under the store's lock, so pushes wait
    only for the copy.
    A request that arrives meanwhile joins that write, or the write after it when the one
    in flight is older than the version the request saw. A failed write is logged in one
    line and counted, leaves no temporary file, and training goes on: the next interval
    tries again.

    Snapshots are taken and written on one thread of their own, for the process's life:
    pserver keeps freed heap memory where the thread that freed it will find it again
    (pserver/launch/allocator.py), so one writer thread reuses one snapshot's memory write after write,
    where snapshots taken by whichever RPC thread asked would each leave theirs behind."""

    def __init__(self, directory: str, flag: str, store, cfg) -> None:
        prepare(directory, flag, cfg.shard, cfg.num_shards)
        self.directory, self.store, self.cfg = directory, store, cfg
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.cond = threading.Condition()
        self.busy = False                     # a snapshot is being taken or written
        self.generation = 0                   # writes ended so far
        self.outcome: tuple[int, str | OSError] = (-1, "")   # (version, path or error) of the last
        self.last_version = max(store.version, 0)   # periodic writes count from here
        self.last_time = time.monotonic()
        self.last_written: float | None = None   # monotonic time of the last write that succeeded

    def request(self) -> tuple[str, int]:
        """(path, version) of a checkpoint at least as new as the store is now; FailedPrecondition
        naming the directory and the OS error when it could not be written."""
        wanted = self.store.version
        with self.cond:
            while self.busy:
                seen = self.generation
                self.cond.wait_for(lambda: self.generation != seen)
                if self.outcome[0] >= wanted:
                    return self._reply(*self.outcome)
            self.busy = True
        return self._reply(*self._start().result())

    def maybe(self) -> None:
        """Called after pushes: when a write is due, start it, and return once its snapshot
        is taken (so it holds the version that made it due); the disk is not waited for."""
        with self.cond:
            if self.busy or not self._due():
                return
            self.busy = True
        self._start()

    def _due(self) -> bool:
        v, every, secs = self.store.version, self.cfg.checkpoint_every, self.cfg.checkpoint_secs
        if v <= self.last_version:
            return False
        return bool((every and v // every > self.last_version // every) or
                    (secs and time.monotonic() - self.last_time >= secs))

    def _start(self) -> Future:
        """Snapshot and write on the writer thread; returns once the snapshot is taken."""
        taken = threading.Event()
        future = self.writer.submit(self._snapshot_and_write, taken)
        future.add_done_callback(_report_bug)
        taken.wait()
        return future

    def _snapshot_and_write(self, taken: threading.Event) -> tuple[int, str | OSError]:
        try:
            snap = self.store.snapshot({"shard": self.cfg.shard, "num_shards": self.cfg.num_shards,
                                        "optimizer": self.cfg.optimizer, "path": ""})
        except BaseException:
            self._end(-1, "")
            raise
        finally:
            taken.set()
        version, result = snap["version"], ""
        try:
            result = save(self.directory, Checkpoint(**snap))
            self.store.counters.add("checkpoints_written")
            # Once per version: the chief's ask at the end and the shard's own last write on
            # stopping rewrite the version the last epoch's checkpoint already has.
            again = self.outcome[0] == version and not isinstance(self.outcome[1], OSError)
            log.log(logging.DEBUG if again else logging.INFO, "shard %d: checkpoint at version %d "
                    "written to %s%s", self.cfg.shard, version, result, " again" if again else "")
        except OSError as e:
            result = e
            self.store.counters.add("checkpoints_failed")
            log.error("shard %d: checkpoint at version %d not written to %s: %s; training goes on, "
                      "the next interval tries again", self.cfg.shard, version, self.directory, e)
        finally:
            self._end(version, result)
        return version, result

    def _end(self, version: int, result: str | OSError) -> None:
        with self.cond:
            self.busy = False
            self.generation += 1
            self.outcome = (version, result)
            if version >= 0:
                self.last_version, self.last_time = version, time.monotonic()
            if version >= 0 and not isinstance(result, OSError):
                self.last_written = self.last_time
            self.cond.notify_all()

    def _reply(self, version: int, result: str | OSError) -> tuple[str, int]:
        if isinstance(result, OSError):
            raise FailedPrecondition(f"checkpoint: shard {self.cfg.shard} could not write version "
                                     f"{version} to {self.directory}: {result.strerror or result}")
        return result, version


def _report_bug(future: Future) -> None:
    """A write that raised anything but an OSError is a bug: say so even when nobody waits."""
    if future.exception() is not None:
        log.error("checkpoint writer failed", exc_info=future.exception())
