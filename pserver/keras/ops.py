"""`from pserver.keras import ops` in place of `from keras import ops`: pserver.ops by Keras's
names. On arrays an op computes now; on a model's symbolic tensors (keras.Input, a layer's
output, inside a layer's `call`) it records a node of the model's graph."""

from pserver.keras._names import missing as _missing
from pserver.ops import (
    abs,
    absolute,
    add,
    cast,
    clip,
    concatenate,
    convert_to_tensor,
    divide,
    exp,
    expand_dims,
    log,
    log_softmax,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    multiply,
    negative,
    one_hot,
    power,
    relu,
    repeat,
    reshape,
    shape,
    sigmoid,
    softmax,
    split,
    sqrt,
    square,
    squeeze,
    stack,
    subtract,
    sum,
    take,
    tanh,
    tile,
    transpose,
    where,
)

__getattr__ = _missing(__name__)     # a keras.ops name pserver lacks: one line naming it

__all__ = ["add", "subtract", "multiply", "divide", "negative", "power", "matmul", "exp", "log", "sqrt",
           "square", "abs", "absolute", "maximum", "minimum", "clip", "where", "cast", "relu", "sigmoid",
           "tanh", "softmax", "log_softmax", "one_hot", "sum", "mean", "max", "min", "reshape",
           "transpose", "expand_dims", "squeeze", "concatenate", "stack", "split", "repeat", "tile",
           "take", "convert_to_tensor", "shape"]
