"""What runs on the GPU (--device cuda): the layers and ops with CUDA kernels, and the check
that refuses any other model at build, with one line naming the first layer or op without
them. This module imports no numba.cuda, so the check runs where there is no GPU stack.

A model (Sequential or Functional) runs on the GPU when every step of its graph, in training
and in inference, is one of DEVICE_LAYERS or an op of DEVICE_OPS that `refusal` accepts (a
user's layer and Lambda are traced into ops, so they run when their ops do), it has one
output, and its loss is a sparse categorical cross-entropy or MSE.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import (
    Activation,
    Add,
    Average,
    AveragePooling2D,
    Concatenate,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    Maximum,
    MaxPooling2D,
    Minimum,
    Multiply,
    Reshape,
    Subtract,
)
from pserver.models import losses
from pserver.ops import core

# The layers whose every pass has a CUDA kernel.
DEVICE_LAYERS = (Dense, Conv2D, MaxPooling2D, AveragePooling2D, Flatten, Reshape, Dropout, Activation,
                 Add, Subtract, Multiply, Average, Maximum, Minimum, Concatenate,
                 GlobalAveragePooling1D, GlobalAveragePooling2D, GlobalMaxPooling1D, GlobalMaxPooling2D)
# The ops with a device form (pserver.models.cuda_ops).
BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum")
ACTIVATIONS = ("relu", "sigmoid", "tanh")
RESHAPES = ("reshape", "expand_dims", "squeeze")
DEVICE_OPS = (*BINARY, "negative", *ACTIVATIONS, *RESHAPES, "concatenate", "split", "sum", "mean",
              "matmul")
LOSSES = (losses.SparseCategoricalCrossentropy, losses.MeanSquaredError)


def check(model) -> None:
    """ConfigError naming the first layer or op of `model` (a built Functional) that cannot
    run on the GPU, and saying that --device cpu runs it."""
    why = f"it has {len(model._outputs)} outputs (one runs on the GPU)" if model.several else None
    if why is None and model.steps > 1:
        why = f"its output has steps ({model.output_shape}; the GPU's losses take (n, units))"
    why = why or next((w for training in (True, False) for step in model._plan(training).steps
                       if (w := _step_refusal(model._plan(training), step))), None)
    if why is None and not isinstance(model.loss, LOSSES):
        why = f"its loss is {model.loss.name}"
    if why is None and getattr(model, "metric_objects", None):
        why = f"it compiled the metric {model.metric_objects[0].name!r} (the GPU step reports accuracy only)"
    if why:
        names = ", ".join(t.__name__ for t in DEVICE_LAYERS)
        raise ConfigError(f"--device cuda: runs models of {names} layers and the ops {', '.join(DEVICE_OPS)} "
                          f"with a sparse categorical cross-entropy or MSE loss on the GPU; {model.name}: "
                          f"{why}. Use --device cpu for this model")


def _step_refusal(plan, step) -> str | None:
    if step.layer is not None:
        layer = plan.layers[step.layer]
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"{layer.label} has an activity_regularizer"
        if isinstance(layer, Dense) and len(layer.input_shape) > 1:
            return f"{layer.label} on a {layer.input_shape} input has no CUDA kernels (a flat one has)"
        return None if isinstance(layer, DEVICE_LAYERS) else f"{layer.label} has no CUDA kernels"
    why = refusal(step.node)
    return None if why is None else f"op {step.node.op} {why}"


def refusal(node: core.Node) -> str | None:
    """Why op node `node` cannot run on the GPU, or None when it can."""
    if node.op not in DEVICE_OPS:
        return "has no CUDA kernel"
    shapes = [getattr(x, "shape", np.shape(x)) for x in node.inputs]
    rank = max(len(s) for s in shapes)
    axis = node.attrs.get("axis", 0)
    if node.op in ("concatenate", "split") and int(axis) % rank == 0:
        return "along the batch axis has no CUDA kernel"
    if node.op in ("sum", "mean") and (axis is None or 0 in axes(axis, rank)):
        return "over the batch axis has no CUDA kernel"
    if node.op == "matmul" and (len(shapes[1]) != 2 or shapes[1][0] is None or len(shapes[0]) < 2):
        return f"of {shapes[0]} by {shapes[1]} has no CUDA kernel (it takes a batch by a matrix)"
    return None


def axes(axis, rank: int) -> tuple[int, ...]:
    """`axis` (an int or several) as non-negative axes of a tensor of rank `rank`."""
    found = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(int(a) % rank for a in found)


def draws_at_random(model) -> str | None:
    """The first layer of `model`'s training pass that draws from the step's seed (a Dropout with
    a rate), or None: a step graph (pserver.models.cuda's StepGraph) replays its kernels with the
    arguments they were captured with, so it is made only for a model whose training step takes
    the same arguments every step."""
    plan = model._plan(True)
    return next((layer.label for layer in plan.layers if isinstance(layer, Dropout) and layer.rate > 0), None)


__all__ = ["DEVICE_LAYERS", "DEVICE_OPS", "check", "refusal", "axes", "draws_at_random"]
