"""keras_rs.layers: Keras-RS's embedding configs and layers, with the tables on the shards, and
its BruteForceRetrieval (pserver.keras_rs.retrieval).

A `TableConfig` is a sparse table on the shards (pserver.sparse): rows are made on first use and
updated there by the table's own optimizer, whatever the model's optimizer is, as Keras-RS's
tables are. `DistributedEmbedding(feature_configs)` called on the model's inputs (the same
structure as the configs: a dict, a list or one) gives each feature's embedding: one vector per
sample, a list feature's ids pooled by its table's combiner. A list feature is an input of
shape (max length,) of ids in [0, vocabulary_size); shorter lists are given as Python lists (or
padded with -1), as Keras-RS takes ragged tensors. Weights, when given, weigh each id of a list.

What a parameter server does with Keras-RS's TPU arguments: `placement`, `table_stacking`,
`update_stats`, `max_ids_per_partition` and `max_unique_ids_per_partition` are accepted and
change nothing (every table is on the shards, row by row). Rows start uniform with the variance
of the table's initializer (Keras-RS's default is VarianceScaling(mode="fan_out"), a truncated
normal of variance 1 / embedding_dim): the shards compute a row's start from its id.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from pserver.errors import ConfigError
from pserver.keras_rs.retrieval import BruteForceRetrieval, Retrieval
from pserver.layers import Embedding, initializers
from pserver.layers.interaction import DotInteraction, FeatureCross
from pserver.ops.core import Symbolic

COMBINERS = ("mean", "sum", "sqrtn")
PLACEMENTS = ("auto", "default_device", "sparsecore")
# A Keras optimizer's name -> the shards' row optimizer, and Keras's default learning rate.
ROW_OPTIMIZERS = {
    "sgd": ("sgd", 0.01),
    "adagrad": ("adagrad", 0.001),
    "adam": ("adam", 0.001),
    "ftrl": ("ftrl", 0.001),
}


@dataclasses.dataclass(order=True)
class TableConfig:
    """One embedding table (Keras-RS's fields and defaults): a sparse table on the shards."""

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Any = dataclasses.field(default_factory=lambda: initializers.VarianceScaling(mode="fan_out"))
    optimizer: Any = "adam"
    combiner: str = "mean"
    placement: str = "auto"
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256

    def __post_init__(self):
        where = f"TableConfig {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"TableConfig: name must be a non-empty string, got {self.name!r}")
        for field in (
            "vocabulary_size",
            "embedding_dim",
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {field} must be an integer >= 1, got {value!r}")
        if self.combiner not in COMBINERS:
            raise ConfigError(
                f"{where}: combiner must be one of {', '.join(COMBINERS)}, got {self.combiner!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"{where}: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        self.row_optimizer()  # a bad optimizer or initializer fails here
        self.init_scale()

    def row_optimizer(self) -> tuple[str, float]:
        """(the shards' row optimizer, its learning rate) for `optimizer`: a name (Keras's default
        rate) or a pserver.keras optimizer (its rate)."""
        opt = self.optimizer
        name = opt.lower() if isinstance(opt, str) else type(opt).__name__.lower()
        if name not in ROW_OPTIMIZERS:
            raise ConfigError(
                f"TableConfig {self.name!r}: optimizer must be one of SGD, Adagrad, Adam or FTRL "
                f"(as Keras-RS's tables), by name or as a keras.optimizers object; got {opt!r}"
            )
        row, rate = ROW_OPTIMIZERS[name]
        if not isinstance(opt, str):
            rate = getattr(opt, "learning_rate", rate)
            if not isinstance(rate, (int, float)):
                raise ConfigError(
                    f"TableConfig {self.name!r}: a table's optimizer takes a fixed learning rate, "
                    f"got {rate!r}"
                )
        return row, float(rate)

    def init_scale(self) -> float:
        """s of the rows' uniform(-s, s) start: the initializer's own for uniform and zeros, else
        the uniform of the same variance (VarianceScaling over a (vocabulary_size, embedding_dim)
        table, or a RandomNormal's stddev)."""
        init = initializers.get(self.initializer, f"TableConfig {self.name!r}: initializer")
        if isinstance(init, initializers.Zeros):
            return 0.0
        if isinstance(init, initializers.RandomUniform) and init.minval == -init.maxval:
            return float(init.maxval)
        if isinstance(init, initializers.RandomNormal) and init.mean == 0:
            return math.sqrt(3.0) * float(init.stddev)
        if isinstance(init, initializers.VarianceScaling):
            fan_in, fan_out = initializers.fans((self.vocabulary_size, self.embedding_dim))
            fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[init.mode]
            return math.sqrt(3.0 * init.scale / max(1.0, fan))
        raise ConfigError(
            f"TableConfig {self.name!r}: initializer must be zeros, a symmetric RandomUniform, a "
            f"RandomNormal of mean 0 or a VarianceScaling (the shards start each row uniform), "
            f"got {type(init).__name__}"
        )


@dataclasses.dataclass(order=True)
class FeatureConfig:
    """One feature (Keras-RS's fields): the table it looks up, its input shape (batch,) for one id
    per sample or (batch, max length) for a list, and its output shape (batch, embedding_dim)."""

    name: str
    table: TableConfig
    input_shape: tuple
    output_shape: tuple

    def __post_init__(self):
        where = f"FeatureConfig {self.name!r}"
        if not isinstance(self.table, TableConfig):
            raise ConfigError(f"{where}: table must be a TableConfig, got {type(self.table).__name__}")
        self.input_shape, self.output_shape = tuple(self.input_shape), tuple(self.output_shape)
        if len(self.input_shape) not in (1, 2):
            raise ConfigError(
                f"{where}: input_shape must be (batch,) or (batch, max length), got {self.input_shape}"
            )
        if self.output_shape[1:] != (self.table.embedding_dim,):
            raise ConfigError(
                f"{where}: output_shape must be (batch, {self.table.embedding_dim}) (the table's "
                f"embedding_dim), got {self.output_shape}"
            )


class DistributedEmbedding:
    """Keras-RS's DistributedEmbedding: called on the inputs (the structure of `feature_configs`),
    gives each feature's embedding in that structure. Each table becomes one sparse Embedding
    layer on the shards, named after the table; features sharing a table look it up together
    (one table on the shards, one lookup per batch, their gradients summed)."""

    def __init__(
        self, feature_configs, *, table_stacking="auto", update_stats: bool = False, name=None, **kwargs
    ):
        self.name = name or "distributed_embedding"
        self.feature_configs = feature_configs
        features = _flatten(feature_configs)
        if not features or not all(isinstance(f, FeatureConfig) for _, f in features):
            raise ConfigError(
                "DistributedEmbedding: feature_configs must be FeatureConfigs (one, or a dict or "
                "list of them)"
            )
        seen: dict[str, TableConfig] = {}
        for _, f in features:
            if f.table.name in seen and seen[f.table.name] != f.table:
                raise ConfigError(f"DistributedEmbedding: two TableConfigs are named {f.table.name!r}; a "
                                  "table shared by features is one TableConfig object or equal ones")
            seen[f.table.name] = f.table
        uses = collections.Counter(f.table.name for _, f in features)
        self._layers = {path: _layer(f, uses[f.table.name] > 1) for path, f in features}

    def __call__(self, inputs, weights=None, training=None):
        paths = dict(_flatten(self.feature_configs))
        given = dict(_flatten(inputs))
        if set(given) != set(paths):
            raise ConfigError(
                f"DistributedEmbedding: the inputs' structure {sorted(given)} is not the "
                f"feature_configs' {sorted(paths)}"
            )
        weighed = dict(_flatten(weights)) if weights is not None else {}
        outputs = {}
        for path, feature in paths.items():
            x, w = given[path], weighed.get(path)
            if isinstance(x, Symbolic) and x.shape[1:] != feature.input_shape[1:]:
                raise ConfigError(
                    f"DistributedEmbedding: feature {feature.name!r} takes inputs of shape "
                    f"{feature.input_shape} (FeatureConfig.input_shape), got {x.shape}"
                )
            outputs[path] = self._layers[path]([x, w] if w is not None else x)
        return _unflatten(self.feature_configs, outputs)


def EmbedReduce(
    input_dim: int,
    output_dim: int,
    embeddings_initializer="uniform",
    embeddings_regularizer=None,
    mask_zero: bool = False,
    combiner: str = "mean",
    **kwargs,
) -> Embedding:
    """Keras-RS's EmbedReduce: an Embedding that pools each sample's list by `combiner` (mean by
    default); one id per sample (input shape ()) is embedded as it is. Call it on ids, or on
    [ids, weights]."""
    if combiner not in COMBINERS:
        raise ConfigError(f"EmbedReduce: combiner must be one of {', '.join(COMBINERS)}, got {combiner!r}")
    return Embedding(
        input_dim,
        output_dim,
        embeddings_initializer,
        embeddings_regularizer=embeddings_regularizer,
        mask_zero=mask_zero,
        combiner=combiner,
        **kwargs,
    )


def _layer(f: FeatureConfig, shared: bool) -> Embedding:
    """The sparse Embedding of feature f's table: a list pooled by the table's combiner, padding -1
    (Keras-RS's ids start at 0). A table several features share is one table on the shards that
    each feature's layer names (Embedding(table=...): their rows and gradients are one)."""
    t = f.table
    row, lr = t.row_optimizer()
    lists, scale = len(f.input_shape) == 2, t.init_scale()
    return Embedding(
        t.vocabulary_size,  # a sparse table still; the data's ids are checked against it before fit
        t.embedding_dim,
        initializers.RandomUniform(-scale, scale) if scale else "zeros",
        sparse=True,
        optimizer=row,
        lr=lr,
        name=f"{t.name}_{f.name}" if shared else t.name,
        table=t.name if shared else None,
        combiner=t.combiner if lists else None,
        padding_id=-1 if lists else None,
    )


def _flatten(structure) -> list[tuple]:
    """(path, leaf) pairs of a dict (nested), list or tuple, or a single leaf at path ()."""
    if isinstance(structure, dict):
        return [((k, *p), leaf) for k in structure for p, leaf in _flatten(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [((i, *p), leaf) for i, s in enumerate(structure) for p, leaf in _flatten(s)]
    return [((), structure)]


def _unflatten(structure, values: dict, at: tuple = ()):
    if isinstance(structure, dict):
        return {k: _unflatten(v, values, (*at, k)) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_unflatten(v, values, (*at, i)) for i, v in enumerate(structure))
    return values[at]


__all__ = [
    "TableConfig",
    "FeatureConfig",
    "DistributedEmbedding",
    "EmbedReduce",
    "FeatureCross",
    "DotInteraction",
    "Retrieval",
    "BruteForceRetrieval",
]
