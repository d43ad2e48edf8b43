"""MultiHeadAttention, Keras's: arguments, defaults, weights (query/kernel (d, heads, key_dim), ...,
attention_output/kernel (heads, value_dim, d)) and formula, so that weights set from a Keras model
give its outputs: softmax(q k^T / sqrt(key_dim)) v per head, then the heads projected back.

The work is batched matrix products (compute-bound), so both passes are np.matmul over NumPy's
BLAS on (n, heads, steps, dim) arrays, fused in one forward and one backward; the twin is
pserver.kernels.reference.attention, Keras's einsum equations. Masked positions take the score
-1e9 before the softmax (Keras's Softmax with a mask), so a masked key gets no weight. In
training, `dropout` drops attention weights after the softmax, as Keras's (inverted dropout on
the probabilities; the kept ones scaled by 1 / (1 - rate)), with Dropout's kernel and seeds.
"""

from __future__ import annotations

import math

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import initializers
from pserver.layers.base import Layer, Weight, mask_of, ones_over_steps, positive_int, sequence_mask
from pserver.layers.dropout import rate_of, seed_of, step_seed
from pserver.ops import math as ops_math
from pserver.ops.core import Symbolic
from pserver.ops.shape import expand_dims, reshape, transpose

MASKED = -1e9        # Keras's _large_negative_number for float32 scores
_PROJECTIONS = ("query", "key", "value")


class MultiHeadAttention(Layer):
    """mha(query, value, key=None, attention_mask=None, use_causal_mask=False) on (steps, dim)
    sequences: called on a list of inputs [query, value, key?, attention_mask?] (`takes_list`)."""

    kind = "multi_head_attention"
    supports_masking = True
    takes_list = True

    def __init__(self, num_heads: int, key_dim: int, value_dim: int | None = None, dropout: float = 0.0,
                 use_bias: bool = True, output_shape=None, attention_axes=None, sliding_window=None,
                 flash_attention=None, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, use_gate: bool = False, seed=None, **kwargs):
        super().__init__(**kwargs)
        owner = "MultiHeadAttention"
        given = dict(attention_axes=_other_axes(attention_axes),
                     sliding_window=sliding_window, flash_attention=flash_attention,
                     kernel_regularizer=kernel_regularizer, bias_regularizer=bias_regularizer,
                     activity_regularizer=activity_regularizer,
                     kernel_constraint=kernel_constraint, bias_constraint=bias_constraint, use_gate=use_gate)
        bad = sorted(k for k, v in given.items() if v not in (None, False, 0))
        if bad:
            raise ConfigError(f"{owner}: {bad[0]}={given[bad[0]]!r} is not supported (docs/guide/keras.md)")
        self.num_heads = positive_int(owner, "num_heads", num_heads)
        self.key_dim = positive_int(owner, "key_dim", key_dim)
        self.value_dim = self.key_dim if value_dim is None else positive_int(owner, "value_dim", value_dim)
        if isinstance(output_shape, (tuple, list)) and len(output_shape) == 1:
            output_shape = output_shape[0]
        self.output_dim = None if output_shape is None else positive_int(owner, "output_shape", output_shape)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = initializers.get(kernel_initializer, f"{owner}: kernel_initializer")
        self.bias_initializer = initializers.get(bias_initializer, f"{owner}: bias_initializer")
        self.scale = 1.0 / math.sqrt(float(self.key_dim))
        self.dropout, self.seed = rate_of(owner, "dropout", dropout), seed_of(seed)

    # -- calling it: Keras's arguments, as a list of inputs -----------------------------------------

    def __call__(self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
                 attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False,
                 form=None):
        """Keras's call; with return_attention_scores, [output, scores] (scores (heads, query
        steps, key steps): the softmax's weights, before dropout, as Keras's). The layer has one
        output, so with scores it computes both packed in one (query steps, dim + heads * key
        steps) tensor that the call slices apart (ops): `summary()` shows the packed shape.

        The graph records the call's `form` (a key of its own, a mask, causal, scores) with its
        list of inputs, which is how a saved graph calls the layer again
        (pserver.models.graph_config): mha([query, value, key?, mask?], form=[...]) gives the
        packed tensor that the saved slicing ops read."""
        replay = form is not None
        if replay:
            form = tuple(bool(f) for f in form)
            inputs = list(query)
            if len(form) != 4 or len(inputs) != 2 + form[0] + form[1]:
                raise ConfigError(f"{self.label}: a saved call's form {list(form)} does not match its "
                                  f"{len(inputs)} inputs")
        else:
            if value is None:
                raise ConfigError(f"{self.label}: is called on query and value: mha(query, value)")
            query_mask = mask_of(query, query_mask)
            key_mask = None if key is None else mask_of(key, key_mask)
            attention_mask = self._with_masks(query, value, query_mask, mask_of(value, value_mask), key_mask,
                                              attention_mask)
            own_key = key is not None and key is not value
            form = (own_key, attention_mask is not None, bool(use_causal_mask), bool(return_attention_scores))
            inputs = [query, value] + ([key] if own_key else []) + ([attention_mask] if form[1] else [])
        if getattr(self, "_form", form) != form:
            raise ConfigError(f"{self.label}: called again with another key, attention_mask, "
                              "use_causal_mask or return_attention_scores than at its first call "
                              "(one layer, one form)")
        self._form = form
        out = super().__call__(inputs, training=training)
        if not isinstance(out, Symbolic):
            return out
        out.node.attrs["kwargs"] = {"form": list(form)}
        if not form[3] or replay:
            out.mask = None if replay else query_mask       # Keras's: the query's mask
            return out
        e, t, s = self.out_dim, self.output_shape[0], self.input_shape[1][0]
        scores = reshape(out[:, :, e:], (-1, t, self.num_heads, s))
        first = out[:, :, :e]
        first.mask = query_mask
        return [first, transpose(scores, (0, 2, 1, 3))]

    def output_mask(self, xs):
        return None                        # set by __call__: the query's

    def _with_masks(self, query, value, query_mask, value_mask, key_mask, attention_mask):
        """Keras's attention mask from the sequences' masks: query step t attends to value step s
        where query_mask[t] and value_mask[s] (and key_mask[s]) are kept, and attention_mask too,
        (batch, T, S); attention_mask as given when no sequence has a mask."""
        if all(m is None for m in (query_mask, value_mask, key_mask)):
            return attention_mask
        query_mask = sequence_mask(self.label, query, query_mask, "query_mask")
        value_mask = sequence_mask(self.label, value, value_mask, "value_mask")
        key_mask = sequence_mask(self.label, value, key_mask, "key_mask")
        kept = ones_over_steps(value)                                        # (batch, S)
        for m in (value_mask, key_mask):
            if m is not None:
                kept = ops_math.multiply(kept, m)
        auto = expand_dims(kept, 1)                                          # (batch, 1, S)
        if query_mask is not None:
            auto = ops_math.multiply(expand_dims(query_mask, -1), auto)      # (batch, T, S)
        if attention_mask is None:
            return auto
        return ops_math.multiply(ops_math.cast(ops_math.greater(attention_mask, 0.5), "float32"), auto)

    def build(self, input_shape):
        shapes = [tuple(s) for s in input_shape]
        form = getattr(self, "_form", (len(shapes) > 2, False, False, False))
        own_key, masked, self.causal, self.scores = form
        query, value = shapes[0], shapes[1]
        key = shapes[2] if own_key else value
        for what, shape in (("query", query), ("value", value), ("key", key)):
            if len(shape) != 2:
                raise ConfigError(f"{self.label}: {what} {shape} is not a sequence (steps, dim): attention "
                                  "over other axes (attention_axes) is not supported")
        if key[0] != value[0]:
            raise ConfigError(f"{self.label}: key {key} and value {value} must have as many steps")
        if masked:
            mask = shapes[-1]
            if len(mask) != 2 or any(m not in (1, d) for m, d in zip(mask[::-1], (value[0], query[0]))):
                raise ConfigError(f"{self.label}: attention_mask {mask} does not broadcast to (query steps, "
                                  f"key steps) {(query[0], value[0])}")
        self.dims = {"query": query[1], "key": key[1], "value": value[1]}
        self.input_shape = shapes
        self.out_dim = self.output_dim or query[1]
        # with return_attention_scores: each query step's output, then its row of every head's scores
        self.output_shape = (query[0], self.out_dim + (self.num_heads * value[0] if self.scores else 0))
        return self.output_shape

    def output_shape_for(self, input_shape):
        return self.output_shape

    def weights(self):
        width = {"query": self.key_dim, "key": self.key_dim, "value": self.value_dim}
        found = []
        for name in _PROJECTIONS:
            found.append(Weight(f"{name}/kernel", (self.dims[name], self.num_heads, width[name]),
                                self.kernel_initializer))
            if self.use_bias:
                found.append(Weight(f"{name}/bias", (self.num_heads, width[name]), self.bias_initializer))
        found.append(Weight("attention_output/kernel", (self.num_heads, self.value_dim, self.out_dim),
                            self.kernel_initializer))
        if self.use_bias:
            found.append(Weight("attention_output/bias", (self.out_dim,), self.bias_initializer))
        return found

    def forward_elements(self):
        (t, _), e, s = self.output_shape, self.out_dim, self.input_shape[1][0]
        return t * e + self.num_heads * (t * (s + self.key_dim + self.value_dim) + s * (self.key_dim
                                                                                       + self.value_dim))

    # -- the passes ---------------------------------------------------------------------------------

    def _roles(self, x: list) -> dict:
        own_key, masked = self._form[:2]
        return {"query": x[0], "value": x[1], "key": x[2] if own_key else x[1],
                "mask": x[-1] if masked else None}

    def _keep(self, mask, t: int, s: int):
        """Where a query step may attend (n or 1, 1, t, s), or None: attention_mask > 0.5 (Keras's
        rule for a non-boolean mask; the heads' axis inserted, as Keras's _masked_softmax) and,
        if causal, key step <= query step."""
        keep = None if mask is None else np.expand_dims(mask > 0.5, 1)
        if self.causal:
            lower = np.tril(np.ones((t, s), bool))
            keep = lower if keep is None else keep & lower
        return keep

    def forward(self, k, p, x, out, s, run):
        r = self._roles(x)
        heads = {name: _project(r[name], p[f"{name}/kernel"], p.get(f"{name}/bias")) for name in _PROJECTIONS}
        q = heads["query"] * np.asarray(self.scale, heads["query"].dtype)
        scores = q @ _t(heads["key"])                                          # (n, heads, t, s)
        keep = self._keep(r["mask"], scores.shape[2], scores.shape[3])
        if keep is not None:
            scores = np.where(keep, scores, np.asarray(MASKED, scores.dtype))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        dropped = None
        if run.training and self.dropout > 0:
            dropped, mask = np.empty_like(probs), np.empty_like(probs)
            k.dropout_forward(probs, dropped, mask, self.dropout, step_seed(run, self.seed))
            s.update(mask=mask)
        context = _merge((probs if dropped is None else dropped) @ heads["value"])   # (n * t, heads * v)
        w = p["attention_output/kernel"]
        e = w.shape[-1]
        if self.scores:                 # packed: the output, then the scores (before dropout)
            n, t, _ = out.shape
            out[:, :, :e] = (context @ w.reshape(-1, e)).reshape(n, t, e)
            out[:, :, e:] = probs.transpose(0, 2, 1, 3).reshape(n, t, -1)
        else:
            np.matmul(context, w.reshape(-1, e), out=out.reshape(-1, e))
        if self.use_bias:
            out[:, :, :e] += p["attention_output/bias"]
        s.update(q=q, k=heads["key"], v=heads["value"], probs=probs, dropped=dropped, context=context,
                 keep=keep)

    def backward(self, k, p, g, x, out, dout, dx, s):
        r, w = self._roles(x), p["attention_output/kernel"]
        n, t, _ = dout.shape
        e = w.shape[-1]
        d2 = np.ascontiguousarray(dout[:, :, :e]).reshape(n * t, e)
        g["attention_output/kernel"][...] = (s["context"].T @ d2).reshape(w.shape)
        if self.use_bias:
            g["attention_output/bias"][...] = d2.sum(axis=0)
        dcontext = np.ascontiguousarray((d2 @ w.reshape(-1, e).T).reshape(n, t, self.num_heads, -1)
                                        .transpose(0, 2, 1, 3))
        probs, dropped = s["probs"], s.get("dropped")
        dprobs = dcontext @ _t(s["v"])
        if dropped is not None:                        # through the dropout: the kept ones, scaled
            dprobs *= s["mask"]
        if self.scores:                                # the scores' own gradient, before dropout
            dprobs += dout[:, :, e:].reshape(n, t, self.num_heads, -1).transpose(0, 2, 1, 3)
        dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
        if s["keep"] is not None:      # a masked score is the constant: no gradient (a row all masked)
            dscores *= s["keep"]
        dheads = {"query": (dscores @ s["k"]) * np.asarray(self.scale, dscores.dtype),
                  "key": _t(dscores) @ s["q"], "value": _t(probs if dropped is None else dropped) @ dcontext}
        sinks = {"query": dx[0], "value": dx[1], "key": dx[2] if self._form[0] else dx[1]}
        for name in ("query", "value", "key"):       # value before key: key may be value (adds)
            add = name == "key" and not self._form[0]
            _project_back(r[name], p[f"{name}/kernel"], dheads[name], g, name, sinks[name], add)
        if self._form[1] and dx[-1] is not None:
            dx[-1][...] = 0                            # a mask takes no gradient


def _other_axes(attention_axes):
    """attention_axes as a refusal's value: None when it names the steps' axis only (Keras's
    default for a (batch, steps, dim) input)."""
    if attention_axes is None or attention_axes in (1, -2, (1,), [1], (-2,), [-2]):
        return None
    return attention_axes


def _t(a):
    """a's last two axes swapped, contiguous: NumPy's stacked matmul calls BLAS only on operands
    whose rows are contiguous (a transposed view runs its own loop, ~10x slower)."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _project(x, w, b):
    """x (n, steps, d) through kernel w (d, heads, dim) (and bias (heads, dim)): (n, heads, steps, dim)."""
    n, steps, d = x.shape
    y = (x.reshape(n * steps, d) @ w.reshape(d, -1)).reshape(n, steps, *w.shape[1:])
    if b is not None:
        y += b
    return y.transpose(0, 2, 1, 3)


def _merge(heads):
    """(n, heads, steps, dim) as (n * steps, heads * dim): the heads side by side per step."""
    n, h, steps, d = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(n * steps, h * d)


def _project_back(x, w, dy, g: dict, name: str, dx, add: bool) -> None:
    """_project's gradients: the kernel's and bias's into g, x's into dx (added when `add`)."""
    d = w.shape[0]
    dy2 = _merge(dy)
    x2 = x.reshape(-1, d)
    g[f"{name}/kernel"][...] = (x2.T @ dy2).reshape(w.shape)
    if f"{name}/bias" in g:
        g[f"{name}/bias"][...] = dy2.sum(axis=0).reshape(w.shape[1:])
    if dx is not None:
        grad = (dy2 @ w.reshape(d, -1).T).reshape(x.shape)
        if add:
            dx += grad
        else:
            dx[...] = grad


__all__ = ["MultiHeadAttention"]
