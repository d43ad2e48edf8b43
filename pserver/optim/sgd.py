"""Plain SGD with optional L2 weight decay: w -= lr * (g + wd * w).

`update` is the numba kernel the shard runs; `update_numpy` is its twin with the same math,
which the tests compare it with. Both work in place on 1-D float32 arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATE = ()  # no state arrays


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, lr, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g would read past its end.
    if g.shape[0] != n:
        raise ValueError("sgd: w and g differ in size")
    # float32 constants keep the loop in float32, as the twin computes.
    lr32, wd32 = np.float32(lr), np.float32(weight_decay)
    # In async mode several gRPC threads run this on the same w at once, without a lock and
    # without the GIL: that race is deliberate (Hogwild!, Niu et al. 2011). An element may
    # lose one of two concurrent updates; sparse, small updates make that harmless. So an
    # update must touch only the elements it changes: writing w[i] - 0 back would overwrite
    # another thread's concurrent update of w[i] (the same value for this thread, a lost
    # update for the other). Skipping those stores keeps pushes on disjoint index sets
    # exact, as Hogwild assumes; the arithmetic is the twin's.
    for i in range(n):
        d = lr32 * (g[i] + wd32 * w[i])
        if d != 0:
            w[i] -= d


def update_numpy(w, g, lr, weight_decay):
    if g.shape != w.shape:
        raise ValueError("sgd: w and g differ in size")
    w -= np.float32(lr) * (g + np.float32(weight_decay) * w)
