"""Adagrad as Keras 3 runs it (keras.optimizers.Adagrad), with optional L2 weight decay.

    g' = g + wd * w                    (pserver's coupled L2; wd = 0 is Keras's rule)
    acc += g'^2                        (acc starts at initial_accumulator, Keras's 0.1)
    w  -= lr * g' / sqrt(acc + eps)

eps sits inside the square root, as in Keras. The state array takes Keras's name,
accumulator. `update` is the numba kernel; `update_numpy` its twin. In place on 1-D float32
arrays. (Sparse tables have their own row-wise Adagrad: pserver.sparse.optim.)
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATE = ("accumulator",)


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, acc, lr, eps, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g or acc would be read past its end.
    if g.shape[0] != n or acc.shape[0] != n:
        raise ValueError("adagrad: w, g and accumulator differ in size")
    lr32, eps32, wd32 = np.float32(lr), np.float32(eps), np.float32(weight_decay)
    # Hogwild! (Niu et al. 2011): in async mode several threads run this on the same w and
    # acc at once with no lock; the races between them are deliberate.
    for i in range(n):
        gi = g[i] + wd32 * w[i]
        ai = acc[i] + gi * gi
        acc[i] = ai
        w[i] -= lr32 * gi / np.sqrt(ai + eps32)


def update_numpy(w, g, acc, lr, eps, weight_decay):
    if g.shape != w.shape or acc.shape != w.shape:
        raise ValueError("adagrad: w, g and accumulator differ in size")
    g = g + np.float32(weight_decay) * w
    acc += g * g
    w -= np.float32(lr) * g / np.sqrt(acc + np.float32(eps))
