"""Model math kernels: one module per backend, all with the same functions.

    reference   plain NumPy, the twin every compiled kernel is tested against
    cpu         numba @njit kernels (float32, C-contiguous, BLAS for the products)
    cuda        numba.cuda kernels on device arrays (float32); imported only when asked for,
                so a CPU-only install never imports numba.cuda

A model is written once against this API and given a module by `get_backend`.

Conventions every kernel keeps: output and gradient buffers are preallocated by the caller and
overwritten (never accumulated into); images are channels-last (N, H, W, C), as Keras's; a
window (convolution or pooling) is placed by stride and the padding before it, as
`conv_output` computes them, and elements outside the image read as zero (convolution), are
never chosen (max pooling) or are not counted (average pooling).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pserver.errors import ConfigError

# Backends every install can import.
BACKENDS = ("cpu", "reference")
# Backends that need an accelerator stack (numba.cuda, and a GPU or the simulator).
DEVICE_BACKENDS = ("cuda",)

# The functions every backend module defines, with the same signatures (the cuda module's
# take device arrays and a keyword-only `stream` as well).
KERNELS = ("dense_forward", "dense_param_grads", "dense_backward", "relu_backward",
           "softmax_xent", "mse", "sigmoid_bce",
           "conv2d_forward", "conv2d_backward", "maxpool2d_forward", "maxpool2d_backward",
           "avgpool2d_forward", "avgpool2d_backward", "activation_forward", "activation_backward",
           "dropout_forward", "dropout_backward", "embedding_forward", "embedding_backward",
           "pooled_embedding_forward", "pooled_embedding_backward", "copy")
# The functions of the CPU backends alone (cpu and its twin): the click-through-rate models'
# math, which runs where their sparse rows are, on the host; and a convolution whose training
# step builds its im2col matrix (or Winograd transform) once, in the forward pass (Conv2D uses
# them where they exist); and the recurrent layers' recurrences (pserver.layers.recurrent: no
# CUDA kernels).
CPU_KERNELS = ("fm_forward", "fm_backward", "conv2d_forward_cols", "conv2d_backward_cols",
               "simple_rnn_forward", "simple_rnn_backward", "lstm_forward", "lstm_backward", "gru_forward",
               "gru_backward")
# The graph layers' kernels (merges, Concatenate, global pooling, an Embedding's ids from its
# input, LayerNormalization over the last axis): memory-bound, so NumPy on the host (cpu takes
# reference's) and numba.cuda on the device, with one signature (cuda's plus `stream`).
GRAPH_KERNELS = ("elementwise", "scale_by", "fill", "extreme_forward", "select_grad", "columns_into",
                 "columns_from", "global_avgpool_forward", "global_avgpool_backward",
                 "global_maxpool_forward", "global_maxpool_backward", "ids_into", "layer_norm_forward",
                 "layer_norm_backward", "transpose", "sum_to", "broadcast_to", "batch_norm_forward",
                 "batch_norm_backward", "batch_norm_statistics", "batched_matmul",
                 "window_into", "window_from", "deviation")


def conv_output(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int]:
    """(output size, padding before) of a window sliding along one axis, as Keras/TF place it.

    'valid': windows wholly inside, out = (size - kernel) // stride + 1 (0 when the kernel is
    larger than the input), no padding. 'same': out = ceil(size / stride), padded by
    max((out - 1) * stride + kernel - size, 0) in all, half before (rounded down) and the
    rest after, as TensorFlow does.
    """
    if padding == "valid":
        return max((size - kernel) // stride + 1, 0), 0
    if padding == "same":
        out = -(-size // stride)
        return out, max((out - 1) * stride + kernel - size, 0) // 2
    raise ValueError(f"padding must be 'valid' or 'same', got {padding!r}")


def get_backend(name: str) -> ModuleType:
    """The kernel module for `name` (imported lazily: `reference` needs no numba compile)."""
    if name not in BACKENDS + DEVICE_BACKENDS:
        raise ConfigError(f"--device: unknown kernel backend {name!r}; "
                          f"choose one of {', '.join(BACKENDS + DEVICE_BACKENDS)}")
    try:
        return importlib.import_module(f"pserver.kernels.{name}")
    except ImportError as e:
        if name not in DEVICE_BACKENDS:
            raise
        # numba-cuda without its CUDA bindings, for one, fails here rather than at launch.
        raise ConfigError(f"--device {name}: numba.cuda cannot be imported ({e}); "
                          f"install the GPU extra: pip install 'pserver[cuda]'") from e


__all__ = ["BACKENDS", "DEVICE_BACKENDS", "KERNELS", "CPU_KERNELS", "GRAPH_KERNELS", "conv_output",
           "get_backend"]
