"""Differentiable ops with Keras's names (keras.ops): each a forward, a vector-Jacobian
product and a NumPy twin, eager on arrays and recorded on symbolic tensors (pserver.ops.core).
By kind: math (element-wise arithmetic, matmul, cast), nn (activations, softmax, one_hot),
reduce (sum, mean, max, min), shape (reshape ... split, repeat, tile, slicing, take)."""

from pserver.ops.core import OPS, Node, Op, Symbolic, apply, register
from pserver.ops.math import (
    abs,
    absolute,
    add,
    cast,
    clip,
    divide,
    equal,
    exp,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    matmul,
    maximum,
    minimum,
    multiply,
    negative,
    not_equal,
    power,
    sqrt,
    square,
    subtract,
    where,
)
from pserver.ops.nn import log_softmax, one_hot, relu, sigmoid, softmax, tanh
from pserver.ops.reduce import max, mean, min, sum
from pserver.ops.shape import (
    arange,
    concatenate,
    convert_to_tensor,
    expand_dims,
    repeat,
    reshape,
    shape,
    split,
    squeeze,
    stack,
    take,
    tile,
    transpose,
)

# the ops by Keras's names (pserver.keras.ops exposes the same), after the core's names
__all__ = ["OPS", "Op", "Node", "Symbolic", "apply", "register",
           "add", "subtract", "multiply", "divide", "negative", "power", "matmul", "exp", "log", "sqrt",
           "square", "abs", "absolute", "maximum", "minimum", "greater", "greater_equal", "less",
           "less_equal", "equal", "not_equal", "clip", "where", "cast", "relu", "sigmoid",
           "tanh", "softmax", "log_softmax", "one_hot", "sum", "mean", "max", "min", "reshape",
           "transpose", "expand_dims", "squeeze", "concatenate", "stack", "split", "repeat", "tile",
           "take", "convert_to_tensor", "shape", "arange"]
