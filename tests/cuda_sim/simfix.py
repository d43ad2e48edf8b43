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


class _Barrier:
    """A block's syncthreads: the last of the block's live threads to arrive releases the others.

    numba's simulator has the block's manager (the launching thread) poll every thread's flag in
    a loop until all have arrived, holding the GIL against the threads it waits for: with 256
    threads a block, most of a launch went into that loop. This is the same rule (threads that
    have returned no longer count, as on the device) with the waiting done in a condition.
    """

    def __init__(self, threads: int) -> None:
        self.cond = threading.Condition()
        self.live, self.arrived, self.generation, self.aborted = threads, 0, 0, False

    def wait(self) -> None:
        with self.cond:
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            self.arrived += 1
            if self.arrived == self.live:
                self._release()
                return
            generation = self.generation
            while generation == self.generation and not self.aborted:
                self.cond.wait()
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self, failed: bool) -> None:
        """A thread returned (or raised: then every waiting thread is aborted, as numba does)."""
        with self.cond:
            self.live -= 1
            if failed:
                self.aborted = True
                self.cond.notify_all()
            elif self.arrived and self.arrived == self.live:
                self._release()

    def _release(self) -> None:
        self.arrived, self.generation = 0, self.generation + 1
        self.cond.notify_all()


def _barrier_blocks() -> None:
    """Replace the simulator's polling block manager with _Barrier (same threads, same order of
    exceptions: the first failing thread's error is raised after the block ends)."""
    from numba.cuda.simulator import kernel

    manager, thread = kernel.BlockManager, kernel.BlockThread
    if not (hasattr(manager, "run") and hasattr(thread, "syncthreads")
            and "_block_dim" in manager.__init__.__code__.co_names):
        raise RuntimeError("numba's CUDA simulator changed: BlockManager/BlockThread are not as "
                           "tests/cuda_sim/simfix.py expects; update it")

    def run(self, grid_point, *args):
        threads = []
        self.barrier = _Barrier(int(np.prod(self._block_dim)))

        def target():
            failed = True
            try:
                self._f(*args)
                failed = False
            finally:
                self.barrier.leave(failed)

        for block_point in np.ndindex(*self._block_dim):
            t = kernel.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        failed = [t for t in threads if t.exception]
        # The thread that raised first is the one that aborted the rest (their errors say abort).
        first = next((t for t in failed if "abort flag set" not in str(t.exception[0])),
                     failed[0] if failed else None)
        if first is not None:
            raise first.exception[0].with_traceback(first.exception[1])

    def syncthreads(self):
        self._manager.barrier.wait()

    manager.run = run
    thread.syncthreads = syncthreads


if SIMULATOR:
    _lock_shared_arrays()
    _barrier_blocks()
    # Threads of a block hand the GIL to each other at every syncthreads. With _Barrier, a 1 ms
    # switch interval cost the least CPU of 0.1, 1 and 5 ms for the 16 and 128 tiled products
    # (user + sys: 14.9, 20.9 and 21.3 s; `/usr/bin/time` around two of check_kernels_cuda's
    # tests, 2026-11-29, on a loaded 2-core machine).
    sys.setswitchinterval(1e-3)
