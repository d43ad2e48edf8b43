"""The model file: a trained model's definition and weights in one .npz that numpy alone reads;
a model with sparse tables (the CTR models) is a directory that adds each table's rows.

    pserver worker|launch ... --save model.npz      the chief writes it after the final evaluation
    pserver export --restore ckpt --model wide_deep --dataset criteo-synthetic --out ctr-model
                                                     a sparse model from checkpoints (pserver.persist.export)
    pserver evaluate --model-file model.npz          its test metrics (pserver.persist.export.evaluate_files)
    pserver.load_model("model.npz").predict(x)       the same in Python

The format (docs/model-file.md): numpy's .npz (a zip of .npy files, no pickles) holding
  "pserver_model"      a 0-d unicode array: the JSON object below
  "<layer>/<weight>"   one float32 array per tensor ("dense/kernel", "dense/bias", ...)
The JSON says how to build the model again ("model": a built-in name or FILE.py:FUNCTION /
package.module:FUNCTION, and "arguments"), lists the tensors in the order of the flat vector
("layout"), and records the dataset it was trained on and the run's results.

A model with sparse tables (version 2) is a directory MODEL/ holding
  model.npz                  the file above, whose JSON adds "tables": per table its config (dim,
                             seed, init_scale, ...), its "index" among the model's tables and "rows"
  tables/<name>.ids.npy      uint64 (n,), sorted: the ids the table holds
  tables/<name>.rows.npy     float32 (n, dim): their rows, in the order of the ids
read with np.load(mmap_mode="r"), so a table need not fit in memory. The JSON's "files" holds the
bytes and sha256 of every file under tables/ (model.npz's own entries carry the zip's CRC-32s):
read_tables verifies each file whole before mapping it, and checks what the lookups rely on (ids
strictly ascending, as many rows as ids, the dtypes and shapes the JSON says); an export written
before "files" existed loads unverified, with a warning. An id the table does not
hold reads its initial value (pserver.sparse.initial_rows of the seed, the index and init_scale),
as a shard's lookup does. The directory is written as MODEL.PID.tmp and renamed
(pserver.persist.atomic): a reader never sees half a model, and the next writer removes what a
killed one left. Its tables are written page by page (TableRows): from arrays (export), or as
the shards stream them (--save, merged by merge_pages), never the whole table in memory.

A delta (`pserver export --since MODEL`, delta_tables) is such a directory whose JSON names its
base ("delta": the base's export_id) and whose tables hold the rows changed since and
tables/<name>.removed.npy; SavedModel.apply takes it in while serving, compact() writes the
result (docs/model-file.md, "Freshness: deltas"). A model without sparse tables has deltas too:
single files, like it, of its dense weights, whose JSON names their base the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import threading
import uuid

import numpy as np

from pserver import sparse
from pserver.errors import ConfigError, DataError, ModelFileError, UnsafeModelFile
from pserver.layers import saving
from pserver.models import DEFAULT_HIDDEN
from pserver.models.ctr import CTR_MODELS, ctr_arguments
from pserver.persist.atomic import fsync_dir, remove_stale, replace, synced
from pserver.sparse.compact import to_float32

log = logging.getLogger("pserver.model")

FORMAT = "pserver-model"
VERSION = 1                       # a dense model: one .npz
SPARSE_VERSION = 2                # a model with sparse tables: a directory (module docstring)
MODEL_NPZ = "model.npz"           # a sparse model's dense part, in its directory
TABLES = "tables"                 # its tables' .npy files
# what rebuilds a CTR model's layout (and its records: multi_hot, each field's list size)
CTR_ARGUMENTS = ("embedding_dim", "dense_features", "fields", "multi_hot")
META = "pserver_model"            # the .npz entry that holds the JSON
DATASET_FIELDS = ("dataset", "data_dir", "seed", "samples", "test_samples", "features", "classes")
FILES = "files"                   # the JSON's {path under MODEL/: {"bytes", "sha256"}}
HASH_CHUNK = 4 << 20              # bytes hashed per read when a file is verified
TRAINED_FIELDS = ("mode", "num_shards", "num_workers", "optimizer", "lr", "batch_size", "epochs",
                  "steps", "test_accuracy", "test_loss", "test_r2", "test_auc")


def definition(cfg, model, ds) -> dict:
    """How `pserver worker` built `model` from its flags: the spec (a user's file made absolute,
    so the file works from any directory), the arguments it was called with, and the dataset."""
    from pserver.models.user import is_path, is_user_spec
    spec = cfg.model
    if is_user_spec(spec):
        target, _, attr = spec.rpartition(":")
        if is_path(target):
            spec = f"{os.path.abspath(target)}:{attr}"
    arguments = {"input_shape": list(getattr(model, "input_shape", ds.sample_shape)),
                 "num_classes": ds.num_classes}
    if spec == "mlp":
        arguments["hidden"] = list(cfg.hidden or DEFAULT_HIDDEN)
    if spec in CTR_MODELS:       # its tower and its tables' and records' shapes
        arguments |= ctr_arguments(model)
    elif getattr(model, "sparse_tables", None):     # a user's model over records
        arguments["input_shape"] = []
    dataset = {k: getattr(cfg, k) for k in DATASET_FIELDS}
    for k in ("dataset", "data_dir"):       # paths, so that they hold from another directory
        if dataset[k] and (k == "data_dir" or dataset[k].lower().endswith(".npz")):
            dataset[k] = os.path.abspath(dataset[k])
    return {"model": spec, "arguments": arguments, "dataset": dataset}


def save(path: str, model, w: np.ndarray, definition: dict | None, summary: dict,
         tables: dict | None = None, origin: dict | None = None, delta: dict | None = None,
         removed: dict | None = None, export_id: str | None = None, layer_configs: bool = True) -> None:
    """Write the model file atomically (a temporary file renamed over `path`). Without a
    definition (a model built in Python), "model" is null: load it with load(path, model=...).

    A model with sparse tables needs `tables`, {name: (ids, rows)} for each of model.sparse_tables
    (any order of ids; written sorted); `path` is then a directory (module docstring), written
    beside it as PATH.PID.tmp and renamed. `origin` (where the weights came from) goes to the JSON.
    A table's rows may also come as TableRows (pages, ascending), written as they come.

    A delta (export --since) adds `delta` (its base: export_id, versions) to the JSON and writes
    `removed`, {name: sorted uint64 ids}, as tables/<name>.removed.npy. `export_id`: the id to
    record (compact() keeps the model's), else a new one. `layer_configs` False: no layers'
    configs for a model built in Python (a file read back only with load(path, model=...),
    whose layers need not be registered: a Keras fit's kept tables)."""
    layout = model.layout
    configs = list(getattr(model, "sparse_tables", None) or [])
    meta = {"format": FORMAT, "version": SPARSE_VERSION if configs else VERSION, "model": None,
            "arguments": {}, "dataset": None,
            **(definition or {}),
            "name": getattr(model, "name", type(model).__name__), "num_params": layout.total,
            "signature": layout.signature(),
            "layout": [{"name": t.name, "shape": list(t.shape)} for t in layout.tensors],
            "task": getattr(model, "task", None),
            "trained": {k: summary.get(k) for k in TRAINED_FIELDS}}
    if hasattr(model, "summary_text"):
        meta["summary"] = model.summary_text()
    elif hasattr(model, "summary"):
        meta["summary"] = model.summary()
    if meta["model"] is None and layer_configs and hasattr(model, "get_config"):
        # A model built in Python: its definition is its layers' configs (Keras's get_config),
        # from which load() builds it again.
        meta["sequential"] = model.get_config()
    if origin:
        meta["origin"] = origin
    meta["export_id"] = export_id or uuid.uuid4().hex    # what a delta names as its base (export --since)
    if delta:
        meta["delta"] = delta
    if not configs:
        if tables:
            raise ConfigError(f"{path}: tables given for a model without sparse tables")
        arrays = {META: np.array(json.dumps(meta, indent=1)), **layout.views(w)}
        _write_atomically(path, lambda tmp: _write_npz(tmp, arrays))
        return
    sources = {}
    for t in configs:
        if t.name not in (tables or {}):
            raise ConfigError(f"{path}: the rows of table {t.name!r} were not given; a model with sparse "
                              f"tables is saved with every table's rows")
        given = tables[t.name]
        sources[t.name] = given if isinstance(given, TableRows) else TableRows.of(t, *given)

    def write(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, TABLES))
        written, sums = {}, {}
        for i, t in enumerate(configs):
            n = _write_table(os.path.join(tmp, TABLES), t, sources[t.name], sums)
            ids = np.load(os.path.join(tmp, TABLES, f"{t.name}.ids.npy"), mmap_mode="r")
            same = next((name for name, other in written.items() if _equal(other, ids)), None)
            written[t.name] = ids
            meta.setdefault("tables", []).append({**t.to_dict(), "index": i, "rows": n,
                                                  **({"ids_as": same} if same else {})})
            if delta:
                gone = np.ascontiguousarray((removed or {}).get(t.name, np.empty(0, np.uint64)), np.uint64)
                meta["tables"][-1]["removed"] = int(gone.shape[0])
                with _SummedFile(os.path.join(tmp, TABLES, f"{t.name}.removed.npy"), sums) as f:
                    np.save(f, gone, allow_pickle=False)
        fsync_dir(os.path.join(tmp, TABLES))
        meta[FILES] = sums
        arrays = {META: np.array(json.dumps(meta, indent=1)), **layout.views(w)}
        _write_npz(os.path.join(tmp, MODEL_NPZ), arrays)
        fsync_dir(tmp)

    _write_atomically(path, write)


class TableRows:
    """A table's rows as they come: `count` rows in all, `pages` an iterator of (ids, rows) with
    the ids ascending across pages (a shard's ExportRows stream, the shards' streams merged, or
    arrays sorted in memory). save() writes them page by page."""

    def __init__(self, count: int, pages) -> None:
        self.count, self.pages = int(count), pages

    @classmethod
    def of(cls, config, ids, rows) -> TableRows:
        ids, rows = _sorted_table(config, ids, rows)
        return cls(ids.shape[0], iter([(ids, rows)]))


def merge_pages(streams: list):
    """Page iterators of ascending, disjoint ids (one per shard) merged into one ascending
    stream of pages: each round takes from every stream the ids up to the smallest of their
    pages' last ids, so at most a page per stream is held."""
    streams = [iter(s) for s in streams]
    held: list = [None] * len(streams)
    while True:
        for k, s in enumerate(streams):
            while s is not None and (held[k] is None or held[k][0].shape[0] == 0):
                held[k] = next(s, None)
                if held[k] is None:
                    streams[k] = s = None
        live = [k for k in range(len(streams)) if held[k] is not None]
        if not live:
            return
        cutoff = min(held[k][0][-1] for k in live)
        ids, rows = [], []
        for k in live:
            page_ids, page_rows = held[k]
            m = int(np.searchsorted(page_ids, cutoff, side="right"))
            ids.append(page_ids[:m])
            rows.append(page_rows[:m])
            held[k] = (page_ids[m:], page_rows[m:])
        ids, rows = np.concatenate(ids), np.concatenate(rows)
        order = np.argsort(ids, kind="stable")
        yield ids[order], rows[order]


def _npy_header(f, dtype, shape) -> None:
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": tuple(shape)})


class _SummedFile:
    """A file written (and fsynced on close) whose bytes are counted and hashed as they go:
    its entry in the JSON's "files", {"bytes", "sha256"}, is added to `sums` under its path
    below the model's directory (TABLES/NAME). np.save writes through write(), not tofile(),
    to an object that is not a real file."""

    def __init__(self, path: str, sums: dict | None) -> None:
        self.path, self.sums = path, sums
        self.f = open(path, "wb")
        self.hash, self.size = hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def __enter__(self) -> _SummedFile:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self.f.flush()
                os.fsync(self.f.fileno())
                if self.sums is not None:
                    self.sums[f"{TABLES}/{os.path.basename(self.path)}"] = {
                        "bytes": self.size, "sha256": self.hash.hexdigest()}
        finally:
            self.f.close()


def _write_table(directory: str, config, source: TableRows, sums: dict | None = None) -> int:
    """TABLE.ids.npy and TABLE.rows.npy from `source`, page by page (each file's header says
    the count it was promised), their bytes and sha256 added to `sums` (the JSON's "files");
    DataError when the pages break the promise: fewer or more rows, ids not ascending, another
    width. The rows keep the type they come in."""
    n, dim, written, last = source.count, config.dim, 0, None
    pages = iter(source.pages)
    first = next(pages, None)
    row_type = np.dtype(np.float32) if first is None else np.asarray(first[1]).dtype
    paths = [os.path.join(directory, f"{config.name}.{what}.npy") for what in ("ids", "rows")]
    with _SummedFile(paths[0], sums) as fi, _SummedFile(paths[1], sums) as fr:
        _npy_header(fi, np.uint64, (n,))
        _npy_header(fr, row_type.newbyteorder("<"), (n, dim))
        for ids, rows in itertools.chain([first] if first is not None else [], pages):
            ids = np.asarray(ids, dtype=np.uint64)
            rows = np.asarray(rows)
            if rows.shape != (ids.shape[0], dim) or rows.dtype != row_type:
                raise DataError(f"table {config.name!r}: a page of {ids.shape[0]} ids came with rows "
                                f"{rows.dtype}{list(rows.shape)}; expected {row_type}[{ids.shape[0]}, {dim}]")
            if ids.shape[0] == 0:
                continue
            if (last is not None and ids[0] <= last) or (ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all()):
                raise DataError(f"table {config.name!r}: ids not ascending (or an id twice) across pages")
            written += ids.shape[0]
            if written > n:
                raise DataError(f"table {config.name!r}: more than the {n} rows promised")
            fi.write(ids.astype("<u8", copy=False).tobytes())
            fr.write(np.ascontiguousarray(rows, dtype=row_type.newbyteorder("<")).tobytes())
            last = ids[-1]
        if written != n:
            raise DataError(f"table {config.name!r}: {written} rows came; {n} were promised")
    return n


def _equal(a: np.ndarray, b: np.ndarray, page: int = 1 << 20) -> bool:
    """Two (mapped) id arrays equal, compared a page at a time."""
    return a.shape == b.shape and all(np.array_equal(a[i:i + page], b[i:i + page])
                                      for i in range(0, a.shape[0], page))


def _sorted_table(config, ids, rows) -> tuple[np.ndarray, np.ndarray]:
    """A table's ids as sorted uint64 and its float32 rows in their order; DataError when the
    arrays do not fit the table (other lengths, another width, an id twice)."""
    ids = np.asarray(ids)
    rows = to_float32(rows, config.row_dtype)     # compact rows: their values (bfloat16: uint16 words)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or rows.shape != (ids.shape[0], config.dim):
        raise DataError(f"table {config.name!r}: ids {ids.dtype}{list(ids.shape)} and rows "
                        f"{rows.dtype}{list(rows.shape)} do not fit a table of dim {config.dim}")
    ids = ids.astype(np.uint64, copy=False)
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], np.ascontiguousarray(rows[order], dtype=np.float32)
    if ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all():
        raise DataError(f"table {config.name!r}: an id appears twice")
    return ids, rows


def _write_npz(path: str, arrays: dict) -> None:
    with synced(path) as f:
        np.savez(f, **arrays)


def _write_atomically(path: str, write) -> None:
    """atomic.replace, after what killed writers of path left is removed; a directory at path
    that is not a model is refused, not replaced."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MODEL_NPZ)):
        raise ConfigError(f"{path}: a directory that is not a pserver model; give another path")
    remove_stale(path)
    replace(path, write)


_NO_IDS = np.empty(0, np.uint64)


def _in_sorted(ids: np.ndarray, sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pos, hit): sorted_ids[pos[i]] == ids[i] where hit[i]."""
    if not sorted_ids.shape[0]:
        return np.zeros(ids.shape[0], np.intp), np.zeros(ids.shape[0], bool)
    pos = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.shape[0] - 1)
    return pos, sorted_ids[pos] == ids


class MappedTable:
    """One table of a sparse model: its sorted ids and rows memory-mapped; lookup() reads a row
    by binary search, and an id it does not hold as its initial value (as a shard does).

    Deltas applied (SavedModel.apply) change it while it serves: rows of ids it holds are
    overwritten in place (the rows are mapped copy-on-write from the file that was verified: the
    pages written become this process's own, the files and the pages other servers of the same
    model map stay as they were, whatever replaced the files since), new ids go to an overlay
    and removed ids to tombstones (they read their initial value). The overlay and tombstones
    are one tuple, built aside and swapped; a row is overwritten under the lock that lookups
    hold while they copy rows out: a lookup sees each row as it was before an apply or after
    it, never half."""

    def __init__(self, config, index: int, ids: np.ndarray, rows: np.ndarray, ids_as: str | None = None):
        self.config, self.index, self.ids, self.rows = config, index, ids, rows
        self.name, self.dim = config.name, config.dim
        self.ids_as = ids_as            # an earlier table whose ids are these (searched once for both)
        self.lock = threading.Lock()    # held while rows are copied out of self.rows or written into it
        self.extra = (_NO_IDS, np.empty((0, self.dim), np.float32), _NO_IDS)   # overlay ids, rows; tombstones

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pos, hit) for uint64 ids: self.ids[pos[i]] == ids[i] where hit[i]."""
        n = self.ids.shape[0]
        # Searched in sorted order: each search starts where the last ended, and neighbours share
        # the pages they touch (3x faster than in batch order on a table of 20M rows).
        order = np.argsort(ids)
        pos = np.empty(ids.shape[0], np.intp)
        pos[order] = np.searchsorted(self.ids, ids[order])
        if not n:
            return pos, np.zeros(ids.shape[0], bool)
        np.minimum(pos, n - 1, out=pos)
        return pos, self.ids[pos] == ids

    def lookup(self, ids: np.ndarray, out: np.ndarray, found=None) -> None:
        """out[i] = the row of ids[i] (uint64), else its initial value. `found`: find(ids), when
        known (from a table that holds the same ids)."""
        ids = np.asarray(ids, dtype=np.uint64)
        pos, hit = found if found is not None else self.find(ids)
        over_ids, over_rows, tombs = self.extra          # one read: an apply swaps the tuple
        if tombs.shape[0]:
            hit = hit & ~_in_sorted(ids, tombs)[1]
        if hit.all():
            with self.lock:
                np.take(self.rows, pos, axis=0, out=out)
            return
        with self.lock:
            out[hit] = self.rows[pos[hit]]
        miss = np.flatnonzero(~hit)
        if over_ids.shape[0]:
            at, there = _in_sorted(ids[miss], over_ids)
            out[miss[there]] = over_rows[at[there]]
            miss = miss[~there]
        initial = np.empty((miss.shape[0], self.dim), np.float32)
        c = self.config
        sparse.initial_rows(ids[miss], self.dim, c.seed, self.index, c.init_scale, initial)
        out[miss] = initial

    def prepare(self, ids: np.ndarray, rows: np.ndarray, removed: np.ndarray):
        """What apply() will do for a delta's changed rows (sorted ids) and removed ids, worked
        out without changing anything: (positions and rows to overwrite, the new extra tuple)."""
        over_ids, over_rows, tombs = self.extra
        pos, held = _in_sorted(ids, self.ids)
        # the overlay: its rows not removed and not changed, plus the changed ids the base lacks
        keep = ~_in_sorted(over_ids, np.union1d(removed, ids))[1]
        new_ids = np.concatenate([over_ids[keep], ids[~held]])
        new_rows = np.concatenate([over_rows[keep], rows[~held]])
        order = np.argsort(new_ids, kind="stable")
        # tombstones: removed ids the base holds, less the ids a row comes back to
        gone = removed[_in_sorted(removed, self.ids)[1]]
        tombs = np.setdiff1d(np.union1d(tombs, gone), ids[held], assume_unique=True)
        return (pos[held], rows[held]), (new_ids[order], new_rows[order], tombs)

    def commit(self, plan, page: int = 1 << 14) -> None:
        """apply()'s second half: rows overwritten in place (a page at a time under the lock),
        then the new overlay and tombstones swapped in."""
        (pos, rows), extra = plan
        if pos.shape[0]:
            if not self.rows.flags.writeable:     # rows given as read-only arrays: copied once
                with self.lock:
                    self.rows = np.array(self.rows)
            for a in range(0, pos.shape[0], page):
                with self.lock:
                    self.rows[pos[a:a + page]] = rows[a:a + page]
        self.extra = extra

    def pages(self, page: int = 1 << 16):
        """(ids, rows) pages of what the table reads now, ascending: the base less its tombstones,
        merged with the overlay (what compact() writes)."""
        over_ids, over_rows, tombs = self.extra

        def base():
            for a in range(0, self.ids.shape[0], page):
                ids = np.asarray(self.ids[a:a + page])
                keep = ~_in_sorted(ids, tombs)[1]
                with self.lock:
                    rows = np.asarray(self.rows[a:a + page])[keep]
                yield ids[keep], rows
        count = self.ids.shape[0] - tombs.shape[0] + over_ids.shape[0]
        return count, merge_pages([base(), iter([(over_ids, over_rows)])])

    def __repr__(self) -> str:
        return f"MappedTable({self.name}: {self.ids.shape[0]:,} rows x {self.dim})"


def _agree(a: np.ndarray, b: np.ndarray, samples: int = 64) -> bool:
    """Two sorted id arrays of one length agree at evenly spaced places and both ends (a check
    of "ids_as" that reads a few pages, not the files)."""
    if a.shape[0] == 0:
        return True
    at = np.unique(np.linspace(0, a.shape[0] - 1, samples).astype(np.intp))
    return bool((a[at] == b[at]).all())


def sums_of(path: str, meta: dict) -> dict | None:
    """The JSON's "files" (what verify() checks), or None for a model written before exports
    carried checksums: that one loads unverified, and says so (a warning naming it)."""
    sums = meta.get(FILES)
    if sums is None:
        log.warning("%s: written before exports carried checksums: its files are not verified (their "
                    "shapes and id order are checked); export it again to have them verified", path)
        return None
    if not isinstance(sums, dict) or not all(isinstance(v, dict) for v in sums.values()):
        raise DataError(f"{path}: the JSON's {FILES!r} is not an object of {{\"bytes\", \"sha256\"}} entries")
    return sums


def verify(path: str, sums: dict | None, name: str, f=None) -> str:
    """The file MODEL/NAME, checked against its entry in the JSON's "files" (its size, then the
    sha256 of every byte, read a few MiB at a time) before anything maps it; its path.
    DataError naming the file when it is not listed or differs. `sums` None: an export written
    before checksums (sums_of), not checked. `f`: that file already open (opened_verified), read
    from its start: what was checked is then what is read, whatever the path names meanwhile."""
    file = os.path.join(path, name)
    if sums is None:
        return file
    want = sums.get(name)
    if want is None:
        raise DataError(f"{file}: not in the model's list of files (the JSON's {FILES!r}): not written with "
                        "this model")
    try:
        with contextlib.nullcontext(f) if f is not None else open(file, "rb", buffering=0) as f:
            f.seek(0)
            size = os.fstat(f.fileno()).st_size
            if size != want.get("bytes"):
                raise DataError(f"{file}: {size} bytes; the model's JSON says {want.get('bytes')!r}: the "
                                "file changed since it was written")
            h, buf = hashlib.sha256(), bytearray(min(HASH_CHUNK, max(size, 1)))
            view = memoryview(buf)
            while k := f.readinto(buf):
                h.update(view[:k])
    except OSError as e:
        raise DataError(f"{file}: does not read ({e.strerror or e})") from None
    if h.hexdigest() != want.get("sha256"):
        raise DataError(f"{file}: sha256 {h.hexdigest()[:16]}... where the model's JSON says "
                        f"{str(want.get('sha256'))[:16]}...: the file changed since it was written")
    return file


def opened_verified(path: str, sums: dict | None, name: str, what: str):
    """MODEL/NAME opened once and verified through that open file (verify), rewound: a file the
    path names after the check (a compaction or an export replacing it) is never the one read."""
    file = os.path.join(path, name)
    try:
        f = open(file, "rb", buffering=0)
    except OSError as e:
        raise DataError(f"{path}: {what}: {file} does not read ({e.strerror or e})") from None
    try:
        verify(path, sums, name, f)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def ascending(file: str, ids: np.ndarray, page: int = 1 << 20) -> None:
    """DataError naming the file unless `ids` (mapped) are strictly ascending, which the
    lookups' binary search relies on (and which makes them unique); read a page at a time."""
    last = None
    for a in range(0, ids.shape[0], page):
        part = np.asarray(ids[a:a + page])
        if last is not None and part.shape[0] and part[0] <= last:
            bad = a
        elif part.shape[0] > 1 and not (part[1:] > part[:-1]).all():
            bad = a + 1 + int(np.argmin(part[1:] > part[:-1]))
        else:
            last = part[-1] if part.shape[0] else last
            continue
        raise DataError(f"{file}: ids not strictly ascending: id {int(ids[bad])} at row {bad} follows "
                        f"{int(ids[bad - 1])} (the ids are searched sorted, each once)")


def _mapped(path: str, sums: dict | None, name: str, what: str, mode: str = "r") -> np.ndarray:
    """MODEL/NAME verified (opened_verified), then memory-mapped from that open file: read-only
    ("r"), or copy-on-write ("c": a table's rows, which deltas overwrite; the pages written
    become this process's own, the file and the other servers' pages stay as they were)."""
    with opened_verified(path, sums, name, what) as f:
        try:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
            if dtype.hasobject:
                raise ValueError("it holds Python objects")
            return np.memmap(f, dtype=dtype, mode=mode, offset=f.tell(), shape=shape,
                             order="F" if fortran else "C")
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: {what}: {os.path.join(path, name)} does not load ({e})") from None


def read_tables(path: str, meta: dict) -> list[MappedTable]:
    """A sparse model directory's tables, each file verified against the JSON's sha256 before it
    is memory-mapped (sums_of, verify), and checked for what the lookups rely on: ids uint64
    strictly ascending, rows float32, as many of each as the JSON says. DataError naming the file."""
    out = []
    entries = meta.get("tables") or []
    sums = sums_of(path, meta) if entries else None
    for i, entry in enumerate(entries):
        try:
            config = sparse.TableConfig.from_dict({k: v for k, v in entry.items()
                                                   if k not in ("index", "rows", "ids_as", "removed")})
        except (ConfigError, TypeError) as e:
            raise DataError(f"{path}: table {i} of the JSON is not a table config ({e})") from None
        if entry.get("index") != i:
            raise DataError(f"{path}: table {config.name!r} has index {entry.get('index')!r}; expected {i}")
        names = {what: f"{TABLES}/{config.name}.{what}.npy" for what in ("ids", "rows")}
        ids, rows = (_mapped(path, sums, names[what], f"table {config.name!r}", mode)
                     for what, mode in (("ids", "r"), ("rows", "c")))
        n = entry.get("rows")
        if (ids.dtype != np.uint64 or ids.shape != (n,) or rows.dtype != np.float32
                or rows.shape != (n, config.dim)):
            raise DataError(f"{path}: table {config.name!r} holds ids {ids.dtype}{list(ids.shape)} and rows "
                            f"{rows.dtype}{list(rows.shape)}; the JSON says {n} rows of dim {config.dim}")
        same = entry.get("ids_as")
        if same is not None:
            earlier = next((t for t in out if t.name == same), None)
            # verified files of one sha256 hold the same ids, checked ascending as the earlier's
            if earlier is None or earlier.ids.shape != ids.shape or not (
                    sums[names["ids"]].get("sha256") == sums.get(f"{TABLES}/{same}.ids.npy", {}).get("sha256")
                    if sums is not None else _agree(earlier.ids, ids)):
                raise DataError(f"{path}: table {config.name!r} says its ids are table {same!r}'s; they "
                                "are not")
        if same is None or sums is None:
            ascending(os.path.join(path, names["ids"]), ids)
        out.append(MappedTable(config, i, ids, rows, same))
    return out


def removed_ids(path: str, entry: dict, sums: dict | None) -> np.ndarray:
    """A delta's TABLE.removed.npy, verified (verify): uint64, strictly ascending, as many as
    the JSON's "removed" says (when it says). DataError naming the file."""
    name = f"{TABLES}/{entry.get('name')}.removed.npy"
    file = os.path.join(path, name)
    try:
        with opened_verified(path, sums, name, "removed ids") as f:
            removed = np.load(f, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{file}: the removed ids do not load ({e})") from None
    if removed.dtype != np.uint64 or removed.ndim != 1:
        raise DataError(f"{file}: removed ids are {removed.dtype}{list(removed.shape)}; expected uint64 (n,)")
    if entry.get("removed", removed.shape[0]) != removed.shape[0]:
        raise DataError(f"{file}: holds {removed.shape[0]} removed ids; the JSON says {entry.get('removed')}")
    ascending(file, removed)
    return removed


class SavedModel:
    """A model and its trained weights, from a model file: predict, evaluate. A model with
    sparse tables has them memory-mapped (`.tables`, pserver.persist.model_file.MappedTable)."""

    def __init__(self, model, weights: np.ndarray, meta: dict, path: str,
                 tables: list | None = None) -> None:
        self.model, self.weights, self.meta, self.path = model, weights, meta, path
        self.tables = tables or []
        self._applying = threading.Lock()       # one apply() or compact() at a time

    def rows(self, ids_per_table) -> list:
        """The batch's TableLookups with their rows read from the tables (what a worker pulls
        from the shards); tables fed the same ids share one dedupe."""
        lookups, seen, found = [], {}, {}
        for ids, t in zip(ids_per_table, self.tables):      # (compact() swaps the list whole)
            first = seen.get(id(ids))
            lookup = sparse.TableLookup.like(first, t.dim) if first else sparse.TableLookup.of(ids, t.dim)
            seen.setdefault(id(ids), lookup)
            key = (id(lookup.uniq), t.ids_as or t.name)     # the same batch ids in the same sorted ids
            if key not in found:
                found[key] = t.find(lookup.uniq)
            t.lookup(lookup.uniq, lookup.rows, found[key])
            lookups.append(lookup)
        return lookups

    def _sparse(self) -> dict:
        return {"rows": self.rows} if self.tables else {}

    def predict(self, x, batch_size: int = 4096) -> np.ndarray:
        """The last layer's outputs for x, (n, units): logits for a classifier (their argmax
        is the class; a CTR model's one logit per record, whose sigmoid is the click
        probability), the predicted value for regression."""
        if not hasattr(self.model, "predict"):
            raise ConfigError(f"{self.path}: the model ({type(self.model).__name__}) has no predict()")
        return self.model.predict(self.weights, x, batch_size=batch_size, **self._sparse())

    def evaluate(self, x, y, batch_size: int = 4096) -> dict:
        """{"loss", "accuracy"} (and "auc" for a binary loss), or {"loss", "r2"}."""
        return self.model.evaluate(self.weights, x, y, batch_size=batch_size, **self._sparse())

    def apply(self, delta: str, exclusive=None) -> dict:
        """Bring this serving copy up to a delta written by `pserver export --since` of this
        model (or of the model its last applied delta made): changed rows overwrite in place,
        new ids go to an overlay, removed ids read their initial value again; the dense weights
        are replaced. Safe while other threads predict (MappedTable). A delta of another model,
        out of order, or with a file that fails its checksum or checks (read_tables,
        removed_ids), is refused (DataError) and nothing changes. Returns its counts.
        `exclusive`: a context manager held while the delta is committed (the files read, verified
        and planned before it): a server's write lock, so that no request sees half a delta."""
        with self._applying:
            meta, arrays = read(delta)
            info = meta.get("delta")
            if not isinstance(info, dict):
                raise DataError(f"{delta}: not a delta (a whole model): load it with load_model")
            mine = self.meta.get("export_id")
            if info.get("base_id") != mine:
                raise DataError(f"{delta}: a delta of model {info.get('base_id')} (version "
                                f"{info.get('base_version')}); this copy is model {mine} (version "
                                f"{(self.meta.get('origin') or {}).get('version')}): apply the deltas "
                                "of this model, in the order they were exported")
            weights = weights_of(delta, meta, arrays, self.model.layout)
            entries = meta.get("tables") or []
            if [(e.get("name"), e.get("dim")) for e in entries] != [(t.name, t.dim) for t in self.tables]:
                raise DataError(f"{delta}: holds tables {[(e.get('name'), e.get('dim')) for e in entries]}; "
                                f"this model has {[(t.name, t.dim) for t in self.tables]}")
            plans, counts = [], {}
            parts = read_tables(delta, meta)        # every file verified before any is used
            sums = meta.get(FILES)
            for t, part, entry in zip(self.tables, parts, entries):
                if not np.isfinite(part.rows).all():          # a shard never holds one: not trained
                    raise DataError(f"{delta}: table {t.name!r} has rows that are not finite (NaN or "
                                    "Inf); nothing applied")
                removed = removed_ids(delta, entry, sums)
                plans.append(t.prepare(np.asarray(part.ids), np.asarray(part.rows), removed))
                counts[t.name] = {"changed": int(part.ids.shape[0]), "removed": int(removed.shape[0])}
            with exclusive if exclusive is not None else contextlib.nullcontext():
                for t, plan in zip(self.tables, plans):     # nothing changed before this point
                    t.commit(plan)
                self.weights = weights
                self.meta = {**self.meta, "export_id": meta["export_id"], "origin": meta.get("origin"),
                             "trained": meta.get("trained")}
            return counts

    def compact(self, out: str | None = None) -> None:
        """Write the model as it reads now (deltas applied) to `out` (default: the directory it
        was loaded from, replaced atomically) and serve from those files, mapped as load maps them. The
        files are what `pserver export` of the same checkpoints writes, row for row."""
        with self._applying:
            out = out or self.path
            tables = {}
            for t in self.tables:
                count, pages = t.pages()
                tables[t.name] = TableRows(count, pages)
            definition = {k: self.meta.get(k) for k in ("model", "arguments", "dataset")}
            save(out, self.model, self.weights, definition, self.meta.get("trained") or {}, tables=tables,
                 origin=self.meta.get("origin"), export_id=self.meta.get("export_id"))
            meta, _ = read(out)
            self.tables = tables_of(out, meta, self.model)
            self.meta, self.path = meta, out

    def __repr__(self) -> str:
        tables = "".join(f" + table {t.name} ({t.ids.shape[0]:,} rows x {t.dim})" for t in self.tables)
        return f"SavedModel({self.path}: {self.meta['name']}, {self.meta['num_params']:,} parameters{tables})"


def load(path: str, model=None, safe_mode: bool = True) -> SavedModel:
    """Read a model file. The model is built again from its definition, unless `model` is
    given: a Sequential (or model object) of the same layout, or a --model spec string. A file
    whose definition names Python code (a --model FILE.py:FUNCTION or package.module:FUNCTION)
    is refused with UnsafeModelFile unless `safe_mode` is False (as Keras's load_model: a file
    from elsewhere runs no code unless the caller allows it); a malformed one raises
    ModelFileError naming what is wrong."""
    if not isinstance(safe_mode, bool):
        raise ConfigError(f"load_model: safe_mode must be True or False, got {safe_mode!r}")
    meta, arrays = read(path)
    refuse_delta(path, meta)
    if model is None and meta.get("model") is None and not meta.get("sequential"):
        raise ConfigError(f"{path}: was saved from a model built in Python, which the file cannot "
                          f"rebuild; give it: load_model({path!r}, model=...)")
    if isinstance(model, str):                   # the caller's --model spec, with the file's arguments
        model = build(meta, model)
    if model is None and meta.get("model") is not None:
        if not isinstance(meta["model"], str):
            raise ModelFileError(f"{path}: 'model' is {meta['model']!r}, not a model's name")
        if safe_mode:
            refuse_code(path, meta)
    with model_file_errors(path), saving.loading(safe_mode):      # the file's own definition
        if model is None and meta.get("model") is None:
            from pserver.models import from_config
            model = from_config(meta["sequential"])
        elif model is None:
            model = build(meta, meta["model"])
    weights = weights_of(path, meta, arrays, model.layout)
    return SavedModel(model, weights, meta, path, tables_of(path, meta, model))


def refuse_code(path: str, meta: dict) -> None:
    """UnsafeModelFile when the file's definition names Python code to import and call (a
    --model FILE.py:FUNCTION or package.module:FUNCTION): loading it runs that code."""
    from pserver.models.user import is_user_spec
    spec = meta.get("model")
    if isinstance(spec, str) and is_user_spec(spec):
        raise UnsafeModelFile(f"{path}: its model is built by Python code ({spec}), which loading would "
                              f"import and run; a model file runs no code unless you trust it: "
                              f"load_model({path!r}, safe_mode=False), or give the model: model=...")


def refuse_delta(path: str, meta: dict) -> None:
    """DataError when the file read is a delta, which is applied, not loaded."""
    if meta.get("delta"):
        raise DataError(f"{path}: a delta (pserver export --since), not a model: apply it to the model it "
                        f"was exported since: load_model(MODEL).apply({path!r})")


@contextlib.contextmanager
def model_file_errors(path: str):
    """A model file whose definition does not build (a layer class neither built in nor
    registered in this process, an unknown optimizer, a malformed config or field) raises
    ModelFileError naming the file and what is wrong."""
    try:
        yield
    except ModelFileError as e:
        raise type(e)(f"{path}: {e}") from None
    except (ConfigError, DataError) as e:
        raise ModelFileError(f"{path}: {e}") from None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError, MemoryError) as e:
        raise ModelFileError(f"{path}: a malformed model definition ({type(e).__name__}: {e})") from None


def tables_of(path: str, meta: dict, model) -> list[MappedTable]:
    """The file's tables (none for a dense model), checked against the model's: the same names
    and widths, in order. DataError naming the first difference."""
    tables = read_tables(path, meta) if meta.get("version") == SPARSE_VERSION else []
    want = [(t.name, t.dim) for t in getattr(model, "sparse_tables", None) or []]
    got = [(t.name, t.dim) for t in tables]
    if want != got:
        raise DataError(f"{path}: holds sparse tables {got or 'none'}; the model "
                        f"({getattr(model, 'name', type(model).__name__)}) has {want or 'none'}")
    return tables


def since_meta(since: str) -> dict:
    """The JSON of a model that deltas may be written since (`export --since`); ConfigError in
    one line for a delta, and for a model written before deltas."""
    meta, _ = read(since, arrays=False)
    if meta.get("delta"):
        raise ConfigError(f"--since: {since} is a delta; give the model it applies to, compacted "
                          "(SavedModel.compact) after its deltas")
    if not (meta.get("origin") or {}).get("versions") or not meta.get("export_id"):
        raise ConfigError(f"--since: {since} does not record the versions it reflects (written before "
                          "deltas existed); export the checkpoints in full once")
    return meta


def delta_tables(since: str, model, ckpt, configs: list[sparse.TableConfig]) -> tuple[dict, dict, dict]:
    """For `pserver export --since MODEL`: each table's rows last updated at or after the version
    MODEL reflects on the row's shard (a row stepped from version v to v+1 records v) and the ids
    MODEL holds that the checkpoint `ckpt` (combined) does not; and the delta's base (JSON)."""
    meta = since_meta(since)
    origin = meta["origin"]
    if origin.get("job") != ckpt.signature:
        raise ConfigError(f"--since: {since} is a model of another job (layout {origin.get('job')}); the "
                          f"checkpoints are of {ckpt.signature}")
    versions = np.asarray(origin["versions"], np.int64)
    if ckpt.version < versions.max():
        raise ConfigError(f"--since: {since} reflects version {int(versions.max())}, newer than the "
                          f"checkpoints' {ckpt.version}")
    base = {t.name: t for t in tables_of(since, meta, model)}
    tables, removed = {}, {}
    for t in configs:
        rows = ckpt.rows[t.name]
        ids = rows.ids.astype(np.uint64, copy=False)
        changed = rows.last_update >= versions[sparse.shard_of(ids, versions.shape[0])]
        tables[t.name] = (ids[changed], rows.rows[changed])
        removed[t.name] = np.setdiff1d(np.asarray(base[t.name].ids), np.sort(ids), assume_unique=True)
    delta = {"base_id": meta["export_id"], "base_version": int(versions.max()),
             "base_versions": origin["versions"]}
    return tables, removed, delta


def build(meta: dict, spec: str, hidden=None):
    """The model `spec` called with the file's arguments (hidden widths: these, if given)."""
    from pserver.models import make_model
    args = meta.get("arguments") or {}
    if not {"input_shape", "num_classes"} <= set(args):
        raise DataError(f"model file: 'arguments' lacks input_shape or num_classes ({args})")
    hidden = hidden or tuple(args.get("hidden", DEFAULT_HIDDEN))
    options = {k: args[k] for k in CTR_ARGUMENTS if k in args}
    return make_model(spec, tuple(args["input_shape"]), args["num_classes"], hidden=hidden, **options)


def read(path: str, arrays: bool = True) -> tuple[dict, dict]:
    """The JSON and the dense arrays of a model file, or of a sparse model's directory (without
    `arrays`: the JSON alone, the weights left unread)."""
    wanted = arrays
    sparse_dir = os.path.isdir(path)
    file = os.path.join(path, MODEL_NPZ) if sparse_dir else path
    if sparse_dir and not os.path.isfile(file):
        raise DataError(f"{path}: a directory without {MODEL_NPZ}: not a pserver model")
    if not os.path.isfile(file):
        raise DataError(f"{path}: no such model file")
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if wanted or k == META}
        meta = json.loads(str(arrays.pop(META)))
    except KeyError:
        raise DataError(f"{file}: not a pserver model file (no {META!r} entry)") from None
    except Exception as e:   # a damaged zip, a pickled array, bad JSON: several types
        raise DataError(f"{file}: not a readable pserver model file ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{file}: not a pserver model file (format {meta.get('format')!r})"
                        if isinstance(meta, dict) else f"{file}: {META} is not a JSON object")
    version = VERSION if not sparse_dir else SPARSE_VERSION
    if meta.get("version") != version:
        if meta.get("version") in (VERSION, SPARSE_VERSION):
            raise DataError(f"{path}: model version {meta['version']} in a "
                            f"{'directory' if sparse_dir else 'single file'}; a model with sparse tables "
                            f"is a directory (version {SPARSE_VERSION}), a dense one a file ({VERSION})")
        raise DataError(f"{path}: model file version {meta.get('version')!r}; this pserver reads "
                        f"{VERSION} and {SPARSE_VERSION}")
    bad = misshapen(meta)
    if bad:
        raise DataError(f"{file}: not a pserver model file: its JSON's {bad}")
    return meta, arrays


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def misshapen(meta: dict) -> str:
    """What in a model file's JSON has the wrong type for what reads it (a loader, a server
    applying a delta, its status), or "": checked when the file is read, before anything of it
    is used, so that a file whose checksums hold but whose JSON does not (written by hand, or by
    something else) is refused whole rather than half applied."""
    if "export_id" in meta and not (isinstance(meta["export_id"], str) and meta["export_id"]):
        return f'"export_id" is {meta["export_id"]!r}, not a non-empty string'
    origin = meta.get("origin")
    if origin is not None:
        if not isinstance(origin, dict):
            return f'"origin" is {origin!r}, not an object'
        if "version" in origin and not _integer(origin["version"]):
            return f'"origin"."version" is {origin["version"]!r}, not an integer'
        versions = origin.get("versions")
        if versions is not None and not (isinstance(versions, list) and all(map(_integer, versions))):
            return f'"origin"."versions" is {versions!r}, not a list of integers'
        if origin.get("job") is not None and not isinstance(origin["job"], str):
            return f'"origin"."job" is {origin["job"]!r}, not a string'
    tables = meta.get("tables")
    if tables is not None and not (isinstance(tables, list) and all(isinstance(t, dict) for t in tables)):
        return f'"tables" is {str(tables)[:80]!r}, not a list of objects'
    for key in ("delta", "trained"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            return f'"{key}" is {str(meta[key])[:80]!r}, not an object'
    delta = meta.get("delta") or {}
    if "base_id" in delta and not isinstance(delta["base_id"], str):
        return f'"delta"."base_id" is {delta["base_id"]!r}, not a string'
    if delta and not isinstance(meta.get("export_id"), str):
        return '"export_id" is missing: a delta names the export it makes'
    return ""


def weights_of(path: str, meta: dict, arrays: dict, layout) -> np.ndarray:
    """The flat vector of `layout` from the file's tensors; ModelFileError when they differ."""
    if meta.get("signature") != layout.signature():
        raise ModelFileError(f"{path}: its weights are for layout {meta.get('signature')} "
                        f"({', '.join(t['name'] + str(t['shape']) for t in meta.get('layout', []))}); "
                        f"the model given is {layout.signature()} ({layout.describe()})")
    for t in layout.tensors:           # before the flat vector is allocated: the file's own sizes
        a = arrays.get(t.name)
        if a is None or a.shape != tuple(t.shape) or a.dtype != np.float32:
            got = "missing" if a is None else f"{a.dtype} {a.shape}"
            raise ModelFileError(f"{path}: tensor {t.name} is {got}; expected float32 {tuple(t.shape)}")
    flat = np.empty(layout.total, dtype=np.float32)
    for name, view in layout.views(flat).items():
        view[...] = arrays[name]
    if not np.isfinite(flat).all():
        raise DataError(f"{path}: the weights hold NaN or Inf")
    return flat


__all__ = ["FORMAT", "VERSION", "SPARSE_VERSION", "META", "MappedTable", "SavedModel", "TableRows",
           "definition", "save", "merge_pages", "delta_tables",
           "load", "read", "read_tables", "verify", "tables_of", "build", "weights_of",
           "refuse_code", "model_file_errors"]
