"""Checkpoints of one shard: its slice, optimizer state, version, the ssp workers' clocks, the
layout and its sparse tables' rows, as a full base or as a delta of what changed since the
file before it (docs/semantics.md, "Checkpoints").

Written atomically: a temporary file in the same directory, fsync, rename over the final name,
then fsync of the directory, so a crash at any moment leaves either the previous checkpoint or
the new one, never a half-written file under a final name; a write that fails removes its
temporary file, and those a killed shard left are removed when it starts again. Loading
verifies each file's checksum and that its name says what its meta does (shard, shard count,
version, base or delta: a renamed file never stands for another version), and skips (with a
warning) any version that does not load, falling back to the next older one; when none of a
shard's files loads, restoring refuses rather than start fresh unasked. Which state of a
directory is read (restore, reshard, inspect, export, evaluate): `newest_usable`, one rule.

    shard{J}-of{S}-v{VERSION:012d}.ckpt               a base: the whole state at VERSION
    shard{J}-of{S}-v{VERSION:012d}.d{BASE:012d}.ckpt  a delta: the rows changed since the file
                                                      before it in the chain that starts at BASE

Each file is an .npz (a zip of .npy arrays) written array by array, a stripe at a time, from
the live state (ShardStore.begin_dump): never a second copy of the state in memory. Arrays:
params and opt.<name> (the dense slice and its optimizer state, whole in a delta too: a dense
optimizer step changes every element), and per sparse table T (meta["tables"][T]):
rows.<T>.entries (one record per row: id, last update, [steps], data = the row and its
optimizer slots side by side, meta["columns"][T] naming them), rows.<T>.pending_ids,
rows.<T>.pending_counts, rows.<T>.counters, and in a delta rows.<T>.evicted (the ids evicted
since the file before). meta (JSON) holds the rest and the sha256 of the arrays. Files written
before deltas existed (rows.<T>.<name> arrays, no "format") load as bases.

A chain is a base and the deltas after it, each naming its parent (the version of the file
before it) and its base's writing (meta["chain"], an id: a base written again under the same
name, by a run started fresh or from an older version, is another chain); loading a delta
loads its base and every delta up to it, checking each, so that a delta loads as the whole
state at its version (`load`), and nothing else (restore, reshard, inspect, export, evaluate)
needs to know about deltas. A broken or missing file ends its chain there: the versions after
it do not load, and restoring falls back to the newest that does, saying which version it
reached. Pruning keeps the KEEP newest versions and every file they need. A file written at a
version replaces any other file of that version of the same run (under the other name).

A directory belongs to one run (`RUN`, a JSON file: the run's id, written atomically with the
run's first checkpoint, `claim`); every file records the id in its meta ("run"). A start that
finds checkpoints in the directory it would write to without restoring that directory is
refused before anything starts (`check_start`): they are another run's. A restore of the
directory adopts it (its id, or, for files written before run ids, the id it then writes).
No process prunes or overwrites a file of another run, and an offline tool never prunes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from pserver.errors import ConfigError, FailedPrecondition
from pserver.observe.progress import Bar
from pserver.wire.sharding import shard_ranges

log = logging.getLogger("pserver.checkpoint")
KEEP = 3                                   # newest checkpoints kept per shard
HASH_CHUNK = 64 << 20                      # bytes hashed between two progress updates
FORMAT = 2                                 # rows as entries; bases and deltas
STRIPE_BYTES = 4 << 20                     # bytes copied at a time from the live state
FULL_EVERY = 10                            # --full-every's default: a base every this many files
# A base as soon as a chain's deltas add up to this much of its base: a restore reads the base
# and its deltas and replays them, at most 1.33x the bytes, measured 1.5-1.6x a base's load on
# 1M rows x 16 (at a half, 1.9-2.0x, over the 1.6 bound: bench/checkpoint_incremental.py b).
CHAIN_LIMIT = 1 / 3
NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})(?:\.d(\d{12}))?\.ckpt$")   # group 4: a delta's base
TMP_NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})(?:\.d\d{12})?\.ckpt\.\d+\.tmp$")   # being written


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


def file_name(shard: int, num_shards: int, version: int, base: int | None = None) -> str:
    """A base's name, or (base given) the name of a delta in the chain that starts at base."""
    delta = "" if base is None else f".d{base:012d}"
    return f"shard{shard}-of{num_shards}-v{version:012d}{delta}.ckpt"


def base_of(path: str) -> int | None:
    """The version of the base a delta file's chain starts at; None for a base."""
    m = NAME.match(os.path.basename(path))
    return int(m.group(4)) if m and m.group(4) else None


def digest(arrays: dict, bar: Bar | None = None) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        # flat first (no copy): a memoryview will not cast a 2-D array with no rows, which an
        # empty table's rows are
        data = _bytes(arrays[name])
        for i in range(0, len(data), HASH_CHUNK):
            h.update(data[i:i + HASH_CHUNK])
            if bar is not None:
                bar.update(min(HASH_CHUNK, len(data) - i))
    return h.hexdigest()


def _bytes(a: np.ndarray) -> np.ndarray:
    """An array's bytes, flat (no copy when it is contiguous), for hashing and writing."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@dataclass
class Part:
    """One array of a checkpoint file, handed over in chunks (`chunks()` yields arrays of
    `dtype` whose elements add up to `shape`), so the file is written without the array
    ever being whole in memory."""
    name: str
    dtype: np.dtype
    shape: tuple
    chunks: Callable[[], Iterable[np.ndarray]]

    @classmethod
    def of(cls, name: str, a: np.ndarray) -> Part:
        a = np.asarray(a)
        return cls(name, a.dtype, a.shape, lambda: (a,))


def header(meta: dict) -> dict:
    """The JSON entry of a file from its checkpoint's fields (sha256 added when written)."""
    return {"format": FORMAT, "kind": "base", **meta}


def write(directory: str, name: str, parts: list[Part], meta: dict) -> str:
    """Write `parts` and `meta` (with the sha256 of the arrays) atomically as directory/name;
    returns the final path. An OSError (disk full, read-only or missing directory) leaves no
    temporary file behind."""
    final = os.path.join(directory, name)
    tmp = f"{final}.{os.getpid()}.tmp"
    h = hashlib.sha256()
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                for part in sorted(parts, key=lambda p: p.name):    # digest's order
                    h.update(part.name.encode())
                    with z.open(f"{part.name}.npy", "w", force_zip64=True) as out:
                        _write_header(out, part.dtype, part.shape)
                        written, want = 0, int(np.prod(part.shape, dtype=np.int64)) * part.dtype.itemsize
                        for chunk in part.chunks():
                            data = _bytes(np.asarray(chunk, part.dtype))
                            h.update(data)
                            out.write(data)
                            written += data.nbytes
                        if written != want:
                            raise RuntimeError(f"checkpoint {name}: {part.name} gave {written} bytes, "
                                               f"its shape {part.shape} needs {want}")
                meta = dict(meta, sha256=h.hexdigest())
                with z.open("meta.npy", "w") as out:
                    np.lib.format.write_array(out, np.frombuffer(json.dumps(meta).encode(), np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(directory)
    return final


def _write_header(out, dtype: np.dtype, shape: tuple) -> None:
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    try:
        np.lib.format.write_array_header_1_0(out, d)
    except ValueError:                        # a header over 64 KiB
        np.lib.format.write_array_header_2_0(out, d)


def entries_of(state: dict, columns: list[str]) -> np.ndarray:
    """A table's state() arrays as one entries array (the file's rows.<T>.entries)."""
    n = state["ids"].shape[0]
    parts = [np.asarray(state[c]) for c in columns]
    if any(p.dtype != np.float32 for p in parts):      # compact rows: the table's uint16 words
        from pserver.sparse.compact import pack
        data = pack(parts)
    else:
        data = np.concatenate(parts, axis=1)
    dtype = np.dtype([("id", "<u8"), ("last", "<i8")] + ([("steps", "<i8")] if "steps" in state else [])
                     + [("data", data.dtype.str, (data.shape[1],))])
    out = np.empty(n, dtype)
    out["id"], out["last"], out["data"] = state["ids"], state["last_update"], data
    if "steps" in state:
        out["steps"] = state["steps"]
    return out


def state_of(entries: np.ndarray, columns: list[str], small: dict, table: dict | None = None) -> dict:
    """entries_of's inverse: a table's state() arrays (contiguous copies), with `small` (pending
    ids and counts, counters) added. `table`: its config (TableConfig.to_dict()), which says how a
    table with compact rows lays its columns out in the words of `data`."""
    data = entries["data"]
    compact = None
    if data.dtype == np.uint16 and table is not None:   # compact rows: columns of their own types
        from pserver.sparse import TableConfig
        compact = TableConfig.from_dict(table).layout().unpack(data)
    width = data.shape[1] // len(columns) if columns else 0
    out = {"ids": np.ascontiguousarray(entries["id"]), "last_update": np.ascontiguousarray(entries["last"])}
    if "steps" in entries.dtype.names:
        out["steps"] = np.ascontiguousarray(entries["steps"])
    for k, c in enumerate(columns):
        out[c] = compact[k] if compact else np.ascontiguousarray(data[:, k * width:(k + 1) * width])
    out.update({k: v for k, v in small.items() if k != "evicted"})
    return out


def save(directory: str, ckpt: Checkpoint, run: str | None = None) -> str:
    """Write a whole Checkpoint held in memory (a reshard's output) as a base, of run `run`;
    returns the final path. Nothing else is removed: an offline tool never prunes."""
    parts = [Part.of("params", ckpt.params), *(Part.of(f"opt.{k}", v) for k, v in ckpt.state.items())]
    columns = []
    for i, t in enumerate(ckpt.tables):
        rows = ckpt.rows[t["name"]]
        columns.append(["rows"] + sorted(k for k in rows if k.startswith("slot_")))
        parts.append(Part.of(f"rows.{i}.entries", entries_of(rows, columns[-1])))
        parts += [Part.of(f"rows.{i}.{k}", rows[k]) for k in ("pending_ids", "pending_counts", "counters")]
    meta = header({"tables": ckpt.tables, "columns": columns, "version": ckpt.version, "shard": ckpt.shard,
                   "num_shards": ckpt.num_shards, "signature": ckpt.signature, "total": ckpt.total,
                   "start": ckpt.start, "end": ckpt.end, "optimizer": ckpt.optimizer,
                   "clocks": {str(r): int(c) for r, c in ckpt.clocks.items()},
                   "positions": {str(r): [int(v) for v in p] for r, p in ckpt.positions.items()},
                   "coordinator": ckpt.coordinator, **({"run": run} if run else {})})
    return write(directory, file_name(ckpt.shard, ckpt.num_shards, ckpt.version), parts, meta)


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
    """(version, path) of this shard's checkpoints, bases and deltas, newest first; temp files
    never match."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = NAME.match(name)
        if m and int(m.group(1)) == shard and int(m.group(2)) == num_shards:
            found.append((int(m.group(3)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def prune(directory: str, shard: int, num_shards: int, keep: int = KEEP, run: str | None = None) -> None:
    """Remove this shard's files but the `keep` newest versions and the files their chains
    need (a kept delta's base and the deltas between them). `run`: only that run's files
    (`owned`) are counted and removed; another run's are left as they are."""
    files = [(v, p) for v, p in candidates(directory, shard, num_shards) if run is None or owned(p, run)]
    needed = set()
    for version, path in files[:keep]:
        needed.add(path)
        base = base_of(path)
        if base is not None:
            needed.add(os.path.join(directory, file_name(shard, num_shards, base)))
            needed.update(p for v, p in files if base_of(p) == base and v < version)
    for _, path in files:
        if path not in needed:
            remove_quietly(path)


class Gone(ValueError):
    """A file listed a moment ago is not there any more (a running job pruned it): not a
    damaged file, one to skip."""


def _check_name(path: str, meta: dict) -> None:
    """A file's name and its meta name the same shard, shard count, version and (a delta) base;
    ValueError saying how they differ otherwise: a renamed file is never taken for the version
    its name says."""
    m = NAME.match(os.path.basename(path))
    if m is None:
        return
    named = {"shard": int(m.group(1)), "num_shards": int(m.group(2)), "version": int(m.group(3)),
             "kind": "delta" if m.group(4) else "base"}
    if m.group(4):
        named["base"] = int(m.group(4))
    wrong = [f"{k} {v} (its meta: {meta.get(k, 'base' if k == 'kind' else None)})" for k, v in named.items()
             if meta.get(k, "base" if k == "kind" else None) != v]     # files before deltas: no kind
    if wrong:
        raise ValueError(f"its name and its meta disagree: the name says {', '.join(wrong)}; "
                         "a renamed file is not loaded")


def read(path: str) -> tuple[dict, dict]:
    """One file's meta and arrays, checked against its checksum and its name; ValueError (with
    why) if it is not a whole checkpoint file of the shard and version its name says, Gone when
    it is not there any more. A large one shows its progress (pserver.observe.progress):
    reading, then checking, every byte."""
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
            _check_name(path, meta)
    except ValueError:
        raise
    except FileNotFoundError:
        raise Gone("gone (removed after it was listed)") from None
    except Exception as e:  # a truncated zip raises several types
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    return meta, arrays


def load(path: str) -> Checkpoint:
    """The whole state at one file's version: a base alone, a delta with its base and the
    deltas before it (each checked); ValueError naming the file and why when any does not
    load, or the chain is broken."""
    base = base_of(path)
    if base is None:
        meta, arrays = read(path)
        return _assemble(path, meta, arrays, [])
    m = NAME.match(os.path.basename(path))
    directory = os.path.dirname(path)
    shard, num_shards, version = int(m.group(1)), int(m.group(2)), int(m.group(3))
    first = os.path.join(directory, file_name(shard, num_shards, base))
    if not os.path.exists(first):
        raise ValueError(f"its base {os.path.basename(first)} is missing")
    try:
        meta, arrays = read(first)
    except ValueError as e:
        raise ValueError(f"its base {os.path.basename(first)}: {e}") from None
    chain = sorted((v, p) for v, p in candidates(directory, shard, num_shards)
                   if base_of(p) == base and v <= version)
    if not chain or chain[-1][1] != path:
        raise Gone("gone (removed after it was listed)")
    deltas, parent = [], base
    for v, p in chain:
        try:
            dmeta, darrays = read(p)
        except ValueError as e:
            if v == version:
                raise
            raise ValueError(f"the delta {os.path.basename(p)} before it: {e}") from None
        if dmeta.get("parent") != parent:
            raise ValueError(f"chain broken: {os.path.basename(p)} follows version {dmeta.get('parent')}, "
                             f"the file before it holds version {parent}")
        if dmeta.get("chain") != meta.get("chain"):
            # a file of another run's chain: the base was written again (a shard started
            # fresh or restored an older version into the same directory), its deltas not
            raise ValueError(f"chain broken: {os.path.basename(p)} extends another writing of "
                             f"{os.path.basename(first)}")
        deltas.append((dmeta, darrays))
        parent = v
    return _assemble(path, meta, arrays, deltas)


def _assemble(path: str, meta: dict, arrays: dict, deltas: list[tuple[dict, dict]]) -> Checkpoint:
    """A Checkpoint from a base's meta and arrays and the deltas after it, in order: dense
    arrays, clocks and small arrays from the newest; rows: the base's, each id's last event
    (an upsert, or an eviction) winning."""
    newest_meta, newest = (meta, arrays) if not deltas else deltas[-1]
    state = {k[4:]: v for k, v in newest.items() if k.startswith("opt.")}
    tables = newest_meta.get("tables", [])
    rows = {}
    for i, t in enumerate(tables):
        if f"rows.{i}.entries" not in arrays:      # a file from before deltas: arrays by name
            rows[t["name"]] = {k.split(".", 2)[2]: v for k, v in arrays.items() if k.startswith(f"rows.{i}.")}
            continue
        columns = newest_meta["columns"][i]
        small = {k: newest[f"rows.{i}.{k}"] for k in ("pending_ids", "pending_counts", "counters")}
        entries = _replay(arrays[f"rows.{i}.entries"],
                          [(d[f"rows.{i}.evicted"], d[f"rows.{i}.entries"]) for _, d in deltas])
        rows[t["name"]] = state_of(entries, columns, small, t)
    m = newest_meta
    return Checkpoint(path, m["version"], m["shard"], m["num_shards"], m["signature"], m["total"], m["start"],
                      m["end"], m["optimizer"], newest["params"], state,
                      {int(r): int(c) for r, c in newest_meta.get("clocks", {}).items()}, tables, rows,
                      {int(r): tuple(int(v) for v in p) for r, p in newest_meta.get("positions", {}).items()},
                      newest_meta.get("coordinator"))


def _replay(base: np.ndarray, deltas: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """A base's entries after deltas of (evicted ids, upserted entries), in order; within one
    delta evictions come first (an id evicted, then created again, is in both). Sorts, no
    hashing: the events' ids once and the base's ids once (NumPy's default sorts, which are
    vectorised, unlike the stable ones np.unique and np.isin take: 9x faster on 2 deltas of
    240k rows onto 1M). The base's rows that an upsert ends in are overwritten in place (its
    array is the one just read); a copy is made only when rows go or come."""
    if not deltas:
        return base
    ids = np.concatenate([a for ev, up in deltas for a in (ev.astype(np.uint64), up["id"])])
    if not ids.size:
        return base
    upsert = np.concatenate([np.full(n, flag) for ev, up in deltas
                             for n, flag in ((ev.shape[0], False), (up.shape[0], True))])
    # Entries moved as raw records (a void view): NumPy copies those 4-7x faster than the
    # structured records field by field.
    raw = np.dtype(f"V{base.dtype.itemsize}")
    ups = np.concatenate([np.ascontiguousarray(up.astype(base.dtype, copy=False)).view(raw)
                          for _, up in deltas])
    at = np.cumsum(upsert) - 1                       # each upsert's place in ups
    # The last event of each id: the highest event index among the equal ids of a sort.
    order = np.argsort(ids)
    ordered = ids[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    touched, last = ordered[starts], np.maximum.reduceat(order, starts)
    # Where each touched id is in the base, if it is.
    base_ids = np.ascontiguousarray(base["id"])
    if base_ids.size:
        border = np.argsort(base_ids)
        pos = border[np.minimum(np.searchsorted(base_ids[border], touched), base_ids.shape[0] - 1)]
        found = base_ids[pos] == touched
    else:
        pos, found = np.zeros(touched.shape, np.int64), np.zeros(touched.shape, bool)
    up_last = upsert[last]
    out = (base if base.flags.c_contiguous and base.flags.writeable else np.array(base)).view(raw)
    hit = found & up_last                            # in the base, last an upsert: in place
    out[pos[hit]] = ups[at[last[hit]]]
    gone = pos[found & ~up_last]                     # in the base, last an eviction
    if gone.size:
        keep = np.ones(out.shape[0], bool)
        keep[gone] = False
        out = out[keep]
    new = last[~found & up_last]                     # not in the base, last an upsert
    if new.size:
        out = np.concatenate([out, ups[at[new]]])
    return out.view(base.dtype)


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


CUT_MODES = ("sync", "backup")      # modes whose shards take every step together: a set is a cut


def scan(directory: str) -> dict[int, dict[int, list[tuple[int, str]]]]:
    """{S: {J: [(version, path), newest first]}} of the checkpoint files in directory."""
    found: dict[int, dict[int, list[tuple[int, str]]]] = {}
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in names:
        if m := NAME.match(name):
            j, s, v = int(m.group(1)), int(m.group(2)), int(m.group(3))
            found.setdefault(s, {}).setdefault(j, []).append((v, os.path.join(directory, name)))
    for shards in found.values():
        for files in shards.values():
            files.sort(reverse=True)
    return found


def cut_versions(shards: dict[int, list[tuple[int, str]]], num_shards: int) -> list[int]:
    """The versions every shard 0..num_shards-1 has a file of, newest first."""
    common = None
    for j in range(num_shards):
        versions = {v for v, _ in shards.get(j, [])}
        common = versions if common is None else common & versions
    return sorted(common or (), reverse=True)


def check_compatible(ckpts: list[Checkpoint], directory: str) -> None:
    """One run's files: the same layout, parameter count, optimizer and tables, shards 0..S-1
    with the ranges S shards have. ConfigError naming the first difference."""
    first = ckpts[0]
    for c in ckpts[1:]:
        for what, a, b in (("layout signature", first.signature, c.signature),
                           ("parameter count", first.total, c.total),
                           ("optimizer", first.optimizer, c.optimizer),
                           ("sparse tables", first.tables, c.tables)):
            if a != b:
                raise ConfigError(f"--restore: {os.path.basename(first.path)} and {os.path.basename(c.path)} "
                                  f"in {directory} differ in {what} ({a} against {b}): they are files of "
                                  f"two runs and cannot be combined")
    ranges = shard_ranges(first.total, len(ckpts))
    for j, c in enumerate(ckpts):
        if (c.shard, c.num_shards, c.start, c.end) != (j, len(ckpts), *ranges[j]):
            raise ConfigError(f"--restore: {c.path} says it is shard {c.shard} of {c.num_shards} with range "
                              f"[{c.start}, {c.end}); its name and the layout say shard {j} of {len(ckpts)}, "
                              f"[{ranges[j][0]}, {ranges[j][1]})")


def describe_versions(shards: dict[int, list[tuple[int, str]]], num_shards: int) -> str:
    return "; ".join(f"shard {j}: " + (", ".join(str(v) for v, _ in shards[j]) if shards.get(j) else "none")
                     for j in range(num_shards))


def why_none(directory: str, found: dict, mode: str, failures: list[str], flag: str = "--restore") -> str:
    """Why no shape of `found` (scan's, one shape or more) has a usable state, naming each
    shape's versions and each file that did not load."""
    (only,) = found if len(found) == 1 else (None,)
    shards = f"its {only} shards" if only else "one number of shards"
    what = (f"no version that every one of {shards} has a checkpoint of that loads, which mode {mode} "
            "needs (a consistent cut)" if mode in CUT_MODES
            else f"no checkpoint that loads of every one of {shards}")
    versions = describe_versions(found[only], only) if only else \
        "; ".join(f"{s} shards: {describe_versions(found[s], s)}" for s in sorted(found))
    return (f"{flag}: {directory} has {what}; versions found: {versions}"
            + (f"; {'; '.join(failures)}" if failures else ""))


@dataclass
class Usable:
    """A state a directory can be restored to: one loaded file per shard of one shape."""
    num_shards: int
    version: int                  # the state's: the cut's in sync and backup, the shards' newest otherwise
    ckpts: list[Checkpoint]       # shard j's file; those not kept (`keep`) without their arrays


@dataclass
class Choice:
    """What `newest_usable` found: the state to restore (None: no shape has one) and
    "file: why" for each file it skipped."""
    best: Usable | None
    failures: list[str]


def newest_usable(directory: str, mode: str, prefer: int = 0, shapes: Iterable[int] | None = None,
                  keep: Callable[[int, int], bool] | None = None, loader: Callable[[str], Checkpoint] = None,
                  found: dict | None = None) -> Choice:
    """The one rule that says which state of a checkpoint directory restore (at a shard's start),
    reshard, inspect, export and evaluate read: of every shape (number of shards) the directory
    holds files of (a directory a job was restored onto another number of shards in holds two),
    the newest usable state, and of those the newest; `prefer` (a restoring job's own number of
    shards), then the larger number, wins a tie.

    A shape's usable state is, in sync and backup, the newest version for which every shard has a
    file that loads (a consistent cut: the shards took every step together), in async and ssp
    each shard's newest file that loads (the state's version is the largest of theirs). A newer
    file that belongs to no such state (a shard died before its other shards' files of that
    version, or a file does not load) is skipped. Files are loaded newest first, a shape at a
    time, until no other shape could hold a newer state; `keep(num_shards, shard)` false: only
    the file's header is kept (memory). `shapes`: consider these alone. `loader`: how a file is
    loaded (inspect's, which has loaded them all already). ConfigError when a set's files are
    of two runs."""
    warn, loader = loader is None, loader or load      # another loader has said why already
    found = scan(directory) if found is None else found
    cut = mode in CUT_MODES
    failures: list[str] = []

    def held(s: int, j: int, ckpt: Checkpoint) -> Checkpoint:
        if keep is None or keep(s, j):
            return ckpt
        return Checkpoint(ckpt.path, ckpt.version, ckpt.shard, ckpt.num_shards, ckpt.signature, ckpt.total,
                          ckpt.start, ckpt.end, ckpt.optimizer, np.empty(0, np.float32), {}, ckpt.clocks,
                          ckpt.tables, {}, ckpt.positions, ckpt.coordinator)

    def attempt(path: str) -> Checkpoint | None:
        try:
            return loader(path)
        except ValueError as e:
            if warn and not isinstance(e, Gone):
                log.warning("skipping checkpoint %s: %s", path, e)
            failures.append(f"{os.path.basename(path)}: {e}")
            return None

    def bound(s: int) -> int:
        """No usable state of shape s is newer than this (-1: it has none)."""
        shards = found[s]
        if any(not shards.get(j) for j in range(s)):
            return -1
        if cut:
            return max(cut_versions(shards, s), default=-1)
        return max(v for j in range(s) for v, _ in shards[j])

    def usable(s: int) -> Usable | None:
        shards = found[s]
        if cut:
            for v in cut_versions(shards, s):
                ckpts = []
                for j in range(s):
                    c = attempt(dict(shards[j])[v])
                    if c is None:
                        break
                    ckpts.append(held(s, j, c))
                else:
                    check_compatible(ckpts, directory)
                    return Usable(s, v, ckpts)
            return None
        ckpts = []
        for j in range(s):
            c = next(filter(None, map(attempt, (p for _, p in shards[j]))), None)
            if c is None:
                return None
            ckpts.append(held(s, j, c))
        check_compatible(ckpts, directory)
        return Usable(s, max(c.version for c in ckpts), ckpts)

    def rank(s: int, version: int) -> tuple:
        return version, s == prefer, s

    order = sorted((s for s in found if shapes is None or s in shapes), key=lambda s: rank(s, bound(s)),
                   reverse=True)
    best = None
    for s in order:
        if bound(s) < 0 or (best is not None and rank(best.num_shards, best.version) >= rank(s, bound(s))):
            break
        state = usable(s)
        if state is not None and (best is None or
                                  rank(s, state.version) > rank(best.num_shards, best.version)):
            best = state
    return Choice(best, failures)


def load_weights(directory: str, layout, mode: str = "sync") -> tuple[np.ndarray, list[int]]:
    """The whole flat vector of `layout` from the state of directory that a restore reads
    (`newest_usable`: in sync, the newest consistent cut), by `pserver evaluate --checkpoint`,
    and each shard's version; ConfigError naming --checkpoint when there is none or a file is
    of another model."""
    if not os.path.isdir(directory):
        raise ConfigError(f"--checkpoint: {directory} is not a directory")
    found = scan(directory)
    if not found:
        raise ConfigError(f"--checkpoint: {directory} holds no checkpoint "
                          "(shard{J}-of{S}-v{VERSION}.ckpt files)")
    choice = newest_usable(directory, mode, found=found)
    if choice.best is None:
        raise ConfigError(why_none(directory, found, mode, choice.failures, "--checkpoint"))
    flat, versions = np.empty(layout.total, dtype=np.float32), []
    for ckpt in choice.best.ckpts:
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


RUN_FILE = "RUN"                           # the run a checkpoint directory belongs to


def run_of(directory: str) -> str | None:
    """The id of the run that directory belongs to (its RUN file); None when it has none."""
    try:
        with open(os.path.join(directory, RUN_FILE)) as f:
            return str(json.load(f)["run"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"<unreadable RUN file: {e}>"       # no run's id: never equal to one


def owned(path: str, run: str) -> bool:
    """Whether a checkpoint file is run `run`'s: its meta names that run, or none (a file
    written before run ids, adopted by the run that restored its directory). A file whose
    meta does not read holds nothing that loads: the directory's run's to replace or prune,
    as before run ids."""
    try:
        return meta_of(path).get("run", run) == run
    except Exception:  # a truncated zip raises several types
        return True


def claim(directory: str, seen: str | None, new: str | None = None) -> str:
    """The run id under which files are written into directory, taken with the first of them:
    the directory's RUN when it has one (the one seen at start, or one that another shard of
    this run wrote since), else `new` (a fresh id by default) written as RUN atomically: a
    temporary file, fsynced, linked to RUN (which fails when another shard of the run got
    there first: its id is taken), then the directory fsynced. OSError when RUN is not the
    one seen at start: another run took the directory."""
    current = run_of(directory)
    if current is None:
        new = new or uuid.uuid4().hex
        final = os.path.join(directory, RUN_FILE)
        tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"    # shards of one process: one each
        try:
            with open(tmp, "w") as f:
                json.dump({"run": new, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "pid": os.getpid()}, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)           # never replaces a RUN written meanwhile
            except FileExistsError:
                current = run_of(directory)
            else:
                fsync_dir(directory)
                return new
        finally:
            remove_quietly(tmp)
    if seen is not None and current != seen:
        raise OSError(errno.EEXIST, f"{directory} was taken by another run meanwhile (its RUN file says "
                                    f"{current}; this run's is {seen}): nothing of it is written over")
    return current


def holdings(directory: str) -> str:
    """What checkpoints directory holds, in words ('' for none): the run, files, shapes, versions."""
    if not os.path.isdir(directory):
        return ""
    found = [m for m in map(NAME.match, os.listdir(directory)) if m]
    if not found:
        return ""
    shapes = sorted({int(m.group(2)) for m in found})
    versions = sorted(int(m.group(3)) for m in found)
    run = run_of(directory)
    return (f"{len(found)} file(s) of {' and '.join(map(str, shapes))} shard(s) at versions "
            f"{versions[0]}-{versions[-1]}, " + (f"run {run}" if run else "written before run ids"))


def check_start(checkpoint_dir: str | None, restore: str | None) -> str | None:
    """What is checked before anything starts (launch and run before their first process, a
    shard before it restores), refused in one line (ConfigError):
    - --restore of a directory that does not exist, unless checkpoints go there (the restart
      idiom, `--checkpoint-dir D --restore D`, or --restore alone): then a first start,
      which the note returned says;
    - a directory to write checkpoints to that holds checkpoints and is not the one restored:
      another run's, which this run would prune and write over.
    Returns that note, else None."""
    where = checkpoint_dir or restore
    same = bool(restore and where) and os.path.abspath(restore) == os.path.abspath(where)
    note = None
    if restore:
        if not os.path.exists(restore):
            if not same:
                raise ConfigError(f"--restore: {restore} does not exist, so there is nothing to restore: "
                                  f"check the path (a restart that may be the first gives "
                                  f"--checkpoint-dir and --restore the same directory)")
            note = f"--restore {restore}: nothing there yet, a first start (its checkpoints go there)"
        elif not os.path.isdir(restore):
            raise ConfigError(f"--restore: {restore} is not a directory")
    if where and not same:
        held = holdings(where)
        if held:
            raise ConfigError(f"--checkpoint-dir: {where} holds another run's checkpoints ({held}) and this "
                              f"run does not restore it: restore it (--checkpoint-dir {where} --restore "
                              f"{where}), or choose another --checkpoint-dir")
    return note


def check_layout(directory: str, layout) -> None:
    """--restore of another model's checkpoints is refused before anything starts: every file
    of directory that reads is of `layout` (its signature and parameter count); one that
    does not read is restore's to report."""
    if not os.path.isdir(directory):
        return
    for name in sorted(filter(NAME.match, os.listdir(directory))):
        try:
            meta = meta_of(os.path.join(directory, name))
        except Exception:  # a truncated zip raises several types
            continue
        if (meta.get("signature"), meta.get("total")) != (layout.signature(), layout.total):
            raise ConfigError(f"--restore: {os.path.join(directory, name)} is of another model (layout "
                              f"{meta.get('signature')}, {meta.get('total') or 0:,} parameters; this model's "
                              f"is {layout.signature()}, {layout.total:,}): check --model, or restore "
                              f"another directory")


class Checkpointer:
    """When and where one shard writes checkpoints: at versions K, 2K, 3K... (every K steps),
    every S seconds, and on request; a base or a delta (`_kind`). At most one write is in flight
    (a bound on what a client can make it hold): it holds the one dump of the store
    (ShardStore.begin_dump), begun under the store's lock and read a stripe at a time, so pushes
    wait only for the stripe being copied, and copy aside only what they are about to change.
    A request that arrives meanwhile joins that write, or the write after it when the one
    in flight is older than the version the request saw. A failed write is logged in one
    line and counted, leaves no temporary file, and training goes on: the next interval
    tries again.

    Dumps are begun and written on one thread of their own, for the process's life: pserver
    keeps freed heap memory where the thread that freed it will find it again
    (pserver/launch/allocator.py), so one writer thread reuses its stripes' memory write after
    write, where writes by whichever RPC thread asked would each leave theirs behind."""

    def __init__(self, directory: str, flag: str, store, cfg) -> None:
        prepare(directory, flag, cfg.shard, cfg.num_shards)
        self.directory, self.store, self.cfg = directory, store, cfg
        self.seen = run_of(directory)             # the run this directory was adopted from, if any
        self.run_id: str | None = None            # taken with the first file written (claim)
        store.track = cfg.full_every > 1          # tables record evicted ids for the deltas
        for table in store.tables.values():
            table.track = store.track
        # The chain being extended: [base version, base bytes, deltas' bytes, files]; None:
        # the next file is a base (at start, and after a failed write, whose delta is lost).
        self.chain: list[int] | None = None
        self.written: tuple[int, str] | None = None   # (version, path) of the last file written
        self.leases_written: dict | None = None   # and the data coordinator's state in it
        self.chain_id = ""                        # the chain's id: its base's and deltas' meta["chain"]
        self.aside_peak = 0                       # bytes kept aside by the last write (copy-on-write)
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

    def _kind(self) -> tuple[int, int] | None:
        """(base, parent) for a delta, or None for a base: --full-every files per chain, and a
        new base as soon as the chain's deltas add up to CHAIN_LIMIT (a third) of its base."""
        c = self.chain
        if c is None or self.written is None or c[3] >= self.cfg.full_every \
                or c[2] >= CHAIN_LIMIT * c[1]:
            return None
        return c[0], self.written[0]

    def _snapshot_and_write(self, taken: threading.Event) -> tuple[int, str | OSError]:
        try:
            with self.store.cond:
                self.store.require_configured()
                version = self.store.version
                leases = self.store.coordinator.state()
            again = self.written is not None and self.written[0] == version
            if again and leases == self.leases_written:
                taken.set()                   # nothing changed since: that file is this version
                self._end(*self.written)
                return self.written
            # The same version with the data coordinator moved on (its last chunks done, its run
            # finished, after the step's write): a base again, so that restarts see where it is.
            kind = None if again else self._kind()
            dump = self.store.begin_dump(kind is not None)
            kind = kind if dump.delta else None     # a table evicted too many ids for a delta
        except BaseException:
            self._end(-1, "")
            raise
        finally:
            taken.set()
        version, result = dump.meta["version"], ""
        chain_id = uuid.uuid4().hex if kind is None else self.chain_id
        try:
            if self.run_id is None:
                self.run_id = claim(self.directory, self.seen)
            result = self._write(dump, kind, chain_id)
            self.chain_id = chain_id
            # A file of the same version under the other name (a base where a delta was, or a
            # delta of another chain), left by a restore of an older version. Gone, so that
            # this version is this file, and the old chain's later deltas break.
            for v, other in candidates(self.directory, self.cfg.shard, self.cfg.num_shards):
                if v == version and other != result and owned(other, self.run_id):
                    remove_quietly(other)
            size = os.path.getsize(result)
            self.chain = [version, size, 0, 1] if kind is None else \
                [self.chain[0], self.chain[1], self.chain[2] + size, self.chain[3] + 1]
            self.written, self.leases_written = (version, result), dump.meta["coordinator"]
            prune(self.directory, self.cfg.shard, self.cfg.num_shards, run=self.run_id)
            self.store.counters.add("checkpoints_written")
            log.info("shard %d: checkpoint at version %d written to %s (%s)", self.cfg.shard, version, result,
                     "a base" if kind is None else f"a delta after version {kind[1]}")
        except OSError as e:
            result, self.chain = e, None
            self.store.counters.add("checkpoints_failed")
            log.error("shard %d: checkpoint at version %d not written to %s: %s; training goes on, "
                      "the next interval tries again", self.cfg.shard, version, self.directory, e)
        finally:
            self.store.end_dump()
            self.aside_peak = dump.aside_bytes + sum(t.dump_peak for t in self.store.tables.values())
            self._end(version, result)
        return version, result

    def _write(self, dump, kind: tuple[int, int] | None, chain_id: str) -> str:
        """One file from a store's dump (ShardStore.begin_dump), a stripe at a time; chain_id
        names the writing of the chain's base (its deltas carry it: load checks)."""
        parts = [Part(name, a.dtype, a.shape, lambda name=name: dump.stripes(name, STRIPE_BYTES))
                 for name, a in dump.dense.items()]
        for i, (config, columns, dtype, count, small) in enumerate(dump.tables):
            parts.append(Part(f"rows.{i}.entries", dtype, (count,),
                              lambda i=i: dump.rows(i, STRIPE_BYTES)))
            parts += [Part.of(f"rows.{i}.{k}", v) for k, v in small.items()]
        meta = header(dict(dump.meta, shard=self.cfg.shard, num_shards=self.cfg.num_shards,
                           optimizer=self.cfg.optimizer, tables=[t[0] for t in dump.tables],
                           columns=[t[1] for t in dump.tables], chain=chain_id, run=self.run_id))
        if kind is not None:
            meta.update(kind="delta", base=kind[0], parent=kind[1])
        name = file_name(self.cfg.shard, self.cfg.num_shards, dump.meta["version"],
                         None if kind is None else kind[0])
        if os.path.exists(os.path.join(self.directory, name)) and \
                not owned(os.path.join(self.directory, name), self.run_id):
            raise OSError(errno.EEXIST, f"{name} is another run's file: not written over")
        return write(self.directory, name, parts, meta)

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
