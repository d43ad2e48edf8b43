"""Target attention over a sequence feature: DINAttention, the Deep Interest Network's activation
unit and attention pooling (Zhou et al. 2018, arXiv 1706.06978), as DeepCTR's
AttentionSequencePoolingLayer computes it.

    DINAttention(hidden_units=(80, 40), activation="sigmoid", normalize=None,
                 mask_zero=False, padding_id=None)
    din([query, keys]) or din([query, keys, ids])
        query (batch, d): the candidate item's embedding; keys (batch, L, d): the user's
        behaviour sequence, one embedding per position; ids (batch, L): that sequence's ids,
        whose padding (id 0 with mask_zero=True, `padding_id` otherwise) marks the positions
        that are no behaviour. Output (batch, d): sum_j a_j keys_j over the positions that are
        not padding, a_j = MLP([q, k_j, q - k_j, q * k_j]) (hidden layers with `activation`,
        then one linear unit). DIN leaves the a_j as they are (normalize=None);
        normalize="softmax" makes them a softmax over the list's positions that are not padding.
        A list of padding only gives zeros.

How the padding reaches the layer: pserver has no Keras masks carried from layer to layer, so
the layer reads the list's ids as a third input and compares them with the padding id (id 0
with mask_zero=True, `padding_id` otherwise), as Embedding does. A 0/1 mask input works too,
with mask_zero=True. The sequence's embeddings come from an Embedding with combiner=None and
the same padding over the same ids input: its padded positions are zeros (on the shards, never
pulled or pushed), which the attention also weighs 0. The ids input may feed the sparse
Embedding and this layer both (the Embedding reads its lookup's positions, this layer the ids).

The layer is traced (pserver.layers.traced): its call is written with ops, whose VJPs give the
gradients. The first hidden layer's kernel is one (4d, units) matrix, as a Dense over the
concatenation [q, k, q - k, q * k] has; the call multiplies its four blocks apart, since
q @ W_q + k @ W_k + (q - k) @ W_d = q @ (W_q + W_d) + k @ (W_k - W_d): q's part once per sample,
not once per position, and no (batch, L, 4d) concatenation.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import activations, initializers
from pserver.layers.base import positive_int
from pserver.layers.embedding import list_padding
from pserver.layers.traced import TracedLayer
from pserver.ops import add, expand_dims, matmul, multiply, not_equal, reshape, softmax, subtract, where
from pserver.ops.core import Symbolic
from pserver.ops.nn import relu, sigmoid, tanh

# the hidden layers' activations by Keras's names (softmax is a normalisation, not a unit's)
UNIT_ACTIVATIONS = {"linear": None, "relu": relu, "sigmoid": sigmoid, "tanh": tanh}
NORMALIZATIONS = (None, "softmax")
MASKED = -1e9         # a padded position's score before a softmax: exp gives it 0 (as MultiHeadAttention)


class DINAttention(TracedLayer):
    """DIN's attention pooling: din([query, keys]) or din([query, keys, ids]) (see the module)."""

    kind = "din_attention"
    supports_masking = True      # it reads the list's padding from its ids; its pooled output has no steps

    def output_mask(self, xs):
        return None

    def __init__(self, hidden_units=(80, 40), activation="sigmoid", normalize: str | None = None,
                 mask_zero: bool = False, padding_id: int | None = None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        owner = "DINAttention"
        if isinstance(hidden_units, (int, np.integer)):
            hidden_units = (hidden_units,)
        self.hidden_units = tuple(positive_int(owner, "hidden_units", u) for u in hidden_units)
        self.activation = activations.get(activation, owner)
        if self.activation not in UNIT_ACTIVATIONS:
            raise ConfigError(f"{owner}: activation={activation!r} is not a hidden unit's; choose one of "
                              f"{', '.join(UNIT_ACTIVATIONS)} (or None)")
        if normalize not in NORMALIZATIONS:
            raise ConfigError(f"{owner}: normalize must be None (DIN's weights as they are) or 'softmax', "
                              f"got {normalize!r}")
        self.padding = list_padding(owner, mask_zero, padding_id)   # the id that pads the list (None: none)
        self.normalize, self.mask_zero = normalize, mask_zero
        self.kernel_initializer = initializers.get(kernel_initializer, f"{owner}: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, f"{owner}: bias_initializer")

    def __call__(self, inputs, training=None):
        """din([query, keys]) or din([query, keys, ids]): the shapes are checked here, before the
        call is traced, so that a refusal names them (and not the trace's frame)."""
        if not isinstance(inputs, (list, tuple)) or len(inputs) not in (2, 3):
            got = f"{len(inputs)} tensors" if isinstance(inputs, (list, tuple)) else type(inputs).__name__
            raise ConfigError(f"{self.label}: is called on [query, keys] or [query, keys, ids], got {got}")
        query, keys, *ids = (tuple(t.shape if isinstance(t, Symbolic) else np.shape(t))[1:] for t in inputs)
        if len(query) != 1 or len(keys) != 2 or keys[1] != query[0]:
            raise ConfigError(f"{self.label}: takes query (d,) and keys (length, d) of one d (shapes without "
                              f"the batch); got query {query} and keys {keys}")
        if ids and ids[0] != keys[:1]:
            raise ConfigError(f"{self.label}: ids {ids[0]} must be (length,) with the keys' length {keys[0]} "
                              "(shapes without the batch)")
        if ids and self.padding is None:
            raise ConfigError(f"{self.label}: the list's ids (a third input) mark its padding: say which id "
                              "pads with mask_zero=True or padding_id=")
        if not ids and self.padding is not None:
            raise ConfigError(f"{self.label}: mask_zero or padding_id needs the list's ids: call it on "
                              "[query, keys, ids]")
        return super().__call__(list(inputs), training=training)

    def build(self, input_shape):
        query = input_shape[0][1:]
        width = 4 * query[0]
        self.kernels, self.biases = [], []
        for i, units in enumerate((*self.hidden_units, 1)):
            name = f"hidden_{i}" if i < len(self.hidden_units) else "score"
            self.kernels.append(self.add_weight((width, units), self.kernel_initializer,
                                                name=f"{name}/kernel"))
            self.biases.append(self.add_weight((units,), self.bias_initializer, name=f"{name}/bias"))
            width = units

    def call(self, inputs):
        query, keys = inputs[0], inputs[1]
        scores = self._scores(query, keys)                                   # (batch, L)
        keep = None if len(inputs) < 3 else not_equal(inputs[2], self.padding)
        if self.normalize == "softmax":
            scores = softmax(scores if keep is None else where(keep, scores, MASKED), axis=-1)
        if keep is not None:        # padding weighs 0: also after a softmax of a list of padding only
            scores = where(keep, scores, 0.0)
        pooled = matmul(expand_dims(scores, 1), keys)                        # (batch, 1, d)
        return reshape(pooled, (None, keys.shape[-1]))

    def _scores(self, query, keys):
        """The activation unit: each position's score from [q, k, q - k, q * k], (batch, L)."""
        length, d = keys.shape[1], keys.shape[2]
        act = UNIT_ACTIVATIONS[self.activation]
        first = self.kernels[0]
        w_q, w_k, w_d, w_p = (first[i * d:(i + 1) * d] for i in range(4))
        products = multiply(keys, expand_dims(query, 1))                     # (batch, L, d)
        per_position = add(matmul(keys, subtract(w_k, w_d)), matmul(products, w_p))
        per_sample = add(matmul(query, add(w_q, w_d)), self.biases[0])      # once per sample
        h = add(per_position, expand_dims(per_sample, 1))                    # (batch, L, units)
        for w, b in zip(self.kernels[1:], self.biases[1:]):     # the hidden layers' activation first
            h = add(matmul(h if act is None else act(h), w), b)
        return reshape(h, (None, length))


__all__ = ["DINAttention", "UNIT_ACTIVATIONS", "NORMALIZATIONS"]
