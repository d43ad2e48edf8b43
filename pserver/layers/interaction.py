"""Keras-RS's feature-interaction layers (keras_rs.layers), with its names, arguments, defaults
and formulas: FeatureCross (DCN-v2's cross layer) and DotInteraction (DLRM's). Both are traced
layers (pserver.layers.traced): their calls are written with ops, whose VJPs give the gradients.

    FeatureCross(projection_dim=None, diag_scale=0.0, use_bias=True, pre_activation=None, ...)
        cross(x0, x=None) = x0 * (act(x @ W + bias) + diag_scale * x) + x, x defaulting to x0;
        with projection_dim, W = U V (x @ U without a bias, then @ V with it)
    DotInteraction(self_interaction=False, skip_gather=False)
        on [e_0, ..., e_{F-1}], each (batch, dim): the dot products <e_i, e_j>, j < i (j <= i with
        self_interaction), row by row; with skip_gather the whole (F, F) matrix, flattened, its
        upper triangle zeroed

As in keras_rs/src/layers/feature_interaction/feature_cross.py and dot_interaction.py.
Keras-RS computes FeatureCross with two Dense sublayers, `down_proj_dense` and `dense`; here
their weights are the layer's own, named after those attributes (down_proj_dense/kernel,
dense/kernel, dense/bias) and in Keras-RS's order, so get_weights lines up with a Keras-RS
layer's (bench/keras_rs_layers_check.py compares the two). pre_activation is that `dense`'s
activation, so it applies after the bias and before diag_scale * x is added.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import initializers, regularizers
from pserver.layers.base import positive_int
from pserver.layers.traced import TracedLayer
from pserver.ops import add, matmul, multiply, reshape, stack, take, transpose
from pserver.ops.core import Symbolic
from pserver.ops.nn import relu, sigmoid, softmax, tanh

# pre_activation by Keras's names (None is "linear"), and the same functions as objects (what
# pserver.keras.activations exports), which a config saves by name, as Keras serializes them.
PRE_ACTIVATIONS = {"linear": None, "relu": relu, "sigmoid": sigmoid, "tanh": tanh, "softmax": softmax}


class FeatureCross(TracedLayer):
    """DCN-v2's cross layer: call(x0, x=None) on (batch, ..., dim) tensors of one shape."""

    kind = "feature_cross"

    def __init__(self, projection_dim: int | None = None, diag_scale: float | None = 0.0,
                 use_bias: bool = True, pre_activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        owner = "FeatureCross"
        self.projection_dim = None if projection_dim is None else positive_int(owner, "projection_dim",
                                                                              projection_dim)
        number = isinstance(diag_scale, (int, float)) and not isinstance(diag_scale, bool)
        if diag_scale is not None and not (number and math.isfinite(diag_scale) and diag_scale >= 0):
            raise ConfigError(f"{owner}: diag_scale must be a number >= 0 (or None), got {diag_scale!r}")
        self.diag_scale = diag_scale
        self.use_bias = bool(use_bias)
        self.pre_activation = _activation_name(pre_activation)
        self.kernel_initializer = initializers.get(kernel_initializer, f"{owner}: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, f"{owner}: bias_initializer")
        self.kernel_regularizer = regularizers.get(kernel_regularizer, f"{owner}: kernel_regularizer")
        self.bias_regularizer = regularizers.get(bias_regularizer, f"{owner}: bias_regularizer")

    def __call__(self, x0, x=None, training=None):
        """Keras-RS's call(x0, x=None), recorded as a call on the list [x0, x] (x0 twice when x is
        None): the graph then plans both inputs before this layer (a keyword tensor would be
        planned after it), and a saved graph replays the call as cross([x0, x])."""
        inputs = list(x0) if isinstance(x0, (list, tuple)) and x is None else [x0, x0 if x is None else x]
        if len(inputs) != 2:
            raise ConfigError(f"{self.label}: is called as cross(x0) or cross(x0, x), got a list of "
                              f"{len(inputs)} tensors")
        if isinstance(inputs[0], Symbolic) != isinstance(inputs[1], Symbolic):
            raise ConfigError(f"{self.label}: x0 and x must both be symbolic tensors (keras.Input, a "
                              "layer's output) or both arrays")
        shapes = [tuple(np.shape(t) if not isinstance(t, Symbolic) else t.shape)[1:] for t in inputs]
        if shapes[0] != shapes[1]:
            raise ConfigError(f"{self.label}: x0 and x must have the same shape, got x0 {shapes[0]} and x "
                              f"{shapes[1]}")
        return super().__call__(inputs, training=training)

    def build(self, input_shape):
        dim = input_shape[0][-1]
        # Keras-RS's Dense sublayers' weights, in the order Keras lists them
        if self.projection_dim is not None:
            self.down_kernel = self.add_weight((dim, self.projection_dim), self.kernel_initializer,
                                               name="down_proj_dense/kernel")
        self.kernel = self.add_weight((self.projection_dim or dim, dim), self.kernel_initializer,
                                      name="dense/kernel")
        if self.use_bias:
            self.bias = self.add_weight((dim,), self.bias_initializer, name="dense/bias")

    def call(self, x0, x=None):
        """Keras-RS's call; traced on the list [x0, x] that __call__ records."""
        if isinstance(x0, (list, tuple)):
            x0, x = x0
        if x is None:
            x = x0
        projected = x if self.projection_dim is None else matmul(x, self.down_kernel)
        out = matmul(projected, self.kernel)
        if self.use_bias:
            out = add(out, self.bias)
        if PRE_ACTIVATIONS[self.pre_activation] is not None:
            out = PRE_ACTIVATIONS[self.pre_activation](out)
        if self.diag_scale:          # Keras-RS's test: None and 0 add nothing
            out = add(out, multiply(float(self.diag_scale), x))
        return add(multiply(x0, out), x)

    def weights(self):
        """add_weight's weights with Keras-RS's regularizers, which add_weight does not take (a
        user's layer gets none): kernel_regularizer on both kernels (Keras-RS gives it to both
        Dense sublayers), bias_regularizer on the bias."""
        return [dataclasses.replace(w, regularizer=self.bias_regularizer if w.name == "dense/bias"
                                    else self.kernel_regularizer)
                for w in super().weights()]

    def get_config(self) -> dict:
        return {**super().get_config(), "pre_activation": self.pre_activation}


class DotInteraction(TracedLayer):
    """DLRM's pairwise dot products, called on a list of (batch, dim) features of one shape."""

    kind = "dot_interaction"

    def __init__(self, self_interaction: bool = False, skip_gather: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.self_interaction, self.skip_gather = bool(self_interaction), bool(skip_gather)

    def __call__(self, inputs, training=None):
        if not isinstance(inputs, (list, tuple)):
            raise ConfigError(f"{self.label}: takes a list of (batch, dim) feature tensors, got "
                              f"{type(inputs).__name__}")
        fewest = 1 if self.self_interaction else 2
        if len(inputs) < fewest:
            raise ConfigError(f"{self.label}: takes at least {fewest} features"
                              f"{'' if self.self_interaction else ' (without self_interaction)'}, "
                              f"got {len(inputs)}")
        shapes = [tuple(np.shape(t)[1:]) if not isinstance(t, Symbolic) else t.shape[1:] for t in inputs]
        bad = next((i for i, s in enumerate(shapes) if len(s) != 1 or s != shapes[0]), None)
        if bad is not None:
            raise ConfigError(f"{self.label}: every feature must be (batch, dim) of one dim; feature {bad} "
                              f"is {shapes[bad]}, feature 0 {shapes[0]}")
        return super().__call__(list(inputs), training=training)

    def call(self, inputs):
        features = stack(inputs, axis=1)                                   # (batch, F, dim)
        products = matmul(features, transpose(features, (0, 2, 1)))        # (batch, F, F)
        f = len(inputs)
        k = 0 if self.self_interaction else -1
        if self.skip_gather:
            kept = multiply(products, np.tril(np.ones((f, f), np.float32), k))
            return reshape(kept, (None, f * f))
        rows, cols = np.tril_indices(f, k)                # row by row, as Keras-RS's loop
        return take(reshape(products, (None, f * f)), rows * f + cols, axis=-1)


def _activation_name(spec) -> str:
    """pre_activation as one of PRE_ACTIVATIONS' names, from a name, None or the function."""
    if spec is None:
        return "linear"
    if isinstance(spec, str) and spec in PRE_ACTIVATIONS:
        return spec
    found = next((name for name, fn in PRE_ACTIVATIONS.items() if fn is not None and fn is spec), None)
    if found is None and callable(spec) and getattr(spec, "__name__", None) == "linear":
        found = "linear"                  # keras.activations.linear (pserver.keras, a layer above)
    if found is None:
        raise ConfigError(f"FeatureCross: pre_activation={spec!r} is not supported; give one of "
                          f"{', '.join(PRE_ACTIVATIONS)} or None")
    return found


__all__ = ["FeatureCross", "DotInteraction"]
