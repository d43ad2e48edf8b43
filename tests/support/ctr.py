"""CTR test data: records with repeating ids, the rows a worker would pull for them, labels,
a planted logistic model, and SGD in a local loop with rows held as the shards hold them."""

from __future__ import annotations

import numpy as np

from pserver.models import Functional
from pserver.models.ctr import record_dtype
from pserver.sparse import TableLookup


def records(model: Functional, n, rng, vocab=6) -> np.ndarray:
    """n records; a small vocabulary per field, so ids repeat within the batch. The ids are
    large and negative too (hashed values are any int64), distinct across fields."""
    x = np.zeros(n, model.record)
    fields = model.record["cat"].shape[0]
    table = rng.integers(-2**62, 2**62, (fields, vocab))
    x["cat"] = table[np.arange(fields), rng.integers(0, vocab, (n, fields))]
    x["dense"] = rng.random((n, x["dense"].shape[1])) * 3
    return x


def pull(model, ids_per_table, rows=None, rng=None, dtype=np.float32) -> list[TableLookup]:
    """What the worker hands the model: per table, a TableLookup with rows from `rows` (a
    per-table {id: row} dict, a new id at the table's initial scale), or random ones from
    `rng`, in `dtype`; grads NaN until the model writes them."""
    out = []
    for i, (ids, table) in enumerate(zip(ids_per_table, model.sparse_tables)):
        lk = TableLookup.of(ids, table.dim)
        if rows is None:
            vals = rng.standard_normal(lk.rows.shape) * 0.5
        else:
            vals = np.stack([_row(rows[i], table, int(u)) for u in lk.uniq])
        out.append(TableLookup(lk.uniq, lk.inverse, vals.astype(dtype),
                               np.full(vals.shape, np.nan, dtype)))
    return out


def lookups(model, x, rng=None, dtype=np.float32, rows=None) -> list[TableLookup]:
    return pull(model, model.batch_ids(x), rows, rng, dtype)


def _row(rows: dict, table, uid: int) -> np.ndarray:
    if uid not in rows:
        scale = table.init_scale
        rows[uid] = np.random.default_rng(uid % 2**63).uniform(-scale, scale, table.dim)
    return rows[uid]


def labels(n, rng, dtype=np.float32):
    return rng.integers(0, 2, n).astype(dtype)


def planted(n, rng, fields=8, vocab=40, dense=4):
    """Records whose clicks come from a logistic model on per-id weights N(0, 0.5^2) and dense
    weights N(0, 0.5^2), with a bias that gives about 25% positives (Criteo's rate); and the
    planted logits (the best any model can rank by)."""
    x = np.zeros(n, record_dtype(dense, fields))
    pick = rng.integers(0, vocab, (n, fields))
    x["cat"] = np.arange(fields) * 1000 + pick - 3000      # distinct per field, negative ones too
    x["dense"] = rng.random((n, dense)) * 2
    logit = rng.normal(0, 0.5, (fields, vocab))[np.arange(fields), pick].sum(axis=1)
    logit += x["dense"] @ rng.normal(0, 0.5, dense)
    logit += -1.1 - np.median(logit)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return x, y, logit


def train_locally(model, x, y, epochs=2, batch=200, lr=0.3, row_lr=2.0):
    """SGD; the rows get a larger step, as each row's gradient is a mean over the whole batch
    of which it touches a few samples."""
    w = model.init_params(0)
    g = np.empty_like(w)
    rows = [{} for _ in model.sparse_tables]
    for _ in range(epochs):
        for a in range(0, len(x), batch):
            lks = lookups(model, x[a:a + batch], rows=rows)
            model.loss_and_grad(w, x[a:a + batch], y[a:a + batch], g, sparse=lks)
            w -= lr * g
            for table, lk in zip(rows, lks):
                for uid, grad in zip(lk.uniq, lk.grads):
                    table[int(uid)] = table[int(uid)] - row_lr * grad
    return w, rows
