"""The model a prediction server answers from: a model file, mapped (pserver.persist.model_file),
brought up to date by delta exports while it serves, one version per request.

    served = ServedModel.load("ctr-model")
    out, version = served.predict({"dense": dense, "cat": cat})     # one version answers
    served.apply("delta-1")                                         # between requests, whole

Versions: a request reads under a shared lock, and a delta's commit (its rows written in place,
the dense weights swapped, the version moved on) under the exclusive one, after its files were
read, verified and planned outside it; so every request sees the model before a delta or after
it, never a mix, and waits at most for one commit. A delta of another model, out of order, or
whose files fail their checksums is refused (DataError) and the version served stays.

`follow(directory)` applies the deltas that appear in a directory, in their chain's order (each
delta names the export it was written since), polling; refusals are counted and the last one
kept for ModelStatus and /metrics. A server that has fallen behind the deltas its exporter keeps
(`pserver export --keep-deltas`) takes up the model they make (DIR/.base) whole instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

from pserver.errors import ConfigError, DataError, Pruned
from pserver.layers.activations import probabilities
from pserver.persist import model_file


class VersionLock:
    """Many readers or one writer; a waiting writer goes before new readers (so a delta's commit
    is not starved by a steady stream of requests)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class ServedModel:
    """A SavedModel answering predictions by version, and taking deltas in while it does."""

    def __init__(self, saved: model_file.SavedModel) -> None:
        self.saved = saved
        self.lock = VersionLock()
        self.applied, self.refused, self.last_refusal = 0, 0, ""
        self.rows_changed = 0
        self.compacted_at = 0                     # self.applied when the model file was last rewritten
        self.taken_up = 0                         # times the model was replaced by its directory's .base
        self.take_up_failure = ""                 # the last line take_up said it could not
        self.follow_failure = ""                  # the last failure of a round of follow(), said once
        self.follow_errors = 0                    # rounds of follow() that failed
        self.last_follow_error = ""               # why the last of them failed (ModelStatus, /metrics)
        self.seen: dict[str, tuple] = {}          # delta path -> its files' signature when it was tried
        self.looked: dict[str, tuple] = {}        # delta path -> its files' signature at the last look

    @classmethod
    def load(cls, path: str) -> ServedModel:
        """The model file at `path` (safe mode: a file that names Python code is refused)."""
        return cls(model_file.load(path))

    @property
    def name(self) -> str:
        return self.saved.meta.get("name") or "model"

    @property
    def version(self) -> int:
        origin = self.saved.meta.get("origin") or {}
        return int(origin.get("version", 0) or 0)

    @property
    def export_id(self) -> str:
        return str(self.saved.meta.get("export_id") or "")

    @property
    def inputs(self) -> list[str]:
        """The model's input names, in order ("" for a model of one unnamed input)."""
        keys = getattr(self.saved.model, "_keys", None)
        return list(keys) if keys else [""]

    def status(self) -> dict:
        return {"name": self.name, "version": self.version, "export_id": self.export_id,
                "deltas_applied": self.applied, "deltas_refused": self.refused,
                "last_refusal": self.last_refusal, "follow_errors": self.follow_errors,
                "last_follow_error": self.last_follow_error, "inputs": self.inputs}

    # -- predictions ---------------------------------------------------------------------------

    def predict(self, inputs: dict) -> tuple[np.ndarray, int, str]:
        """The model's outputs for `inputs` (arrays by input name; "" for a single unnamed
        input), the version and the export id that answered: all three from one version.
        ValueError naming the input for a bad one."""
        x = self._x(inputs)
        with self.lock.shared():
            out, version, export_id = np.asarray(self.saved.predict(x)), self.version, self.export_id
        # As Keras's predict and TensorFlow Serving: what the model states, probabilities after a
        # softmax or sigmoid last layer (which computes logits for its loss); a logit stays one
        model = self.saved.model
        kind = None if getattr(model, "several", False) else getattr(model, "output_activation", None)
        if kind:
            out = probabilities(kind, out.astype(np.float32, copy=True))
        return out, version, export_id

    def _x(self, inputs: dict):
        names = self.inputs
        if len(names) == 1 and set(inputs) == {""}:     # one input: its name may be left out
            inputs = {names[0]: inputs[""]}
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            raise ValueError(f"the model takes inputs {', '.join(map(repr, names))}; "
                             + (f"missing {', '.join(map(repr, missing))}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"unknown {', '.join(map(repr, extra))}" if extra else ""))
        arrays = {n: as_input(n, inputs[n]) for n in names}
        counts = {len(a) if isinstance(a, list) or a.ndim else -1 for a in arrays.values()}
        if len(counts) != 1 or -1 in counts or 0 in counts:
            raise ValueError("every input holds the same number (>= 1) of samples, the samples first; got "
                             + ", ".join(f"{n or 'x'} {_shape(a)}" for n, a in arrays.items()))
        model = self.saved.model
        if names == [""]:
            return arrays[""]
        pack = getattr(model, "pack", None)
        # the model's own packing: records for sparse tables, and lists of ids (a list feature's,
        # ragged) padded with its padding
        return pack(arrays) if pack is not None else arrays

    # -- deltas --------------------------------------------------------------------------------

    def apply(self, delta: str) -> dict:
        """Take in one delta (SavedModel.apply), its commit under the exclusive lock. DataError
        (and the version served unchanged) for a delta that does not follow this model."""
        try:
            counts = self.saved.apply(delta, exclusive=self.lock.exclusive())
        except (DataError, ConfigError, OSError) as e:
            if not os.path.exists(delta):         # its exporter pruned it meanwhile: not refused
                raise Pruned(f"{delta}: removed while it was read") from None
            self.refused += 1
            self.last_refusal = f"{delta}: {' '.join(str(e).split())}"
            raise DataError(self.last_refusal) from None
        self.applied += 1
        self.rows_changed += sum(c["changed"] for c in counts.values())
        return counts

    def pending(self, directory: str) -> list[str]:
        """The deltas in `directory` to try now, oldest first: each settled (its files the same
        as at the last look: a delta being copied in is left until it is whole) and not tried
        yet as it is (a refused one is tried again once its files change). The chain's order is
        follow_once's."""
        try:
            names = os.listdir(directory)
        except OSError as e:
            raise DataError(f"--follow {directory}: cannot list it ({e.strerror})") from None
        found = []
        for gone in set(self.looked) - {os.path.join(directory, name) for name in names}:
            self.looked.pop(gone)                  # pruned by its exporter: forgotten
            self.seen.pop(gone, None)
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith(".") or ".tmp" in name or not (os.path.isdir(path) or os.path.isfile(path)):
                continue                 # a delta still being written is PATH.PID.tmp, renamed at the end
            sig = _signature(path)
            settled, self.looked[path] = self.looked.get(path) == sig, sig
            if settled and sig is not None and self.seen.get(path) != sig:
                found.append((sig[1], path))
        return [p for _, p in sorted(found)]

    def follow_once(self, directory: str, say=print) -> int:
        """Apply what `directory` holds that follows this model, in the chain's order; returns
        how many were applied. A delta that does not follow (yet) is retried next round while
        a later one may make it apply; one that failed its checks is refused and said once."""
        candidates, tried = self.pending(directory), set()     # settled at this look: once per round
        applied, progress = 0, True
        while progress:                  # until no candidate follows the model any more
            progress = False
            for path in candidates:
                meta = _meta_of(path)
                base = ((meta or {}).get("delta") or {}).get("base_id")
                if path in tried or base is not None and base != self.export_id and not self._foreign(meta):
                    continue             # not this model's next delta (or not yet): left for later
                tried.add(path)          # this model's next, another model's (refused), or unreadable
                self.seen[path] = self.looked[path]
                try:
                    counts = self.apply(path)
                except Pruned:
                    continue
                except DataError as e:
                    say(f"pserver serve-model: refused {e}; still serving version {self.version}")
                    continue
                applied += 1
                progress = True
                rows = ", ".join(f"{t} {c['changed']} rows" for t, c in counts.items()) or "dense weights"
                say(f"pserver serve-model: applied {os.path.basename(path)}: version {self.version} ({rows})")
        return applied or int(self.take_up(directory, say))

    def _foreign(self, meta: dict | None) -> bool:
        """Whether a delta that does not follow this model's version is another model's (another
        layout, or another job's): refused at once, since no delta to come can make it follow.
        One of this model's own that is not next yet (a later one come first), or older (applied
        before a restart, or copied in again) is passed over, not refused."""
        if not meta:
            return False
        mine = self.saved.meta
        job, my_job = ((m.get("origin") or {}).get("job") for m in (meta, mine))
        return meta.get("signature") != mine.get("signature") or (job is not None and my_job is not None
                                                                  and job != my_job)

    def take_up(self, directory: str, say=print) -> bool:
        """When this model has fallen behind the deltas `directory` holds (its exporter pruned the
        next one: export --keep-deltas), the model they make, DIR/.base (export.DeltaChain), is
        written over this model's file as a compaction writes it and served from there; True if
        it was. Only a model of the same job (its origin's "job", the layout trained) newer than
        this one is taken, and only while no delta there follows this model."""
        source = os.path.join(directory, ".base")
        try:
            meta, _ = model_file.read(source, arrays=False)
        except DataError:
            return False
        origin, mine = meta.get("origin") or {}, self.saved.meta.get("origin") or {}
        if int(origin.get("version", -1)) <= self.version or origin.get("job") is None or \
                origin.get("job") != mine.get("job"):
            return False
        for name in os.listdir(directory):
            meta = _meta_of(os.path.join(directory, name)) if not name.startswith(".") else None
            if ((meta or {}).get("delta") or {}).get("base_id") == self.export_id:
                return False              # this model's next delta is there: it is applied instead
        try:
            fresh = model_file.load(source)
            fresh.compact(self.saved.path)
        except (DataError, ConfigError, OSError) as e:   # rewritten while read: the next look
            line = f"pserver serve-model: could not take up {source} yet ({' '.join(str(e).split())})"
            if line != self.take_up_failure:               # said once, not at every look
                self.take_up_failure = line
                say(line)
            return False
        before = self.version
        with self.lock.exclusive():
            self.saved = fresh
        self.taken_up += 1
        say(f"pserver serve-model: version {before} is behind the deltas kept in {directory}: took up "
            f"{source}, version {self.version}, written to {self.saved.path}")
        return True

    def follow(self, directory: str, poll: float, stop: threading.Event, say=print,
               compact_every: int = 0) -> None:
        """follow_once every `poll` seconds until `stop` is set; with `compact_every`, the model
        file is rewritten with the deltas applied after every that many (compact)."""
        while not stop.is_set():
            try:
                if self.follow_once(directory, say) and compact_every and \
                        self.applied - self.compacted_at >= compact_every:
                    self.compact(say)
                self.follow_failure = ""
            except Exception as e:   # noqa: BLE001 - a full or read-only disk, anything: the model
                # served stays as it was (a delta or a compaction takes effect whole or not at all),
                # and the thread goes on following: said once, counted, in ModelStatus
                line = f"pserver serve-model: {e if isinstance(e, DataError) else f'{type(e).__name__}: {e}'}"
                self.follow_errors += 1
                self.last_follow_error = line.removeprefix("pserver serve-model: ")
                if line != self.follow_failure:
                    self.follow_failure = line
                    say(f"{line}; still serving version {self.version}, following on")
            stop.wait(poll)

    def compact(self, say=print) -> None:
        """Rewrite the model file as it reads now, deltas applied (SavedModel.compact: the same
        directory, replaced atomically), and serve from it: the deltas' new rows and the pages
        they wrote go back to files, so memory stops growing with them. The values (and so the
        version) are the same before and after, so requests go on meanwhile. A restart then
        starts from this version and takes only the deltas after it."""
        started = time.monotonic()
        self.saved.compact()
        self.compacted_at = self.applied
        say(f"pserver serve-model: compacted {self.saved.path} at version {self.version} "
            f"in {time.monotonic() - started:.2f} s")


def as_input(name: str, values):
    """An input as an array of numbers, all finite; or, ragged (a list feature's lists of ids of
    different lengths), the Python lists as they came, which the model pads."""
    if isinstance(values, list) and values and all(isinstance(v, list) for v in values) \
            and len({len(v) for v in values}) > 1:
        if not all(isinstance(i, (int, float)) and not isinstance(i, bool) for v in values for i in v):
            raise ValueError(f"input {name or 'x'!r}: lists of numbers expected")
        return values
    try:
        a = np.asarray(values)
    except ValueError:
        raise ValueError(f"input {name or 'x'!r}: nested lists of uneven lengths") from None
    if a.dtype.kind not in "biuf":
        raise ValueError(f"input {name or 'x'!r} holds {a.dtype}; inputs are numbers")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ValueError(f"input {name or 'x'!r} holds values that are not finite")
    return a


def _shape(a) -> tuple:
    return (len(a), "lists") if isinstance(a, list) else a.shape


def _signature(path: str) -> tuple | None:
    """A delta's files (a directory's, or the one file of a model without sparse tables) as a
    change shows: (their count, newest mtime, total bytes)."""
    count, newest, total = 0, 0, 0
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return 1, st.st_mtime_ns, st.st_size
        for root, _, files in os.walk(path):
            for f in files:
                st = os.stat(os.path.join(root, f))
                count, newest, total = count + 1, max(newest, st.st_mtime_ns), total + st.st_size
    except OSError:
        return None                    # moved or removed while looked at: next time
    return count, newest, total


def _meta_of(path: str) -> dict | None:
    """A delta's JSON (None: unreadable, which apply then refuses with the reason)."""
    try:
        return model_file.read(path, arrays=False)[0]
    except Exception:           # noqa: BLE001 - any unreadable file: apply says why
        return None


__all__ = ["ServedModel", "VersionLock", "as_input"]
