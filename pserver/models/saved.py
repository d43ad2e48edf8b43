"""The model file: a trained model's definition and weights in one .npz that numpy alone reads;
a model with sparse tables (the CTR models) is a directory that adds each table's rows.

    pserver worker|launch ... --save model.npz      the chief writes it after the final evaluation
    pserver export --restore ckpt --model wide_deep --dataset criteo-synthetic --out ctr-model
                                                     a sparse model from checkpoints (pserver.api)
    pserver evaluate --model-file model.npz          its test metrics (pserver.api.evaluate_files)
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
read with np.load(mmap_mode="r"), so a table need not fit in memory. An id the table does not
hold reads its initial value (pserver.sparse.initial_rows of the seed, the index and init_scale),
as a shard's lookup does. The directory is written as MODEL.tmp-PID and renamed: a reader never
sees half a model, and the next writer removes what a killed one left.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np

from pserver import sparse
from pserver.errors import ConfigError, DataError
from pserver.models import DEFAULT_HIDDEN
from pserver.sparse.compact import to_float32

FORMAT = "pserver-model"
VERSION = 1                       # a dense model: one .npz
SPARSE_VERSION = 2                # a model with sparse tables: a directory (module docstring)
MODEL_NPZ = "model.npz"           # a sparse model's dense part, in its directory
TABLES = "tables"                 # its tables' .npy files
CTR_ARGUMENTS = ("embedding_dim", "dense_features", "fields")   # what rebuilds a CTR model's layout
META = "pserver_model"            # the .npz entry that holds the JSON
DATASET_FIELDS = ("dataset", "data_dir", "seed", "samples", "test_samples", "features", "classes")
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
    if getattr(model, "sparse_tables", None):       # a CTR model: its tower and its tables' shapes
        arguments["input_shape"] = []
        arguments["hidden"] = [layer.units for layer in model.deep[:-1]]
        arguments["embedding_dim"] = model.factors.output_dim if model.factors is not None else 8
        arguments["dense_features"] = model.linear.input_shape[0]
        arguments["fields"] = model.fields
    dataset = {k: getattr(cfg, k) for k in DATASET_FIELDS}
    for k in ("dataset", "data_dir"):       # paths, so that they hold from another directory
        if dataset[k] and (k == "data_dir" or dataset[k].lower().endswith(".npz")):
            dataset[k] = os.path.abspath(dataset[k])
    return {"model": spec, "arguments": arguments, "dataset": dataset}


def save(path: str, model, w: np.ndarray, definition: dict | None, summary: dict,
         tables: dict | None = None, origin: dict | None = None) -> None:
    """Write the model file atomically (a temporary file renamed over `path`). Without a
    definition (a model built in Python), "model" is null: load it with load(path, model=...).

    A model with sparse tables needs `tables`, {name: (ids, rows)} for each of model.sparse_tables
    (any order of ids; written sorted); `path` is then a directory (module docstring), written
    beside it as PATH.tmp-PID and renamed. `origin` (where the weights came from) goes to the JSON."""
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
    if hasattr(model, "summary"):
        meta["summary"] = model.summary()
    if origin:
        meta["origin"] = origin
    if not configs:
        if tables:
            raise ConfigError(f"{path}: tables given for a model without sparse tables")
        arrays = {META: np.array(json.dumps(meta, indent=1)), **layout.views(w)}
        _write_atomically(path, lambda tmp: _write_npz(tmp, arrays), f"{path}.{os.getpid()}.tmp")
        return
    sorted_tables = {}
    for i, t in enumerate(configs):
        if t.name not in (tables or {}):
            raise ConfigError(f"{path}: the rows of table {t.name!r} were not given; a model with sparse "
                              f"tables is saved with every table's rows")
        ids, rows = _sorted_table(t, *tables[t.name])
        same = next((name for name, (other, _) in sorted_tables.items() if np.array_equal(other, ids)), None)
        sorted_tables[t.name] = (ids, rows)
        meta.setdefault("tables", []).append({**t.to_dict(), "index": i, "rows": int(ids.shape[0]),
                                              **({"ids_as": same} if same else {})})
    arrays = {META: np.array(json.dumps(meta, indent=1)), **layout.views(w)}

    def write(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, TABLES))
        _write_npz(os.path.join(tmp, MODEL_NPZ), arrays)
        for name, (ids, rows) in sorted_tables.items():
            for what, a in (("ids", ids), ("rows", rows)):
                with open(os.path.join(tmp, TABLES, f"{name}.{what}.npy"), "wb") as f:
                    np.save(f, a, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
        _fsync_dir(os.path.join(tmp, TABLES))
        _fsync_dir(tmp)

    remove_stale(path)
    _write_atomically(path, write, f"{path}.tmp-{os.getpid()}")


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
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: str, write, tmp: str) -> None:
    """write(tmp), then tmp renamed to path. A directory at path (an older sparse model) is moved
    aside first and removed after; a directory that is not a model is refused, not replaced."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MODEL_NPZ)):
        raise ConfigError(f"{path}: a directory that is not a pserver model; give another path")
    aside = f"{path}.old-{os.getpid()}"
    try:
        write(tmp)
        if os.path.isdir(path):
            os.rename(path, aside)
        elif os.path.isdir(tmp) and os.path.lexists(path):
            os.remove(path)             # a dense model file replaced by a sparse model's directory
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        _remove(tmp)
        raise
    _remove(aside)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def remove_stale(path: str) -> list[str]:
    """What writers of `path` that were killed left beside it (PATH.tmp-PID, PATH.old-PID of a
    process that is gone), removed; their paths."""
    removed = []
    for leftover in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        pid = leftover.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(leftover)
            removed.append(leftover)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                # ours, from an earlier call that failed: not in use
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MappedTable:
    """One table of a sparse model: its sorted ids and rows memory-mapped; lookup() reads a row
    by binary search, and an id it does not hold as its initial value (as a shard does)."""

    def __init__(self, config, index: int, ids: np.ndarray, rows: np.ndarray, ids_as: str | None = None):
        self.config, self.index, self.ids, self.rows = config, index, ids, rows
        self.name, self.dim = config.name, config.dim
        self.ids_as = ids_as            # an earlier table whose ids are these (searched once for both)

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
        if hit.all():
            np.take(self.rows, pos, axis=0, out=out)
            return
        out[hit] = self.rows[pos[hit]]
        miss = ~hit
        initial = np.empty((int(miss.sum()), self.dim), np.float32)
        c = self.config
        sparse.initial_rows(ids[miss], self.dim, c.seed, self.index, c.init_scale, initial)
        out[miss] = initial

    def __repr__(self) -> str:
        return f"MappedTable({self.name}: {self.ids.shape[0]:,} rows x {self.dim})"


def _agree(a: np.ndarray, b: np.ndarray, samples: int = 64) -> bool:
    """Two sorted id arrays of one length agree at evenly spaced places and both ends (a check
    of "ids_as" that reads a few pages, not the files)."""
    if a.shape[0] == 0:
        return True
    at = np.unique(np.linspace(0, a.shape[0] - 1, samples).astype(np.intp))
    return bool((a[at] == b[at]).all())


def read_tables(path: str, meta: dict) -> list[MappedTable]:
    """A sparse model directory's tables, memory-mapped; DataError naming a missing or bad file."""
    out = []
    for i, entry in enumerate(meta.get("tables") or []):
        try:
            config = sparse.TableConfig.from_dict({k: v for k, v in entry.items()
                                                   if k not in ("index", "rows", "ids_as")})
        except (ConfigError, TypeError) as e:
            raise DataError(f"{path}: table {i} of the JSON is not a table config ({e})") from None
        if entry.get("index") != i:
            raise DataError(f"{path}: table {config.name!r} has index {entry.get('index')!r}; expected {i}")
        arrays = {}
        for what in ("ids", "rows"):
            file = os.path.join(path, TABLES, f"{config.name}.{what}.npy")
            try:
                arrays[what] = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: table {config.name!r}: {file} does not load ({e})") from None
        ids, rows = arrays["ids"], arrays["rows"]
        n = entry.get("rows")
        if (ids.dtype != np.uint64 or ids.shape != (n,) or rows.dtype != np.float32
                or rows.shape != (n, config.dim)):
            raise DataError(f"{path}: table {config.name!r} holds ids {ids.dtype}{list(ids.shape)} and rows "
                            f"{rows.dtype}{list(rows.shape)}; the JSON says {n} rows of dim {config.dim}")
        same = entry.get("ids_as")
        if same is not None:
            earlier = next((t for t in out if t.name == same), None)
            if earlier is None or earlier.ids.shape != ids.shape or not _agree(earlier.ids, ids):
                raise DataError(f"{path}: table {config.name!r} says its ids are table {same!r}'s; they "
                                "are not")
        out.append(MappedTable(config, i, ids, rows, same))
    return out


class SavedModel:
    """A model and its trained weights, from a model file: predict, evaluate. A model with
    sparse tables has them memory-mapped (`.tables`, pserver.models.saved.MappedTable)."""

    def __init__(self, model, weights: np.ndarray, meta: dict, path: str,
                 tables: list | None = None) -> None:
        self.model, self.weights, self.meta, self.path = model, weights, meta, path
        self.tables = tables or []

    def rows(self, ids_per_table) -> list:
        """The batch's TableLookups with their rows read from the tables (what a worker pulls
        from the shards); tables fed the same ids share one dedupe."""
        lookups, seen, found = [], {}, {}
        for ids, t in zip(ids_per_table, self.tables):
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

    def __repr__(self) -> str:
        tables = "".join(f" + table {t.name} ({t.ids.shape[0]:,} rows x {t.dim})" for t in self.tables)
        return f"SavedModel({self.path}: {self.meta['name']}, {self.meta['num_params']:,} parameters{tables})"


def load(path: str, model=None) -> SavedModel:
    """Read a model file. The model is built again from its definition, unless `model` is
    given: a Sequential (or model object) of the same layout, or a --model spec string."""
    meta, arrays = read(path)
    if model is None and meta.get("model") is None:
        raise ConfigError(f"{path}: was saved from a model built in Python, which the file cannot "
                          f"rebuild; give it: load_model({path!r}, model=...)")
    if model is None or isinstance(model, str):
        model = build(meta, model or meta["model"])
    weights = weights_of(path, meta, arrays, model.layout)
    return SavedModel(model, weights, meta, path, tables_of(path, meta, model))


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


def build(meta: dict, spec: str, hidden=None):
    """The model `spec` called with the file's arguments (hidden widths: these, if given)."""
    from pserver.models import make_model
    args = meta.get("arguments") or {}
    if not {"input_shape", "num_classes"} <= set(args):
        raise DataError(f"model file: 'arguments' lacks input_shape or num_classes ({args})")
    hidden = hidden or tuple(args.get("hidden", DEFAULT_HIDDEN))
    options = {k: args[k] for k in CTR_ARGUMENTS if k in args}
    return make_model(spec, tuple(args["input_shape"]), args["num_classes"], hidden=hidden, **options)


def read(path: str) -> tuple[dict, dict]:
    """The JSON and the dense arrays of a model file, or of a sparse model's directory."""
    sparse_dir = os.path.isdir(path)
    file = os.path.join(path, MODEL_NPZ) if sparse_dir else path
    if sparse_dir and not os.path.isfile(file):
        raise DataError(f"{path}: a directory without {MODEL_NPZ}: not a pserver model")
    if not os.path.isfile(file):
        raise DataError(f"{path}: no such model file")
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
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
    return meta, arrays


def weights_of(path: str, meta: dict, arrays: dict, layout) -> np.ndarray:
    """The flat vector of `layout` from the file's tensors; DataError when they differ."""
    if meta.get("signature") != layout.signature():
        raise DataError(f"{path}: its weights are for layout {meta.get('signature')} "
                        f"({', '.join(t['name'] + str(t['shape']) for t in meta.get('layout', []))}); "
                        f"the model given is {layout.signature()} ({layout.describe()})")
    flat = np.empty(layout.total, dtype=np.float32)
    for name, view in layout.views(flat).items():
        a = arrays.get(name)
        if a is None or a.shape != view.shape or a.dtype != np.float32:
            got = "missing" if a is None else f"{a.dtype} {a.shape}"
            raise DataError(f"{path}: tensor {name} is {got}; expected float32 {view.shape}")
        view[...] = a
    if not np.isfinite(flat).all():
        raise DataError(f"{path}: the weights hold NaN or Inf")
    return flat


__all__ = ["FORMAT", "VERSION", "SPARSE_VERSION", "META", "MappedTable", "SavedModel", "definition", "save",
           "load", "read", "read_tables", "tables_of", "remove_stale", "build", "weights_of"]
