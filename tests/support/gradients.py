"""A model's gradient against central finite differences of its loss (float64, the NumPy twins)."""

from __future__ import annotations

import numpy as np


def grad_and_fd(model, x, y, seed=0, eps=1e-6, step=0):
    """The model's gradient and central finite differences of its loss, in float64; every
    call with the step seed `step` (the same dropout masks)."""
    model.use_backend("reference")
    w = model.init_params(seed).astype(np.float64)
    w += np.random.default_rng(seed).normal(0, 0.1, w.shape)     # no zero bias, no tie at a kink
    g = np.zeros_like(w)
    model.loss_and_grad(w, x, y, g, seed=step)
    fd = np.empty_like(w)
    for j in range(w.size):
        e = np.zeros_like(w)
        e[j] = eps
        fd[j] = (model.loss_and_grad(w + e, x, y, np.zeros_like(w), seed=step)
                 - model.loss_and_grad(w - e, x, y, np.zeros_like(w), seed=step)) / (2 * eps)
    return g, fd


def assert_fd(model, x, y, seed=0, step=0):
    g, fd = grad_and_fd(model, x, y, seed, step=step)
    assert np.allclose(g, fd, rtol=1e-5, atol=1e-7), np.abs(g - fd).max()


def assert_directional(loss, x, params: dict, dx, grads: dict, rng, eps: float = 1e-6) -> None:
    """A layer's gradients against central differences of loss(params, x) along one random
    direction of x and of each weight (float64): <grad, d> = (loss(v + eps d) - loss(v - eps d)) / 2 eps."""
    for name, value in [("x", x), *params.items()]:
        d = rng.standard_normal(value.shape)
        at = (lambda v: loss(params, v)) if name == "x" else (lambda v: loss({**params, name: v}, x))
        fd = (at(value + eps * d) - at(value - eps * d)) / (2 * eps)
        got = np.sum((dx if name == "x" else grads[name]) * d)
        assert abs(fd - got) <= 1e-6 * (1 + abs(fd)), name
