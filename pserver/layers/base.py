"""What a layer is: Keras's arguments at construction, weights declared by `build`, one
forward and one backward pass through the kernels of a backend.

A layer owns no arrays. `Sequential` hands it, per call, views of its weights and of their
gradients in the flat vectors (by short name: "kernel", "bias", ...), its input, a preallocated
output, the gradient of the loss with respect to that output, and scratch buffers it asked for.
Shapes exclude the batch dimension, as Keras's `input_shape` does.
"""

from __future__ import annotations

import abc
import contextvars
import functools
import inspect
import warnings
from dataclasses import dataclass

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import activations, initializers, regularizers
from pserver.ops.core import Node, Symbolic, apply, defer, unknown

# Set while a traced layer's call is traced (pserver.layers.traced): a layer with weights called
# there on an array is a node of that graph with a constant input, as Keras computes
# `self.pos_emb(ops.arange(0, maxlen, 1))` inside a call with the layer's own weights.
TRACING = contextvars.ContextVar("pserver_tracing", default=False)


@dataclass(frozen=True)
class Weight:
    """A named tensor a layer owns; `name` is short ("kernel"), the model prefixes the layer's."""
    name: str
    shape: tuple[int, ...]
    initializer: initializers.Initializer
    trainable: bool = True      # False: the shards' optimizer leaves it (add_weight(trainable=False))
    regularizer: regularizers.L1L2 | None = None   # its penalty joins the loss (the model adds it)
    # A moving statistic (BatchNormalization's, in pairs: mean then variance): the shards update it
    # from the workers' batch statistics with this momentum (pserver.layers.normalization).
    momentum: float | None = None


@dataclass(frozen=True)
class Pass:
    """What a forward pass needs besides arrays: training or inference, and a seed (Dropout)."""
    training: bool = False
    seed: int = 0


class Layer(abc.ABC):
    """Base of every layer. Subclasses set `kind` (the Keras name prefix) and override
    `output_shape_for`, and `forward`/`backward` unless they only reshape."""

    kind = "layer"
    # True for a layer whose output is its input reshaped (Flatten): no buffer, no kernel.
    reshapes_only = False
    # True for a layer called on a list of tensors (Add, Concatenate): its x and dx are lists.
    takes_list = False
    # True for a layer whose math is its `call` traced into ops (a user's Layer, Lambda):
    # pserver.models.graph runs the ops in its place; it has no forward/backward of its own.
    traced = False
    # Keras's supports_masking: the layer passes its first input's mask on to its output (Dense,
    # Dropout, activations, normalizations); a layer that does not drops it, with Keras's warning.
    # A layer that reads the mask overrides output_mask.
    supports_masking = False

    def __new__(cls, *args, **kwargs):
        # The arguments as given, defaults filled in: get_config's, as Keras's layers keep theirs.
        self = super().__new__(cls)
        self._config = init_arguments(cls, args, kwargs)
        return self

    @property
    def input(self):
        """Keras's: what the layer was first called on in a graph (a keras.Input, a layer's output)."""
        return self._first_called("input")[0]

    @property
    def output(self):
        """Keras's: the tensor (or tensors) the layer's first call in a graph gave, to build
        another model from (keras.Model(inputs=model.input, outputs=layer.output): a feature
        extractor sharing the layers)."""
        return self._first_called("output")[1]

    def _first_called(self, what: str) -> tuple:
        if "_first_call" not in self.__dict__:
            raise ConfigError(f"{self.label}: has no {what}: it was not called on keras.Input or a layer's "
                              "output yet")
        return self._first_call

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:       # a layer's own __call__ defers as Layer's does
            cls.__call__ = _deferring(cls.__dict__["__call__"])

    def __init__(self, *, input_shape=None, name: str | None = None):
        self.name = name
        self.input_shape = None if input_shape is None else as_shape("input_shape", input_shape)
        self.output_shape: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name or ''})"

    # -- trainable: Keras's flag; a frozen layer's weights are left as they are by the shards -----

    @property
    def trainable(self) -> bool:
        return self.__dict__.get("_trainable", True)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        """As Keras's: for the layer and the layers it holds; read when training starts (fit)."""
        if not isinstance(value, bool):
            raise ConfigError(f"{self.label}: trainable must be True or False, got {value!r}")
        self._trainable = value
        for layer in self.sublayers():
            layer.trainable = value

    def sublayers(self) -> list["Layer"]:
        """The layers this one holds (a user's layer made of layers); a built-in layer holds none."""
        return []

    def frozen_weights(self) -> list[str]:
        """The short names of the weights training leaves as they are."""
        return [w.name for w in self.weights() if not (self.trainable and w.trainable)]

    # -- calling a layer (Keras's functional API) -------------------------------------------------

    def __call__(self, inputs, training=None, **kwargs):  # wrapped by _deferring below the class
        """On symbolic tensors (keras.Input, another layer's output): build for their shape and
        record a Node (pserver.models.graph runs it); the same layer called again shares its
        weights. On NumPy arrays: compute now, for a layer without weights. Other keyword
        arguments go to a traced layer's call (a built-in layer takes none)."""
        if kwargs and not self.traced:
            raise ConfigError(f"{self.label}: takes no argument {sorted(kwargs)[0]!r} when called")
        xs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if self.takes_list != isinstance(inputs, (list, tuple)):
            wanted = "a list of tensors" if self.takes_list else "one tensor"
            raise ConfigError(f"{self.label}: takes {wanted}, got {type(inputs).__name__}")
        if not any(isinstance(x, Symbolic) for x in xs):
            if TRACING.get() and not self.traced and type(self).weights is not Layer.weights:
                return self._constant(xs, training)
            return self._eager(xs, kwargs, training)
        strays = [x for x in xs if not isinstance(x, Symbolic)]
        if strays:
            raise ConfigError(f"{self.label}: called on {type(strays[0]).__name__} among symbolic tensors; "
                              "give it tensors only (keras.Input, a layer's output)")
        shapes = [x.shape[1:] for x in xs]
        self.build_once(shapes if self.takes_list else shapes[0])
        attrs = {} if training is None else {"training": training}
        if kwargs:
            attrs["kwargs"] = kwargs
        node = Node(self.kind, xs, attrs, layer=self)
        node.outputs.append(Symbolic((None, *self.output_shape), "float32", node, 0))
        node.outputs[0].mask = self.output_mask(xs)
        return node.outputs[0]

    def output_mask(self, xs: list):
        """Keras's compute_mask: the mask of this call's output, from its inputs' (Symbolic.mask)."""
        mask = xs[0].mask if xs else None
        if mask is None or self.supports_masking:
            return mask
        warnings.warn(f"Layer '{self.name or self.kind}' (of type {type(self).__name__}) was passed an input "
                      "with a mask attached to it. However, this layer does not support masking and will "
                      "therefore destroy the mask information. Downstream layers will not see the mask.",
                      stacklevel=3)
        return None

    def build_once(self, input_shape) -> None:
        """Build for `input_shape` at the first call; a later call must bring the same shape
        (the weights fit one)."""
        built = getattr(self, "_built_for", None)
        if built is None:
            given = self.input_shape
            if given is not None and not self.takes_list and tuple(input_shape) != given:
                raise ConfigError(f"{self.label}: declared input_shape={given}, called on "
                                  f"{tuple(input_shape)}")
            self.build(input_shape)
            self._built_for = input_shape
        elif built != input_shape:
            raise ConfigError(f"{self.label}: built for input shape {_shapes_text(built)}, called again "
                              f"on {_shapes_text(input_shape)}: a layer's weights fit one input shape")

    def _constant(self, xs: list, training):
        """A layer that has weights, on arrays inside a traced call: each array is one sample
        (Keras's tensor without a batch: positions' ids), so the node takes them as a batch of
        one and its output loses that batch again (a reshape), broadcasting over the model's
        batch. (A layer without weights computes now, as outside a trace: _eager.)"""
        arrays = [np.asarray(x)[None] for x in xs]
        self.build_once([a.shape[1:] for a in arrays] if self.takes_list else arrays[0].shape[1:])
        node = Node(self.kind, arrays, {} if training is None else {"training": training}, layer=self)
        node.outputs.append(Symbolic((1, *self.output_shape), "float32", node, 0))
        return apply("reshape", node.outputs[0], newshape=self.output_shape)

    def _eager(self, xs: list, kwargs: dict, training=None):
        """The layer applied to arrays now, with the cpu kernels: for a layer without weights
        that training changes (a model's flat vector holds them, so a layer alone has none to
        compute with)."""
        if not all(isinstance(x, np.ndarray) for x in xs):
            bad = next(x for x in xs if not isinstance(x, np.ndarray))
            raise ConfigError(f"{self.label}: called on {type(bad).__name__}; call a layer on "
                              "keras.Input(...) (or another layer's output) to build a model, or on "
                              "NumPy arrays")
        xs = [np.ascontiguousarray(x, np.float32 if x.dtype.kind in "biu" else x.dtype) for x in xs]
        shapes = [x.shape[1:] for x in xs]
        self.build_once(shapes if self.takes_list else shapes[0])
        if self.traced or any(w.trainable for w in self.weights()):
            raise ConfigError(f"{self.label}: has weights, which a model holds: call it on keras.Input(...) "
                              "inside a keras.Model and train or predict with the model")
        from pserver.kernels import get_backend
        n, dtype = xs[0].shape[0], xs[0].dtype
        out = np.empty((n, *self.output_shape), dtype)
        # Weights training leaves (Normalization's statistics) are their initial values here.
        p = {w.name: np.zeros(w.shape, dtype) for w in self.weights()}
        for w in self.weights():
            w.initializer(np.random.default_rng(0), p[w.name])
        self.forward(get_backend("cpu"), p, xs if self.takes_list else xs[0], out, self.scratch(n, dtype),
                     self.eager_pass(training))
        return out

    def eager_pass(self, training) -> Pass:
        """The pass of a call on arrays given `training` (None unless the caller says): inference
        (an augmentation layer, as Keras's, transforms unless told training=False)."""
        return Pass(training=False)

    def get_config(self) -> dict:
        """The constructor's arguments (Keras's get_config): `type(layer).from_config(config)`
        makes the same layer, unbuilt. The name is the one the model gave it."""
        config = {k: _plain(v) for k, v in self._config.items()}
        config["name"] = self.name
        if config.get("input_shape") is not None:
            config["input_shape"] = list(self.input_shape)
        return config

    def saved_class(self) -> type:
        """The class a model file names for this layer (pserver.layers.saving.serialize)."""
        return type(self)

    @classmethod
    def from_config(cls, config: dict) -> "Layer":
        config = {k: _unplain(v) for k, v in config.items()}
        if config.get("input_shape") is not None:
            config["input_shape"] = tuple(config["input_shape"])
        return cls(**config)

    @property
    def label(self) -> str:
        """How errors name this layer: its name and kind."""
        return f"layer {self.name or self.kind} ({type(self).__name__})"

    def build(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Fix the input shape; return the output shape. Shapes that cannot work raise
        ConfigError naming this layer and the shapes."""
        self.input_shape = as_shape("input_shape", input_shape)
        self.output_shape = self.output_shape_for(self.input_shape)
        return self.output_shape

    @abc.abstractmethod
    def output_shape_for(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """This layer's output shape (without the batch) for `input_shape`."""

    def forward_elements(self) -> int:
        """Elements per sample a forward pass writes (its output; a Conv2D adds its im2col
        rows): how models size evaluation chunks to fit in cache. 0 for a reshaping layer."""
        return 0 if self.reshapes_only else int(np.prod(self.output_shape))

    def weights(self) -> list[Weight]:
        """The tensors this layer owns, once built (none by default)."""
        return []

    def scratch(self, n: int, dtype) -> dict[str, np.ndarray]:
        """Per-batch-size buffers beyond input and output (a pooling argmax, a dropout mask)."""
        return {}

    @abc.abstractmethod
    def forward(self, k, p: dict, x: np.ndarray, out: np.ndarray, s: dict, run: Pass) -> None:
        """out[:] = this layer applied to x; p are the weights' views, s the scratch."""

    @abc.abstractmethod
    def backward(self, k, p: dict, g: dict, x: np.ndarray, out: np.ndarray, dout: np.ndarray,
                 dx: np.ndarray | None, s: dict) -> None:
        """Weight gradients into g, and dx[:] = d loss / d x unless dx is None (nothing
        before this layer needs it). dout (d loss / d out) may be overwritten."""

    def expect_rank(self, input_shape: tuple[int, ...], rank: int, what: str) -> None:
        if len(input_shape) != rank:
            raise ConfigError(f"{self.label}: needs {what} input (a shape of {rank} "
                              f"dimension{'s' if rank > 1 else ''} without the batch), "
                              f"got {input_shape}")



def _deferring(call):
    """A layer's __call__ that, on a tensor of unknown shape (computed from a keras.Input with a
    dimension None), records the call instead (pserver.ops.core.defer): the layer is built and
    called at the model's first data, on its shape."""
    if getattr(call, "defers", False):
        return call

    @functools.wraps(call)
    def deferring(self, *args, **kwargs):
        if unknown(args, kwargs):
            out = defer(self, args, kwargs, self.label)
        else:
            depth = self.__dict__.get("_depth", 0)   # a subclass's __call__ calling Layer's
            self._depth = depth + 1
            try:
                out = call(self, *args, **kwargs)
            finally:
                self._depth = depth
            if depth:
                return out
        if "_first_call" not in self.__dict__ and _symbolic(out):
            self._first_call = (args[0] if args else kwargs.get("inputs"), out)   # Keras's input, output
        return out

    deferring.defers = True
    return deferring


Layer.__call__ = _deferring(Layer.__call__)


def _symbolic(out) -> bool:
    """Whether a call gave tensors of a graph (one, or a tuple, list or dict of them)."""
    outs = list(out.values()) if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else [out]
    return bool(outs) and all(isinstance(o, Symbolic) for o in outs)


class KernelLayer(Layer):
    """A layer with a kernel, an optional bias (units or filters wide) and an activation
    (Dense, Conv2D): the weights, the bias-less case and the activation in one place."""

    def __init__(self, width: int, activation, use_bias: bool, kernel_initializer,
                 bias_initializer, kernel_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.width = width
        self.activation = activations.get(activation, owner)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer, f"{owner}: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, f"{owner}: bias_initializer")
        self.kernel_regularizer = regularizers.get(kernel_regularizer, f"{owner}: kernel_regularizer")
        self.bias_regularizer = regularizers.get(bias_regularizer, f"{owner}: bias_regularizer")
        self.activity_regularizer = activity(owner, activity_regularizer, self.activation)

    @abc.abstractmethod
    def kernel_shape(self) -> tuple[int, ...]:
        """The kernel's shape, from the built input shape and the layer's arguments."""

    def weights(self):
        w = [Weight("kernel", self.kernel_shape(), self.kernel_initializer,
                    regularizer=self.kernel_regularizer)]
        if self.use_bias:
            w.append(Weight("bias", (self.width,), self.bias_initializer, regularizer=self.bias_regularizer))
        return w

    def scratch(self, n, dtype):
        # Without a bias the kernels still add one and write its gradient: zeros, and a sink.
        return {} if self.use_bias else {"bias": np.zeros(self.width, dtype),
                                         "dbias": np.empty(self.width, dtype)}

    def bias(self, p: dict, s: dict) -> np.ndarray:
        return p["bias"] if self.use_bias else s["bias"]

    def dbias(self, g: dict, s: dict) -> np.ndarray:
        return g["bias"] if self.use_bias else s["dbias"]


def activity(owner: str, given, activation: str | None = None) -> regularizers.L1L2 | None:
    """A layer's activity_regularizer: a penalty on its output, divided by the batch size, as
    Keras's (pserver.models.graph adds its gradient to the output's). Refused after a softmax or
    sigmoid, which the loss fuses (the layer's output there is the logits)."""
    reg = regularizers.get(given, f"{owner}: activity_regularizer")
    if reg is not None and activation in ("softmax", "sigmoid"):
        raise ConfigError(f"{owner}: activity_regularizer with activation={activation!r} is not supported "
                          "(the loss fuses it): put Activation() after the layer")
    return reg


def mask_of(sequence, given):
    """The mask given to a call, else the one the sequence carries (Symbolic.mask), else None."""
    return given if given is not None else getattr(sequence, "mask", None)


def sequence_mask(owner: str, sequence, mask, what: str = "mask"):
    """`mask` (batch, steps) for `sequence`, checked and as float32 (a comparison's booleans
    cast), or None when none is given; one line naming `owner` and `what` otherwise."""
    if mask is None:
        return None
    if not (isinstance(sequence, Symbolic) and isinstance(mask, Symbolic)):
        raise ConfigError(f"{owner}: {what} is for a model's tensors (keras.Input, a layer's output), "
                          "not arrays")
    if mask.shape[1:] != sequence.shape[1:2]:
        raise ConfigError(f"{owner}: {what} must be (batch, steps) = (None, {sequence.shape[1]}), got "
                          f"{mask.shape}")
    return mask if mask.dtype == np.float32 else apply("cast", mask, dtype="float32")


def ones_over_steps(sequence: Symbolic) -> Symbolic:
    """(batch, steps) of ones for a sequence (batch, steps, features): a mask that keeps every step."""
    return apply("add", apply("multiply", sequence[:, :, 0], 0.0), 1.0)


def _shapes_text(shape) -> str:
    return ", ".join(map(str, shape)) if shape and isinstance(shape[0], tuple) else str(tuple(shape))


def init_arguments(cls, args: tuple, kwargs: dict) -> dict:
    """cls.__init__'s arguments by name, defaults filled in and **kwargs spread out: what Keras's
    automatic get_config records at construction. {} when they do not bind: __init__ then says
    what is wrong, and pickle and copy call __new__ bare, then restore the instance's dict."""
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    config = dict(bound.arguments)
    config.pop(next(iter(config)))                   # self
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            config.update(config.pop(name, {}))
    return config


def _plain(value):
    """A config value as JSON: an initializer or regularizer object as Keras writes one
    ({class_name, config})."""
    if isinstance(value, initializers.Initializer):
        return {"class_name": type(value).__name__, "config": dict(vars(value))}
    if isinstance(value, regularizers.Regularizer):
        return {"class_name": type(value).__name__, "config": value.get_config()}
    if isinstance(value, (tuple, list)):          # nested too: Cropping2D's ((top, bottom), (left, right))
        return [_plain(v) for v in value]
    return value


def _unplain(value):
    if isinstance(value, dict) and set(value) == {"class_name", "config"}:
        if value["class_name"] in ("L1", "L2", "L1L2"):
            return regularizers.get(value, "a layer's config")
        cls = getattr(initializers, value["class_name"], None)
        if not (isinstance(cls, type) and issubclass(cls, initializers.Initializer)):
            raise ConfigError(f"unknown initializer class {value['class_name']!r} in a layer's config")
        return cls(**value["config"])
    return value


def as_shape(what: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ConfigError(f"{what}: {shape!r} is not a shape (a tuple of positive integers)") from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ConfigError(f"{what}: {shape!r} is not a shape (a tuple of positive integers)")
    return tuple(int(d) for d in dims)


def rows(a):
    """a as (rows, last axis): a view (the buffers are contiguous, on the host or the device);
    None stays None. (The CUDA simulator's shapes take no negative index.)"""
    if a is None or len(a.shape) == 2:
        return a
    last = a.shape[len(a.shape) - 1]
    return a.reshape(a.size // last, last)


def positive_int(owner: str, what: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{owner}: {what} must be a positive integer, got {value!r}")
    return int(value)


def pair(owner: str, what: str, value) -> tuple[int, int]:
    """Keras's int-or-pair arguments (kernel_size, strides, pool_size) as (h, w)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ConfigError(f"{owner}: {what} must be an integer or a pair of integers, got {value!r}")
    return positive_int(owner, what, value[0]), positive_int(owner, what, value[1])


def channels_last(owner: str, data_format) -> None:
    """Keras's data_format: None or 'channels_last' (pserver's only layout), else ConfigError."""
    if data_format not in (None, "channels_last"):
        raise ConfigError(f"{owner}: data_format={data_format!r}: pserver's images and sequences are "
                          "channels_last")


PADDINGS = ("valid", "same")


def padding(owner: str, value) -> str:
    if not isinstance(value, str) or value.lower() not in PADDINGS:
        raise ConfigError(f"{owner}: padding must be 'valid' or 'same', got {value!r}")
    return value.lower()


__all__ = ["Layer", "KernelLayer", "Weight", "Pass", "as_shape", "channels_last", "init_arguments", "pair",
           "padding", "positive_int"]
