"""What runs on the GPU (--device cuda): the layers and ops with CUDA kernels, and the check
that refuses any other model at build, with one line naming the first layer or op without
them. This module imports no numba.cuda, so the check runs where there is no GPU stack.

A model (Sequential or Functional) runs on the GPU when every step of its graph, in training
and in inference, is one of DEVICE_LAYERS or an op of DEVICE_OPS that `refusal` accepts (a
user's layer and Lambda are traced into ops, so they run when their ops do). Its loss runs on
the GPU too where `loss_on_device` says so (one output, a sparse categorical cross-entropy or
MSE, no compiled metric); any other (several outputs, another loss, metrics, sample weights)
runs on the host, as the CPU model's, on the outputs each step brings back.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.kernels.reference import COMPARISONS, UNARY
from pserver.layers import (
    Activation,
    Add,
    Average,
    AveragePooling2D,
    BatchNormalization,
    Concatenate,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Cropping1D,
    Cropping2D,
    Dense,
    Dot,
    Dropout,
    Embedding,
    Flatten,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    LayerNormalization,
    Maximum,
    MaxPooling2D,
    Minimum,
    Multiply,
    Normalization,
    Permute,
    RepeatVector,
    Rescaling,
    Reshape,
    Subtract,
    UpSampling1D,
    UpSampling2D,
    ZeroPadding1D,
    ZeroPadding2D,
)
from pserver.models import losses
from pserver.ops import core

# The layers whose every pass has a CUDA kernel.
DEVICE_LAYERS = (Dense, Conv2D, Conv1D, MaxPooling2D, AveragePooling2D, Flatten, Reshape, Dropout, Activation,
                 Embedding, LayerNormalization, Add, Subtract, Multiply, Average, Maximum, Minimum,
                 Concatenate, GlobalAveragePooling1D, GlobalAveragePooling2D, GlobalMaxPooling1D,
                 GlobalMaxPooling2D, Permute, RepeatVector, BatchNormalization, Dot, ZeroPadding1D,
                 ZeroPadding2D, Cropping1D, Cropping2D, UpSampling1D, UpSampling2D, Conv2DTranspose,
                 Rescaling, Normalization)
# The ops with a device form (pserver.models.cuda_ops).
BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power")
ACTIVATIONS = ("relu", "sigmoid", "tanh")
RESHAPES = ("reshape", "expand_dims", "squeeze")
SOFTMAXES = ("softmax", "log_softmax")
GATHERS = ("getitem", "take", "tile", "repeat")      # ops that only move elements: a gather by index
DEVICE_OPS = (*BINARY, *COMPARISONS, "negative", *UNARY, "clip", "where", "cast", *ACTIVATIONS, *SOFTMAXES,
              *RESHAPES, "transpose", "concatenate", "split", "stack", "sum", "mean", "max", "min", "matmul",
              *GATHERS, "one_hot")
# Ids travel to the GPU in the batch's float32, exact up to 2**24.
FLOAT32_IDS = 2**24
LOSSES = (losses.SparseCategoricalCrossentropy, losses.MeanSquaredError)


def check(model) -> None:
    """ConfigError naming the first layer or op of `model` (a built Functional) that cannot
    run on the GPU, and saying that --device cpu runs it."""
    why = next((w for training in (True, False) for step in model._plan(training).steps
                if (w := _step_refusal(model._plan(training), step))), None)
    if why:
        names = ", ".join(t.__name__ for t in DEVICE_LAYERS)
        raise ConfigError(f"--device cuda: runs models of {names} layers and the ops {', '.join(DEVICE_OPS)} "
                          f"on the GPU; {model.name}: {why}. Use --device cpu for this model")


def loss_on_device(model) -> bool:
    """Whether `model`'s training loss runs on the GPU, in the step (and its step graph): one
    output of (n, units), a loss of LOSSES, no compiled metric and no sample weights. Otherwise
    each step brings the outputs to the host for the host model's loss (pserver.models.cuda)."""
    return (not model.several and model.steps <= 1 and isinstance(model.loss, LOSSES)
            and not getattr(model, "metric_objects", None) and not model.sample_weighted)


def _step_refusal(plan, step) -> str | None:
    if step.layer is not None:
        layer = plan.layers[step.layer]
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"{layer.label} has an activity_regularizer"
        if isinstance(layer, LayerNormalization) and not layer.over_last_axis:
            return f"{layer.label} over the axes {list(layer.axes)} has no CUDA kernels (over the last has)"
        if isinstance(layer, Embedding) and layer.sparse:
            return f"{layer.label} is sparse (its rows live on the shards; a dense table runs on the GPU)"
        if isinstance(layer, Embedding) and layer.input_dim > FLOAT32_IDS:
            return (f"{layer.label} has input_dim={layer.input_dim}: a batch reaches the GPU as float32, "
                    f"which holds ids exactly up to {FLOAT32_IDS}")
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
    if node.op in ("concatenate", "split") and int(axis) % rank == 0 or \
            node.op == "stack" and int(axis) % (rank + 1) == 0:
        return "along the batch axis has no CUDA kernel"
    if node.op in ("sum", "mean", "max", "min") and (axis is None or 0 in axes(axis, rank)):
        return "over the batch axis has no CUDA kernel"
    if node.op == "take" and not isinstance(node.inputs[1], np.ndarray):
        return "with indices computed in the graph has no CUDA kernel (constant indices have)"
    if node.op == "one_hot" and int(node.attrs.get("axis", -1)) % (rank + 1) != rank:
        return "along another axis than the last has no CUDA kernel"
    if node.op == "one_hot" and not np.issubdtype(np.dtype(node.attrs.get("dtype", "float32")), np.floating):
        return (f"to {np.dtype(node.attrs['dtype'])} has no CUDA kernel (the GPU's tensors are float32)")
    if node.op == "clip" and not all(isinstance(b, np.ndarray) and b.size == 1 for b in node.inputs[1:]):
        return "with bounds that are not numbers has no CUDA kernel"
    if node.op == "cast" and not np.issubdtype(np.dtype(node.attrs["dtype"]), np.floating):
        return f"to {np.dtype(node.attrs['dtype'])} has no CUDA kernel (the GPU's tensors are float32)"
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


__all__ = ["DEVICE_LAYERS", "DEVICE_OPS", "UNARY", "COMPARISONS", "SOFTMAXES", "GATHERS", "check",
           "loss_on_device", "refusal", "axes", "draws_at_random"]
