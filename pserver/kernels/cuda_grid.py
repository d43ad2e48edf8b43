"""How the CUDA kernel modules (pserver.kernels.cuda, cuda_graph) size their launches: one
thread per element in blocks of ELEMENT_THREADS, over arrays seen flat."""

from __future__ import annotations

ELEMENT_THREADS = 256


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _flat(a):
    return a.reshape(a.size)
