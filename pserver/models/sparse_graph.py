"""The sparse model protocol of a graph: sparse Embedding layers whose rows live on the shards.

A Functional whose inputs are a dict and whose graph has `Embedding(None, dim, sparse=True)`
layers takes records: a structured array whose fields are its inputs by name (the CTR models'
x["dense"] float32 (n, 13) and x["cat"] int64 (n, 26)). Each sparse layer declares a table
(`sparse_tables`, named after the layer) and reads ids straight from one field. Per batch the
worker pulls the rows of the batch's unique ids (`batch_ids(x)`, one array per table; tables fed
by one field share it, so the worker dedupes it once) and hands them in as
`pserver.sparse.TableLookup`s: a sparse layer's table is its lookup's rows, its input the
lookup's `inverse` (each id's position among them), and its backward pass writes the rows'
gradients, summed per unique id, into `lookup.grads`, which is what the worker pushes.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.layers.base import Pass
from pserver.models import graph, metrics
from pserver.models.outputs import chunk_scores, scores
from pserver.sparse import PaddedIds, TableLookup


class SparseLayers:
    """A plan's sparse Embedding layers: their indices in Plan.layers, the model input (record
    field) each reads, and their tables' configs: one table per name. Layers that name one
    table (`Embedding(table=...)`, Keras-RS's features sharing a TableConfig) share its rows: a
    batch looks up their fields' ids together (side by side per record), each layer reads its
    columns of the lookup, and their row gradients are summed into the lookup's."""

    def __init__(self, plan: graph.Plan, keys: list[str], where: str):
        self.record = np.dtype([(k, x.dtype, x.shape[1:]) for k, x in zip(keys, plan.slots)])
        self.checked: np.dtype | None = None       # the dtype of records last found to fit
        self.layers, self.fields = [], []
        for step in plan.steps:
            if step.layer is not None and getattr(plan.layers[step.layer], "sparse", False):
                self.layers.append(step.layer)
                self.fields.append(_field(plan, step, keys, where))
        # A list feature's padding id, by field: every sparse layer that reads a field agrees on it.
        self.padding: dict[int, int] = {}
        for li, i in zip(self.layers, self.fields):
            pad = plan.layers[li].padding
            if any(plan.layers[o].padding != pad for o, j in zip(self.layers, self.fields) if j == i):
                raise ConfigError(f"{where}: input {keys[i]!r} feeds sparse Embeddings with and without "
                                  "mask_zero; its id 0 is padding for all of them or for none")
            if pad is not None:
                self.padding[i] = pad
        # The tables, by name in first-use order; members[t]: the positions in self.layers of
        # the layers that look table t up.
        self.tables, self.members = [], []
        for j, li in enumerate(self.layers):
            config = plan.layers[li].table_config()
            t = next((t for t, c in enumerate(self.tables) if c.name == config.name), None)
            if t is None:
                self.tables.append(config)
                self.members.append([j])
            elif config != self.tables[t]:
                first = plan.layers[self.layers[self.members[t][0]]]
                raise ConfigError(f"{where}: {first.label} and {plan.layers[li].label} share table "
                                  f"{config.name!r} with other settings (dim, optimizer, initializer...): a "
                                  "shared table is one table")
            else:
                self.members[t].append(j)
        # A shared table looks its inputs' ids up together: one padding for all of them.
        for t, members in enumerate(self.members):
            mine = [self.fields[j] for j in members]
            if len({self.padding[i] for i in mine if i in self.padding}) > 1:
                raise ConfigError(f"{where}: the layers sharing table {self.tables[t].name!r} read inputs "
                                  "of different paddings; a shared table has one padding")


def _field(plan: graph.Plan, step: graph.Step, keys: list[str], where: str) -> int:
    """The model input a sparse Embedding's step reads: ids straight from a record field."""
    layer, i = plan.layers[step.layer], step.ins[0]
    if i >= len(keys) or plan.uses(step.layer) > 1:
        raise ConfigError(f"{where}: {layer.label}: a sparse Embedding is called once, on a "
                          "model input of ids (a record field)")
    if plan.slots[i].dtype.kind not in "iu":
        raise ConfigError(f"{where}: {layer.label} reads input {keys[i]!r} of "
                          f"{plan.slots[i].dtype}; give ids: Input(..., dtype='int64')")
    return i


class SparseProtocol:
    """Functional's side of the sparse model protocol (used when `sparse_tables` is not empty:
    a graph with dict inputs and sparse Embedding layers)."""

    def _find_sparse(self) -> None:
        """At build: the sparse layers (None for a graph without them). The records' fields are
        the inputs by name, whether the model took them as a dict, a list or one tensor."""
        found = SparseLayers(self._plan(False), self._keys, self.name)
        self._sparse = found if found and found.layers else None
        if self._sparse is not None and self.several:
            raise ConfigError(f"{self.name}: a model with sparse tables has one output, for now "
                              f"(it has {len(self.output_names)})")
        if self._sparse is not None and len(self._shapes[1]) > 1:      # (built: _fix_layout set it)
            raise ConfigError(f"{self.name}: a model with sparse tables has a flat output (n, units), for "
                              f"now (its output is {self._shapes[1]})")

    @property
    def sparse_tables(self) -> list:
        sparse = self.build()._sparse
        return [] if sparse is None else sparse.tables

    @sparse_tables.setter
    def sparse_tables(self, configs) -> None:
        """The shards' configs of the same tables (an export: the seed that made the rows)."""
        self.build()._sparse.tables = list(configs)

    @property
    def record(self) -> np.dtype:
        """The records a model with sparse tables takes: one field per input, by name."""
        return self.build()._sparse.record

    def pack_records(self, x) -> np.ndarray:
        """x (arrays by input name, a list in input order, or one array; lists of ids as Python
        lists) as this model's records (a prediction server's request)."""
        return self._pack_records(x)

    def _pack_records(self, x) -> np.ndarray:
        """Keras's x for a model with sparse tables (a dict of arrays by input name, a list in
        input order, or one array) as its records; records already are returned as they are."""
        x = x if isinstance(x, (dict, list, tuple)) else np.asarray(x)
        if isinstance(x, np.ndarray) and x.dtype.names:
            return x
        parts = dict(x) if isinstance(x, dict) else dict(zip(self._keys, x if isinstance(x, (list, tuple))
                                                             else [x]))
        missing = [k for k in self._keys if k not in parts]
        if missing or len(parts) != len(self._keys):
            raise ValueError(f"x has inputs {', '.join(map(str, parts)) or 'none'}; {self._takes()}")
        padded = {self._keys[i]: pad for i, pad in list_paddings(self._plan(False), len(self._keys)).items()}
        arrays = {k: pad_lists(parts[k], self.record[k].shape, padded[k], k) if k in padded
                  else np.asarray(parts[k]) for k in self._keys}
        n = len(next(iter(arrays.values())))
        out = np.empty(n, self.record)
        for k, a in arrays.items():
            want = self.record[k]
            ids = want.base.kind in "iu"
            if len(a) != n or a.shape[1:] != want.shape or a.dtype.kind not in ("iu" if ids else "iuf"):
                raise ValueError(f"input {k!r}: x has {a.dtype} of shape {a.shape}; it takes {want.base} "
                                 f"of shape (n, {', '.join(map(str, want.shape))}) with n = {n}")
            if ids and a.size and not np.can_cast(a.dtype, want.base):     # a narrowing cast must not wrap
                bounds = np.iinfo(want.base)
                if a.min() < bounds.min or a.max() > bounds.max:
                    raise ValueError(f"input {k!r}: x holds ids beyond {want.base}; give Input(..., "
                                     "dtype='int64') for 64-bit ids")
            out[k] = a
        return out

    def batch_ids(self, x) -> list[np.ndarray]:
        """Per table, the ids of the batch: its field of the records (one array per field); a
        shared table's fields side by side, (n, their ids per record)."""
        x, sparse = self._records(x), self._sparse
        fields: dict[int, np.ndarray | PaddedIds] = {}
        out = []
        for members in sparse.members:
            mine = [sparse.fields[j] for j in members]
            if len(mine) > 1:
                ids = np.concatenate([x[self._keys[i]].reshape(len(x), -1) for i in mine], axis=1)
                pad = next((sparse.padding[i] for i in mine if i in sparse.padding), None)
                out.append(PaddedIds(ids, pad) if pad is not None else ids)
                continue
            i = mine[0]
            if i not in fields:
                ids = np.ascontiguousarray(x[self._keys[i]])
                fields[i] = PaddedIds(ids, sparse.padding[i]) if i in sparse.padding else ids
            out.append(fields[i])
        return out

    # -- steps ------------------------------------------------------------------------------------

    def _sparse_inputs(self, x, lookups, params, grads, dtype) -> list[np.ndarray]:
        """The graph's inputs for records x: float fields in the weights' dtype, integer fields as
        they are (the ids, for any layer that reads them beside a sparse one); each sparse layer's
        table is its lookup's rows, its ids' positions among them ("positions", -1 for padding)
        the lookup's inverse, its gradient the lookup's grads."""
        lookups = self._check_lookups(lookups, len(x))
        sparse = self._sparse
        self._shared_grads = []          # (a shared table's grads, a later member's): summed after
        for members, lookup, table in zip(sparse.members, lookups, sparse.tables):
            at = 0
            for k, j in enumerate(members):
                li, i = sparse.layers[j], sparse.fields[j]
                inverse = lookup.inverse
                if len(members) > 1:                 # this layer's columns of the table's lookup
                    shape = self._inputs[i].shape[1:]
                    width = int(np.prod(shape))
                    inverse = np.ascontiguousarray(lookup.inverse[:, at:at + width]).reshape(len(x), *shape)
                    at += width
                own = lookup.grads if k == 0 else np.zeros_like(lookup.grads)
                if k:
                    self._shared_grads.append((lookup.grads, own))
                params[li] = {"embeddings": lookup.rows, "positions": inverse}
                grads[li] = {"embeddings": own}
        return [np.ascontiguousarray(x[k], dtype if inp.dtype.kind == "f" else None)
                for k, inp in zip(self._keys, self._inputs)]

    def _sparse_step(self, w, x, y, grad_out, lookups, run: Pass) -> float:
        params, grads = self._layer_views(w), self._layer_views(grad_out)
        bufs = self._buffers(len(x), w.dtype)
        ins = self._forward(params, self._sparse_inputs(x, lookups, params, grads, w.dtype), bufs, run)
        loss = self.output_loss([ins[-1]], y, None, bufs.dlosses)     # one flat output (no weights)
        self._backward(params, grads, ins, bufs)
        for total, part in self._shared_grads:       # a shared table's rows: every layer's gradient
            total += part
        return loss

    def _sparse_outputs(self, w, x, batch_size: int, rows, what: str):
        """The output of each batch_size records of x, in order, with its rows from
        `rows(ids per table)` (the worker's pull, or a saved model's tables)."""
        if rows is None:
            raise ValueError(f"{self.name}.{what} needs rows=: a function from the batch's ids "
                             "per table to TableLookups with the rows filled")
        params = self._per_layer(self.layout.views(w))
        for a in range(0, len(x), batch_size):
            xb = x[a:a + batch_size]
            xs = self._sparse_inputs(xb, rows(self.batch_ids(xb)), params, [{} for _ in params], w.dtype)
            yield a, xb, self._forward(params, xs, self._buffers(len(xb), w.dtype), Pass())[-1]

    def _sparse_evaluate(self, w, x, y, batch_size: int, rows) -> dict:
        x, y = self._check_batch(w, x, y)
        parts, sums = [], []
        for a, xb, out in self._sparse_outputs(w, x, batch_size, rows, "evaluate"):
            yb = y[a:a + len(xb)]
            parts.append(chunk_scores(self.kernels, self.loss, out, yb))
            sums.append(self.metric_sums(out, yb))
        return {**scores(self.loss, parts, y), **metrics.values_of(self.metric_objects, np.sum(sums, axis=0))}

    def _sparse_predict(self, w, x, batch_size: int, rows) -> np.ndarray:
        self._check_w(w)
        x = self._records(x)
        out = np.empty((len(x), *self.output_shape), w.dtype)
        for a, xb, got in self._sparse_outputs(w, x, batch_size, rows, "predict"):
            out[a:a + len(xb)] = got
        return out

    # -- checks -----------------------------------------------------------------------------------

    def _records(self, x) -> np.ndarray:
        """x as a 1-D array of records; ValueError naming the field and what it should be."""
        x, record = np.asarray(x), self._sparse.record
        if x.dtype == self._sparse.checked and x.ndim == 1 and len(x):    # as the last batch's
            return x
        if not set(record.names) <= set(x.dtype.names or ()):
            raise ValueError(f"x has dtype {x.dtype}; {self._takes()}")
        if x.ndim != 1 or len(x) == 0:
            raise ValueError(f"x has shape {x.shape}; {self._takes()}, as a 1-D array of n >= 1 records")
        for field in record.names:
            self._check_field(field, x.dtype[field], record[field])
        self._sparse.checked = x.dtype
        return x

    def _check_field(self, field: str, got: np.dtype, expect: np.dtype) -> None:
        ids = expect.base.kind in "iu"
        if got.shape != expect.shape or got.base.kind not in ("iu" if ids else "f"):
            what = "integer ids" if ids else "floats"
            raise ValueError(f"x[{field!r}] has dtype {got.base} and shape {got.shape}; it must "
                             f"hold {what} of shape {expect.shape} ({self._takes()})")

    def _takes(self) -> str:
        record = self._sparse.record
        fields = ", ".join(f"{k} {record[k].base} {record[k].shape}" for k in record.names)
        return f"{self.name} takes records with fields {fields}"

    def _check_records(self, w, x, y) -> tuple[np.ndarray, np.ndarray]:
        self._check_w(w)
        x = self._records(x)
        y = self._labels(self.loss.labels(y), len(x), "records")
        return x, np.ascontiguousarray(y, dtype=self.loss.label_dtype(w.dtype))

    def _check_lookups(self, sparse, n: int) -> list[TableLookup]:
        """One lookup per table, in order, whose inverse has the shape of the batch's ids."""
        tables = self._sparse.tables
        if sparse is None or len(sparse) != len(tables):
            raise ValueError(f"{self.name} has {len(tables)} sparse tables "
                             f"({', '.join(t.name for t in tables)}); got "
                             f"{0 if sparse is None else len(sparse)} lookups")
        for table, lookup, members in zip(tables, sparse, self._sparse.members):
            fields = [self._sparse.fields[j] for j in members]
            u, ids = len(lookup.uniq), ((n, *self._inputs[fields[0]].shape[1:]) if len(fields) == 1 else
                                        (n, sum(int(np.prod(self._inputs[i].shape[1:])) for i in fields)))
            if (lookup.inverse.shape != ids or lookup.rows.shape != (u, table.dim)
                    or lookup.grads.shape != (u, table.dim)):
                raise ValueError(f"table {table.name}: the lookup has inverse {lookup.inverse.shape}, "
                                 f"rows {lookup.rows.shape} and grads {lookup.grads.shape}; the "
                                 f"batch needs {ids}, ({u}, {table.dim}) twice")
        return sparse

    def _check_record_data(self, x, y, what: str) -> np.ndarray:
        """A whole dataset checked before training: records, labels, finite float fields, and the
        ids a sparse table with a vocabulary (input_dim: a Keras-RS table's vocabulary_size) reads
        against it."""
        try:
            x, _ = self._check_records(np.zeros(self.layout.total, np.float32), x, y)
            plan = self._plan(False)
            for li, i in zip(self._sparse.layers, self._sparse.fields):
                if plan.layers[li].input_dim is not None:
                    plan.layers[li].check_ids(x[self._keys[i]])
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None
        for field in self.record.names:
            if x.dtype[field].base.kind == "f":
                finite = np.isfinite(x[field].reshape(len(x), -1)).all(axis=1)
                if not finite.all():
                    raise DataError(f"{what}: x[{field!r}] has NaN or Inf values in {int((~finite).sum())} "
                                    f"records, the first at index {int(np.argmin(finite))}")
        return x


def list_paddings(plan: graph.Plan, inputs: int) -> dict:
    """What pads each model input a pooling Embedding reads straight from: its padding id (an
    int), or 0.0 for the input that weighs its lists. {input index: padding}."""
    pads: dict = {}
    for step in plan.steps:
        layer = None if step.layer is None else plan.layers[step.layer]
        if not getattr(layer, "takes_ids", False) or layer.padding is None:   # (Conv2D's padding is another)
            continue
        if step.ins[0] < inputs:
            pads[step.ins[0]] = layer.padding
        for s in step.ins[1:]:
            if s < inputs:
                pads[s] = 0.0
    return pads


def pad_lists(lists, shape: tuple, padding, name: str) -> np.ndarray:
    """A list feature as the records hold it, (n, length): an array of that shape as it is, or
    a list of lists (or a 1-D object array of them) of at most `length` values each, padded with
    `padding` after its values: int64 ids after an int padding, float32 weights after a float.
    ValueError naming the input and the first list too long."""
    if isinstance(lists, np.ndarray) and lists.dtype != object:
        return lists
    if not isinstance(lists, (list, tuple, np.ndarray)) or not all(
            isinstance(a, (list, tuple, np.ndarray)) for a in lists):
        return np.asarray(lists)
    width = shape[0] if len(shape) == 1 else None
    lengths = [len(a) for a in lists]
    if width is None:
        raise ValueError(f"input {name!r}: lists of ids fill a 1-D input; it takes {shape}")
    if lengths and max(lengths) > width:
        first = next(j for j, m in enumerate(lengths) if m > width)
        raise ValueError(f"input {name!r}: list {first} has {lengths[first]} ids; the input holds at most "
                         f"{width} (Input(shape=({width},))): give a wider Input")
    ids = isinstance(padding, int)
    out = np.full((len(lists), width), padding, np.int64 if ids else np.float32)
    for j, a in enumerate(lists):
        values = np.asarray(a)
        if values.size and values.dtype.kind not in ("iu" if ids else "iuf"):
            raise ValueError(f"input {name!r}: list {j} holds {values.dtype} values; "
                             + ("ids are integers" if ids else "weights are numbers"))
        out[j, :values.size] = values
    return out


__all__ = ["SparseLayers", "SparseProtocol", "list_paddings", "pad_lists"]
