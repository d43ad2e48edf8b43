"""Checkpoints read by a cluster of another number of shards, and the version a restore starts
from (docs/semantics.md, "Restore onto another number of shards").

A directory may hold the files of several cluster shapes (`shard{J}-of{S}-v{V}.ckpt`). A shard
J' of S' restoring from it picks a set of files (`restore_point`):

- its own shape's files when there are any: the newest version that every shard of the set has
  (a consistent cut) in sync and backup, its own newest otherwise;
- else another shape's files, combined (`combine`): the dense range [start', end') of shard J'
  gathered from the old ranges, with the optimizer state of those elements; every table's rows
  (and pending admissions) whose id hashes to J' with their optimizer slots, last updates and
  lazy-Adam step counts; the tables' counters summed onto shard 0, so the cluster's totals stay
  what they were; each worker's clock the smallest any old shard recorded, so no data is skipped.

Versions: in sync and backup every old shard's file must be of one version (the newest that
every old shard has and that loads); in async and ssp each old shard's newest, and the new
shard's version is the largest of them (it also sets Adam's step count and the schedule's step).

`pserver checkpoint reshard` and `pserver checkpoint inspect` (pserver.cli) run the same code
offline."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from pserver import sparse
from pserver.errors import ConfigError
from pserver.server import checkpoint, coordinator
from pserver.wire.sharding import shard_range, shard_ranges

log = logging.getLogger("pserver.checkpoint")
CUT_MODES = ("sync", "backup")      # modes whose shards take every step together


def scan(directory: str) -> dict[int, dict[int, list[tuple[int, str]]]]:
    """{S: {J: [(version, path), newest first]}} of the checkpoint files in directory."""
    found: dict[int, dict[int, list[tuple[int, str]]]] = {}
    if not os.path.isdir(directory):
        return found
    for name in os.listdir(directory):
        if m := checkpoint.NAME.match(name):
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


def _describe(shards: dict[int, list[tuple[int, str]]], num_shards: int) -> str:
    return "; ".join(f"shard {j}: " + (", ".join(str(v) for v, _ in shards[j]) if shards.get(j) else "none")
                     for j in range(num_shards))


def select(directory: str, num_shards: int, mode: str) -> list[checkpoint.Checkpoint]:
    """One loaded checkpoint per shard of an S-shard set, by the mode's version rule;
    ConfigError naming what was found when no set can be combined."""
    shards = scan(directory).get(num_shards, {})
    missing = [j for j in range(num_shards) if not shards.get(j)]
    if missing:
        raise ConfigError(f"--restore: {directory} holds checkpoints of {num_shards} shards but none of "
                          f"shard(s) {', '.join(map(str, missing))}; a set needs every shard's file")
    if mode in CUT_MODES:
        failures = []
        for v in cut_versions(shards, num_shards):
            try:
                ckpts = [checkpoint.load(dict(shards[j])[v]) for j in range(num_shards)]
            except ValueError as e:
                failures.append(f"version {v}: {e}")
                log.warning("checkpoint set of %d shards at version %d does not load: %s", num_shards, v, e)
                continue
            check_compatible(ckpts, directory)
            return ckpts
        raise ConfigError(f"--restore: {directory} has no version that every one of its {num_shards} shards "
                          f"has a checkpoint of that loads, which mode {mode} needs (a consistent cut); "
                          f"versions found: {_describe(shards, num_shards)}"
                          + (f"; {'; '.join(failures)}" if failures else ""))
    ckpts = []
    for j in range(num_shards):
        ckpt, failures = checkpoint.newest(directory, j, num_shards)
        if ckpt is None:
            raise ConfigError(f"--restore: no checkpoint of shard {j} of {num_shards} in {directory} loads "
                              f"({'; '.join(failures)})")
        ckpts.append(ckpt)
    check_compatible(ckpts, directory)
    return ckpts


def check_compatible(ckpts: list[checkpoint.Checkpoint], directory: str, pair: bool = False) -> None:
    """One run's files: the same layout, parameter count, optimizer and tables, shards 0..S-1
    with the ranges S shards have (`pair`: two files of the set, the ranges not checked).
    ConfigError naming the first difference."""
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
    if pair:
        return
    ranges = shard_ranges(first.total, len(ckpts))
    for j, c in enumerate(ckpts):
        if (c.shard, c.num_shards, c.start, c.end) != (j, len(ckpts), *ranges[j]):
            raise ConfigError(f"--restore: {c.path} says it is shard {c.shard} of {c.num_shards} with range "
                              f"[{c.start}, {c.end}); its name and the layout say shard {j} of {len(ckpts)}, "
                              f"[{ranges[j][0]}, {ranges[j][1]})")


def _gather(parts: list[tuple[int, np.ndarray]], start: int, end: int) -> np.ndarray:
    """Elements [start, end) of a vector given as (offset, piece) parts that cover it."""
    out = np.empty(end - start, dtype=np.float32)
    for offset, piece in parts:
        lo, hi = max(start, offset), min(end, offset + piece.shape[0])
        if lo < hi:
            out[lo - start:hi - start] = piece[lo - offset:hi - offset]
    return out


def _rows_for(states: list[dict], num_shards: int, shard: int, counters: bool) -> dict:
    """One table's state() for `shard` of `num_shards` out of the old shards' states."""
    out = {key: np.concatenate([s[key] for s in states]) for key in states[0] if key != "counters"}
    mine = sparse.shard_of(out["ids"], num_shards) == shard
    pending = sparse.shard_of(out["pending_ids"], num_shards) == shard
    for key in list(out):
        out[key] = out[key][pending if key.startswith("pending_") else mine]
    total = np.sum([s["counters"] for s in states], axis=0).astype(np.int64)
    out["counters"] = total if counters else np.zeros_like(total)
    return out


def combine(ckpts: list[checkpoint.Checkpoint], num_shards: int, shard: int) -> checkpoint.Checkpoint:
    """Shard `shard` of `num_shards` made of a compatible set (one file per old shard)."""
    first = ckpts[0]
    start, end = shard_range(first.total, num_shards, shard)
    params = _gather([(c.start, c.params) for c in ckpts], start, end)
    state = {k: _gather([(c.start, c.state[k]) for c in ckpts], start, end) for k in first.state}
    rows = {t["name"]: _rows_for([c.rows[t["name"]] for c in ckpts], num_shards, shard, counters=shard == 0)
            for t in first.tables}
    clocks: dict[int, int] = {}
    positions: dict[int, tuple] = {}
    for c in ckpts:
        for r, clock in c.clocks.items():
            if r not in clocks or clock < clocks[r]:
                clocks[r] = clock
                if r in c.positions:
                    positions[r] = c.positions[r]
        for r, p in c.positions.items():
            positions.setdefault(r, p)
    olds = ", ".join(os.path.basename(c.path) for c in ckpts)
    return checkpoint.Checkpoint(f"{olds} (resharded)", max(c.version for c in ckpts), shard, num_shards,
                                 first.signature, first.total, start, end, first.optimizer, params, state,
                                 clocks, list(first.tables), rows, positions,
                                 coordinator.for_new_shard({c.shard: c.coordinator for c in ckpts}, shard))


@dataclass
class RestorePoint:
    ckpt: checkpoint.Checkpoint | None
    resharded_from: int = 0        # the old number of shards, when the files were of another shape


def newest_shape(found: dict, prefer: int = 0) -> int:
    """The number of shards whose newest file has the highest version (the shape the job ran
    last); `prefer` wins a tie."""
    def newest(s: int) -> int:
        return max(v for files in found[s].values() for v, _ in files)
    return max(found, key=lambda s: (newest(s), s == prefer, s))


def restore_point(directory: str, shard: int, num_shards: int, mode: str,
                  fresh_if_corrupt: bool = False) -> RestorePoint:
    """What shard `shard` of `num_shards` restores from directory (None on a first start)."""
    found = scan(directory) if os.path.isdir(directory) else {}
    if not found:
        return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))
    last = newest_shape(found, prefer=num_shards)
    if last != num_shards:
        # Files of another shape are newer than any of this one (a job resharded in this
        # directory and then brought back): the newest state wins, combined.
        log.info("shard %d of %d: %s holds newer checkpoints of %d shards; combining them", shard,
                 num_shards, directory, last)
        return RestorePoint(combine(select(directory, last, mode), num_shards, shard), resharded_from=last)
    own = found[num_shards]
    if shard not in own:
        raise ConfigError(f"--restore: {directory} holds checkpoints of shards "
                          f"{', '.join(map(str, sorted(own)))} of {num_shards} but none of "
                          f"shard {shard}: starting it fresh would mix a new shard into a trained model; "
                          f"restore from the directory that holds its files")
    if mode in CUT_MODES and set(own) != {shard} and cut_versions(own, num_shards):
        return RestorePoint(_own_at_cut(directory, own, shard, num_shards, mode, fresh_if_corrupt))
    if mode in CUT_MODES and set(own) != {shard}:
        # No version that every shard has: one shard restarted while the others went on (they
        # are live, ahead of its files) restores its own newest, as it always did.
        log.warning("shard %d: no version every shard of %d has a checkpoint of in %s (%s); restoring "
                    "this shard's newest", shard, num_shards, directory, _describe(own, num_shards))
    # async and ssp, or a directory that holds this shard's files alone: its newest
    return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))


def _own_at_cut(directory: str, shards: dict, shard: int, num_shards: int, mode: str,
                fresh_if_corrupt: bool) -> checkpoint.Checkpoint | None:
    """In sync and backup, with the other shards' files in the same directory: this shard's file
    at the newest version for which every shard's file loads (each is read and checked, one at
    a time, and only this shard's kept), so that every shard of a job restarted at once starts
    from the same step. ConfigError naming the versions found when there is none."""
    failures = []
    for v in cut_versions(shards, num_shards):
        files = {j: dict(shards[j])[v] for j in range(num_shards)}
        try:
            own = checkpoint.load(files[shard])
            for j, path in files.items():
                if j != shard:
                    check_compatible([own, checkpoint.load(path)], directory, pair=True)
        except ValueError as e:
            failures.append(f"version {v}: {e}")
            log.warning("checkpoint set of %d shards at version %d does not load: %s", num_shards, v, e)
            continue
        return own
    if fresh_if_corrupt and failures:     # cuts there were, and not one loads
        log.warning("shard %d: no version loads for every shard in %s; starting fresh as "
                    "--restore-fresh-if-corrupt asks", shard, directory)
        return None
    raise ConfigError(f"--restore: {directory} has no version that every one of its {num_shards} shards "
                      f"has a checkpoint of that loads, which mode {mode} needs (a consistent cut); "
                      f"versions found: {_describe(shards, num_shards)}"
                      + (f"; {'; '.join(failures)}" if failures else ""))


def reshard_directory(source: str, target: str, num_shards: int, mode: str) -> list[str]:
    """`pserver checkpoint reshard`: write the set `restore_point` would combine from source as
    num_shards files into target (atomically each, as a shard writes them); their paths.
    Refused (ConfigError, before anything is written) when target is not a directory that can
    be one, or holds another run's files or other checkpoints of num_shards shards (a restore
    would take those, or mix them in), or num_shards is above the parameter count. Nothing is
    pruned; the temporary files a killed reshard left in target are removed."""
    found = scan(source)
    if not found:
        raise ConfigError(f"--from: {source} holds no checkpoint "
                          "(shard{J}-of{S}-v{VERSION}.ckpt files)")
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"--to: {target} is a file, not a directory")
    same = os.path.abspath(source) == os.path.abspath(target)
    if same and num_shards in found:
        raise ConfigError(f"--to: {target} already holds checkpoints of {num_shards} shards; write elsewhere")
    old = newest_shape(found)
    total = _total(found[old])
    if total is not None and num_shards > total:
        raise ConfigError(f"--num-shards: {num_shards:,} is more than the model's {total:,} parameters "
                          f"(each shard holds at least one); at most {total:,}")
    ckpts = select(source, old, mode)
    version = max(c.version for c in ckpts)
    run = checkpoint.run_of(source) or _derived_run(source, old, version)
    names = {checkpoint.file_name(j, num_shards, version) for j in range(num_shards)}
    _check_target(target, same, run, num_shards, names)
    checkpoint.check_directory(target, "--to")
    stale = [n for n in os.listdir(target)
             if (m := checkpoint.TMP_NAME.match(n)) and int(m.group(2)) == num_shards]
    for name in stale:
        checkpoint.remove_quietly(os.path.join(target, name))
    if stale:
        log.info("removed %d temporary file(s) an interrupted write left in %s", len(stale), target)
    try:
        checkpoint.claim(target, None if same else checkpoint.run_of(target), new=run)
        return [checkpoint.save(target, combine(ckpts, num_shards, j), run) for j in range(num_shards)]
    except OSError as e:
        raise ConfigError(f"--to: cannot write checkpoints to {target} ({e.strerror or e})") from None


def _total(shards: dict[int, list[tuple[int, str]]]) -> int | None:
    """The parameter count a shape's files record (the first whose meta reads), read alone."""
    for files in shards.values():
        for _, path in files:
            try:
                return int(checkpoint.meta_of(path)["total"])
            except Exception:  # a truncated zip raises several types; select reports it
                continue
    return None


def _derived_run(source: str, num_shards: int, version: int) -> str:
    """The run id of a reshard of files written before run ids: the same for the same source
    set, so that a reshard run again (after it was killed) writes over its own files."""
    text = f"{os.path.abspath(source)}:{num_shards}:{version}"
    return "resharded-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _check_target(target: str, same: bool, run: str, num_shards: int, names: set[str]) -> None:
    """A reshard's target holds nothing but what it writes: no file of another run (another
    RUN, or a file not the reshard's own from an earlier try) and no other checkpoint of the
    new shape; ConfigError naming what it found and the ways on. In the source directory
    itself the other shapes' files are the source's: the run's own."""
    if not os.path.isdir(target):
        return
    held = checkpoint.run_of(target)
    other = [] if same or held in (None, run) else [f"a RUN file of run {held}"]
    for name in sorted(os.listdir(target)):
        m = checkpoint.NAME.match(name)
        if not m or (same and int(m.group(2)) != num_shards):
            continue
        if name not in names or not checkpoint.owned(os.path.join(target, name), run):
            other.append(name)
    if other:
        raise ConfigError(f"--to: {target} holds another run's checkpoints ({', '.join(other[:3])}"
                          f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}), which a restore "
                          f"would take or mix in; nothing was written: choose an empty --to directory")


def inspect(directory: str) -> dict:
    """`pserver checkpoint inspect`: every file (shard, version, bytes, whether it loads and its
    checksum holds), each shape's layout and tables, and the consistent cuts."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: not a directory")
    report = {"directory": directory, "sets": []}
    for s, shards in sorted(scan(directory).items()):
        files, layout = [], None
        for j in sorted(shards):
            for v, path in shards[j]:
                base = checkpoint.base_of(path)
                entry = {"file": os.path.basename(path), "shard": j, "version": v,
                         "bytes": os.path.getsize(path), "kind": "base" if base is None else "delta"}
                if base is not None:
                    entry["base"] = base              # the version its chain starts at
                try:
                    c = checkpoint.load(path)
                except ValueError as e:
                    entry.update(loads=False, why=str(e))
                else:
                    meta = checkpoint.meta_of(path)
                    entry.update(loads=True, sha256=meta["sha256"],
                                 range=[c.start, c.end],
                                 rows={name: int(st["ids"].shape[0]) for name, st in c.rows.items()})
                    layout = layout or {"signature": c.signature, "parameters": c.total,
                                        "optimizer": c.optimizer,
                                        "tables": [{"name": t["name"], "dim": t["dim"],
                                                    "row_optimizer": t.get("optimizer")} for t in c.tables]}
                files.append(entry)
        loads = {(f["shard"], f["version"]) for f in files if f["loads"]}
        cuts = [v for v in cut_versions(shards, s) if all((j, v) in loads for j in range(s))]
        report["sets"].append({"num_shards": s, "layout": layout, "files": files, "consistent_cuts": cuts,
                               "missing_shards": [j for j in range(s) if j not in shards]})
    return report


def describe(report: dict) -> list[str]:
    """`inspect`'s report as the lines `pserver checkpoint inspect` prints."""
    if not report["sets"]:
        return [f"{report['directory']}: no checkpoint files"]
    lines = []
    for cs in report["sets"]:
        lay = cs["layout"] or {}
        tables = ", ".join(f"{t['name']} (dim {t['dim']}, {t['row_optimizer']})"
                           for t in lay.get("tables", []))
        lines.append(f"{cs['num_shards']} shard(s): layout {lay.get('signature', '?')}, "
                     f"{lay.get('parameters', 0):,} parameters, optimizer {lay.get('optimizer', '?')}; "
                     f"tables: {tables or 'none'}")
        for f in cs["files"]:
            rows = ", ".join(f"{k} {v:,}" for k, v in f.get("rows", {}).items()) or "none"
            what = (f"loads (sha256 {f['sha256'][:12]}... holds), range {f['range']}, rows {rows}"
                    if f["loads"] else f"DOES NOT LOAD: {f['why']}")
            kind = "base" if f["kind"] == "base" else f"delta of the chain from version {f['base']}"
            lines.append(f"  {f['file']}  {kind}  {f['bytes']:,} bytes  {what}")
        if cs["missing_shards"]:
            lines.append(f"  no file of shard(s) {', '.join(map(str, cs['missing_shards']))}")
        lines.append("  consistent cuts (versions every shard has a file of that loads): "
                     + (", ".join(map(str, cs["consistent_cuts"])) or "none"))
    return lines
