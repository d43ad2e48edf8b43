"""SGD with (heavy-ball or Nesterov) momentum and optional L2 weight decay.

    g' = g + wd * w
    v  = mu * v + g'
    w -= lr * v                  (heavy ball)
    w -= lr * (g' + mu * v)      (Nesterov, as in PyTorch's SGD(nesterov=True))

`update` is the numba kernel; `update_numpy` its twin. In place on 1-D float32 arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATE = ("v",)  # the velocity


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, v, lr, mu, nesterov, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g or v would be read past its end.
    if g.shape[0] != n or v.shape[0] != n:
        raise ValueError("momentum: w, g and v differ in size")
    lr32, mu32, wd32 = np.float32(lr), np.float32(mu), np.float32(weight_decay)
    # Hogwild! (Niu et al. 2011): in async mode several threads run this on the same w and v
    # at once with no lock; a lost update here and there is the deliberate price of no lock.
    for i in range(n):
        gi = g[i] + wd32 * w[i]
        vi = mu32 * v[i] + gi
        v[i] = vi
        if nesterov:
            w[i] -= lr32 * (gi + mu32 * vi)
        else:
            w[i] -= lr32 * vi


def update_numpy(w, g, v, lr, mu, nesterov, weight_decay):
    if g.shape != w.shape or v.shape != w.shape:
        raise ValueError("momentum: w, g and v differ in size")
    lr32, mu32 = np.float32(lr), np.float32(mu)
    g = g + np.float32(weight_decay) * w
    v *= mu32
    v += g
    w -= lr32 * (g + mu32 * v) if nesterov else lr32 * v
