"""Click-through-rate models on Criteo records, with sparse embedding tables on the shards.

A batch is a structured array of records (pserver.data.criteo.RECORD): x["dense"] float32
(n, 13), x["cat"] int64 (n, 26), one hashed id per categorical field; labels are 0/1. Each
model computes one logit per record and trains on binary cross-entropy from it:

    lr         logit = wide
    fm         logit = wide + FM(embeddings)
    wide_deep  logit = wide + deep
    deepfm     logit = wide + FM(embeddings) + deep            (FM and deep share the embeddings)
    dcn        logit = tower(cross_1(x0, cross_0(x0))), x0 = [embeddings flattened, dense]
               (DCN-v2, stacked: two keras_rs FeatureCross layers, full rank)
    dlrm       logit = tower([bottom, DotInteraction([bottom, e_1, ..., e_fields])]),
               bottom = Dense(64, relu), Dense(embedding_dim, relu) on the dense features, e_f
               field f's row (DLRM: pairwise dot products of the 27 vectors)

    wide        = sum over fields of a per-id weight (sparse table "linear", dim 1)
                  + Dense(1) on the dense features (its bias is the model's bias)
    embeddings  = one row per field from the sparse table "factors" (dim embedding_dim)
    deep        = Dense(h, relu) for h in hidden, then Dense(1), on [embeddings flattened, dense]
    tower       = the same layers on what the model gives them (dcn, dlrm: no wide part)

Multi-hot records (pserver.data.criteo.record(sizes): x["cat_j"] field j's list of up to
sizes[j] ids, padded with -1) make each field's row the mean of its list's rows (an Embedding
with combiner="mean" per field, all sharing the tables "linear" and "factors"), the rest alike.

Each is a Functional graph of these layers over the inputs {"dense", "cat"}, like a user's
model; its sparse Embedding layers make it speak the sparse model protocol
(pserver.models.sparse_graph). The layer names ("linear", "factors", "dense_linear",
"deep_i") are the tables' and the layout's, as checkpoints and model files hold them.
"""

from __future__ import annotations

import numpy as np

from pserver import ops
from pserver.errors import ConfigError
from pserver.layers import FM, Add, Concatenate, Dense, Embedding, Flatten, RandomUniform
from pserver.layers.base import positive_int
from pserver.layers.interaction import DotInteraction, FeatureCross
from pserver.models.functional import Functional
from pserver.models.mlp import he, lecun
from pserver.ops.core import Symbolic

# What each built-in has beside the wide part ("fm": the FM term) or in its place ("cross", "dot":
# DCN's and DLRM's interactions), and the deep tower's default hidden widths.
CTR_MODELS = {"lr": ("", ()), "fm": ("fm", ()), "wide_deep": ("", (256, 128)), "deepfm": ("fm", (256, 128)),
              "dcn": ("cross", (256, 128)), "dlrm": ("dot", (256, 128))}
DLRM_BOTTOM = 64            # the bottom MLP's hidden width; its output is embedding_dim wide
LIST_PADDING = -1           # pads multi-hot records' lists (pserver.data.criteo.PADDING; the tests check)


def record_dtype(dense_features: int = 13, fields: int = 26, multi_hot=None) -> np.dtype:
    """The records the models take; the defaults are Criteo's (pserver.data.criteo.RECORD), and
    with `multi_hot` (each field's list size) the multi-hot ones (criteo.record(sizes))."""
    if multi_hot:
        return np.dtype([("dense", np.float32, (dense_features,))]
                        + [(f"cat_{j}", np.int64, (n,)) for j, n in enumerate(multi_hot)])
    return np.dtype([("dense", np.float32, (dense_features,)), ("cat", np.int64, (fields,))])


def ctr_graph(name: str, *, fm: bool = False, hidden: tuple[int, ...] = (), embedding_dim: int = 8,
              init_scale: float = 0.05, dense_features: int = 13, fields: int = 26, interaction: str = "",
              multi_hot=None, **table) -> Functional:
    """wide [+ FM] [+ deep] over records of `dense_features` floats and `fields` ids; or, with
    `interaction` "cross" (DCN) or "dot" (DLRM), that interaction and the tower, no wide part.
    `multi_hot`: each field's list size (multi-hot records, a list's rows pooled by mean).

    The table options (optimizer, lr, min_count, max_rows, ttl_steps, seed, optimizer_params,
    row_dtype, state_dtype) go to both sparse tables; `init_scale` is the range of the factors'
    initial values (the per-id weights start at zero, as logistic regression's do).
    """
    fields = positive_int("ctr_model", "fields", fields)
    dense_features = positive_int("ctr_model", "dense_features", dense_features)
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not init_scale >= 0:
        raise ConfigError(f"ctr_model: init_scale must be a number >= 0, got {init_scale!r}")
    dense = Symbolic((None, dense_features), "float32", name="dense")
    if multi_hot is not None:
        multi_hot = [positive_int("ctr_model", "multi_hot", n) for n in multi_hot]
        if len(multi_hot) != fields:
            raise ConfigError(f"ctr_model: multi_hot has {len(multi_hot)} list sizes for {fields} fields")
        lists = [Symbolic((None, n), "int64", name=f"cat_{j}") for j, n in enumerate(multi_hot)]
        inputs = {"dense": dense} | {x.name: x for x in lists}
    else:
        cat = Symbolic((None, fields), "int64", name="cat")
        inputs = {"dense": dense, "cat": cat}

    def rows(name, dim, init):
        """(n, fields, dim): each field's row of table `name`, or its list's rows' mean."""
        if multi_hot is None:
            return Embedding(None, dim, init, sparse=True, name=name, **table)(cat)
        pooled = [Embedding(None, dim, init, sparse=True, name=f"{name}_{j}", table=name, combiner="mean",
                            padding_id=LIST_PADDING, **table)(x) for j, x in enumerate(lists)]
        return ops.stack(pooled, axis=1)

    def factors():
        return rows("factors", embedding_dim, RandomUniform(-init_scale, init_scale))

    def tower(h):
        for i, units in enumerate(hidden):
            h = Dense(units, activation="relu", kernel_initializer=he(), name=f"deep_{i}")(h)
        return Dense(1, kernel_initializer=lecun(), name=f"deep_{len(hidden)}")(h)

    if interaction == "cross":
        x0 = Concatenate(name="cross_input")([Flatten(name="embeddings")(factors()), dense])
        logit = tower(FeatureCross(name="cross_1")(x0, FeatureCross(name="cross_0")(x0)))
    elif interaction == "dot":
        e = factors()
        bottom = Dense(DLRM_BOTTOM, activation="relu", kernel_initializer=he(), name="bottom_0")(dense)
        bottom = Dense(embedding_dim, activation="relu", kernel_initializer=he(), name="bottom_1")(bottom)
        rows = [ops.reshape(f, (-1, embedding_dim)) for f in ops.split(e, fields, axis=1)]
        pairs = DotInteraction(name="interaction")([bottom, *rows])
        logit = tower(Concatenate(name="tower_input")([bottom, pairs]))
    else:
        # the wide part's layers made first: their order is the layout's and the tables', as files hold them
        wide = rows("linear", 1, "zeros")
        parts = [ops.sum(wide, axis=1), Dense(1, kernel_initializer="zeros", name="dense_linear")(dense)]
        e = factors() if fm or hidden else None
        if fm:
            parts.append(FM(name="fm")(e))
        if hidden:
            parts.append(tower(Concatenate(name="tower_input")([Flatten(name="embeddings")(e), dense])))
        logit = Add(name="logit")(parts)
    return Functional(inputs, logit, name=name, loss="binary_crossentropy").build()


def ctr_arguments(model: Functional) -> dict:
    """What rebuilds a built-in CTR model (a model file's arguments): its tower's widths, its
    embeddings' width and its records' shapes."""
    deep = [layer for layer in model.layers if isinstance(layer, Dense) and layer.name.startswith("deep_")]
    factors = [layer.output_dim for layer in model.layers
               if "factors" in (layer.name, getattr(layer, "table", None))]
    lists = [model.record[name].shape[0] for name in model.record.names if name.startswith("cat_")]
    return {"input_shape": [], "hidden": [layer.units for layer in deep[:-1]],
            "embedding_dim": factors[0] if factors else 8,
            "dense_features": model.record["dense"].shape[0],
            "fields": len(lists) if lists else model.record["cat"].shape[0], "multi_hot": lists or None}


def ctr_model(name: str, input_shape=(), num_classes: int = 2, hidden=None, **options) -> Functional:
    """A built-in CTR model by name (see CTR_MODELS); `hidden` replaces the deep tower's widths,
    `options` are ctr_graph's (embedding_dim, table options, ...). ConfigError naming the flag."""
    kind, default_hidden = CTR_MODELS[name]
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
    return ctr_graph(name, fm=kind == "fm", hidden=deep, interaction=kind if kind in ("cross", "dot") else "",
                     **options)


# What ctr_model passes on to ctr_graph and its Embedding tables.
CTR_OPTIONS = {"embedding_dim", "init_scale", "dense_features", "fields", "multi_hot", "optimizer",
               "lr", "min_count", "max_rows", "ttl_steps", "seed", "optimizer_params", "row_dtype",
               "state_dtype"}


__all__ = ["CTR_MODELS", "CTR_OPTIONS", "ctr_arguments", "ctr_graph", "ctr_model", "record_dtype"]
