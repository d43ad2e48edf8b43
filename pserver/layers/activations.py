"""Activations by Keras's names, applied after a layer's kernel (ReLU fused into it).

Backward turns d loss / d output into d loss / d pre-activation in place, from the output
alone: relu' = (y > 0), sigmoid' = y (1 - y), tanh' = 1 - y^2, so no pre-activation is kept.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.registry import Registry

ACTIVATIONS = Registry("activation", "activation")
ACTIVATIONS.add("linear", "none: the layer's output as it is (activation=None)")
ACTIVATIONS.add("relu", "max(0, x), fused into the layer's kernel")
ACTIVATIONS.add("sigmoid", "1 / (1 + exp(-x))")
ACTIVATIONS.add("tanh", "tanh(x)")
ACTIVATIONS.add("softmax", "exp(x) / sum(exp(x)) over the outputs: the last layer only, before a "
                "cross-entropy loss, which takes its probabilities (computed from the logits, stably)")


def get(spec, owner: str) -> str:
    """None or a Keras name -> one of ACTIVATIONS."""
    kind = "linear" if spec is None else spec
    if kind not in ACTIVATIONS:
        raise ConfigError(f"{owner}: unknown activation {spec!r}; choose one of "
                          f"{', '.join(ACTIVATIONS.names())} (or None)")
    return kind


def probabilities(kind: str, out):
    """The model's outputs as it states them: a fused softmax or sigmoid last layer computes
    logits (its loss takes them, stably); this turns them into probabilities, in place."""
    if kind == "softmax":
        out -= out.max(axis=-1, keepdims=True)        # over the units (an output with steps too)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
    elif kind == "sigmoid":
        np.negative(out, out=out)
        np.exp(out, out=out)
        out += 1
        np.reciprocal(out, out=out)
    return out


def forward(k, kind: str, out) -> None:
    """out = activation(out), in place; a no-op for relu (the kernel fused it) and linear.
    A softmax never gets here: Sequential fuses it into the loss, or refuses the model."""
    if kind in ("sigmoid", "tanh"):
        k.activation_forward(kind, out, out)


def forward_unfused(k, kind: str, out) -> None:
    """out = activation(out), in place, ReLU included: for a layer whose kernel fuses none
    (Conv2DTranspose, DepthwiseConv2D)."""
    if kind != "linear":
        k.activation_forward(kind, out, out)


def backward(k, kind: str, out, dout) -> None:
    """dout = d loss / d pre-activation, in place; out is the activation's output."""
    if kind != "linear":
        k.activation_backward(kind, out, dout, dout)


__all__ = ["ACTIVATIONS", "get", "forward", "forward_unfused", "backward", "probabilities"]
