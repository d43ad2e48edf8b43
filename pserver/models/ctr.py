"""Click-through-rate models on Criteo records, with sparse embedding tables on the shards.

A batch is a structured array of records (pserver.data.criteo.RECORD): x["dense"] float32
(n, 13), x["cat"] int64 (n, 26), one hashed id per categorical field; labels are 0/1. Each
model computes one logit per record and trains on binary cross-entropy from it:

    lr         logit = wide
    fm         logit = wide + FM(embeddings)
    wide_deep  logit = wide + deep
    deepfm     logit = wide + FM(embeddings) + deep            (FM and deep share the embeddings)

    wide        = sum over fields of a per-id weight (sparse table "linear", dim 1)
                  + Dense(1) on the dense features (its bias is the model's bias)
    embeddings  = one row per field from the sparse table "factors" (dim embedding_dim)
    deep        = Dense(h, relu) for h in hidden, then Dense(1), on [embeddings flattened, dense]

The dense weights are the model's layout, as for any model; the sparse tables follow the
sparse model protocol: `sparse_tables`, `batch_ids(x)`, and `loss_and_grad`/`evaluate` taking
the rows of the batch's unique ids (`pserver.sparse.TableLookup`) and writing their gradients.
"""

from __future__ import annotations

import functools

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.kernels import get_backend
from pserver.layers import FM, Dense, Embedding, Pass, RandomUniform
from pserver.layers.base import positive_int
from pserver.models import losses, metrics
from pserver.models.base import BatchBuffers, Model
from pserver.models.layout import Layout
from pserver.models.mlp import he, lecun
from pserver.sparse import TableLookup

# Which parts each built-in has: the FM term, and the deep tower's default hidden widths.
CTR_MODELS = {"lr": (False, ()), "fm": (True, ()), "wide_deep": (False, (256, 128)),
              "deepfm": (True, (256, 128))}


def record_dtype(dense_features: int = 13, fields: int = 26) -> np.dtype:
    """The records the models take; the defaults are Criteo's (pserver.data.criteo.RECORD)."""
    return np.dtype([("dense", np.float32, (dense_features,)), ("cat", np.int64, (fields,))])


class CTRModel(Model):
    """wide [+ FM] [+ deep] over records of `dense_features` floats and `fields` ids.

    The table options (optimizer, lr, min_count, max_rows, ttl_steps, seed, optimizer_params,
    row_dtype, state_dtype)
    go to both sparse tables; `init_scale` is the range of the factors' initial values (the
    per-id weights start at zero, as logistic regression's do).
    """

    task = "classification"
    num_classes = 2

    def __init__(self, name: str, *, fm: bool = False, hidden: tuple[int, ...] = (),
                 embedding_dim: int = 8, init_scale: float = 0.05, dense_features: int = 13,
                 fields: int = 26, backend: str = "cpu", **table):
        fields = positive_int("CTRModel", "fields", fields)
        dense_features = positive_int("CTRModel", "dense_features", dense_features)
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not init_scale >= 0:
            raise ConfigError(f"CTRModel: init_scale must be a number >= 0, got {init_scale!r}")
        self.name, self.fields = name, fields
        self.loss = losses.BinaryCrossentropy()
        self.record = record_dtype(dense_features, fields)
        self.wide = Embedding(None, 1, "zeros", sparse=True, name="linear", **table)
        self.linear = Dense(1, kernel_initializer="zeros", name="dense_linear")
        self.factors = (Embedding(None, embedding_dim, RandomUniform(-init_scale, init_scale),
                                  sparse=True, name="factors", **table) if fm or hidden else None)
        self.fm = FM(name="fm") if fm else None
        self.deep = [Dense(h, activation="relu", kernel_initializer=he(), name=f"deep_{i}")
                     for i, h in enumerate(hidden)]
        if hidden:
            self.deep.append(Dense(1, kernel_initializer=lecun(), name=f"deep_{len(hidden)}"))
        self._build(dense_features)
        self.use_backend(backend)
        self._buffers = BatchBuffers(lambda n, dtype: _Buffers(self, n, dtype))

    def _build(self, dense_features: int) -> None:
        self.wide.build((self.fields,))
        self.linear.build((dense_features,))
        self.sparse_layers = [self.wide]
        if self.factors is not None:
            self.factors.build((self.fields,))
            self.sparse_layers.append(self.factors)
            if self.fm is not None:
                self.fm.build(self.factors.output_shape)
        shape = (self.fields * self.factors.output_dim + dense_features,) if self.deep else None
        for layer in self.deep:
            shape = layer.build(shape)
        self.dense_layers = [self.linear, *self.deep]
        self.layout = Layout.of((f"{layer.name}/{w.name}", w.shape)
                                for layer in self.dense_layers for w in layer.weights())
        self.sparse_tables = [layer.table_config() for layer in self.sparse_layers]

    def use_backend(self, backend: str) -> "CTRModel":
        """Compute with "cpu" (numba) or "reference" (NumPy) kernels."""
        if backend == "cuda":
            raise ConfigError(f"--device cuda: {self.name} runs on the CPU (its rows come from the "
                              "shards batch by batch); use --device cpu")
        self.backend, self.kernels = backend, get_backend(backend)
        return self

    # -- parameters ----------------------------------------------------------------------------

    def init_params(self, seed: int) -> np.ndarray:
        """The dense weights from their initialisers, in layout order (the rows' initial
        values are the shards', from the tables' seed)."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.layout.total, dtype=np.float32)
        for layer, p in zip(self.dense_layers, self._per_layer(flat)):
            for w in layer.weights():
                w.initializer(rng, p[w.name])
        return flat

    def _per_layer(self, flat: np.ndarray) -> list[dict]:
        views = self.layout.views(flat)
        return [{w.name: views[f"{layer.name}/{w.name}"] for w in layer.weights()}
                for layer in self.dense_layers]

    # -- the sparse model protocol -------------------------------------------------------------

    def batch_ids(self, x: np.ndarray) -> list[np.ndarray]:
        """Per table, the ids of the batch: the categorical fields (both tables key on them)."""
        ids = np.ascontiguousarray(self._records(x)["cat"])
        return [ids for _ in self.sparse_tables]

    def loss_and_grad(self, w, x, y, grad_out, sparse: list[TableLookup]) -> float:
        """Mean loss of the batch; the dense gradient into grad_out, each table's row
        gradients (d mean loss / d row, summed over the row's uses) into its lookup.grads."""
        x, y = self._check_batch(w, x, y)
        if grad_out.shape != w.shape or grad_out.dtype != w.dtype or not grad_out.flags.c_contiguous:
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector of shape {w.shape}, "
                             f"got {grad_out.dtype} {grad_out.shape} with strides {grad_out.strides}")
        lookups = self._check_lookups(sparse, len(x))
        bufs, params = self._buffers(len(x), w.dtype), self._per_layer(w)
        logit = self._forward(params, lookups, x, bufs, Pass(training=True))
        loss = self.loss(self.kernels, logit, y, bufs.douts["logit"])
        self._backward(params, self._per_layer(grad_out), lookups, bufs)
        return float(loss)

    def evaluate(self, w, x, y, batch_size: int = 4096, rows=None) -> dict:
        """{"loss" (logloss), "accuracy", "auc"} over all of x; `rows(ids per table)` returns
        the batch's TableLookups with their rows filled (the worker pulls them from the shards)."""
        if rows is None:
            raise ValueError(f"{self.name}.evaluate needs rows=: a function from the batch's ids "
                             "per table to TableLookups with the rows filled")
        x, y = self._check_batch(w, x, y)
        params, k = self._per_layer(w), self.kernels
        loss_sum, correct, scores = 0.0, 0, []
        for a in range(0, len(x), batch_size):
            xb, yb = x[a:a + batch_size], y[a:a + batch_size]
            lookups = self._check_lookups(rows(self.batch_ids(xb)), len(xb))
            logit = self._forward(params, lookups, xb, self._buffers(len(xb), w.dtype), Pass())
            loss_sum += self.loss(k, logit, yb, np.empty_like(logit)) * len(xb)
            correct += metrics.accuracy(logit, yb)
            scores.append(logit[:, 0].copy())
        return {"loss": loss_sum / len(x), "accuracy": correct / len(x),
                "auc": metrics.auc(np.concatenate(scores), y)}

    def predict(self, w, x, batch_size: int = 4096, rows=None) -> np.ndarray:
        """The logit of each record, (n, 1) float32 (its sigmoid is the click probability);
        `rows` as for evaluate (a saved model's memory-mapped tables: SavedModel.rows)."""
        if rows is None:
            raise ValueError(f"{self.name}.predict needs rows=: a function from the batch's ids "
                             "per table to TableLookups with the rows filled")
        x = self._records(x)
        if w.shape != (self.layout.total,) or w.dtype.kind != "f":
            raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}; "
                             f"{self.name} needs float ({self.layout.total},)")
        params, out = self._per_layer(w), np.empty((len(x), 1), w.dtype)
        for a in range(0, len(x), batch_size):
            xb = x[a:a + batch_size]
            lookups = self._check_lookups(rows(self.batch_ids(xb)), len(xb))
            out[a:a + len(xb)] = self._forward(params, lookups, xb, self._buffers(len(xb), w.dtype), Pass())
        return out

    # -- the math ------------------------------------------------------------------------------

    def _forward(self, params, lookups, x, bufs, run) -> np.ndarray:
        """The logit (n, 1): the sum of the parts, each computed into its own buffer."""
        k, out, logit = self.kernels, bufs.outs, bufs.outs["logit"]
        np.copyto(bufs.dense, x["dense"])          # float32 records -> the weights' dtype
        self.wide.forward(k, {"embeddings": lookups[0].rows}, lookups[0].inverse, out["linear"], {}, run)
        np.sum(out["linear"], axis=1, out=logit)
        self.linear.forward(k, params[0], bufs.dense, out["dense_linear"], bufs.scratch[0], run)
        logit += out["dense_linear"]
        if self.factors is not None:
            self.factors.forward(k, {"embeddings": lookups[1].rows}, lookups[1].inverse,
                                 out["factors"], {}, run)
        if self.fm is not None:
            self.fm.forward(k, {}, out["factors"], out["fm"], {}, run)
            logit += out["fm"]
        if self.deep:
            h = bufs.deep_in
            np.concatenate([out["factors"].reshape(len(h), -1), bufs.dense], axis=1, out=h)
            for i, layer in enumerate(self.deep, start=1):
                layer.forward(k, params[i], h, out[layer.name], bufs.scratch[i], run)
                h = out[layer.name]
            logit += h
        return logit

    def _backward(self, params, grads, lookups, bufs) -> None:
        """Each part gets its own copy of d loss / d logit (a layer may overwrite its dout);
        FM and deep both add into d loss / d embeddings, which the factors' table sums per id."""
        k, out, d = self.kernels, bufs.outs, bufs.douts
        dlogit = d["logit"]
        d["linear"][:] = dlogit[:, None, :]
        self.wide.backward(k, {}, {"embeddings": lookups[0].grads}, lookups[0].inverse,
                           out["linear"], d["linear"], None, {})
        np.copyto(d["dense_linear"], dlogit)
        self.linear.backward(k, params[0], grads[0], bufs.dense, out["dense_linear"],
                             d["dense_linear"], None, bufs.scratch[0])
        if self.fm is not None:
            np.copyto(d["fm"], dlogit)
            self.fm.backward(k, {}, {}, out["factors"], out["fm"], d["fm"], d["factors"], {})
        if self.deep:
            self._backward_deep(params, grads, bufs)
        if self.factors is not None:
            self.factors.backward(k, {}, {"embeddings": lookups[1].grads}, lookups[1].inverse,
                                  out["factors"], d["factors"], None, {})

    def _backward_deep(self, params, grads, bufs) -> None:
        """The tower from the top down, to d loss / d (its input); then the embeddings' part of
        that into d["factors"] (added to FM's when there is one)."""
        k, out, d = self.kernels, bufs.outs, bufs.douts
        np.copyto(d[self.deep[-1].name], d["logit"])
        for i in range(len(self.deep) - 1, -1, -1):
            layer = self.deep[i]
            x = out[self.deep[i - 1].name] if i else bufs.deep_in
            dx = d[self.deep[i - 1].name] if i else d["deep_in"]
            layer.backward(k, params[i + 1], grads[i + 1], x, out[layer.name], d[layer.name], dx,
                           bufs.scratch[i + 1])
        demb = d["deep_in"][:, :d["factors"][0].size].reshape(d["factors"].shape)
        if self.fm is not None:
            d["factors"] += demb
        else:
            np.copyto(d["factors"], demb)

    # -- checks --------------------------------------------------------------------------------

    def _records(self, x) -> np.ndarray:
        """x as a 1-D array of records; ValueError naming the field and what it should be."""
        x = np.asarray(x)
        want = f"{self.name} takes records with fields {_describe(self.record)} (pserver.data.criteo.RECORD)"
        names = x.dtype.names or ()
        if "dense" not in names or "cat" not in names:
            raise ValueError(f"x has dtype {x.dtype}; {want}")
        if x.ndim != 1 or len(x) == 0:
            raise ValueError(f"x has shape {x.shape}; {want}, as a 1-D array of n >= 1 records")
        for field in ("dense", "cat"):
            got, expect = x.dtype[field], self.record[field]
            kinds = "iu" if field == "cat" else "f"
            if got.shape != expect.shape or got.base.kind not in kinds:
                what = "integer ids" if field == "cat" else "floats"
                raise ValueError(f"x[{field!r}] has dtype {got.base} and shape {got.shape}; it must "
                                 f"hold {what} of shape {expect.shape} ({want})")
        return x

    def _check_batch(self, w, x, y) -> tuple[np.ndarray, np.ndarray]:
        if w.shape != (self.layout.total,) or w.dtype.kind != "f":
            raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}; "
                             f"{self.name} needs float ({self.layout.total},)")
        x, y = self._records(x), np.asarray(y)
        if y.shape != (len(x),):
            raise ValueError(f"y has shape {y.shape}; x has {len(x)} records")
        bad = (y != 0) & (y != 1)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"label out of range: y[{i}] = {y[i].item()!r}; {self.name} takes 0 "
                             "or 1 (click)")
        return x, np.ascontiguousarray(y, dtype=w.dtype)

    def _check_lookups(self, sparse, n: int) -> list[TableLookup]:
        """One lookup per table, in order, whose inverse is the batch's (n, fields) ids."""
        if len(sparse) != len(self.sparse_tables):
            raise ValueError(f"{self.name} has {len(self.sparse_tables)} sparse tables "
                             f"({', '.join(t.name for t in self.sparse_tables)}); got "
                             f"{len(sparse)} lookups")
        for table, lookup in zip(self.sparse_tables, sparse):
            u = len(lookup.uniq)
            if (lookup.inverse.shape != (n, self.fields) or lookup.rows.shape != (u, table.dim)
                    or lookup.grads.shape != (u, table.dim)):
                raise ValueError(f"table {table.name}: the lookup has inverse {lookup.inverse.shape}, "
                                 f"rows {lookup.rows.shape} and grads {lookup.grads.shape}; the "
                                 f"batch needs ({n}, {self.fields}), ({u}, {table.dim}) twice")
        return sparse

    def check_data(self, x, y, what: str = "data") -> np.ndarray:
        """A whole dataset checked before training: records, labels, finite dense features."""
        try:
            x, _ = self._check_batch(np.zeros(self.layout.total, np.float32), x, y)
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None
        finite = np.isfinite(x["dense"]).all(axis=1)
        if not finite.all():
            raise DataError(f"{what}: x['dense'] has NaN or Inf values in {int((~finite).sum())} "
                            f"records, the first at index {int(np.argmin(finite))}")
        return x


class _Buffers:
    """One batch size's arrays: each part's output and d loss / d output, by name."""

    def __init__(self, model: CTRModel, n: int, dtype):
        self.model, self.n, self.dtype = model, n, dtype
        self.dense = np.empty((n, model.linear.input_shape[0]), dtype)
        self.deep_in = np.empty((n, *model.deep[0].input_shape), dtype) if model.deep else None
        self.outs = self._per_part()
        self.scratch = [layer.scratch(n, dtype) for layer in model.dense_layers]

    def _per_part(self) -> dict[str, np.ndarray]:
        m, n = self.model, self.n
        parts = [layer for layer in (m.wide, m.linear, m.factors, m.fm) if layer is not None]
        shapes = {"logit": (1,), **{layer.name: layer.output_shape for layer in parts + m.deep}}
        return {name: np.empty((n, *shape), self.dtype) for name, shape in shapes.items()}

    @functools.cached_property
    def douts(self) -> dict[str, np.ndarray]:
        """Made at the first training step of this size (evaluation needs none)."""
        douts = self._per_part()
        if self.deep_in is not None:
            douts["deep_in"] = np.empty_like(self.deep_in)
        return douts


def _describe(record: np.dtype) -> str:
    return ", ".join(f"{name} {record[name].base} {record[name].shape}" for name in record.names)


def ctr_model(name: str, input_shape=(), num_classes: int = 2, hidden=None, **options) -> CTRModel:
    """A built-in CTR model by name (see CTR_MODELS); `hidden` replaces the deep tower's widths,
    `options` are CTRModel's (embedding_dim, table options, ...). ConfigError naming the flag."""
    fm, default_hidden = CTR_MODELS[name]
    if tuple(input_shape or ()) != ():
        raise ConfigError(f"--model {name} takes Criteo records (--dataset criteo:PATH or "
                          f"criteo-synthetic), not samples of shape {tuple(input_shape)}")
    if num_classes != 2:
        raise ConfigError(f"--model {name} predicts clicks (2 classes); the dataset has {num_classes}")
    deep = tuple(hidden) if hidden is not None and default_hidden else default_hidden
    unknown = set(options) - CTR_OPTIONS
    if unknown:
        raise ConfigError(f"--model {name}: unknown options {sorted(unknown)}; it takes "
                          f"{', '.join(sorted(CTR_OPTIONS))}")
    return CTRModel(name, fm=fm, hidden=deep, **options)


# What ctr_model passes on to CTRModel and its Embedding tables.
CTR_OPTIONS = {"embedding_dim", "init_scale", "dense_features", "fields", "optimizer",
               "lr", "min_count", "max_rows", "ttl_steps", "seed", "optimizer_params", "row_dtype",
               "state_dtype"}


__all__ = ["CTRModel", "CTR_MODELS", "CTR_OPTIONS", "ctr_model", "record_dtype"]
