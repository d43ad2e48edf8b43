"""Checkpoints read offline: `pserver export` (the model a directory's checkpoints hold, written as
a model file, or a delta since one) and `pserver evaluate` (a model file's or a directory's
weights on the test set). The state read is the one a restore reads (checkpoint_dir);
the model and its data are built as a worker builds them (pserver.build). No server runs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from pserver import models
from pserver.build import fit_data, load_data, model_for
from pserver.config import WorkerConfig, check_directory_writable, check_writable
from pserver.data import load_dataset
from pserver.errors import ConfigError, DataError
from pserver.models.ctr import CTR_MODELS
from pserver.persist import atomic, checkpoint_dir, model_file
from pserver.persist.checkpoint import scan
from pserver.persist.reshard import combine


def evaluate_files(model_path: str | None, checkpoint: str | None, options: dict, mode: str = "sync") -> dict:
    """`pserver evaluate`: the test metrics of a model with the weights of a model file or of
    the checkpoints in `checkpoint` (the state a restore in `mode` reads). The model and dataset
    are the file's unless `options` (the flags given: model, hidden and the dataset fields) say
    otherwise. A model file that is not one (or not of the model given) is the user's mistake
    here: ConfigError, exit 2."""
    if model_path is None and checkpoint is None:
        raise ConfigError("--model-file: give the model file (--model-file PATH), checkpoints "
                          "(--checkpoint DIR, with --model and the dataset flags), or both")
    with _the_model_file():
        meta, arrays = model_file.read(model_path) if model_path else ({}, {})
        model_file.refuse_delta(model_path, meta)
    spec = options.get("model") or (meta.get("model") if meta else "mlp")
    if spec is None and not meta.get("sequential"):
        raise ConfigError(f"--model: {model_path} was saved from a model built in Python; give its "
                          "definition with --model FILE.py:FUNCTION")
    model = tables = None
    if meta:
        model, weights, source, tables = _from_file(model_path, meta, arrays, spec, options, checkpoint)
    data = {k: v for k, v in (meta.get("dataset") or {}).items() if k in model_file.DATASET_FIELDS}
    data |= {k: options[k] for k in model_file.DATASET_FIELDS if options.get(k) is not None}
    task = models.task_of(spec) if spec is not None else model.task
    ds = load_dataset(data.pop("dataset", "synthetic"), task=task, **data)
    if model is None:          # as the worker built it: for the dataset's samples and classes
        model = models.make_model(spec, ds.sample_shape, ds.num_classes,
                                  hidden=options.get("hidden") or models.DEFAULT_HIDDEN)
    if checkpoint and getattr(model, "sparse_tables", None):
        raise ConfigError(f"--checkpoint: model {spec} keeps sparse tables, which --checkpoint does not "
                          f"read; export the checkpoints first (pserver export --restore {checkpoint} "
                          f"--model {spec} ... --out MODEL) and evaluate --model-file MODEL")
    sparse_rows = {}
    if checkpoint:
        weights, versions = checkpoint_dir.load_weights(checkpoint, model.layout, mode)
        source = f"{checkpoint} (shard versions {', '.join(map(str, versions))})"
    elif tables:
        sparse_rows = {"rows": model_file.SavedModel(model, weights, meta, model_path, tables).rows}
    ds = fit_data(model, ds)
    metrics = model.evaluate(weights, ds.x_test, ds.y_test, **sparse_rows)
    return {"model": getattr(model, "name", type(model).__name__), "num_params": model.layout.total,
            "weights": source, "dataset": ds.name, "test_samples": ds.num_test,
            **{f"test_{k}": v for k, v in metrics.items()}}


def _from_file(path: str, meta: dict, arrays: dict, spec: str | None, options: dict, checkpoint) -> tuple:
    """(model, weights, source, tables) of the file --model-file names, read and verified before
    the dataset loads (weights and tables None when --checkpoint gives them): a model.save
    file's built from its layers' configs in safe mode, else `spec` with the file's arguments."""
    with _the_model_file():
        if spec is None:
            saved = model_file.load(path)
            return saved.model, saved.weights, path, None
        model = model_file.build(meta, spec, options.get("hidden"))
        if checkpoint:
            return model, None, None, None
        return (model, model_file.weights_of(path, meta, arrays, model.layout), path,
                model_file.tables_of(path, meta, model))


@contextlib.contextmanager
def _the_model_file():
    """Reading the file named by --model-file: one that is not a model (of this kind) is the
    user's mistake, ConfigError; the dataset's errors stay DataError."""
    try:
        yield
    except DataError as e:
        raise ConfigError(f"--model-file: {e}") from None


def export_checkpoints(directory: str, out: str, options: dict, mode: str = "sync",
                       since: str | None = None, built: dict | None = None,
                       state: checkpoint_dir.Usable | None = None) -> dict:
    """`pserver export`: the model a directory's checkpoints hold (the newest usable set of any
    number of shards, as a restore reads it), written as a model file at `out`, a directory for
    a model with sparse tables (pserver.persist.model_file). `options` are the worker's model and
    dataset flags given (model is required); the seed and the embedding width default to the
    checkpoints' tables'. Returns what was written.

    `since`: a model of this job (an export, a --save, or one with deltas applied and compacted);
    `out` is then a delta (docs/model-file.md): the dense weights, the rows last updated at or
    after the version the model reflects (a row stepped from version v to v+1 records v), and
    the ids the model holds that the checkpoints no longer do.

    `built`: a dict in which the model built for a job's checkpoints is kept between calls (by
    export --follow: building it reads the dataset, 0.36 of a wide_deep export's 0.43 s).
    `state`: the directory's state read already (checkpoint_dir.newest_shape's), exported as it
    is: a job's newer files, or its pruning, since then do not change what is written."""
    _check_export_paths(directory, out, options, since)
    ckpts = (state or checkpoint_dir.newest_shape(directory, mode)).ckpts
    ckpt = combine(ckpts, 1, 0)
    key = (repr(ckpt.tables), ckpt.signature, ckpt.total)
    made = None if built is None else built.get(key)
    if made is None:
        made = _model_of(ckpt, directory, options)
        if built is not None:                    # the job's model, for the next delta (one kept)
            built.clear()
            built[key] = made
    cfg, model, ds = made
    old, configs = len(ckpts), ckpt.tables
    summary = {"mode": mode, "num_shards": old, "optimizer": ckpt.optimizer, "steps": ckpt.version}
    origin = {"checkpoints": os.path.abspath(directory), "num_shards": old, "version": ckpt.version,
              "versions": [c.version for c in ckpts], "job": ckpt.signature}
    result = {"out": out, "model": cfg.model, "num_params": model.layout.total, "num_shards": old,
              "version": ckpt.version}
    definition = model_file.definition(cfg, model, ds)
    if since is not None:
        tables, removed, delta = model_file.delta_tables(since, model, ckpt, configs)
        model_file.save(out, model, ckpt.params, definition, summary, tables=tables, origin=origin,
                        delta=delta, removed=removed)
        return {**result, "since": delta["base_version"],
                "tables": {name: int(ids.shape[0]) for name, (ids, _) in tables.items()},
                "removed": {name: int(ids.shape[0]) for name, ids in removed.items()}}
    tables = {t.name: (ckpt.rows[t.name].ids, ckpt.rows[t.name].rows) for t in configs}
    model_file.save(out, model, ckpt.params, definition, summary, tables=tables or None, origin=origin)
    return {**result, "tables": {name: int(ids.shape[0]) for name, (ids, _) in tables.items()}}


class DeltaChain:
    """Deltas of a job's checkpoints in `directory`, written into `out_dir` each since the one
    before, the first since `since` (an export of the job): what `pserver serve-model MODEL --follow
    DIR` applies, in order. The model as the deltas made it is kept in OUT/.base (a dot directory,
    each delta applied to it and compacted) to write the next delta since; one already there (a
    chain that was stopped) is gone on from. `step()` writes one delta when the checkpoints hold a
    newer usable state (`pserver export --follow`, and the chief's --export-every). `keep`: the
    newest deltas kept (0: every one); a server behind those takes up OUT/.base instead."""

    def __init__(self, directory: str, since: str, out_dir: str, options: dict, mode: str = "sync",
                 keep: int = 0) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"--keep-deltas: {keep!r}; give how many of the newest deltas to keep "
                              "(an integer >= 1), or 0 to keep every one")
        self.directory, self.out_dir, self.options, self.mode = directory, out_dir, options, mode
        self.keep = keep
        self.work = os.path.join(out_dir, ".base")
        model_file.since_meta(since)                          # refused at once, not at the first delta
        _check_out_is_not_since(out_dir, since)
        if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
            raise ConfigError(f"--out: {out_dir} is a file; --follow writes its deltas into a directory")
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out: cannot make directory {out_dir} ({e.strerror or e})") from None
        check_directory_writable("--out", out_dir)
        if not os.path.exists(self.work):
            model_file.load(since).compact(self.work)     # the model to write deltas since, a copy of MODEL
        self.written, self.built = 0, {}
        self.have = int((model_file.read(self.work, arrays=False)[0].get("origin") or {}).get("version", -1))

    def step(self) -> dict | None:
        """The delta to the newest usable state, when it is newer than the last one written
        (its export_checkpoints result, "path" added); None when there is none."""
        named = [v for shards in scan(self.directory).values() for files in shards.values() for v, _ in files]
        if max(named, default=-1) <= self.have:           # the files are read only when one is named newer
            return None
        try:
            state = checkpoint_dir.newest_shape(self.directory, self.mode)
        except ConfigError:
            return None                                   # no usable state yet: the job has not written one
        newest = state.version
        if newest <= self.have:
            return None
        out = os.path.join(self.out_dir, f"delta-v{newest:09d}")
        result = export_checkpoints(self.directory, out, self.options, self.mode, since=self.work,
                                    built=self.built, state=state)
        model = model_file.load(self.work)
        model.apply(out)
        model.compact(self.work)
        self.have, self.written = newest, self.written + 1
        if self.keep:
            self.prune()
        return {**result, "path": out}

    def prune(self) -> None:
        """Remove the deltas in out_dir (delta-vVERSION) but the `keep` newest, oldest first, once
        OUT/.base holds the model they make: a server that falls behind what is kept takes that
        model up instead (pserver.serving.model.ServedModel.follow_once)."""
        deltas = sorted((int(m.group(1)), m.group(0)) for m in map(DELTA.fullmatch, os.listdir(self.out_dir))
                        if m)
        for _, name in deltas[:-self.keep]:
            atomic.remove(os.path.join(self.out_dir, name))


DELTA = re.compile(r"delta-v(\d{9,})")          # the deltas a DeltaChain writes, by version


def follow_checkpoints(directory: str, since: str, out_dir: str, options: dict, mode: str = "sync",
                       poll: float = 5.0, stop=None, say=print, keep: int = 0) -> int:
    """`pserver export --since MODEL --out DIR --follow`: while a job writes checkpoints into
    `directory`, write a delta into `out_dir` each time a newer usable state appears there
    (delta-vVERSION, written aside and renamed; DeltaChain), keeping the `keep` newest (0: every
    one). Stops when `stop` (an Event) is set; returns the deltas written."""
    import threading
    stop = stop or threading.Event()
    chain = DeltaChain(directory, since, out_dir, options, mode, keep)
    failed = ""
    while not stop.is_set():
        try:
            result = chain.step()
        except OSError as e:    # a full or read-only disk: said once, the next poll tries again
            line = (f"pserver export: cannot write the next delta into {out_dir} ({e.strerror or e}); "
                    "trying again")
            if line != failed:
                say(line)
            failed, result = line, None
        else:
            failed = "" if result is not None else failed
        if result is not None:
            say(delta_line(result))
            continue                             # a newer state may be there already
        stop.wait(poll)
    return chain.written


def delta_line(result: dict) -> str:
    changed = sum(result["tables"].values())
    return (f"pserver export: wrote {result['path']} (version {result['since']} -> {result['version']}: "
            f"{changed:,} rows changed)")


def _check_export_paths(directory: str, out: str, options: dict, since: str | None = None) -> None:
    """What export refuses before it reads a checkpoint: nothing is written. `out` replaces only
    a pserver model (never the --since model itself, which a delta is written against, nor a
    file of the user's that is not a model), in a directory this process can write."""
    if not options.get("model"):
        raise ConfigError("--model: give the model the checkpoints are of (lr, fm, wide_deep, deepfm, "
                          "mlp, ...): a checkpoint records its layout, not the model's definition")
    if not os.path.isdir(directory):
        raise ConfigError(f"--restore: {directory} is not a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"--out: {out} cannot be written: {parent} "
                          f"{'is not a directory' if os.path.lexists(parent) else 'does not exist'}")
    _check_out_is_not_since(out, since)
    check_writable("--out", out, model=True)
    if os.path.lexists(out) and not os.path.isdir(out):
        try:
            model_file.read(out, arrays=False)
        except DataError:
            raise ConfigError(f"--out: {out} is a file that is not a pserver model: export replaces a "
                              "model only; give another path") from None


def _check_out_is_not_since(out: str, since: str | None) -> None:
    if since is not None and os.path.realpath(out) == os.path.realpath(since):
        raise ConfigError(f"--out: {out} is the --since model: the delta goes to a path of its own, the "
                          "model it is written against stays as it is")


def _model_of(ckpt, directory: str, options: dict):
    """(config, model, dataset) of the model `options` name, built as a worker builds it, with the
    checkpoint's tables; ConfigError when the checkpoint is not of that model."""
    spec, configs = options["model"], ckpt.tables
    if configs and spec not in CTR_MODELS:
        raise ConfigError(f"--model {spec}: the checkpoints in {directory} hold sparse tables "
                          f"({', '.join(t.name for t in configs)}); give the CTR model they are of")
    # The run's --seed (the synthetic data's and the tables' initial rows'): the tables', else the
    # data order every worker counted its position in (a dense model's checkpoints hold no other)
    seeds = {int(p[0]) for p in ckpt.positions.values()}
    defaults = {"seed": configs[0].seed} if configs else {"seed": seeds.pop()} if len(seeds) == 1 else {}
    factors = [t.dim for t in configs if t.name == "factors"]
    if factors:
        defaults["embedding_dim"] = factors[0]
    fields = {k: v for k, v in {**defaults, **options}.items() if k in WorkerConfig.__dataclass_fields__}
    cfg = dataclasses.replace(WorkerConfig(), **fields)
    ds = load_data(cfg)
    model = model_for(cfg, ds)
    have = [(t.name, t.dim) for t in getattr(model, "sparse_tables", None) or []]
    if have != [(t.name, t.dim) for t in configs]:
        raise ConfigError(f"--model: the checkpoints' tables are {[(t.name, t.dim) for t in configs]}; "
                          f"{spec} has {have or 'none'}")
    if configs:     # the shards' configs, which made the rows' initial values
        model.sparse_tables = list(configs)
    registered = model.layout.with_tables(getattr(model, "sparse_tables", None) or ())
    checkpoint_dir.check_model(ckpt.signature, ckpt.total, registered, "--model",
                            f"the checkpoints in {directory} are",
                            f"check --model, --hidden and --embedding-dim ({model.layout.describe()})",
                            this=f"{spec} with these flags is")
    return cfg, model, ds
