"""RMSprop as Keras 3 runs it (keras.optimizers.RMSprop), with optional L2 weight decay.

    g' = g + wd * w                              (pserver's coupled L2; wd = 0 is Keras's rule)
    v  = rho * v + (1 - rho) * g'^2
    a  = rho * a + (1 - rho) * g'                (centered only)
    d  = v - a^2 + eps   if centered   else   v + eps
    u  = lr * g' / sqrt(d)
    mo = mu * mo + u;  w -= mo                   (momentum mu > 0)
    w -= u                                       (mu = 0)

eps sits inside the square root, as in Keras (not added to sqrt(v) as in Adam). The state
arrays take Keras's names: velocity (v), momentum (mo, only when mu > 0) and
average_gradient (a, only when centered). `update` is the numba kernel; `update_numpy` its
twin. In place on 1-D float32 arrays; an unused state array is passed empty.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def state_names(momentum: float, centered: bool) -> tuple[str, ...]:
    """The state arrays this configuration keeps (Keras allocates the same ones)."""
    return ("velocity",) + ("momentum",) * (momentum > 0) + ("average_gradient",) * bool(centered)


@njit(cache=True, nogil=True, error_model="numpy")
def update(w, g, v, mo, a, lr, rho, mu, eps, centered, weight_decay):
    n = w.shape[0]
    # numba does not bounds-check: a short g or state array would be read past its end.
    if g.shape[0] != n or v.shape[0] != n or (mu > 0 and mo.shape[0] != n) \
            or (centered and a.shape[0] != n):
        raise ValueError("rmsprop: w, g and the state arrays differ in size")
    rho32, one_rho = np.float32(rho), np.float32(1.0 - rho)
    lr32, mu32, eps32, wd32 = np.float32(lr), np.float32(mu), np.float32(eps), np.float32(weight_decay)
    # Hogwild! (Niu et al. 2011): in async mode several threads run this on the same arrays at
    # once with no lock; the races between them are deliberate.
    for i in range(n):
        gi = g[i] + wd32 * w[i]
        vi = rho32 * v[i] + one_rho * (gi * gi)
        v[i] = vi
        if centered:
            ai = rho32 * a[i] + one_rho * gi
            a[i] = ai
            d = vi - ai * ai + eps32
        else:
            d = vi + eps32
        u = lr32 * gi / np.sqrt(d)
        if mu > 0:
            u = mu32 * mo[i] + u
            mo[i] = u
        w[i] -= u


def update_numpy(w, g, v, mo, a, lr, rho, mu, eps, centered, weight_decay):
    if g.shape != w.shape or v.shape != w.shape or (mu > 0 and mo.shape != w.shape) \
            or (centered and a.shape != w.shape):
        raise ValueError("rmsprop: w, g and the state arrays differ in size")
    rho32, one_rho = np.float32(rho), np.float32(1.0 - rho)
    g = g + np.float32(weight_decay) * w
    v[:] = rho32 * v + one_rho * (g * g)
    if centered:
        a[:] = rho32 * a + one_rho * g
        d = v - a * a + np.float32(eps)
    else:
        d = v + np.float32(eps)
    u = np.float32(lr) * g / np.sqrt(d)
    if mu > 0:
        mo[:] = np.float32(mu) * mo + u
        u = mo
    w -= u
