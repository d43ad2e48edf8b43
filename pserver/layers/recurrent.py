"""Recurrent layers on sequences x (n, steps, features): SimpleRNN, LSTM, GRU with Keras's names,
arguments, defaults and weights, and Bidirectional around one of them.

Weights as Keras's: kernel (features, k * units), recurrent_kernel (units, k * units) and bias,
the k blocks in Keras's gate order (LSTM i, f, c, o; GRU z, r, h); GRU's bias is (2, 3 * units),
the input's and the recurrent product's (reset_after=True, Keras 3's default). Weights set from a
Keras model give Keras's outputs.

Forward is one matmul for every step's input projection (xw = x @ kernel + bias, the backend's
dense kernel), then the backend's fused recurrence (pserver.kernels.reference describes the
layout); backward through time the same way round, then the weight gradients as two products.

initial_state: the states start from the given tensors (else zeros), and backward gives them
their gradients. return_state: Keras's layer returns [output, h] (LSTM [output, h, c]). A pserver
layer has one output, so with return_state it computes them packed as rows of one (rows, units)
tensor (the output's steps, or one row without return_sequences, then each state) and the call
slices them out (getitem ops): `summary()` shows the packed shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import initializers, regularizers
from pserver.layers.base import Layer, Weight, activity, mask_of, positive_int, sequence_mask
from pserver.layers.dropout import rate_of, seed_of, step_seed
from pserver.ops.core import Symbolic
from pserver.ops.shape import reshape

# The activations the fused kernels compute (their derivatives from their outputs).
ACTIVATIONS = ("tanh", "sigmoid", "relu", "linear")


class _ForgetBias(initializers.Initializer):
    """LSTM's unit_forget_bias: `inner`'s bias with the forget gate's block ones, as Keras's."""

    def __init__(self, inner: initializers.Initializer):
        self.inner = inner

    def __call__(self, rng, out):
        self.inner(rng, out)
        u = out.shape[0] // 4
        out[u:2 * u] = 1


def _activation(owner: str, what: str, spec) -> str:
    kind = "linear" if spec is None else spec
    if kind not in ACTIVATIONS:
        raise ConfigError(f"{owner}: {what}={spec!r} is not supported; choose one of "
                          f"{', '.join(ACTIVATIONS)} (or None)")
    return kind


def _refuse(owner: str, **given) -> None:
    """One line for the first argument given a value pserver does not run (a truthy one)."""
    bad = sorted(k for k, v in given.items() if v)
    if bad:
        raise ConfigError(f"{owner}: {bad[0]}={given[bad[0]]!r} is not supported (docs/guide/keras.md)")


class _Recurrent(Layer):
    """What the three cells share: arguments, weights, the input projection, the packed outputs
    and the gradients of the weights. A subclass sets `gates` (the kernel's blocks), `states`
    (those return_state gives) and runs its kernels in `_cell_forward` / `_cell_backward`."""

    gates = 1
    states = 1
    supports_masking = True
    masked = False              # called with Keras's mask: the node's last input, (steps,) 0 where masked

    def _setup(self, units, activation, recurrent_activation, use_bias, kernel_initializer,
               recurrent_initializer, bias_initializer, kernel_regularizer, recurrent_regularizer,
               bias_regularizer, activity_regularizer, constraints: dict, dropout, recurrent_dropout,
               return_sequences, return_state, go_backwards, stateful, unroll, kwargs, seed=None) -> None:
        owner = type(self).__name__
        _refuse(owner, stateful=stateful, unroll=unroll, **constraints)
        self.recurrent_dropout = rate_of(owner, "recurrent_dropout", recurrent_dropout)
        # Keras's RNN argument: a masked step's output is zeros, not the last state (Bidirectional
        # sets it with return_sequences, as Keras's does)
        self.zero_output_for_mask = bool(kwargs.pop("zero_output_for_mask", False))
        self.dropout, self.seed = rate_of(owner, "dropout", dropout), seed_of(seed)
        super().__init__(**kwargs)
        self.units = positive_int(owner, "units", units)
        self.activation = _activation(owner, "activation", activation)
        self.recurrent_activation = _activation(owner, "recurrent_activation", recurrent_activation)
        self.use_bias = bool(use_bias)
        self.return_sequences, self.return_state = bool(return_sequences), bool(return_state)
        self.go_backwards = bool(go_backwards)
        self.initializers = {w: initializers.get(i, f"{owner}: {w}_initializer") for w, i in (
            ("kernel", kernel_initializer), ("recurrent", recurrent_initializer), ("bias", bias_initializer))}
        self.regularizers = {w: regularizers.get(r, f"{owner}: {w}_regularizer") for w, r in (
            ("kernel", kernel_regularizer), ("recurrent", recurrent_regularizer), ("bias", bias_regularizer))}
        self.activity_regularizer = activity(owner, activity_regularizer)
        if self.activity_regularizer is not None and self.return_state:
            raise ConfigError(f"{owner}: activity_regularizer with return_state=True is not supported")

    def __call__(self, inputs, training=None, initial_state=None, mask=None, packed=False, masked=False,
                 **kwargs):
        """Keras's call; with return_state the list [output, *states]. initial_state (h, or LSTM's
        [h, c]) makes the node's inputs [x, *states] (a saved graph replays it as that list).
        mask (batch, steps), or else the mask the sequence carries (Embedding(mask_zero=True),
        Masking): a masked step keeps the states as they were and outputs the last one (zeros
        with zero_output_for_mask), as Keras's; it is the node's last input, and the node records
        masked=True (a replay passes it so). The node of a return_state call records packed=True,
        so that a saved graph's replay (pserver.models.graph_config) gets the packed tensor its
        slicing ops read."""
        if masked:                               # a saved graph's replay: the mask is the last input
            *inputs, mask = inputs
            inputs = inputs if len(inputs) > 1 else inputs[0]
        if isinstance(inputs, (list, tuple)) and initial_state is None and not masked and len(inputs) > 1:
            inputs, initial_state = inputs[0], list(inputs[1:])
        sequence = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        mask = sequence_mask(self.label, sequence, mask_of(sequence, mask))
        if initial_state is not None:
            states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
            inputs = [sequence, *states]
        if mask is not None:
            inputs = [*(inputs if isinstance(inputs, (list, tuple)) else [inputs]), mask]
        given, was = isinstance(inputs, (list, tuple)), getattr(self, "_built_for", None)
        if was is not None and (given, mask is not None) != (self.takes_list, self.masked):
            raise ConfigError(f"{self.label}: called with and without initial_state or a mask; a layer's "
                              "calls must agree (use two layers)")
        self.takes_list, self.masked = given, mask is not None
        out = super().__call__(list(inputs) if given else inputs, training=training, **kwargs)
        if not isinstance(out, Symbolic):
            return out
        _record(self, out, mask)
        if not self.return_state:
            return out
        return out if packed else self._unpacked(out)

    def _unpacked(self, out: Symbolic) -> list:
        """[output, *states] sliced from the packed rows."""
        rows = self._out_rows
        first = out[:, :rows] if self.return_sequences else out[:, 0]
        return [first, *(out[:, rows + j] for j in range(self.states))]

    def build(self, input_shape):
        """With initial_state the shapes [x's, *the states'], each state (units,); a mask's last."""
        if self.takes_list:
            input_shape, *states = input_shape
            if self.masked:
                if tuple(states[-1]) != input_shape[:1]:
                    raise ConfigError(f"{self.label}: mask must be (batch, steps), steps {input_shape[0]}; "
                                      f"got {tuple(states[-1])}")
                states = states[:-1]
            wrong = (states or not self.masked) and len(states) != self.states
            if wrong or any(tuple(st) != (self.units,) for st in states):
                raise ConfigError(f"{self.label}: initial_state must be {self.states} tensor(s) of shape "
                                  f"({self.units},), got {[tuple(st) for st in states]}")
        return super().build(input_shape)

    @property
    def _out_rows(self) -> int:
        return self.input_shape[0] if self.return_sequences else 1

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 2, "a sequence (steps, features)")
        if self.return_state:
            return ((input_shape[0] if self.return_sequences else 1) + self.states, self.units)
        return (input_shape[0], self.units) if self.return_sequences else (self.units,)

    def forward_elements(self):
        steps, width = self.input_shape[0], self.gates * self.units
        return super().forward_elements() + steps * (2 * width + 3 * self.units)

    def bias_shape(self) -> tuple[int, ...]:
        return (self.gates * self.units,)

    def bias_initializer(self) -> initializers.Initializer:
        return self.initializers["bias"]

    def weights(self):
        width = self.gates * self.units
        w = [Weight("kernel", (self.input_shape[1], width), self.initializers["kernel"],
                     regularizer=self.regularizers["kernel"]),
             Weight("recurrent_kernel", (self.units, width), self.initializers["recurrent"],
                     regularizer=self.regularizers["recurrent"])]
        if self.use_bias:
            w.append(Weight("bias", self.bias_shape(), self.bias_initializer(),
                             regularizer=self.regularizers["bias"]))
        return w

    def scratch(self, n, dtype):
        steps, u, width = self.input_shape[0], self.units, self.gates * self.units
        s = {"xw": np.empty((n, steps, width), dtype), "hs": np.empty((steps + 1, n, u), dtype),
             "gates": np.empty((steps, n, width), dtype), "rdb": np.empty(width, dtype)}
        if not self.use_bias:
            s["bias"] = np.zeros(self.bias_shape(), dtype)
            s["dbias"] = np.empty(self.bias_shape(), dtype)
        return s

    def _biases(self, p: dict, s: dict):
        """(the input projection's bias, the recurrent product's or None)."""
        return (p["bias"] if self.use_bias else s["bias"]), None

    def _dbiases(self, g: dict, s: dict):
        return (g["bias"] if self.use_bias else s["dbias"]), s["rdb"]

    def _draw(self, k, shape, rate, seed, dtype):
        """A dropout mask of `shape` (0 or 1/(1 - rate)), Dropout's kernel and seeds."""
        ones, mask = np.ones(shape, dtype), np.empty(shape, dtype)
        k.dropout_forward(ones, np.empty_like(ones), mask, rate, seed)
        return mask

    def _gate_dropout(self, k, p, x, s, run) -> bool:
        """Keras's recurrent_dropout, in training: one mask per gate on the state before its
        recurrent product (rmask (k, n, units)), and then (Keras's implementation 1) one input
        mask per gate as well (gate_masks (k, n, features)), each the same at every step. Whether
        the input projection is per gate (the caller's dense product otherwise)."""
        n, _, features = x.shape
        s["rmask"] = np.empty((0, 0, 0), x.dtype)
        s.pop("gate_masks", None)
        if not (run.training and self.recurrent_dropout > 0):
            return False
        seed = step_seed(run, self.seed)
        s["rmask"] = self._draw(k, (self.gates, n, self.units), self.recurrent_dropout,
                                (seed * 6364136223846793005 + 1442695040888963407) % (1 << 63), x.dtype)
        if self.dropout == 0:
            return False
        s.pop("input_mask", None)
        s["gate_masks"] = gm = self._draw(k, (self.gates, n, features), self.dropout, seed, x.dtype)
        u, w, b = self.units, p["kernel"], self._biases(p, s)[0]
        for g in range(self.gates):
            blk = slice(g * u, (g + 1) * u)
            s["xw"][..., blk] = (x * gm[g][:, None, :]) @ w[:, blk] + b[blk]
        return True

    def _dropped(self, k, x, s, run):
        """Keras's `dropout` on a recurrent layer's inputs, in training: one mask per sample and
        feature, the same at every step (its cell's one dropout mask per call), with Dropout's
        kernel and seeds; x itself at inference (and s forgets an earlier pass's mask)."""
        if not (run.training and self.dropout > 0):
            s.pop("input_mask", None)
            return x
        n, _, features = x.shape
        ones, mask = np.ones((n, features), x.dtype), np.empty((n, features), x.dtype)
        k.dropout_forward(ones, np.empty_like(ones), mask, self.dropout, step_seed(run, self.seed))
        s["input_mask"], s["dropped"] = mask, x * mask[:, None, :]
        return s["dropped"]

    def _parts(self, x) -> tuple:
        """(the sequence, its initial states or None, the mask (n, steps) or an empty one)."""
        if not self.takes_list:
            return x, None, np.empty((0, 0), x.dtype)
        rest = list(x[1:])
        mask = rest.pop() if self.masked else np.empty((0, 0), x[0].dtype)
        return x[0], rest or None, np.ascontiguousarray(mask, x[0].dtype)

    def forward(self, k, p, x, out, s, run):
        x, states, s["mask"] = self._parts(x)
        states = states or [0] * self.states
        if not self._gate_dropout(k, p, x, s, run):
            x = self._dropped(k, x, s, run)
            n, steps, features = x.shape
            k.dense_forward(x.reshape(n * steps, features), p["kernel"], self._biases(p, s)[0],
                            s["xw"].reshape(n * steps, -1), False)
        n, steps, features = x.shape
        for name, state in zip(("hs", "cs"), states):
            s[name][0] = state
        self._cell_forward(k, p, s)
        out3, hs = out.reshape(n, -1, self.units), s["hs"]
        if self.return_sequences:
            out3[:, :steps] = hs[1:].transpose(1, 0, 2)
            if self.zero_output_for_mask and s["mask"].size:
                out3[:, :steps] *= self._kept(s)
        else:
            out3[:, 0] = hs[steps]
        if self.return_state:
            for j, state in enumerate(self._final_states(s)):
                out3[:, self._out_rows + j] = state

    def _kept(self, s: dict):
        """(n, steps, 1): 1 where the output's step s (in the order read) was not masked."""
        keep = (s["mask"] != 0).astype(s["hs"].dtype)
        return (keep[:, ::-1] if self.go_backwards else keep)[:, :, None]

    def _final_states(self, s: dict) -> list:
        return [s["hs"][-1]]

    def backward(self, k, p, g, x, out, dout, dx, s):
        dstates = []
        if self.takes_list:                # the initial states' gradients: d hs[0], and LSTM's dc
            x, (dx, *dstates) = x[0], dx
            if self.masked:                # a mask takes no gradient
                if dstates[-1] is not None:
                    dstates[-1][...] = 0
                dstates = dstates[:-1]
        n, steps, features = x.shape
        u, width = self.units, self.gates * self.units
        if "dhs" not in s:               # made at the first training step of this batch size
            s.update(dhs=np.empty_like(s["hs"]), dc=np.empty((n, u), x.dtype), dxw=np.empty_like(s["xw"]),
                     drec=np.empty_like(s["gates"]))
        d3, dhs = dout.reshape(n, -1, u), s["dhs"]
        dhs[0] = 0
        if self.return_sequences:
            dhs[1:] = (d3[:, :steps] * self._kept(s) if self.zero_output_for_mask and s["mask"].size
                       else d3[:, :steps]).transpose(1, 0, 2)
        else:
            dhs[1:steps] = 0
            dhs[steps] = d3[:, 0]
        s["dc"][...] = 0
        if self.return_state:
            dhs[steps] += d3[:, self._out_rows]
            if self.states == 2:
                s["dc"][...] = d3[:, self._out_rows + 1]
        self._cell_backward(k, p, s)
        for d, got in zip(dstates, (dhs[0], s["dc"])):
            if d is not None:
                d[...] = got
        dbias, drbias = self._dbiases(g, s)
        rmask = s["rmask"]
        if rmask.size:                        # recurrent dropout: each gate's block saw h * its mask
            for j in range(self.gates):
                blk = slice(j * u, (j + 1) * u)
                g["recurrent_kernel"][:, blk] = ((s["hs"][:steps] * rmask[j]).reshape(steps * n, u).T
                                                 @ s["drec"][..., blk].reshape(steps * n, u))
            drbias[...] = s["drec"].reshape(steps * n, width).sum(0)
        else:
            k.dense_param_grads(s["hs"][:steps].reshape(steps * n, u), s["drec"].reshape(steps * n, width),
                                g["recurrent_kernel"], drbias)
        if "gate_masks" in s:                 # and each gate's input projection its own input mask
            self._gate_input_grads(p, g, x, dx, s, dbias)
            return
        mask = s.get("input_mask")
        if mask is not None:                  # the kernel saw the dropped inputs
            x = s["dropped"]
        x2, dxw = x.reshape(n * steps, features), s["dxw"].reshape(n * steps, width)
        if dx is None:
            k.dense_param_grads(x2, dxw, g["kernel"], dbias)
        else:
            k.dense_backward(x2, p["kernel"], dxw, g["kernel"], dbias, dx.reshape(n * steps, features), False)
            if mask is not None:
                dx *= mask[:, None, :]

    def _gate_input_grads(self, p, g, x, dx, s, dbias) -> None:
        n, steps, features = x.shape
        u, gm, dxw = self.units, s["gate_masks"], s["dxw"]
        if dx is not None:
            dx[...] = 0
        for j in range(self.gates):
            blk = slice(j * u, (j + 1) * u)
            xm = x * gm[j][:, None, :]
            g["kernel"][:, blk] = xm.reshape(n * steps, features).T @ dxw[..., blk].reshape(n * steps, u)
            if dx is not None:
                dx += (dxw[..., blk] @ p["kernel"][:, blk].T) * gm[j][:, None, :]
        dbias[...] = dxw.reshape(n * steps, -1).sum(0)

    def _cell_forward(self, k, p, s) -> None:
        k.simple_rnn_forward(s["xw"], p["recurrent_kernel"], s["hs"], self.go_backwards, self.activation,
                             s["mask"], s["rmask"])

    def _cell_backward(self, k, p, s) -> None:
        k.simple_rnn_backward(p["recurrent_kernel"], s["hs"], s["dhs"], s["dxw"], s["drec"],
                              self.go_backwards, self.activation, s["mask"], s["rmask"])


class SimpleRNN(_Recurrent):
    """h = activation(x_t @ kernel + h' @ recurrent_kernel + bias)."""

    kind = "simple_rnn"

    def __init__(self, units: int, activation="tanh", use_bias: bool = True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None, dropout=0.0, recurrent_dropout=0.0,
                 return_sequences: bool = False, return_state: bool = False, go_backwards: bool = False,
                 stateful: bool = False, unroll: bool = False, seed=None, **kwargs):
        self._setup(units, activation, "sigmoid", use_bias, kernel_initializer, recurrent_initializer,
                    bias_initializer, kernel_regularizer, recurrent_regularizer, bias_regularizer,
                    activity_regularizer, dict(kernel_constraint=kernel_constraint,
                                               recurrent_constraint=recurrent_constraint,
                                               bias_constraint=bias_constraint),
                    dropout, recurrent_dropout, return_sequences, return_state, go_backwards, stateful,
                    unroll, kwargs, seed)


class LSTM(_Recurrent):
    """Keras's LSTM: gates i, f, c, o; c = f * c' + i * activation(z_c), h = o * activation(c);
    return_state gives [output, h, c]."""

    kind = "lstm"
    gates, states = 4, 2

    def __init__(self, units: int, activation="tanh", recurrent_activation="sigmoid", use_bias: bool = True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", unit_forget_bias: bool = True, kernel_regularizer=None,
                 recurrent_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, recurrent_constraint=None, bias_constraint=None, dropout=0.0,
                 recurrent_dropout=0.0, seed=None, return_sequences: bool = False, return_state: bool = False,
                 go_backwards: bool = False, stateful: bool = False, unroll: bool = False, use_cudnn="auto",
                 **kwargs):
        self.unit_forget_bias = bool(unit_forget_bias)
        self._setup(units, activation, recurrent_activation, use_bias, kernel_initializer,
                    recurrent_initializer, bias_initializer, kernel_regularizer, recurrent_regularizer,
                    bias_regularizer, activity_regularizer, dict(kernel_constraint=kernel_constraint,
                                                                 recurrent_constraint=recurrent_constraint,
                                                                 bias_constraint=bias_constraint),
                    dropout, recurrent_dropout, return_sequences, return_state, go_backwards, stateful,
                    unroll, kwargs, seed)

    def bias_initializer(self):
        inner = self.initializers["bias"]
        return _ForgetBias(inner) if self.unit_forget_bias else inner

    def scratch(self, n, dtype):
        return {**super().scratch(n, dtype), "cs": np.empty((self.input_shape[0] + 1, n, self.units), dtype)}

    def _final_states(self, s):
        return [s["hs"][-1], s["cs"][-1]]

    def _cell_forward(self, k, p, s):
        k.lstm_forward(s["xw"], p["recurrent_kernel"], s["hs"], s["cs"], s["gates"], self.go_backwards,
                       self.activation, self.recurrent_activation, s["mask"], s["rmask"])

    def _cell_backward(self, k, p, s):
        k.lstm_backward(p["recurrent_kernel"], s["hs"], s["cs"], s["gates"], s["dhs"], s["dc"], s["dxw"],
                        s["drec"], self.go_backwards, self.activation, self.recurrent_activation, s["mask"],
                        s["rmask"])


class GRU(_Recurrent):
    """Keras 3's GRU with reset_after=True: gates z, r, h; hh = activation(x_h + r * (h' @ R_h +
    b_h)), h = z * h' + (1 - z) * hh; bias (2, 3 * units): the input's, the recurrent product's."""

    kind = "gru"
    gates = 3

    def __init__(self, units: int, activation="tanh", recurrent_activation="sigmoid", use_bias: bool = True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None, dropout=0.0, recurrent_dropout=0.0,
                 seed=None, return_sequences: bool = False, return_state: bool = False,
                 go_backwards: bool = False, stateful: bool = False, unroll: bool = False,
                 reset_after: bool = True, use_cudnn="auto", **kwargs):
        if reset_after is not True:
            raise ConfigError(f"GRU: reset_after={reset_after!r} is not supported (True only, Keras 3's "
                              "default)")
        self.reset_after = True
        self._setup(units, activation, recurrent_activation, use_bias, kernel_initializer,
                    recurrent_initializer, bias_initializer, kernel_regularizer, recurrent_regularizer,
                    bias_regularizer, activity_regularizer, dict(kernel_constraint=kernel_constraint,
                                                                 recurrent_constraint=recurrent_constraint,
                                                                 bias_constraint=bias_constraint),
                    dropout, recurrent_dropout, return_sequences, return_state, go_backwards, stateful,
                    unroll, kwargs, seed)

    def bias_shape(self):
        return (2, 3 * self.units)

    def scratch(self, n, dtype):
        return {**super().scratch(n, dtype), "rh": np.empty((self.input_shape[0], n, self.units), dtype)}

    def _biases(self, p, s):
        b = p["bias"] if self.use_bias else s["bias"]
        return b[0], b[1]

    def _dbiases(self, g, s):
        b = g["bias"] if self.use_bias else s["dbias"]
        return b[0], b[1]

    def _cell_forward(self, k, p, s):
        k.gru_forward(s["xw"], p["recurrent_kernel"], self._biases(p, s)[1], s["hs"], s["gates"], s["rh"],
                      self.go_backwards, self.activation, self.recurrent_activation, s["mask"], s["rmask"])

    def _cell_backward(self, k, p, s):
        k.gru_backward(p["recurrent_kernel"], s["hs"], s["gates"], s["rh"], s["dhs"], s["dxw"], s["drec"],
                       self.go_backwards, self.activation, self.recurrent_activation, s["mask"], s["rmask"])


def _record(layer, out: Symbolic, mask) -> None:
    """What a recurrent call's node records for a saved graph's replay (packed=True: return_state's
    packed tensor; masked=True: the mask is the last input), and the mask its output carries on
    (the input's, with return_sequences)."""
    recorded = {**({"packed": True} if layer.return_state else {}),
                **({"masked": True} if layer.masked else {})}
    if recorded:
        out.node.attrs["kwargs"] = recorded
    out.mask = mask if layer.return_sequences and not layer.return_state else None


MERGE_MODES = ("concat", "sum", "mul", "ave")
CELLS = {cls.__name__: cls for cls in (SimpleRNN, LSTM, GRU)}


def _check_wrapped(what: str, layer) -> None:
    """A layer Bidirectional can wrap: a cell layer whose one output it can merge."""
    if not isinstance(layer, _Recurrent):
        raise ConfigError(f"Bidirectional: {what} must be a SimpleRNN, LSTM or GRU, got {layer!r}")
    _refuse(f"Bidirectional({type(layer).__name__})", initial_state=layer.takes_list,
            activity_regularizer=layer.activity_regularizer is not None)


class Bidirectional(Layer):
    """Keras's Bidirectional: `layer` and a copy that reads the sequence backwards (go_backwards
    flipped; or `backward_layer`), their outputs merged (the backward one's steps put back in
    order first, with return_sequences); weights forward_<name>/... then backward_<name>/....

    With return_state (on the wrapped layers), Keras's call returns [output, *forward states,
    *backward states]. The layer computes them packed in one flat vector per sample (the merged
    output's elements, then each state's units in that order) that the call slices apart (ops),
    as the cells' own return_state does: `summary()` shows the packed shape."""

    kind = "bidirectional"
    supports_masking = True
    masked = False

    def __init__(self, layer, merge_mode="concat", weights=None, backward_layer=None, **kwargs):
        super().__init__(**kwargs)
        if merge_mode not in MERGE_MODES:
            raise ConfigError(f"Bidirectional: merge_mode={merge_mode!r} is not supported; choose one of "
                              f"{', '.join(MERGE_MODES)}")
        _refuse("Bidirectional", weights=weights is not None)
        _check_wrapped("layer", layer)
        if backward_layer is None:
            flipped = {**layer.get_config(), "go_backwards": not layer.go_backwards}
            backward_layer = type(layer).from_config(flipped)
        _check_wrapped("backward_layer", backward_layer)
        if backward_layer.return_sequences != layer.return_sequences:
            raise ConfigError("Bidirectional: layer and backward_layer must agree on return_sequences")
        if (backward_layer.return_state, backward_layer.states) != (layer.return_state, layer.states):
            raise ConfigError("Bidirectional: layer and backward_layer must agree on return_state and "
                              "have as many states")
        self.merge_mode, self.layer, self.backward_layer = merge_mode, layer, backward_layer
        for inner in (layer, backward_layer):      # Keras's: a masked step's output is zeros in a sequence
            inner.zero_output_for_mask = inner.return_sequences
        self.return_sequences, self.return_state = layer.return_sequences, layer.return_state
        self.prefixes = (f"forward_{layer.name or layer.kind}/",
                         f"backward_{backward_layer.name or backward_layer.kind}/")

    def sublayers(self):
        return [self.layer, self.backward_layer]

    def get_config(self):
        """Keras's: the wrapped layers as {"class_name", "config"} (one of the three cells)."""
        config = super().get_config()
        for what in ("layer", "backward_layer"):
            inner = getattr(self, what)
            config[what] = {"class_name": type(inner).__name__, "config": inner.get_config()}
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for what in ("layer", "backward_layer"):
            entry = config.get(what)
            if entry is not None:
                if not isinstance(entry, dict) or entry.get("class_name") not in CELLS:
                    raise ConfigError(f"Bidirectional: {what} must be one of {', '.join(CELLS)}, "
                                      f"got {entry!r}")
                config[what] = CELLS[entry["class_name"]].from_config(entry["config"])
        return super().from_config(config)

    def __call__(self, inputs, training=None, mask=None, packed=False, masked=False, **kwargs):
        """Keras's call; with return_state the list [output, *forward states, *backward states]
        sliced from the packed vector. The node of such a call records packed=True, so that a
        saved graph's replay gets the packed tensor its slicing ops read. A mask (mask=, or the
        sequence's) reaches both layers as the cells' does (the node's inputs [x, mask], masked=True)."""
        if masked:
            inputs, mask = inputs
        mask = sequence_mask(self.label, inputs, mask_of(inputs, mask))
        if mask is not None:
            inputs = [inputs, mask]
        if getattr(self, "_built_for", None) is not None and self.masked != (mask is not None):
            raise ConfigError(f"{self.label}: called with and without a mask; a layer's calls must agree "
                              "(use two layers)")
        self.masked = self.takes_list = mask is not None
        for inner in self.sublayers():
            inner.masked = inner.takes_list = self.masked
        out = super().__call__(inputs, training=training, **kwargs)
        if not isinstance(out, Symbolic):
            return out
        _record(self, out, mask)
        if not self.return_state:
            return out
        if packed:
            return out
        first = out[:, :self.merged_size]
        if len(self.merged_shape) > 1:
            first = reshape(first, (-1, *self.merged_shape))
        return [first, *(out[:, columns] for _, _, columns in self._state_columns())]

    def build(self, input_shape):
        """Masked: [the sequence's shape, the mask's], which the wrapped layers build for."""
        self._inner_shape = [tuple(s) for s in input_shape] if self.masked else None
        return super().build(input_shape[0] if self.masked else input_shape)

    def output_shape_for(self, input_shape):
        input_shape = getattr(self, "_inner_shape", None) or input_shape
        shape = self.layer.build(input_shape)
        if self.backward_layer.build(input_shape) != shape:
            raise ConfigError(f"{self.label}: layer and backward_layer give different shapes")
        if self.return_state:              # the cells' packed rows: the output's, then the states'
            rows, units = shape[0] - self.layer.states, shape[1]
            shape = (rows, units) if self.return_sequences else (units,)
        self.merged_shape = (*shape[:-1], 2 * shape[-1]) if self.merge_mode == "concat" else shape
        self.merged_size = int(np.prod(self.merged_shape))
        if not self.return_state:
            return self.merged_shape
        return (self.merged_size + 2 * self.layer.states * self.layer.units,)

    def _state_columns(self) -> list:
        """(direction, state, its columns in the packed vector) for every state, forward's first."""
        u, states = self.layer.units, self.layer.states
        at = [self.merged_size + k * u for k in range(2 * states + 1)]
        return [(i, j, slice(at[i * states + j], at[i * states + j + 1]))
                for i in range(2) for j in range(states)]

    def forward_elements(self):
        return super().forward_elements() + 2 * self.layer.forward_elements()

    def weights(self):
        return [dataclasses.replace(w, name=prefix + w.name)
                for prefix, inner in zip(self.prefixes, self.sublayers()) for w in inner.weights()]

    def _part(self, d: dict, i: int) -> dict:
        return {name[len(self.prefixes[i]):]: v for name, v in d.items() if name.startswith(self.prefixes[i])}

    def scratch(self, n, dtype):
        return {"inner": [inner.scratch(n, dtype) for inner in self.sublayers()],
                "outs": [np.empty((n, *inner.output_shape), dtype) for inner in self.sublayers()]}

    def _aligned(self, a):
        """The backward layer's output (or its gradient) with its steps in input order."""
        return a[:, ::-1] if self.return_sequences else a

    def _outputs(self, s) -> tuple:
        """(the forward layer's output, the backward one's in input order): with return_state,
        the output rows of their packed tensors."""
        outs = s["outs"]
        if self.return_state:
            rows = self.layer._out_rows
            outs = [o[:, :rows] if self.return_sequences else o[:, 0] for o in outs]
        return outs[0], self._aligned(outs[1])

    def _merged(self, a):
        """The merged output's part of `a` (this layer's output or its gradient), as merged_shape."""
        if not self.return_state:
            return a
        return a[:, :self.merged_size].reshape(a.shape[0], *self.merged_shape)

    def forward(self, k, p, x, out, s, run):
        for i, inner in enumerate(self.sublayers()):
            inner.forward(k, self._part(p, i), x, s["outs"][i], s["inner"][i], run)
        y, y_rev = self._outputs(s)
        if self.return_state:
            rows = self.layer._out_rows
            for i, j, columns in self._state_columns():
                out[:, columns] = s["outs"][i][:, rows + j]
            out = self._merged(out)
        if self.merge_mode == "concat":
            u = y.shape[-1]
            out[..., :u], out[..., u:] = y, y_rev
        elif self.merge_mode == "sum":
            np.add(y, y_rev, out=out)
        elif self.merge_mode == "mul":
            np.multiply(y, y_rev, out=out)
        else:
            np.add(y, y_rev, out=out)
            out *= 0.5

    def _split_grad(self, dout, s) -> list:
        y, y_rev = self._outputs(s)
        if self.merge_mode == "concat":
            u = y.shape[-1]
            parts = [dout[..., :u], dout[..., u:]]
        elif self.merge_mode == "mul":
            parts = [dout * y_rev, dout * y]
        else:
            parts = [dout * 0.5, dout * 0.5] if self.merge_mode == "ave" else [dout, dout]
        return [np.ascontiguousarray(parts[0]), np.ascontiguousarray(self._aligned(parts[1]))]

    def output_mask(self, xs):
        return None                        # set by __call__: the mask with return_sequences

    def backward(self, k, p, g, x, out, dout, dx, s):
        if self.masked:                    # [dx, d mask]: a mask takes no gradient
            if dx[1] is not None:
                dx[1][...] = 0
            dx = dx[0]
        douts = self._split_grad(self._merged(dout), s)
        if self.return_state:              # each cell's packed gradient: its output's rows, its states'
            rows = self.layer._out_rows
            packed = [np.empty(o.shape, dout.dtype) for o in s["outs"]]
            for full, d in zip(packed, douts):
                full[:, :rows] = d if self.return_sequences else d[:, None]
            for i, j, columns in self._state_columns():
                packed[i][:, rows + j] = dout[:, columns]
            douts = packed
        tmp = None if dx is None else np.empty_like(dx)
        for i, inner in enumerate(self.sublayers()):
            into = dx if i == 0 else tmp
            inner.backward(k, self._part(p, i), self._part(g, i), x, s["outs"][i], douts[i],
                           [into, None] if self.masked else into, s["inner"][i])
        if dx is not None:
            dx += tmp


__all__ = ["SimpleRNN", "LSTM", "GRU", "Bidirectional"]
