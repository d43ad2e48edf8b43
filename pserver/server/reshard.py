"""Checkpoints read by a cluster of another number of shards, and the version a restore starts
from (docs/semantics.md, "Restore onto another number of shards").

A directory may hold the files of several cluster shapes (`shard{J}-of{S}-v{V}.ckpt`). A shard
J' of S' restoring from it reads the state checkpoint.newest_usable picks, the one rule that
restore, reshard, inspect, export and evaluate share (`restore_point`):

- of its own shape: its own file of that state;
- of another shape, combined (`combine`): the dense range [start', end') of shard J'
  gathered from the old ranges, with the optimizer state of those elements; every table's rows
  (and pending admissions) whose id hashes to J' with their optimizer slots, last updates and
  lazy-Adam step counts; the tables' counters summed onto shard 0, so the cluster's totals stay
  what they were; each worker's clock the smallest any old shard recorded, so no data is skipped.

Versions: in sync and backup every old shard's file must be of one version (the newest that
every old shard has and that loads); in async and ssp each old shard's newest, and the new
shard's version is the largest of them (it also sets Adam's step count and the schedule's step).
With no usable state of its own shape and its own files at least as new as any other's, a shard
does as before reshards existed (`restore_point`'s docstring).

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
from pserver.wire.sharding import shard_range

log = logging.getLogger("pserver.checkpoint")
CUT_MODES = checkpoint.CUT_MODES


def select(directory: str, num_shards: int, mode: str) -> list[checkpoint.Checkpoint]:
    """One loaded checkpoint per shard of an S-shard set, by the mode's version rule
    (checkpoint.newest_usable, of this shape alone); ConfigError naming what was found when no
    set can be combined."""
    shards = checkpoint.scan(directory).get(num_shards, {})
    missing = [j for j in range(num_shards) if not shards.get(j)]
    if missing:
        raise ConfigError(f"--restore: {directory} holds checkpoints of {num_shards} shards but none of "
                          f"shard(s) {', '.join(map(str, missing))}; a set needs every shard's file")
    choice = checkpoint.newest_usable(directory, mode, shapes=[num_shards])
    if choice.best is not None:
        return choice.best.ckpts
    raise ConfigError(checkpoint.why_none(directory, {num_shards: shards}, mode, choice.failures))


def newest_set(directory: str, mode: str, flag: str = "--restore") -> list[checkpoint.Checkpoint]:
    """The files of the state a restore of directory reads (checkpoint.newest_usable), whole;
    ConfigError naming `flag` when it holds no checkpoint, or no usable state."""
    found = checkpoint.scan(directory)
    if not found:
        raise ConfigError(f"{flag}: {directory} holds no checkpoint "
                          "(shard{J}-of{S}-v{VERSION}.ckpt files)")
    choice = checkpoint.newest_usable(directory, mode, found=found)
    if choice.best is None:
        raise ConfigError(checkpoint.why_none(directory, found, mode, choice.failures, flag))
    return choice.best.ckpts


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


def restore_point(directory: str, shard: int, num_shards: int, mode: str,
                  fresh_if_corrupt: bool = False) -> RestorePoint:
    """What shard `shard` of `num_shards` restores from directory (None on a first start): the
    state checkpoint.newest_usable picks, its own file when the state is of this number of
    shards, else combined. When no state of this shape is usable but this shard's own files are
    at least as new as any other shape's state, as before a reshard: in sync and backup with no
    version every shard has (one shard restarted while the others went on), its own newest;
    with such versions none of which loads, refused (or fresh, --restore-fresh-if-corrupt)."""
    found = checkpoint.scan(directory)
    if not found:
        return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))
    choice = checkpoint.newest_usable(directory, mode, prefer=num_shards, found=found,
                                      keep=lambda s, j: s != num_shards or j == shard)
    best, own = choice.best, found.get(num_shards, {})
    if best is not None and best.num_shards == num_shards:
        return RestorePoint(best.ckpts[shard])
    # This shape has a state to try (every shard's files; in sync and backup a version they all
    # have): `best` is newer, or it did not load. Else, this shard's own files as before, unless
    # `best` is newer than all of them.
    candidate = bool(own) and all(own.get(j) for j in range(num_shards)) and \
        (mode not in CUT_MODES or bool(checkpoint.cut_versions(own, num_shards)))
    own_newest = max((v for files in own.values() for v, _ in files), default=-1)
    if best is not None and (candidate or best.version > own_newest):
        log.info("shard %d of %d: the newest usable state in %s is version %d of %d shards; combining it",
                 shard, num_shards, directory, best.version, best.num_shards)
        return RestorePoint(combine(best.ckpts, num_shards, shard), resharded_from=best.num_shards)
    if not own:
        raise ConfigError(checkpoint.why_none(directory, found, mode, choice.failures))
    if shard not in own:
        raise ConfigError(f"--restore: {directory} holds checkpoints of shards "
                          f"{', '.join(map(str, sorted(own)))} of {num_shards} but none of "
                          f"shard {shard}: starting it fresh would mix a new shard into a trained model; "
                          f"restore from the directory that holds its files")
    if mode in CUT_MODES and set(own) != {shard} and checkpoint.cut_versions(own, num_shards):
        if fresh_if_corrupt:          # cuts there are, and not one loads
            log.warning("shard %d: no version loads for every shard in %s; starting fresh as "
                        "--restore-fresh-if-corrupt asks", shard, directory)
            return RestorePoint(None)
        raise ConfigError(checkpoint.why_none(directory, {num_shards: own}, mode, choice.failures))
    if mode in CUT_MODES and set(own) != {shard}:
        # No version that every shard has: one shard restarted while the others went on (they
        # are live, ahead of its files) restores its own newest, as it always did.
        log.warning("shard %d: no version every shard of %d has a checkpoint of in %s (%s); restoring "
                    "this shard's newest", shard, num_shards, directory,
                    checkpoint.describe_versions(own, num_shards))
    # async and ssp, or a directory that holds this shard's files alone: its newest
    return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))


def reshard_directory(source: str, target: str, num_shards: int, mode: str) -> list[str]:
    """`pserver checkpoint reshard`: write the set `restore_point` would combine from source
    (newest_set: checkpoint.newest_usable's state) as num_shards files into target (atomically
    each, as a shard writes them); their paths.
    Refused (ConfigError, before anything is written) when target is not a directory that can
    be one, or holds another run's files or other checkpoints of num_shards shards (a restore
    would take those, or mix them in), or num_shards is above the parameter count. Nothing is
    pruned; the temporary files a killed reshard left in target are removed."""
    found = checkpoint.scan(source)
    if not found:
        raise ConfigError(f"--from: {source} holds no checkpoint "
                          "(shard{J}-of{S}-v{VERSION}.ckpt files)")
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"--to: {target} is a file, not a directory")
    same = os.path.abspath(source) == os.path.abspath(target)
    if same and num_shards in found:
        raise ConfigError(f"--to: {target} already holds checkpoints of {num_shards} shards; write elsewhere")
    total = next((t for shape in found.values() if (t := _total(shape)) is not None), None)
    if total is not None and num_shards > total:
        raise ConfigError(f"--num-shards: {num_shards:,} is more than the model's {total:,} parameters "
                          f"(each shard holds at least one); at most {total:,}")
    ckpts = newest_set(source, mode, "--from")
    version = max(c.version for c in ckpts)
    run = checkpoint.run_of(source) or _derived_run(source, len(ckpts), version)
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


def inspect(directory: str, mode: str = "sync", found: dict | None = None) -> dict:
    """`pserver checkpoint inspect`: every file (shard, version, bytes, whether it loads and its
    checksum holds), each shape's layout and tables, the consistent cuts, and the state a restore
    in `mode` reads (checkpoint.newest_usable; None: none). A file a running job removes after
    the listing (`found`: checkpoint.scan's, taken now when not given) is left out, as gone."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: not a directory")
    report = {"directory": directory, "mode": mode, "sets": [], "restores": None}
    found = checkpoint.scan(directory) if found is None else found
    loaded: dict[str, checkpoint.Checkpoint | ValueError] = {}
    for s, shards in sorted(found.items()):
        files, layout = [], None
        for j in sorted(shards):
            for v, path in list(shards[j]):
                base = checkpoint.base_of(path)
                try:
                    entry = {"file": os.path.basename(path), "shard": j, "version": v,
                             "bytes": os.path.getsize(path), "kind": "base" if base is None else "delta"}
                    if base is not None:
                        entry["base"] = base              # the version its chain starts at
                    try:
                        c = loaded[path] = checkpoint.load(path)
                    except checkpoint.Gone:
                        raise FileNotFoundError(path) from None
                    except ValueError as e:
                        loaded[path] = e
                        entry.update(loads=False, why=str(e))
                    else:
                        meta = checkpoint.meta_of(path)
                        entry.update(loads=True, sha256=meta["sha256"],
                                     range=[c.start, c.end],
                                     rows={name: int(st["ids"].shape[0]) for name, st in c.rows.items()})
                        tables = [{"name": t["name"], "dim": t["dim"], "row_optimizer": t.get("optimizer")}
                                  for t in c.tables]
                        layout = layout or {"signature": c.signature, "parameters": c.total,
                                            "optimizer": c.optimizer, "tables": tables}
                except FileNotFoundError:             # pruned since it was listed: gone, not broken
                    shards[j].remove((v, path))
                    loaded.pop(path, None)
                    continue
                files.append(entry)
        loads = {(f["shard"], f["version"]) for f in files if f["loads"]}
        cuts = [v for v in checkpoint.cut_versions(shards, s) if all((j, v) in loads for j in range(s))]
        report["sets"].append({"num_shards": s, "layout": layout, "files": files, "consistent_cuts": cuts,
                               "missing_shards": [j for j in range(s) if not shards.get(j)]})

    def known(path: str) -> checkpoint.Checkpoint:
        result = loaded[path]
        if isinstance(result, ValueError):
            raise result
        return result

    try:
        best = checkpoint.newest_usable(directory, mode, loader=known, found=found).best
    except ConfigError as e:                          # a set of files of two runs
        report["refused"] = str(e)
        best = None
    if best is not None:
        report["restores"] = {"num_shards": best.num_shards, "version": best.version,
                              "versions": [c.version for c in best.ckpts]}
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
    r, refused = report["restores"], report.get("refused")
    lines.append(f"a restore (mode {report['mode']}) reads: " +
                 (f"version {r['version']} of {r['num_shards']} shard(s) (files at versions "
                  f"{', '.join(map(str, r['versions']))})" if r else
                  f"nothing: no usable state{' (' + refused + ')' if refused else ''}"))
    return lines
