"""AdamW as Keras 3 runs it (keras.optimizers.AdamW): Adam with decoupled weight decay.

    w -= w * wd * lr                     (the decay, first: Keras's _apply_weight_decay)
    m += (g - m) * (1 - b1)
    v += (g^2 - v) * (1 - b2)
    w -= m * alpha / (sqrt(v) + eps)     alpha = lr * sqrt(1 - b2^t) / (1 - b1^t)

t is the number of updates applied so far including this one (t >= 1). The decay is
decoupled (Loshchilov & Hutter 2019): it scales w by (1 - lr * wd) before the Adam step and
never enters m or v, so a zero gradient still shrinks w. Keras applies it in that order, with
the same (scheduled) lr, and so does this. The Adam step is Keras's form: eps is added to
sqrt(v) before the bias correction (alpha), "epsilon hat" in Kingma & Ba, where pserver's
`adam` adds it to the corrected sqrt(v / (1 - b2^t)). `update` is the numba kernel;
`update_numpy` its twin. In place on 1-D float32 arrays.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

STATE = ("m", "v")  # first and second moment estimates, as adam's


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, m, v, lr, beta1, beta2, eps, t, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g, m or v would be read past its end.
    if g.shape[0] != n or m.shape[0] != n or v.shape[0] != n:
        raise ValueError("adamw: w, g, m and v differ in size")
    if t < 1:
        raise ValueError("adamw: t counts updates including this one, so t >= 1")
    # The bias corrections in float64 (beta2**t is close to 1 for small t), used as float32.
    alpha = np.float32(lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t))
    one_b1, one_b2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    lr32, eps32, wd32 = np.float32(lr), np.float32(eps), np.float32(weight_decay)
    # Hogwild! (Niu et al. 2011): in async mode several threads run this on the same w, m and
    # v at once with no lock; the races between them are deliberate.
    for i in range(n):
        wi = w[i] - w[i] * wd32 * lr32
        gi = g[i]
        mi = m[i] + (gi - m[i]) * one_b1
        vi = v[i] + (gi * gi - v[i]) * one_b2
        m[i], v[i] = mi, vi
        w[i] = wi - mi * alpha / (np.sqrt(vi) + eps32)


def update_numpy(w, g, m, v, lr, beta1, beta2, eps, t, weight_decay):
    if not g.shape == m.shape == v.shape == w.shape:
        raise ValueError("adamw: w, g, m and v differ in size")
    if t < 1:
        raise ValueError("adamw: t counts updates including this one, so t >= 1")
    alpha = np.float32(lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t))
    w -= w * np.float32(weight_decay) * np.float32(lr)
    m += (g - m) * np.float32(1.0 - beta1)
    v += (g * g - v) * np.float32(1.0 - beta2)
    w -= m * alpha / (np.sqrt(v) + np.float32(eps))
