"""Sequential: a list of layers, as in Keras: the chain case of the graph model.

At build it calls its layers in order on a symbolic input of its input shape, so it trains,
evaluates and predicts through the same planned graph as any Functional model
(pserver.models.functional); it adds only `add`, where the input shape comes from, and its
config (a list of layers, the file format every Sequential was saved in).
"""

from __future__ import annotations

from pserver.errors import ConfigError
from pserver.layers import deserialize
from pserver.layers.base import Layer, as_shape
from pserver.models import losses, metrics
from pserver.models.functional import Functional
from pserver.ops.core import Symbolic


class Sequential(Functional):
    """Sequential([Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), ...]).

    `input_shape` goes on the first layer or here (without the batch dimension). The loss is
    sparse categorical cross-entropy from logits unless `compile(loss=...)` says otherwise.
    """

    def __init__(self, layers=(), input_shape=None, name: str = "sequential",
                 loss="sparse_categorical_crossentropy", backend: str = "cpu"):
        self._setup(name, loss, backend)
        self._input_shape = input_shape
        for layer in layers:
            self.add(layer)

    def add(self, layer: Layer) -> None:
        if not isinstance(layer, Layer):
            raise ConfigError(f"Sequential: {layer!r} is not a layer (pserver.layers.*)")
        if layer.takes_list:
            raise ConfigError(f"Sequential: {layer.label} takes several inputs: build the model with "
                              "keras.Model(inputs, outputs)")
        if self._built:
            raise ConfigError("Sequential: the model is built (its layout is fixed); add layers first")
        self._name(layer)
        self.layers.append(layer)

    def build(self, input_shape=None) -> "Sequential":
        """Call the layers in order on an input of the shape given here, to Sequential or to the
        first layer (ids when the first layer takes them): the graph, its every shape and the
        layout; a shape that cannot work names the layer and the shapes."""
        if self._built:
            return self
        if not self.layers:
            raise ConfigError(f"{self.name}: has no layers")
        shape = input_shape or self._input_shape or self.layers[0].input_shape
        if shape is None:
            raise ConfigError(f"{self.name}: no input shape; give input_shape= to the first layer "
                              "or to Sequential")
        self._check_names()
        h = x = Symbolic((None, *as_shape("input_shape", shape)), self._input_dtype)
        for layer in self.layers:
            h = layer(h)
        self._connect(x, h)
        return super().build()

    @property
    def _takes_ids(self) -> bool:
        return getattr(self.layers[0], "takes_ids", False)

    @property
    def _input_dtype(self) -> str:
        """float32, or ids: int32 for a dense Embedding's rows, int64 for a sparse one's
        (unbounded 64-bit ids, its records' field); a first lookup or text layer's (strings)."""
        first = self.layers[0]
        if getattr(first, "preprocessing", False):     # a lookup or text layer: its data's
            return first.input_dtype
        if not self._takes_ids:
            return "float32"
        return "int64" if getattr(self.layers[0], "sparse", False) else "int32"

    # -- configs (Keras's get_config / from_config) --------------------------------------------

    def get_config(self) -> dict:
        """The model's definition as JSON: each layer's class and config, the input shape, the
        loss. `Sequential.from_config` builds the same model (weights are not in it)."""
        # the data's shape: a first lookup or text layer's input, not the graph's (its output)
        shape = self._input_shape or (self._given[0].shape[1:] if self._built else None)
        return {"name": self.name,
                "input_shape": None if shape is None else list(shape),
                "layers": self._layer_configs([*self.preprocessing_layers, *self.layers]),
                "loss": self.loss.get_config(), "metrics": list(getattr(self, "metrics", ())),
                **metrics.objects_config(getattr(self, "metric_objects", []))}

    @classmethod
    def from_config(cls, config: dict, **kwargs) -> "Sequential":
        """The Sequential `config` describes (pserver.models.from_config builds either kind)."""
        try:
            layers = [deserialize(entry) for entry in config["layers"]]
            shape = config.get("input_shape")
            model = cls(layers, input_shape=None if shape is None else tuple(shape),
                        name=config.get("name", "sequential"), loss=losses.get(config["loss"]), **kwargs)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"a Sequential's config: {type(e).__name__} {e}") from None
        model.metrics, model.metric_objects = metrics.restored(config)
        return model


__all__ = ["Sequential"]
