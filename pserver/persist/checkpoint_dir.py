"""A checkpoint directory across shards and shapes: which files make a state that restore (at a
shard's start), reshard, inspect, export and evaluate read (`newest_usable`, one rule, and
`newest_shape`, its state or why there is none), whether files are of one run and of a model
(`check_compatible`, `check_model`), the consistent cuts, and `inspect`. The files themselves
(names, chains, loading) are pserver.persist.checkpoint's.

A directory belongs to one run (`RUN`, a JSON file: the run's id, written atomically with the
run's first checkpoint, `claim`); every file records the id in its meta ("run"). A start that
finds checkpoints in the directory it would write to without restoring that directory is
refused before anything starts (`check_start`): they are another run's. A restore of the
directory adopts it (its id, or, for files written before run ids, the id it then writes).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from pserver.errors import ConfigError
from pserver.persist.atomic import fsync_dir, remove_quietly, synced, temp_path
from pserver.persist.checkpoint import Checkpoint, Gone, base_of, load, meta_of, scan
from pserver.wire.sharding import shard_ranges

log = logging.getLogger("pserver.checkpoint")


CUT_MODES = ("sync", "backup")      # modes whose shards take every step together: a set is a cut


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


def check_model(signature: str | None, total: int | None, layout, flag: str, where: str, hint: str,
                this: str = "this model's is") -> None:
    """Whether checkpoints are of a model: the one test, their layout's signature and parameter
    count against `layout`'s (restore's check before anything starts, evaluate --checkpoint,
    export). ConfigError `flag`: `where` is of another model ..., `hint` saying what to check."""
    if (signature, total) != (layout.signature(), layout.total):
        raise ConfigError(f"{flag}: {where} of another model (layout {signature}, {total or 0:,} parameters; "
                          f"{this} {layout.signature()}, {layout.total:,}): {hint}")


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
    """What `newest_usable` found: the state to restore (None: no shape has one), "file: why"
    for each file it skipped, and how many of those were gone (pruned since the listing)."""
    best: Usable | None
    failures: list[str]
    gone: int = 0


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
    owner = run_of(directory)                           # a file another run wrote is not this directory's
    cut = mode in CUT_MODES
    failures: list[str] = []
    gone = 0

    def held(s: int, j: int, ckpt: Checkpoint) -> Checkpoint:
        if keep is None or keep(s, j):
            return ckpt
        return dataclasses.replace(ckpt, params=np.empty(0, np.float32), state={}, rows={})

    def attempt(path: str) -> Checkpoint | None:
        try:
            ckpt = loader(path)
            if ckpt.run is not None and owner is not None and ckpt.run != owner:
                raise ValueError(f"written by run {ckpt.run}, not by this directory's run {owner} (its "
                                 f"{RUN_FILE} file): a file of another run, copied in, is never mixed in")
            return ckpt
        except ValueError as e:
            nonlocal gone
            gone += isinstance(e, Gone)
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
    return Choice(best, failures, gone)


def newest_shape(directory: str, mode: str, flag: str = "--restore", shape: int | None = None) -> Usable:
    """The state of directory that a restore reads (`newest_usable`), its files whole; `shape`:
    of that number of shards alone. ConfigError naming `flag` when it holds no checkpoint (of
    every shard of `shape`), or no usable state. A running job that pruned every file listed
    while they were read (export --follow of a job that checkpoints faster than a state loads)
    is listed again, up to RESCANS times, before there is said to be none."""
    for _ in range(RESCANS):
        found = scan(directory)
        if shape is not None:
            missing = [j for j in range(shape) if not found.get(shape, {}).get(j)]
            if missing:
                raise ConfigError(f"{flag}: {directory} holds checkpoints of {shape} shards but none of "
                                  f"shard(s) {', '.join(map(str, missing))}; a set needs every shard's file")
            found = {shape: found[shape]}
        if not found:
            raise ConfigError(f"{flag}: {directory} holds no checkpoint "
                              "(shard{J}-of{S}-v{VERSION}.ckpt files)")
        choice = newest_usable(directory, mode, found=found)
        if choice.best is not None:
            return choice.best
        if not choice.gone:
            break
    raise ConfigError(why_none(directory, found, mode, choice.failures, flag))


RESCANS = 10            # listings newest_shape reads before it says a directory pruned meanwhile has no state


def load_weights(directory: str, layout, mode: str = "sync") -> tuple[np.ndarray, list[int]]:
    """The whole flat vector of `layout` from the state of directory that a restore reads
    (`newest_shape`: in sync, the newest consistent cut), by `pserver evaluate --checkpoint`,
    and each shard's version; ConfigError naming --checkpoint when there is none or a file is
    of another model."""
    if not os.path.isdir(directory):
        raise ConfigError(f"--checkpoint: {directory} is not a directory")
    flat, versions = np.empty(layout.total, dtype=np.float32), []
    for ckpt in newest_shape(directory, mode, "--checkpoint").ckpts:
        check_model(ckpt.signature, ckpt.total, layout, "--checkpoint", f"{ckpt.path} is",
                    "check --model or --model-file")
        flat[ckpt.start:ckpt.end] = ckpt.params
        versions.append(ckpt.version)
    return flat, versions


def write_directory(cfg) -> tuple[str, str] | None:
    """(directory, flag) where a shard writes its checkpoints: --checkpoint-dir, else the
    directory it restores from; None for neither."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir, "--checkpoint-dir"
    return (cfg.restore, "--restore") if cfg.restore else None


RUN_FILE = "RUN"                           # the run a checkpoint directory belongs to
UNREADABLE = "<unreadable RUN file"        # what run_of says of a RUN file that does not read


def run_of(directory: str) -> str | None:
    """The id of the run that directory belongs to (its RUN file); None when it has none."""
    try:
        with open(os.path.join(directory, RUN_FILE)) as f:
            return str(json.load(f)["run"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{UNREADABLE}: {e}>"              # no run's id: never equal to one (check_start refuses it)


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
        tmp = temp_path(final, unique=True)    # shards of one process: one each
        try:
            with synced(tmp) as f:
                f.write(json.dumps({"run": new, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "pid": os.getpid()}).encode())
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
    found = scan(directory)
    versions = sorted(v for shards in found.values() for files in shards.values() for v, _ in files)
    if not versions:
        return ""
    run = run_of(directory)
    return (f"{len(versions)} file(s) of {' and '.join(map(str, sorted(found)))} shard(s) at versions "
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
    for directory in {d for d in (restore, where) if d and os.path.isdir(d)}:
        run = run_of(directory)
        if run is not None and run.startswith(UNREADABLE):
            # Its files would be taken for another run's (never restored) and never pruned
            why = run[len(UNREADABLE) + 2:-1]
            raise ConfigError(f"{os.path.join(directory, RUN_FILE)} does not read ({why}): "
                              f"it names the run the directory's checkpoints belong to; put back the "
                              f"one that was there, or remove it if every checkpoint there is this job's")
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
    of directory that reads is of `layout` (check_model); one that does not read is restore's to
    report."""
    found = scan(directory)
    for path in sorted(p for shards in found.values() for files in shards.values() for _, p in files):
        try:
            meta = meta_of(path)
        except Exception:  # a truncated zip raises several types
            continue
        check_model(meta.get("signature"), meta.get("total"), layout, "--restore", f"{path} is",
                    "check --model, or restore another directory")


def inspect(directory: str, mode: str = "sync", found: dict | None = None) -> dict:
    """`pserver checkpoint inspect`: every file (shard, version, bytes, whether it loads and its
    checksum holds), each shape's layout and tables, the consistent cuts, and the state a restore
    in `mode` reads (newest_usable; None: none). A file a running job removes after
    the listing (`found`: scan's, taken now when not given) is left out, as gone."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: not a directory")
    report = {"directory": directory, "mode": mode, "sets": [], "restores": None}
    found = scan(directory) if found is None else found
    loaded: dict[str, Checkpoint | ValueError] = {}
    for s, shards in sorted(found.items()):
        files, layout = [], None
        for j in sorted(shards):
            for v, path in list(shards[j]):
                base = base_of(path)
                try:
                    entry = {"file": os.path.basename(path), "shard": j, "version": v,
                             "bytes": os.path.getsize(path), "kind": "base" if base is None else "delta"}
                    if base is not None:
                        entry["base"] = base              # the version its chain starts at
                    try:
                        c = loaded[path] = load(path)
                    except Gone:
                        raise FileNotFoundError(path) from None
                    except ValueError as e:
                        loaded[path] = e
                        entry.update(loads=False, why=str(e))
                    else:
                        meta = meta_of(path)
                        entry.update(loads=True, sha256=meta["sha256"],
                                     range=[c.start, c.end],
                                     rows={name: st.size for name, st in c.rows.items()})
                        tables = [{"name": t.name, "dim": t.dim, "row_optimizer": t.optimizer}
                                  for t in c.tables]
                        layout = layout or {"signature": c.signature, "parameters": c.total,
                                            "optimizer": c.optimizer, "tables": tables}
                except FileNotFoundError:             # pruned since it was listed: gone, not broken
                    shards[j].remove((v, path))
                    loaded.pop(path, None)
                    continue
                files.append(entry)
        loads = {(f["shard"], f["version"]) for f in files if f["loads"]}
        cuts = [v for v in cut_versions(shards, s) if all((j, v) in loads for j in range(s))]
        report["sets"].append({"num_shards": s, "layout": layout, "files": files, "consistent_cuts": cuts,
                               "missing_shards": [j for j in range(s) if not shards.get(j)]})

    def known(path: str) -> Checkpoint:
        result = loaded[path]
        if isinstance(result, ValueError):
            raise result
        return result

    try:
        best = newest_usable(directory, mode, loader=known, found=found).best
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
