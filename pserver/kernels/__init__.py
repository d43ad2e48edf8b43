"""Model math kernels: one module per backend, all with the same functions.

    reference   plain NumPy, the twin every compiled kernel is tested against
    cpu         numba @njit kernels (float32, C-contiguous, BLAS for the products)

A model is written once against this API and given a module by `get_backend`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pserver.errors import ConfigError

BACKENDS = ("cpu", "reference")

# The functions every backend module defines, with the same signatures.
KERNELS = ("dense_forward", "dense_param_grads", "dense_backward", "relu_backward",
           "softmax_xent", "mse")


def get_backend(name: str) -> ModuleType:
    """The kernel module for `name` (imported lazily: `reference` needs no numba compile)."""
    if name not in BACKENDS:
        raise ConfigError(f"--device: unknown kernel backend {name!r}; "
                          f"choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"pserver.kernels.{name}")


__all__ = ["BACKENDS", "KERNELS", "get_backend"]
