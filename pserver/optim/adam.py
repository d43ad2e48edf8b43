"""Adam (Kingma & Ba 2015) with optional L2 weight decay added to the gradient.

    g' = g + wd * w
    m  = b1 * m + (1 - b1) * g'
    v  = b2 * v + (1 - b2) * g'^2
    w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

t is the number of updates applied so far including this one (t >= 1). The weight decay is
the coupled kind (torch.optim.Adam's weight_decay), not AdamW's decoupled one.
`update` is the numba kernel; `update_numpy` its twin. In place on 1-D float32 arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATE = ("m", "v")  # first and second moment estimates


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, m, v, lr, beta1, beta2, eps, t, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g, m or v would be read past its end.
    if g.shape[0] != n or m.shape[0] != n or v.shape[0] != n:
        raise ValueError("adam: w, g, m and v differ in size")
    if t < 1:
        raise ValueError("adam: t counts updates including this one, so t >= 1")
    # Bias corrections in float64 (beta2**t is close to 1 for small t), used as float32.
    inv_c1 = np.float32(1.0 / (1.0 - beta1 ** t))
    inv_c2 = np.float32(1.0 / (1.0 - beta2 ** t))
    b1, b2 = np.float32(beta1), np.float32(beta2)
    one_b1, one_b2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    lr32, eps32, wd32 = np.float32(lr), np.float32(eps), np.float32(weight_decay)
    # Hogwild! (Niu et al. 2011): in async mode several threads run this on the same w, m and
    # v at once with no lock; the races between them are deliberate.
    for i in range(n):
        gi = g[i] + wd32 * w[i]
        mi = b1 * m[i] + one_b1 * gi
        vi = b2 * v[i] + one_b2 * (gi * gi)
        m[i], v[i] = mi, vi
        w[i] -= lr32 * (mi * inv_c1) / (np.sqrt(vi * inv_c2) + eps32)


def update_numpy(w, g, m, v, lr, beta1, beta2, eps, t, weight_decay):
    if not g.shape == m.shape == v.shape == w.shape:
        raise ValueError("adam: w, g, m and v differ in size")
    if t < 1:
        raise ValueError("adam: t counts updates including this one, so t >= 1")
    inv_c1 = np.float32(1.0 / (1.0 - beta1 ** t))
    inv_c2 = np.float32(1.0 / (1.0 - beta2 ** t))
    g = g + np.float32(weight_decay) * w
    m *= np.float32(beta1)
    m += np.float32(1.0 - beta1) * g
    v *= np.float32(beta2)
    v += np.float32(1.0 - beta2) * (g * g)
    w -= np.float32(lr) * (m * inv_c1) / (np.sqrt(v * inv_c2) + np.float32(eps))
