"""Layers whose math is a `call` written with ops, traced (Keras's way of writing a layer).

A user's layer subclasses `TracedLayer` (pserver.keras.layers.Layer): `build(input_shape)`
declares weights with `add_weight`, which returns a symbolic tensor standing for the weight;
`call(inputs, training=None)` computes with pserver.ops (or Python operators on the tensors).
Called on symbolic tensors, the layer records one node; pserver.models.graph traces `call`
again at that node, once per `training` value, into op nodes whose weight inputs are these
tensors (so a layer called twice shares its weights, and the layout holds them once).

Python control flow on a tensor's value cannot be traced (`if x > 0:`): the error names the
user's file and line. `Lambda(function)` is the same with the function as `call`.
"""

from __future__ import annotations

import inspect
import os
import re
import traceback

from pserver.errors import ConfigError
from pserver.layers import initializers, saving
from pserver.layers.base import TRACING, Layer, Weight, as_shape
from pserver.ops.core import Symbolic

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WeightTensor(Symbolic):
    """A layer's weight while its call is traced: no batch dimension, made by no node."""

    def __init__(self, shape, layer: "TracedLayer", weight: str):
        super().__init__(shape, "float32", None, 0, f"{layer.name or layer.kind}/{weight}")
        self.layer, self.weight = layer, weight


class TracedLayer(Layer):
    """Keras's Layer to subclass: __init__ (call super().__init__(**kwargs)), build, call."""

    kind = "layer"
    traced = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = [c for c in cls.__mro__[:cls.__mro__.index(TracedLayer)] if "forward" in c.__dict__]
        if own:
            raise ConfigError(f"{cls.__name__}: a keras.layers.Layer subclass defines call (traced); a layer "
                              "with its own forward and backward subclasses pserver.layers.Layer")
        if "kind" not in cls.__dict__:       # Keras's default name: the class in snake case
            cls.kind = snake_case(cls.__name__)

    def __init__(self, *, input_shape=None, name: str | None = None, trainable: bool = True, dtype=None):
        super().__init__(input_shape=input_shape, name=name)
        if dtype not in (None, "float32"):
            raise ConfigError(f"{type(self).__name__}: dtype={dtype!r}: pserver trains float32 layers")
        self._own_weights: list[Weight] = []
        self.trainable = trainable

    # -- what a user's layer calls and overrides --------------------------------------------------

    def add_weight(self, shape=(), initializer="glorot_uniform", dtype=None, trainable=True, name=None,
                   regularizer=None, constraint=None, **unsupported) -> WeightTensor:
        """A weight of this layer (Keras's add_weight): held in the model's flat vector."""
        where = f"{self.label}: add_weight"
        bad = {**unsupported, "regularizer": regularizer, "constraint": constraint,
               "trainable": None if isinstance(trainable, bool) else trainable,
               "dtype": None if dtype in (None, "float32") else dtype}
        bad = {k: v for k, v in bad.items() if v is not None}
        if bad:
            k = sorted(bad)[0]
            raise ConfigError(f"{where}: {k}={bad[k]!r} is not supported (docs/guide/keras.md)")
        own = getattr(self, "_own_weights", None)
        if own is None:
            raise ConfigError(f"{where}: call super().__init__() in {type(self).__name__}.__init__ first")
        n = len(own)
        name = name or ("variable" if n == 0 else f"variable_{n}")
        if any(w.name == name for w in own):
            raise ConfigError(f"{where}: two weights are named {name!r}")
        own.append(Weight(name, as_shape(f"{where}: shape", shape) if shape != () else (),
                          initializers.get(initializer, f"{where}: initializer"), trainable))
        return WeightTensor(own[-1].shape, self, name)

    def build(self, input_shape) -> None:
        """Keras's build: weights for this input shape (with the batch, None). None by default."""

    def call(self, inputs, training=None):
        raise ConfigError(f"{self.label}: a Layer subclass defines call(self, inputs)")

    def compute_mask(self, inputs, previous_mask):
        """Keras's: the mask the output carries, from the inputs and their masks (`previous_mask`:
        the input's, or a list of them), made with ops; a layer that defines it supports masking,
        as in Keras. By default the input's mask with supports_masking = True, else none."""
        return previous_mask if self.supports_masking else None

    # -- how pserver builds and traces it ---------------------------------------------------------

    def __call__(self, inputs, training=None, **kwargs):
        if isinstance(inputs, dict):         # a dict by name: a list in its keys' order, given back to call
            if getattr(self, "_dict_keys", None) not in (None, list(inputs)):
                raise ConfigError(f"{self.label}: built for inputs {self._dict_keys}, called on "
                                  f"{list(inputs)}")
            self._dict_keys, inputs = list(inputs), list(inputs.values())
        if getattr(self, "_built_for", None) is None:
            self.takes_list = isinstance(inputs, (list, tuple))
            self._first_kwargs = kwargs      # the build's trace sees the first call's arguments
        masked = [x for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])
                  if getattr(x, "mask", None) is not None]
        if masked and "mask" in inspect.signature(self.call).parameters:
            raise ConfigError(f"{self.label}: its call takes mask= and its input carries a mask "
                              "(Embedding(mask_zero=True), Masking), which Keras would pass; pserver does "
                              "not pass a mask to a layer's own call: compute with the padding ids instead, "
                              "or drop the mask")
        out = super().__call__(inputs, training=training, **kwargs)
        form = getattr(self, "_form", None)
        if form is None or not (isinstance(out, Symbolic) and getattr(out.node, "layer", None) is self):
            return out
        # A call that returned several tensors: one node with an output for each, given back as
        # call gave them (a tuple, a list or a dict by key).
        node = out.node
        for k, shape in enumerate(self.output_shapes[1:], 1):
            node.outputs.append(Symbolic((None, *shape), "float32", node, k))
        kind, keys = form
        return (dict(zip(keys, node.outputs)) if kind == "dict" else
                tuple(node.outputs) if kind == "tuple" else list(node.outputs))

    def output_mask(self, xs):
        if type(self).compute_mask is TracedLayer.compute_mask:
            return super().output_mask(xs)
        previous = [x.mask for x in xs] if self.takes_list else xs[0].mask
        with _user_errors(self, "compute_mask"):
            mask = self.compute_mask(self._as_called(xs) if self.takes_list else xs[0], previous)
        if mask is not None and not isinstance(mask, Symbolic):
            raise ConfigError(f"{self.label}: compute_mask returned {type(mask).__name__}, not a tensor "
                              "computed with ops from the inputs, or None")
        return mask

    def _as_called(self, inputs):
        """The inputs as call takes them: a dict again when the layer was called on one."""
        keys = getattr(self, "_dict_keys", None)
        return dict(zip(keys, inputs)) if keys is not None else inputs

    def build_once(self, input_shape) -> None:
        if getattr(self, "_built_for", None) is None:
            batched = [(None, *s) for s in input_shape] if self.takes_list else (None, *input_shape)
            with _user_errors(self, "build"):
                self.build(self._as_called(batched))
            self.input_shape, self._built_for = input_shape, input_shape
            inputs = [Symbolic(s) for s in batched] if self.takes_list else Symbolic(batched)
            outs = self.trace(inputs, False, **getattr(self, "_first_kwargs", {}))
            self.output_shapes = [o.shape[1:] for o in outs]
            self.output_shape = self.output_shapes[0]
        super().build_once(input_shape)

    def trace(self, inputs, training: bool, **kwargs) -> list[Symbolic]:
        """call() on symbolic `inputs` (and the call's other keyword arguments): the outputs it
        records (one, or each of a tuple, list or dict call returned), else ConfigError naming the
        layer and the user's file and line."""
        if "training" in inspect.signature(self.call).parameters:
            kwargs["training"] = training
        token = TRACING.set(True)
        try:
            with _user_errors(self, "call"):
                out = self.call(self._as_called(inputs), **kwargs)
        finally:
            TRACING.reset(token)
        outs, form = self._outputs_of(out)
        if not hasattr(self, "_form"):
            self._form = form
        elif form != self._form:
            raise ConfigError(f"{self.label}: call returned {_form_text(form)} with training={training}, "
                              f"{_form_text(self._form)} before: give the same outputs either way")
        for o in outs:
            if o.shape[:1] != (None,):
                raise ConfigError(f"{self.label}: call's output {o.shape} has no batch dimension")
        return outs

    def _outputs_of(self, out) -> tuple[list[Symbolic], tuple | None]:
        """call's result as its tensors and their form: None for one tensor, else ("tuple" or
        "list", n) or ("dict", keys)."""
        if isinstance(out, Symbolic):
            return [out], None
        if isinstance(out, dict):
            outs, form = list(out.values()), ("dict", list(out))
        elif isinstance(out, (list, tuple)):
            outs, form = list(out), (type(out).__name__, len(out))
        else:
            outs, form = [out], None
        if not outs or not all(isinstance(o, Symbolic) for o in outs):
            bad = next((o for o in outs if not isinstance(o, Symbolic)), out)
            raise ConfigError(f"{self.label}: call returned {type(bad).__name__}, not a tensor computed "
                              "with ops from its inputs (pserver.keras.ops), or a tuple, list or dict "
                              "of them")
        return outs, form

    def _eager(self, xs, kwargs: dict, training=None):
        self.build_once([x.shape[1:] for x in xs] if self.takes_list else xs[0].shape[1:])
        if self.weights():
            return super()._eager(xs, kwargs, training)     # refused there: a model holds the weights
        return self.call(self._as_called(xs) if self.takes_list else xs[0], **kwargs)

    def weights(self):
        return list(self._own_weights)

    def sublayers(self) -> list:
        """The layers held in attributes (directly, or in a list, tuple or dict's values), as Keras
        tracks them."""
        found = []
        for value in vars(self).values():
            value = list(value.values()) if isinstance(value, dict) else value
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, Layer) and v is not self:
                    found.append(v)
        return found

    def output_shape_for(self, input_shape):
        return self.output_shape

    def forward(self, k, p, x, out, s, run):
        raise ConfigError(f"{self.label}: a traced layer has no kernel of its own: its call runs as "
                          "the ops it traced, in a model's graph (keras.Model, pserver.models.Functional)")

    backward = forward


def _form_text(form) -> str:
    return "one tensor" if form is None else f"a dict of {form[1]}" if form[0] == "dict" else \
        f"a {form[0]} of {form[1]}"


class Lambda(TracedLayer):
    """Lambda(function): function(inputs) written with ops, as a layer (traced, no weights)."""

    kind = "lambda"

    def __init__(self, function, output_shape=None, arguments=None, **kwargs):
        super().__init__(**kwargs)
        if not callable(function):
            raise ConfigError(f"Lambda: function must be callable, got {function!r}")
        self.function, self.arguments = function, dict(arguments or {})

    def call(self, inputs):
        return self.function(inputs, **self.arguments)

    def get_config(self) -> dict:
        """The function (and a callable output_shape) as Keras saves it: a lambda's bytecode, or
        a named function's module and name (pserver.layers.saving)."""
        config = {**super().get_config(), "function": saving.dump_function(self.function, self.label)}
        if callable(config.get("output_shape")):
            config["output_shape"] = saving.dump_function(config["output_shape"], self.label)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "Lambda":
        where = f"layer {config.get('name') or cls.kind} (Lambda)"
        config = {**config, "function": saving.load_function(config["function"], where)}
        if isinstance(config.get("output_shape"), dict):
            config["output_shape"] = saving.load_function(config["output_shape"], where)
        return super().from_config(config)


def snake_case(name: str) -> str:
    """Keras's to_snake_case: MLPBlock -> mlp_block, Linear -> linear."""
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)).lower()


class _user_errors:   # noqa: N801 (used as a with-statement)
    """A ConfigError, or any error, raised while a user's build or call runs: one ConfigError
    naming the layer and the user's own file and line (the last frame outside pserver)."""

    def __init__(self, layer: Layer, what: str):
        self.layer, self.what = layer, what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not isinstance(error, Exception):
            return False
        frames = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(_PACKAGE)]
        at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        text = str(error) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
        raise ConfigError(f"{self.layer.label}: {self.what}{at}: {text}") from None


__all__ = ["TracedLayer", "WeightTensor", "Lambda", "snake_case"]
