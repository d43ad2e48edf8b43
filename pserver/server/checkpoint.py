"""Checkpoints of one shard: its slice, optimizer state, version and layout, in one file.

Written atomically (DESIGN §8): a temporary file in the same directory, fsync, rename
over the final name, then fsync of the directory, so a crash at any moment leaves either
the previous checkpoint or the new one, never a half-written file under a final name.
Loading also verifies a checksum over the arrays and skips (with a warning) any file
that does not load, falling back to the next older one.

    shard{J}-of{S}-v{VERSION:012d}.ckpt     an .npz: params, opt.<name> arrays, meta (JSON)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pserver.errors import ConfigError

log = logging.getLogger("pserver.checkpoint")
KEEP = 3                                   # newest checkpoints kept per shard
NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})\.ckpt$")


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
    clocks: dict = field(default_factory=dict)   # ssp: rank -> clock; older files have none


def file_name(shard: int, num_shards: int, version: int) -> str:
    return f"shard{shard}-of{num_shards}-v{version:012d}.ckpt"


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def save(directory: str, ckpt: Checkpoint) -> str:
    """Write atomically; returns the final path. Older checkpoints beyond KEEP are removed."""
    os.makedirs(directory, exist_ok=True)
    arrays = {"params": ckpt.params, **{f"opt.{k}": v for k, v in ckpt.state.items()}}
    meta = {"version": ckpt.version, "shard": ckpt.shard, "num_shards": ckpt.num_shards,
            "signature": ckpt.signature, "total": ckpt.total, "start": ckpt.start, "end": ckpt.end,
            "optimizer": ckpt.optimizer, "clocks": {str(r): int(c) for r, c in ckpt.clocks.items()},
            "sha256": digest(arrays)}
    final = os.path.join(directory, file_name(ckpt.shard, ckpt.num_shards, ckpt.version))
    tmp = f"{final}.{os.getpid()}.tmp"
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    with open(tmp, "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(directory)
    prune(directory, ckpt.shard, ckpt.num_shards)
    return final


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
        try:
            os.remove(path)
        except OSError:
            pass


def load(path: str) -> Checkpoint:
    """Load and verify one file; ValueError (with why) if it is not a whole checkpoint."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # a truncated zip raises several types
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    if "meta" not in arrays or "params" not in arrays:
        raise ValueError("missing meta or params")
    meta = json.loads(arrays.pop("meta").tobytes())
    if digest(arrays) != meta.get("sha256"):
        raise ValueError("checksum mismatch")
    state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
    return Checkpoint(path, meta["version"], meta["shard"], meta["num_shards"], meta["signature"],
                      meta["total"], meta["start"], meta["end"], meta["optimizer"],
                      arrays["params"], state,
                      {int(r): int(c) for r, c in meta.get("clocks", {}).items()})


def load_latest(directory: str, shard: int, num_shards: int) -> Checkpoint | None:
    """The newest checkpoint of this shard that loads and verifies, or None."""
    if not os.path.exists(directory):
        return None                           # a first start: nothing to restore yet
    if not os.path.isdir(directory):
        raise ConfigError(f"--restore: {directory} is not a directory")
    for _, path in candidates(directory, shard, num_shards):
        try:
            return load(path)
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    # Files of other shards of the same cluster are expected (a shared directory); files
    # written for another number of shards mean the cluster changed shape.
    other = sorted(n for n in os.listdir(directory)
                   if NAME.match(n) and int(NAME.match(n).group(2)) != num_shards)
    if other:
        raise ConfigError(f"--restore: {directory} has checkpoints for another number of shards "
                          f"({other[-1]}), this is shard {shard} of {num_shards}; check --num-shards")
    return None


class Checkpointer:
    """When and where one shard writes checkpoints: every N steps, every S seconds, on
    request. Writes happen on a background thread, one at a time, from a snapshot taken
    under the store's lock, so pushes wait only for the copy, not for the disk."""

    def __init__(self, directory: str, store, cfg) -> None:
        self.directory, self.store, self.cfg = directory, store, cfg
        self.lock = threading.Lock()         # one write at a time
        self.last_version = store.version
        self.last_time = time.monotonic()
        self.busy = False

    def write_now(self) -> tuple[str, int]:
        snap = self.store.snapshot({"shard": self.cfg.shard, "num_shards": self.cfg.num_shards,
                                    "optimizer": self.cfg.optimizer, "path": ""})
        with self.lock:
            path = save(self.directory, Checkpoint(**snap))
        self.last_version, self.last_time = snap["version"], time.monotonic()
        log.info("shard %d: checkpoint at version %d written to %s", self.cfg.shard, snap["version"], path)
        return path, snap["version"]

    def due(self) -> bool:
        v = self.store.version
        if v < 0 or v == self.last_version or self.busy:
            return False
        every, secs = self.cfg.checkpoint_every, self.cfg.checkpoint_secs
        return bool((every and v - self.last_version >= every) or
                    (secs and time.monotonic() - self.last_time >= secs))

    def maybe(self) -> None:
        """Called after pushes: start a background write when one is due."""
        if self.due():
            self.busy = True
            threading.Thread(target=self._background, name="checkpoint", daemon=True).start()

    def _background(self) -> None:
        try:
            self.write_now()
        except Exception:
            log.exception("shard %d: checkpoint failed", self.cfg.shard)
        finally:
            self.busy = False
