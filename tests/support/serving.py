"""Model files for the prediction server's tests and bench: a small wide & deep CTR model with
random rows, written as `pserver export` writes one, and a chain of deltas since it (each
changing some rows, adding and removing ids, and moving the dense weights), written as
`export --since` writes them (its correctness against checkpoints: tests/e2e/test_export.py)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import numpy as np

from pserver.models import make_model
from pserver.persist import model_file
from pserver.serving import ModelServer, ServeModelConfig

SMALL = dict(dense_features=3, fields=4, embedding_dim=5)


def ctr_model():
    return make_model("wide_deep", (), 2, hidden=(8,), backend="cpu", **SMALL)


def records(n: int, rng, vocab: int = 40) -> np.ndarray:
    model = ctr_model()
    x = np.zeros(n, model.record)
    x["dense"] = rng.random((n, 3)).astype(np.float32)
    x["cat"] = rng.integers(0, vocab, (n, 4))
    return x


def write_base(path: str, rng, vocab: int = 40) -> str:
    """The base export: rows for ids 0..vocab-1 in both tables; returns its export id."""
    model = ctr_model()
    w = rng.standard_normal(model.layout.total).astype(np.float32) * 0.3
    ids = np.arange(vocab, dtype=np.uint64)
    tables = {t.name: (ids, rng.standard_normal((vocab, t.dim)).astype(np.float32))
              for t in model.sparse_tables}
    definition = {"model": "wide_deep", "arguments": {"input_shape": [], "hidden": [8], **SMALL,
                                                      "num_classes": 2}, "dataset": None}
    model_file.save(path, model, w, definition, {}, tables=tables,
                    origin={"live": True, "num_shards": 1, "versions": [10], "version": 10})
    return model_file.read(path)[0]["export_id"]


def write_delta(path: str, base_id: str, version: int, rng, vocab: int = 40) -> str:
    """A delta since export `base_id`, at `version`: a third of the ids changed, two new ids,
    one removed; new dense weights. Returns its export id."""
    model = ctr_model()
    w = rng.standard_normal(model.layout.total).astype(np.float32) * 0.3
    changed = np.sort(rng.choice(vocab + 10, vocab // 3, replace=False)).astype(np.uint64)
    removed = {t.name: np.array([vocab + 20 + version], np.uint64) for t in model.sparse_tables}
    tables = {t.name: (changed, rng.standard_normal((len(changed), t.dim)).astype(np.float32))
              for t in model.sparse_tables}
    definition = {"model": "wide_deep", "arguments": {"input_shape": [], "hidden": [8], **SMALL,
                                                      "num_classes": 2}, "dataset": None}
    model_file.save(path, model, w, definition, {}, tables=tables, removed=removed,
                    origin={"live": True, "num_shards": 1, "versions": [version], "version": version},
                    delta={"base_id": base_id, "base_version": version - 10, "base_versions": [version - 10]})
    return model_file.read(path)[0]["export_id"]


def chain(directory: str, rng, deltas: int) -> tuple[str, list[str]]:
    """A base export in directory/model and `deltas` chained deltas (directory/deltas/delta-K);
    returns the base's path and the deltas' paths, in order."""
    base = os.path.join(directory, "model")
    export_id = write_base(base, rng)
    os.makedirs(os.path.join(directory, "deltas"), exist_ok=True)
    paths = []
    for k in range(deltas):
        path = os.path.join(directory, "deltas", f"delta-{k + 1}")
        export_id = write_delta(path, export_id, 10 * (k + 2), rng)
        paths.append(path)
    return base, paths


def start(base, **options) -> ModelServer:
    """A model server of `base` on free ports, in this process, quiet."""
    return ModelServer(ServeModelConfig(base, port=0, http_port=0, **options), say=lambda *_: None).start()


def http(server: ModelServer, path: str, body=None, token=None):
    """(status, body text) of a GET (no body) or a POST of `body` as JSON to the server's HTTP port."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
