"""Checkpoints read by a cluster of another number of shards, and the version a restore starts
from (docs/semantics.md, "Restore onto another number of shards").

A directory may hold the files of several cluster shapes (`shard{J}-of{S}-v{V}.ckpt`). A shard
J' of S' restoring from it reads the state checkpoint_dir.newest_usable picks, the one rule that
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
from pserver.persist import checkpoint, checkpoint_dir
from pserver.wire.sharding import shard_range

log = logging.getLogger("pserver.checkpoint")
CUT_MODES = checkpoint_dir.CUT_MODES


def _gather(parts: list[tuple[int, np.ndarray]], start: int, end: int) -> np.ndarray:
    """Elements [start, end) of a vector given as (offset, piece) parts that cover it."""
    out = np.empty(end - start, dtype=np.float32)
    for offset, piece in parts:
        lo, hi = max(start, offset), min(end, offset + piece.shape[0])
        if lo < hi:
            out[lo - start:hi - start] = piece[lo - offset:hi - offset]
    return out


def _rows_for(states: list[sparse.RowState], num_shards: int, shard: int, counters: bool) -> sparse.RowState:
    """One table's rows for `shard` of `num_shards` out of the old shards' (the counters summed
    into new shard 0's)."""
    every = sparse.RowState.concat(states)
    return every.select(sparse.shard_of(every.ids, num_shards) == shard,
                        sparse.shard_of(every.pending_ids, num_shards) == shard,
                        every.counters if counters else np.zeros_like(every.counters))


def combine(ckpts: list[checkpoint.Checkpoint], num_shards: int, shard: int) -> checkpoint.Checkpoint:
    """Shard `shard` of `num_shards` made of a compatible set (one file per old shard)."""
    first = ckpts[0]
    start, end = shard_range(first.total, num_shards, shard)
    params = _gather([(c.start, c.params) for c in ckpts], start, end)
    state = {k: _gather([(c.start, c.state[k]) for c in ckpts], start, end) for k in first.state}
    rows = {t.name: _rows_for([c.rows[t.name] for c in ckpts], num_shards, shard, counters=shard == 0)
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
    return checkpoint.Checkpoint(path=f"{olds} (resharded)", version=max(c.version for c in ckpts),
                                 shard=shard, num_shards=num_shards, signature=first.signature,
                                 total=first.total,
                                 start=start, end=end, optimizer=first.optimizer, params=params, state=state,
                                 clocks=clocks, tables=list(first.tables), rows=rows, positions=positions,
                                 coordinator=for_new_shard({c.shard: c.coordinator for c in ckpts}, shard),
                                 lr_set=first.lr_set)     # every shard took the chief's change at one step


def for_new_shard(states: dict[int, dict | None], shard: int) -> dict | None:
    """The data coordinator's state (pserver.server.coordinator) for a new shard: it lives in
    shard 0; old shard 0's state goes to new shard 0."""
    return states.get(0) if shard == 0 else None


@dataclass
class RestorePoint:
    ckpt: checkpoint.Checkpoint | None
    resharded_from: int = 0        # the old number of shards, when the files were of another shape


def restore_point(directory: str, shard: int, num_shards: int, mode: str,
                  fresh_if_corrupt: bool = False) -> RestorePoint:
    """What shard `shard` of `num_shards` restores from directory (None on a first start): the
    state checkpoint_dir.newest_usable picks, its own file when the state is of this number of
    shards, else combined. When no state of this shape is usable but this shard's own files are
    at least as new as any other shape's state, as before a reshard: in sync and backup with no
    version every shard has (one shard restarted while the others went on), its own newest;
    with such versions none of which loads, refused (or fresh, --restore-fresh-if-corrupt)."""
    found = checkpoint.scan(directory)
    if not found:
        return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))
    choice = checkpoint_dir.newest_usable(directory, mode, prefer=num_shards, found=found,
                                      keep=lambda s, j: s != num_shards or j == shard)
    best, own = choice.best, found.get(num_shards, {})
    if best is not None and best.num_shards == num_shards:
        return RestorePoint(best.ckpts[shard])
    # This shape has a state to try (every shard's files; in sync and backup a version they all
    # have): `best` is newer, or it did not load. Else, this shard's own files as before, unless
    # `best` is newer than all of them.
    candidate = bool(own) and all(own.get(j) for j in range(num_shards)) and \
        (mode not in CUT_MODES or bool(checkpoint_dir.cut_versions(own, num_shards)))
    own_newest = max((v for files in own.values() for v, _ in files), default=-1)
    if best is not None and (candidate or best.version > own_newest):
        log.info("shard %d of %d: the newest usable state in %s is version %d of %d shards; combining it",
                 shard, num_shards, directory, best.version, best.num_shards)
        return RestorePoint(combine(best.ckpts, num_shards, shard), resharded_from=best.num_shards)
    if not own:
        raise ConfigError(checkpoint_dir.why_none(directory, found, mode, choice.failures))
    if shard not in own:
        newest = max(v for files in own.values() for v, _ in files)
        raise ConfigError(f"--restore: {directory} holds checkpoints of shards "
                          f"{', '.join(map(str, sorted(own)))} of {num_shards} (up to version {newest}) but "
                          f"none of shard {shard}: starting it fresh would mix a new shard into a trained "
                          f"model; restore from the directory that holds its files, or, if none does "
                          f"(shard {shard} stopped before its first checkpoint), the others' state cannot be "
                          f"resumed without it: start the job afresh with another --checkpoint-dir (or move "
                          f"{directory} aside)")
    if mode in CUT_MODES and set(own) != {shard} and checkpoint_dir.cut_versions(own, num_shards):
        if fresh_if_corrupt:          # cuts there are, and not one loads
            log.warning("shard %d: no version loads for every shard in %s; starting fresh as "
                        "--restore-fresh-if-corrupt asks", shard, directory)
            return RestorePoint(None)
        raise ConfigError(checkpoint_dir.why_none(directory, {num_shards: own}, mode, choice.failures))
    if mode in CUT_MODES and set(own) != {shard}:
        # No version that every shard has: one shard restarted while the others went on (they
        # are live, ahead of its files) restores its own newest, as it always did.
        log.warning("shard %d: no version every shard of %d has a checkpoint of in %s (%s); restoring "
                    "this shard's newest", shard, num_shards, directory,
                    checkpoint_dir.describe_versions(own, num_shards))
    # async and ssp, or a directory that holds this shard's files alone: its newest
    return RestorePoint(checkpoint.load_latest(directory, shard, num_shards, fresh_if_corrupt))


def reshard_directory(source: str, target: str, num_shards: int, mode: str) -> list[str]:
    """`pserver checkpoint reshard`: write the set `restore_point` would combine from source
    (checkpoint_dir.newest_shape's state) as num_shards files into target (atomically
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
    ckpts = checkpoint_dir.newest_shape(source, mode, "--from").ckpts
    version = max(c.version for c in ckpts)
    run = checkpoint_dir.run_of(source) or _derived_run(source, len(ckpts), version)
    names = {checkpoint.file_name(j, num_shards, version) for j in range(num_shards)}
    _check_target(target, same, run, num_shards, names)
    checkpoint.prepare(target, "--to", None, num_shards)
    try:
        checkpoint_dir.claim(target, None if same else checkpoint_dir.run_of(target), new=run)
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
    held = checkpoint_dir.run_of(target)
    other = [] if same or held in (None, run) else [f"a RUN file of run {held}"]
    found = checkpoint.scan(target)
    for path in sorted(p for s, shards in found.items() if not same or s == num_shards
                       for files in shards.values() for _, p in files):
        if os.path.basename(path) not in names or not checkpoint.owned(path, run):
            other.append(os.path.basename(path))
    if other:
        raise ConfigError(f"--to: {target} holds another run's checkpoints ({', '.join(other[:3])}"
                          f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}), which a restore "
                          f"would take or mix in; nothing was written: choose an empty --to directory")
