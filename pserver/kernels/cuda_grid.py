"""What the CUDA kernel modules (pserver.kernels.cuda, cuda_graph) share: their launches, one
thread per element in blocks of ELEMENT_THREADS over arrays seen flat, and the fill kernel."""

from __future__ import annotations

from numba import cuda

ELEMENT_THREADS = 256


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _flat(a):
    return a.reshape(a.size)


@cuda.jit
def fill_kernel(a, value):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = value
