"""The model file: a trained model's definition and weights in one .npz that numpy alone reads.

    pserver worker|launch ... --save model.npz      the chief writes it after the final evaluation
    pserver evaluate --model-file model.npz          its test metrics (pserver.api.evaluate_files)
    pserver.load_model("model.npz").predict(x)       the same in Python

The format (docs/model-file.md): numpy's .npz (a zip of .npy files, no pickles) holding
  "pserver_model"      a 0-d unicode array: the JSON object below
  "<layer>/<weight>"   one float32 array per tensor ("dense/kernel", "dense/bias", ...)
The JSON says how to build the model again ("model": a built-in name or FILE.py:FUNCTION /
package.module:FUNCTION, and "arguments"), lists the tensors in the order of the flat vector
("layout"), and records the dataset it was trained on and the run's results.
"""

from __future__ import annotations

import json
import os

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.models import DEFAULT_HIDDEN

FORMAT = "pserver-model"
VERSION = 1
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
    dataset = {k: getattr(cfg, k) for k in DATASET_FIELDS}
    for k in ("dataset", "data_dir"):       # paths, so that they hold from another directory
        if dataset[k] and (k == "data_dir" or dataset[k].lower().endswith(".npz")):
            dataset[k] = os.path.abspath(dataset[k])
    return {"model": spec, "arguments": arguments, "dataset": dataset}


def save(path: str, model, w: np.ndarray, definition: dict | None, summary: dict) -> None:
    """Write the model file atomically (a temporary file renamed over `path`). Without a
    definition (a model built in Python), "model" is null: load it with load(path, model=...)."""
    layout = model.layout
    meta = {"format": FORMAT, "version": VERSION, "model": None, "arguments": {}, "dataset": None,
            **(definition or {}),
            "name": getattr(model, "name", type(model).__name__), "num_params": layout.total,
            "signature": layout.signature(),
            "layout": [{"name": t.name, "shape": list(t.shape)} for t in layout.tensors],
            "task": getattr(model, "task", None),
            "trained": {k: summary.get(k) for k in TRAINED_FIELDS}}
    if hasattr(model, "summary"):
        meta["summary"] = model.summary()
    arrays = {META: np.array(json.dumps(meta, indent=1)), **layout.views(w)}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class SavedModel:
    """A model and its trained weights, from a model file: predict, evaluate."""

    def __init__(self, model, weights: np.ndarray, meta: dict, path: str) -> None:
        self.model, self.weights, self.meta, self.path = model, weights, meta, path

    def predict(self, x, batch_size: int = 4096) -> np.ndarray:
        """The last layer's outputs for x, (n, units): logits for a classifier (their argmax
        is the class), the predicted value for regression."""
        if not hasattr(self.model, "predict"):
            raise ConfigError(f"{self.path}: the model ({type(self.model).__name__}) has no predict()")
        return self.model.predict(self.weights, x, batch_size=batch_size)

    def evaluate(self, x, y, batch_size: int = 4096) -> dict:
        """{"loss", "accuracy"} (and "auc" for a binary loss), or {"loss", "r2"}."""
        return self.model.evaluate(self.weights, x, y, batch_size=batch_size)

    def __repr__(self) -> str:
        return f"SavedModel({self.path}: {self.meta['name']}, {self.meta['num_params']:,} parameters)"


def load(path: str, model=None) -> SavedModel:
    """Read a model file. The model is built again from its definition, unless `model` is
    given: a Sequential (or model object) of the same layout, or a --model spec string."""
    meta, arrays = read(path)
    if model is None and meta.get("model") is None:
        raise ConfigError(f"{path}: was saved from a model built in Python, which the file cannot "
                          f"rebuild; give it: load_model({path!r}, model=...)")
    if model is None or isinstance(model, str):
        model = build(meta, model or meta["model"])
    return SavedModel(model, weights_of(path, meta, arrays, model.layout), meta, path)


def build(meta: dict, spec: str, hidden=None):
    """The model `spec` called with the file's arguments (hidden widths: these, if given)."""
    from pserver.models import make_model
    args = meta.get("arguments") or {}
    if not {"input_shape", "num_classes"} <= set(args):
        raise DataError(f"model file: 'arguments' lacks input_shape or num_classes ({args})")
    hidden = hidden or tuple(args.get("hidden", DEFAULT_HIDDEN))
    return make_model(spec, tuple(args["input_shape"]), args["num_classes"], hidden=hidden)


def read(path: str) -> tuple[dict, dict]:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such model file")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop(META)))
    except KeyError:
        raise DataError(f"{path}: not a pserver model file (no {META!r} entry)") from None
    except Exception as e:   # a damaged zip, a pickled array, bad JSON: several types
        raise DataError(f"{path}: not a readable pserver model file ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a pserver model file (format {meta.get('format')!r})"
                        if isinstance(meta, dict) else f"{path}: {META} is not a JSON object")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: model file version {meta.get('version')!r}; this pserver reads {VERSION}")
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


__all__ = ["FORMAT", "VERSION", "META", "SavedModel", "definition", "save", "load", "read", "build",
           "weights_of"]
