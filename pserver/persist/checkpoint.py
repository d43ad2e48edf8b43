"""The checkpoint files of one shard: its slice, optimizer state, version, the ssp workers'
clocks, the layout and its sparse tables' rows, as a full base or as a delta of what changed
since the file before it (docs/semantics.md, "Checkpoints"). When a shard writes one is
pserver.server.checkpoint's (Checkpointer); which files of a directory make a state, across
shards and shapes, is pserver.persist.checkpoint_dir's.

Written atomically (pserver.persist.atomic), so a crash at any moment leaves either the
previous checkpoint or the new one, never a half-written file under a final name; a write that
fails removes its temporary file, and those a killed shard left are removed when it starts
again (`prepare`). Loading verifies each file's checksum and that its name says what its meta
does (shard, shard count, version, base or delta: a renamed file never stands for another
version); `newest` skips (with a warning) any version that does not load, falling back to the
next older one; when none of a shard's files loads, restoring refuses rather than start fresh
unasked (`load_latest`).

    shard{J}-of{S}-v{VERSION:012d}.ckpt               a base: the whole state at VERSION
    shard{J}-of{S}-v{VERSION:012d}.d{BASE:012d}.ckpt  a delta: the rows changed since the file
                                                      before it in the chain that starts at BASE

Each file is an .npz (a zip of .npy arrays) written array by array, a stripe at a time, from
the live state (ShardStore.begin_dump): never a second copy of the state in memory. Arrays:
params and opt.<name> (the dense slice and its optimizer state, whole in a delta too: a dense
optimizer step changes every element), and per sparse table T (meta["tables"][T]):
rows.<T>.entries (one record per row: id, last update, [steps], data = the row and its
optimizer slots side by side, meta["columns"][T] naming them), rows.<T>.pending_ids,
rows.<T>.pending_counts, rows.<T>.counters, and in a delta rows.<T>.evicted (the ids removed
since the file before: "removed" in the code, as in a model file's delta). meta (JSON) holds the
rest and the sha256 of the arrays. Files written before deltas existed (rows.<T>.<name> arrays,
no "format") load as bases.

In memory a Checkpoint's tables are TableConfigs and its rows a RowState per table
(pserver.sparse): converted here, at the file's edge, from what any version wrote (`tables_of`).

A chain is a base and the deltas after it, each naming its parent (the version of the file
before it) and its base's writing (meta["chain"], an id: a base written again under the same
name, by a run started fresh or from an older version, is another chain); loading a delta
loads its base and every delta up to it, checking each, so that a delta loads as the whole
state at its version (`load`), and nothing else (restore, reshard, inspect, export, evaluate)
needs to know about deltas. A broken or missing file ends its chain there: the versions after
it do not load, and restoring falls back to the newest that does, saying which version it
reached. Pruning keeps the KEEP newest versions and every file they need. Every file records
the run that wrote it in its meta ("run"; pserver.persist.checkpoint_dir's RUN file): no process
prunes or overwrites a file of another run (`owned`), and an offline tool never prunes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from pserver.errors import ConfigError
from pserver.observe.progress import Bar
from pserver.persist.atomic import remove_quietly, replace, sweep, synced
from pserver.sparse import RowState, TableConfig

log = logging.getLogger("pserver.checkpoint")
KEEP = 3                                   # newest checkpoints kept per shard
HASH_CHUNK = 64 << 20                      # bytes hashed between two progress updates
FORMAT = 2                                 # rows as entries; bases and deltas
NAME = re.compile(r"^shard(\d+)-of(\d+)-v(\d{12})(?:\.d(\d{12}))?\.ckpt$")   # group 4: a delta's base


@dataclass(kw_only=True)
class Checkpoint:
    """One shard's whole state at one version, as a file (or a chain) holds it; built by keyword."""
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
    tables: list[TableConfig] = field(default_factory=list)   # the sparse tables, in the layout's order
    rows: dict[str, RowState] = field(default_factory=dict)   # table name -> its rows on this shard
    positions: dict = field(default_factory=dict)  # rank -> (data_seed, steps_per_epoch) of its clock
    coordinator: dict | None = None   # shard 0's data coordinator (pserver.server.coordinator.state())
    lr_set: float | None = None       # the chief's learning rate, when it changed --lr (Shard.set_lr)
    run: str | None = None            # the id of the run that wrote it (older files have none)


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
    os.makedirs(directory, exist_ok=True)
    replace(final, lambda tmp: _write_zip(tmp, name, parts, meta))
    return final


def _write_zip(tmp: str, name: str, parts: list[Part], meta: dict) -> None:
    h = hashlib.sha256()
    with synced(tmp) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
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


def _write_header(out, dtype: np.dtype, shape: tuple) -> None:
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    try:
        np.lib.format.write_array_header_1_0(out, d)
    except ValueError:                        # a header over 64 KiB
        np.lib.format.write_array_header_2_0(out, d)


def entries_of(state: RowState, columns: list[str]) -> np.ndarray:
    """A table's rows as one entries array (the file's rows.<T>.entries)."""
    n, arrays = state.size, state.arrays()
    parts = [np.asarray(arrays[c]) for c in columns]
    if any(p.dtype != np.float32 for p in parts):      # compact rows: the table's uint16 words
        from pserver.sparse.compact import pack
        data = pack(parts)
    else:
        data = np.concatenate(parts, axis=1)
    steps = state.steps is not None
    dtype = np.dtype([("id", "<u8"), ("last", "<i8")] + ([("steps", "<i8")] if steps else [])
                     + [("data", data.dtype.str, (data.shape[1],))])
    out = np.empty(n, dtype)
    out["id"], out["last"], out["data"] = state.ids, state.last_update, data
    if steps:
        out["steps"] = state.steps
    return out


SMALL = ("pending_ids", "pending_counts", "counters")   # a table's arrays beside its entries
REMOVED = "evicted"   # rows.<T>.evicted: the name on disk of a delta's removed ids (written so since deltas)


def small_parts(i: int, small: dict[str, np.ndarray]) -> list[Part]:
    """Table i's arrays beside its entries (SMALL, and a delta's "removed" ids), named as on disk."""
    return [Part.of(f"rows.{i}.{REMOVED if k == 'removed' else k}", v) for k, v in small.items()]


def state_of(entries: np.ndarray, columns: list[str], small: dict,
             table: TableConfig | None = None) -> RowState:
    """entries_of's inverse: a table's rows (contiguous copies), with `small` (pending ids and
    counts, counters; SMALL) added. `table`: its config, which says how a table with compact
    rows lays its columns out in the words of `data`."""
    data = entries["data"]
    compact = None
    if data.dtype == np.uint16 and table is not None:   # compact rows: columns of their own types
        compact = table.layout().unpack(data)
    width = data.shape[1] // len(columns) if columns else 0
    out = {"ids": np.ascontiguousarray(entries["id"]), "last_update": np.ascontiguousarray(entries["last"])}
    if "steps" in entries.dtype.names:
        out["steps"] = np.ascontiguousarray(entries["steps"])
    for k, c in enumerate(columns):
        out[c] = compact[k] if compact else np.ascontiguousarray(data[:, k * width:(k + 1) * width])
    out.update({k: small[k] for k in SMALL})
    return RowState.of(out)


def save(directory: str, ckpt: Checkpoint, run: str | None = None) -> str:
    """Write a whole Checkpoint held in memory (a reshard's output) as a base, of run `run`;
    returns the final path. Nothing else is removed: an offline tool never prunes."""
    parts = [Part.of("params", ckpt.params), *(Part.of(f"opt.{k}", v) for k, v in ckpt.state.items())]
    columns = []
    for i, t in enumerate(ckpt.tables):
        rows = ckpt.rows[t.name]
        columns.append(["rows"] + sorted(rows.slots))
        parts.append(Part.of(f"rows.{i}.entries", entries_of(rows, columns[-1])))
        parts += small_parts(i, {k: getattr(rows, k) for k in SMALL})
    meta = header({"tables": [t.to_dict() for t in ckpt.tables], "columns": columns, "version": ckpt.version,
                   "shard": ckpt.shard, "num_shards": ckpt.num_shards, "signature": ckpt.signature,
                   "total": ckpt.total, "start": ckpt.start, "end": ckpt.end, "optimizer": ckpt.optimizer,
                   "clocks": {str(r): int(c) for r, c in ckpt.clocks.items()},
                   "positions": {str(r): [int(v) for v in p] for r, p in ckpt.positions.items()},
                   "coordinator": ckpt.coordinator, **({"run": run} if run else {}),
                   **({} if ckpt.lr_set is None else {"lr_set": ckpt.lr_set})})
    return write(directory, file_name(ckpt.shard, ckpt.num_shards, ckpt.version), parts, meta)

def candidates(directory: str, shard: int, num_shards: int) -> list[tuple[int, str]]:
    """(version, path) of this shard's checkpoints, bases and deltas, newest first; temp files
    never match."""
    return scan(directory).get(num_shards, {}).get(shard, [])


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


def _gone_or(path: str, why: str) -> ValueError:
    """What a delta whose chain did not read raises: Gone when the delta itself is not there
    any more (a running job pruned it, and the files its chain needs, since it was listed),
    else ValueError(why), a broken chain."""
    return ValueError(why) if os.path.exists(path) else Gone("gone (removed after it was listed)")


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
        raise _gone_or(path, f"its base {os.path.basename(first)} is missing")
    try:
        meta, arrays = read(first)
    except ValueError as e:
        raise _gone_or(path, f"its base {os.path.basename(first)}: {e}") from None
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
            raise _gone_or(path, f"the delta {os.path.basename(p)} before it: {e}") from None
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
    (an upsert, or a removal) winning."""
    newest_meta, newest = (meta, arrays) if not deltas else deltas[-1]
    state = {k[4:]: v for k, v in newest.items() if k.startswith("opt.")}
    tables = tables_of(newest_meta)
    rows = {}
    for i, t in enumerate(tables):
        if f"rows.{i}.entries" not in arrays:      # a file from before deltas: arrays by name
            rows[t.name] = _by_name(arrays, f"rows.{i}.")
            continue
        columns = newest_meta["columns"][i]
        small = {k: newest[f"rows.{i}.{k}"] for k in SMALL}
        entries = _replay(arrays[f"rows.{i}.entries"],
                          [(d[f"rows.{i}.{REMOVED}"], d[f"rows.{i}.entries"]) for _, d in deltas])
        rows[t.name] = state_of(entries, columns, small, t)
    m = newest_meta
    return Checkpoint(path=path, version=m["version"], shard=m["shard"], num_shards=m["num_shards"],
                      signature=m["signature"], total=m["total"], start=m["start"], end=m["end"],
                      optimizer=m["optimizer"], params=newest["params"], state=state,
                      clocks={int(r): int(c) for r, c in m.get("clocks", {}).items()},
                      tables=tables, rows=rows,
                      positions={int(r): tuple(int(v) for v in p) for r, p in m.get("positions", {}).items()},
                      coordinator=m.get("coordinator"), lr_set=m.get("lr_set"), run=m.get("run"))


def tables_of(meta: dict) -> list[TableConfig]:
    """The sparse tables a file's meta records, as the TableConfig of this version: a field it
    no longer knows is left out, one added since takes its default (TableConfig.from_dict,
    stored). ValueError when a table's record makes no config (the file does not load)."""
    try:
        return [TableConfig.from_dict(t, stored=True) for t in meta.get("tables", [])]
    except (ConfigError, TypeError, AttributeError) as e:
        raise ValueError(f"its sparse tables' meta makes no table config ({e})") from None


def _by_name(arrays: dict, prefix: str) -> RowState:
    """A table's rows in a file written before deltas: an array per name (rows.<T>.<name>)."""
    try:
        return RowState.of({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
    except KeyError as e:
        raise ValueError(f"its table {prefix[:-1]} has {e}") from None


def _replay(base: np.ndarray, deltas: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """A base's entries after deltas of (removed ids, upserted entries), in order; within one
    delta removals come first (an id removed, then created again, is in both). Sorts, no
    hashing: the events' ids once and the base's ids once (NumPy's default sorts, which are
    vectorised, unlike the stable ones np.unique and np.isin take: 9x faster on 2 deltas of
    240k rows onto 1M). The base's rows that an upsert ends in are overwritten in place (its
    array is the one just read); a copy is made only when rows go or come."""
    if not deltas:
        return base
    ids = np.concatenate([a for removed, up in deltas for a in (removed.astype(np.uint64), up["id"])])
    if not ids.size:
        return base
    upsert = np.concatenate([np.full(n, flag) for removed, up in deltas
                             for n, flag in ((removed.shape[0], False), (up.shape[0], True))])
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
    gone = pos[found & ~up_last]                     # in the base, last a removal
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
    # Files of other shards, of this cluster or of another shape, are pserver.persist.reshard's.
    return None

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


def prepare(directory: str, flag: str, shard: int | None, num_shards: int) -> None:
    """Before a writer of directory starts (a shard, or a reshard writing every shard: shard
    None): the directory is writable, and the temporary files that a killed writer of these
    files left behind are removed."""
    check_directory(directory, flag)

    def ours(final: str) -> bool:
        m = NAME.match(final)
        return bool(m) and int(m.group(2)) == num_shards and shard in (None, int(m.group(1)))

    orphans = sweep(directory, ours)
    if orphans:
        log.info("%sremoved %d temporary file(s) an interrupted checkpoint write left in %s",
                 "" if shard is None else f"shard {shard}: ", len(orphans), directory)


def owned(path: str, run: str) -> bool:
    """Whether a checkpoint file is run `run`'s: its meta names that run, or none (a file
    written before run ids, adopted by the run that restored its directory). A file whose
    meta does not read holds nothing that loads: the directory's run's to replace or prune,
    as before run ids."""
    try:
        return meta_of(path).get("run", run) == run
    except Exception:  # a truncated zip raises several types
        return True

