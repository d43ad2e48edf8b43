"""What the modules in this folder import first: the simulator check and one simulator fix.

These modules run in a subprocess with NUMBA_ENABLE_CUDASIM=1 (tests/test_kernels_cuda.py starts
it), since numba reads that variable once, at import. Run directly, on a machine with a GPU and
without the variable, they test the real device instead.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from numba import cuda

SIMULATOR = bool(cuda.config.ENABLE_CUDASIM)

if not cuda.is_available():
    # A collection error, not a skip: a run that tests nothing must not pass.
    raise RuntimeError("no CUDA device and NUMBA_ENABLE_CUDASIM is not 1: nothing to test on")


def _lock_shared_arrays() -> None:
    """Make the simulator's cuda.shared.array thread-safe.

    The simulator runs each CUDA thread as a Python thread and gives a block's threads the same
    shared array by looking the caller's (file, line) up in a dict, creating the array if it is
    missing. That check-then-set is not locked (numba 0.68 and numba-cuda 0.30 alike), so when
    a thread switch falls between the two, threads of one block get different arrays and a
    correct kernel computes garbage now and then (seen in about 3% of launches of the tiled
    product here). This does the same lookup under a lock.
    """
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np.numpy_support import as_dtype

    cls = kernelapi.FakeCUDAShared
    original, lock = cls.array, threading.Lock()

    def array(self, shape, dtype, *args, **kwargs):
        if shape == 0:      # dynamic shared memory: one preallocated buffer, no race
            return original(self, shape, dtype, *args, **kwargs)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                dt = as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                found = self._allocations[key] = np.empty(shape, dt)
        return found

    if not hasattr(cls(0), "_allocations"):
        raise RuntimeError("numba's CUDA simulator changed: FakeCUDAShared has no _allocations; "
                           "update tests/cuda_sim/simfix.py")
    cls.array = array


if SIMULATOR:
    _lock_shared_arrays()
    # Threads of a block hand the GIL to each other at every syncthreads; a shorter switch
    # interval than the default 5 ms makes the simulator about twice as fast here.
    sys.setswitchinterval(1e-4)
