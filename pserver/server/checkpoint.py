"""When one shard writes its checkpoints (Checkpointer): every K steps, every S seconds and on
request, a base or a delta, at most one write in flight. What a file holds and how it is
written, loaded and pruned is pserver.persist.checkpoint's; the directory's run (RUN) is
pserver.persist.checkpoint_dir's."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from pserver.errors import FailedPrecondition
from pserver.persist.atomic import remove_quietly
from pserver.persist.checkpoint import (
    Part,
    candidates,
    file_name,
    header,
    owned,
    prepare,
    prune,
    small_parts,
    write,
)
from pserver.persist.checkpoint_dir import claim, run_of

log = logging.getLogger("pserver.checkpoint")
STRIPE_BYTES = 4 << 20                     # bytes copied at a time from the live state
# A base as soon as a chain's deltas add up to this much of its base: a restore reads the base
# and its deltas and replays them, at most 1.33x the bytes, measured 1.5-1.6x a base's load on
# 1M rows x 16 (at a half, 1.9-2.0x, over the 1.6 bound: bench/checkpoint_incremental.py b).
CHAIN_LIMIT = 1 / 3


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
        store.track = cfg.full_every > 1          # tables record removed ids for the deltas
        for table in store.tables.values():
            table.track = store.track
        # The chain being extended: [base version, base bytes, deltas' bytes, files]; None:
        # the next file is a base (at start, and after a failed write, whose delta is lost).
        self.chain: list[int] | None = None
        self.written: tuple[int, str] | None = None   # (version, path) of the last file written
        # and what else it holds that may move at one version: (the data coordinator's state,
        # the chief's learning rate); a change of either writes that version again
        self.state_written: tuple | None = None
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
                state = (self.store.coordinator.state(), self.store.lr_set)
            again = self.written is not None and self.written[0] == version
            if again and state == self.state_written:
                taken.set()                   # nothing changed since: that file is this version
                self._end(*self.written)
                return self.written
            # The same version with the data coordinator moved on (its last chunks done, its run
            # finished, after the step's write) or the chief's learning rate changed since: a base
            # again, so that restarts see where it is.
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
            self.written = (version, result)
            self.state_written = (dump.meta["coordinator"], dump.meta.get("lr_set"))
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
            parts += small_parts(i, small)
        meta = header(dict(dump.meta, shard=self.cfg.shard, num_shards=self.cfg.num_shards,
                           optimizer=self.cfg.optimizer, tables=[t[0].to_dict() for t in dump.tables],
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
