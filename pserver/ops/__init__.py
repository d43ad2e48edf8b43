"""Differentiable ops with Keras's names (keras.ops): each a forward, a vector-Jacobian
product and a NumPy twin, eager on arrays and recorded on symbolic tensors (pserver.ops.core)."""

from pserver.ops.core import OPS, Node, Op, Symbolic, apply, register

__all__ = ["OPS", "Op", "Node", "Symbolic", "apply", "register"]
