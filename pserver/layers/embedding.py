"""Embedding(input_dim, output_dim): integer ids (n, length) -> rows of a table
(n, length, output_dim).

Dense (the default): the table is a dense tensor of the layout like any other, input_dim rows.

Sparse (`sparse=True`, and `input_dim=None` for unbounded 64-bit ids): the table lives on the
shards as a `pserver.sparse` table that grows row by row, so the layer owns no dense weights;
it declares a `TableConfig` instead (its row optimizer, admission and eviction are arguments
here). Per batch, the model hands the layer the rows of the batch's unique ids (a
`TableLookup`) as its table and each id's position among them (`lookup.inverse`) as its
input; the kernels are the dense ones, and the backward pass sums the gradients of repeated
ids into `lookup.grads`, one row per unique id, which is what the worker pushes.

A list feature (multi-hot: several ids per sample, a user's recent items): `combiner="sum"`,
`"mean"` or `"sqrtn"` pools each sample's ids (n, length) into one vector (n, output_dim), in
one kernel forward and backward (pserver.kernels' pooled_embedding_*), as Keras-RS's
`TableConfig(combiner=...)` and TensorFlow's embedding_lookup_sparse do. Lists of different
lengths are padded: `mask_zero=True` (Keras's name) makes id 0 padding, which reads no row and
counts in no mean; the model pads lists given as Python lists with it. An id of 0 is then no
row's (as in Keras). `padding_id=-1` pads with -1 instead, for ids that start at 0 (Keras-RS's
tables: pserver.keras_rs). Weighted lists (Keras-RS's `weights`): call the layer on `[ids, weights]`,
weights a float model input of the ids' shape; `mean` divides by the sum of a list's weights,
`sqrtn` by the root of the sum of their squares.

A sequence (an attention's keys: pserver.layers.sequence): `combiner=None` with `mask_zero` or
`padding_id` gives one row per position, zeros at padding, which passes no gradient and, on
the shards, is never pulled or pushed.

`table="name"` on sparse layers makes them look up one table on the shards (Keras-RS's features
sharing a TableConfig), each reading its own input (pserver.models.sparse_graph.SparseLayers).
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.kernels.reference import COMBINERS
from pserver.layers import initializers, regularizers
from pserver.layers.base import Layer, Weight, activity, positive_int
from pserver.ops.core import Symbolic
from pserver.ops.math import cast, not_equal
from pserver.sparse import TableConfig


class Embedding(Layer):
    kind = "embedding"
    takes_ids = True     # its input is integer ids, not float features

    def __init__(self, input_dim: int | None, output_dim: int, embeddings_initializer="uniform",
                 input_length: int | None = None, *, sparse: bool = False,
                 optimizer: str = "adagrad", lr: float = 0.05, min_count: int = 0,
                 max_rows: int = 0, ttl_steps: int = 0, seed: int = 0,
                 optimizer_params: dict | None = None, row_dtype: str = "float32",
                 state_dtype: str = "float32", embeddings_regularizer=None, activity_regularizer=None,
                 mask_zero: bool = False, combiner: str | None = None, padding_id: int | None = None,
                 table: str | None = None, **kwargs):
        if input_length is not None and "input_shape" not in kwargs:
            kwargs["input_shape"] = (input_length,)
        super().__init__(**kwargs)
        self.sparse = bool(sparse)
        if input_dim is None and not self.sparse:
            raise ConfigError("Embedding: input_dim=None (unbounded ids) needs sparse=True")
        self.input_dim = None if input_dim is None else positive_int("Embedding", "input_dim", input_dim)
        self.output_dim = positive_int("Embedding", "output_dim", output_dim)
        if combiner is not None and combiner not in COMBINERS:
            raise ConfigError(f"Embedding: combiner must be one of {', '.join(COMBINERS)} (or None: one "
                              f"vector per id), got {combiner!r}")
        padding = list_padding("Embedding", mask_zero, padding_id)
        if table is not None and (not self.sparse or not isinstance(table, str) or not table):
            raise ConfigError(f"Embedding: table={table!r} names a sparse table (sparse=True) to share with "
                              "other sparse Embeddings: a non-empty string")
        self.mask_zero, self.combiner, self.table = mask_zero, combiner, table
        self.padding = padding                              # the id that pads a list (None: none does)
        self.embeddings_initializer = initializers.get(embeddings_initializer,
                                                       "Embedding: embeddings_initializer")
        self.embeddings_regularizer = regularizers.get(embeddings_regularizer,
                                                       "Embedding: embeddings_regularizer")
        self.activity_regularizer = activity("Embedding", activity_regularizer)
        if self.sparse and self.embeddings_regularizer is not None:
            raise ConfigError("Embedding(sparse=True): embeddings_regularizer is not supported (the rows "
                              "live on the shards)")
        if self.sparse:
            # Every field but the name, which the model gives the layer later.
            self._table = dict(dim=self.output_dim, optimizer=optimizer, lr=lr,
                               init_scale=_init_scale(self.embeddings_initializer), seed=seed,
                               min_count=min_count, max_rows=max_rows, ttl_steps=ttl_steps,
                               params=tuple(sorted((optimizer_params or {}).items())),
                               row_dtype=row_dtype, state_dtype=state_dtype)
            self.table_config("embedding")    # a bad option fails here, not at the first step

    def table_config(self, name: str | None = None) -> TableConfig:
        """The sparse table this layer declares, named after the layer unless it names one
        (`table=`: layers naming one table share its rows) (sparse mode only)."""
        config = TableConfig(name=name or self.table or self.name, **self._table)
        try:
            config.check()
        except ValueError as e:
            raise ConfigError(f"Embedding(sparse=True): {e}") from None
        return config

    def __call__(self, inputs, training=None, **kwargs):
        if isinstance(inputs, (list, tuple)):        # [ids, weights]: a weighted list feature
            if not self.combiner or len(inputs) != 2:
                raise ConfigError(f"{self.label}: takes one tensor of ids, or [ids, weights] with a "
                                  f"combiner (a weighted list feature); got {len(inputs)} tensors"
                                  + ("" if self.combiner else " and combiner=None"))
            weights = inputs[1]
            if isinstance(weights, Symbolic) and (weights.node is not None or weights.dtype.kind != "f"):
                raise ConfigError(f"{self.label}: a list's weights must be a float model input "
                                  "(keras.Input(shape=(length,)), not a layer's output: they take no "
                                  "gradient)")
            self.takes_list = True
        return super().__call__(inputs, training, **kwargs)

    def build(self, input_shape):
        if not self.takes_list:
            return super().build(input_shape)
        ids, weights = (tuple(s) for s in input_shape)
        if ids != weights:
            raise ConfigError(f"{self.label}: a list's weights must have its ids' shape; ids {ids}, "
                              f"weights {weights}")
        return super().build(ids)

    def output_shape_for(self, input_shape):
        if input_shape == ():        # one id per sample (Keras's Input(shape=())): one vector, no pooling
            if self.padding is not None:
                raise ConfigError(f"{self.label}: one id per sample (input shape ()) has no padding; "
                                  "mask_zero and padding_id are for lists")
            return (self.output_dim,)
        self.expect_rank(input_shape, 1, "ids (length,)")
        return (self.output_dim,) if self.combiner else (input_shape[0], self.output_dim)

    def output_mask(self, xs):
        """Keras's compute_mask: an unpooled sequence with padding (mask_zero=True, padding_id) carries
        the mask ids != padding, which recurrent layers, attention and GlobalAveragePooling1D read."""
        if self.pooled or self.padding is None or self.input_shape == ():
            return None
        return cast(not_equal(xs[0], self.padding), "float32")

    @property
    def pooled(self) -> bool:
        """Whether each sample's ids are pooled into one vector (a combiner, over lists)."""
        return bool(self.combiner) and self.input_shape != ()

    def weights(self):
        if self.sparse:
            return []
        return [Weight("embeddings", (self.input_dim, self.output_dim), self.embeddings_initializer,
                       regularizer=self.embeddings_regularizer)]

    def scratch(self, n, dtype):
        s = {} if self.sparse else {"ids": np.empty((n, *self.input_shape), np.int64)}
        if self.pooled and not self.takes_list:        # each id's weight in its list: 1
            s["weights"] = np.ones((n, *self.input_shape), np.float32)
        return s

    def check_ids(self, x: np.ndarray) -> None:
        """Ids outside [0, input_dim) would read another row, or outside the table (padding
        reads none)."""
        ids = x if self.padding is None else x[x != self.padding]
        if ids.size and (ids.min() < 0 or ids.max() >= self.input_dim or not np.all(ids == np.floor(ids))):
            bad = (x < 0) | (x >= self.input_dim) | (x != np.floor(x))
            if self.padding is not None:
                bad &= x != self.padding
            first = tuple(int(i) for i in np.argwhere(bad)[0])    # where the data has it, padding and all
            raise ValueError(f"{self.label}: id {x[first].item()!r} at {first} is not an integer in "
                            f"[0, input_dim={self.input_dim})")

    def _ids(self, k, p, x, s) -> np.ndarray:
        """The row of the table each input reads (-1: padding): a sparse layer's are its lookup's
        inverse (int64 positions among the batch's rows, given as p["positions"]); a dense
        one's, x, are checked (on the host: on the GPU an id outside the table reads a row of NaN,
        pserver.kernels.cuda.embedding_forward) and copied."""
        if not self.sparse:
            if isinstance(x, np.ndarray):
                self.check_ids(x)
            k.ids_into(x, s["ids"], self.padding)
            return s["ids"]
        if "embeddings" not in p:
            raise ConfigError(f"{self.label}: a sparse Embedding trains in a model with sparse "
                              "tables (a Functional with dict inputs, on records); Sequential holds "
                              "dense tensors only")
        return p["positions"]

    def forward(self, k, p, x, out, s, run):
        x, weights = (x[0], x[1]) if self.takes_list else (x, s.get("weights"))
        ids = self._ids(k, p, x, s)
        if self.pooled:
            k.pooled_embedding_forward(ids, weights, p["embeddings"], COMBINERS[self.combiner], out)
        else:
            ids, out = _as_lists(ids, out)
            k.embedding_forward(ids, p["embeddings"], out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        x, weights = (x[0], x[1]) if self.takes_list else (x, s.get("weights"))
        ids = p["positions"] if self.sparse else s["ids"]
        if self.pooled:
            k.pooled_embedding_backward(ids, weights, dout, COMBINERS[self.combiner], g["embeddings"])
        else:
            ids, dout = _as_lists(ids, dout)
            k.embedding_backward(ids, dout, g["embeddings"])


def list_padding(owner: str, mask_zero, padding_id) -> int | None:
    """The id that pads a list, from Keras's mask_zero (id 0) or padding_id (None: no padding);
    ConfigError naming `owner` for a bad pair."""
    if not isinstance(mask_zero, bool):
        raise ConfigError(f"{owner}: mask_zero must be True or False, got {mask_zero!r}")
    if padding_id is not None and (isinstance(padding_id, bool) or not isinstance(padding_id, int)
                                   or mask_zero and padding_id != 0):
        raise ConfigError(f"{owner}: padding_id must be an integer id (0 with mask_zero=True), got "
                          f"{padding_id!r}")
    return 0 if mask_zero else padding_id


def _as_lists(ids, y):
    """ids (n, length) and y (n, length, dim) as the kernels take them: one id per sample, (n,)
    and (n, dim), is a list of one (views, on the host or the device)."""
    if len(ids.shape) == 1:
        return ids.reshape(ids.shape[0], 1), y.reshape(y.shape[0], 1, y.shape[1])
    return ids, y


def _init_scale(init: initializers.Initializer) -> float:
    """A sparse row's initial value is uniform(-scale, scale), computed on the shards from its
    id (so every process agrees without drawing it): the initialisers that fit that form."""
    if isinstance(init, initializers.Zeros):
        return 0.0
    if (isinstance(init, initializers.RandomUniform) and init.maxval >= 0
            and init.minval == -init.maxval):
        return init.maxval
    raise ConfigError("Embedding(sparse=True): embeddings_initializer must be 'zeros', 'uniform' or "
                      f"RandomUniform(-s, s) (the shards compute each row's initial value), got "
                      f"{type(init).__name__}{vars(init)}")
