"""Row-wise optimizers that a shard runs over the rows a push touched, and only those.

A table keeps each row and its optimizer slots side by side in one float32 matrix `data`:
columns [0, dim) are the row (the weights), then one block of dim columns per slot, in the
order of its RowRule's `slots`. So data[r, :dim] is row r, data[r, dim:2 dim] its first slot, and
one row's whole state is contiguous (one pass over memory per touched row). Adam also keeps a per-row
step count in `steps` (int64).

Every step takes row numbers `idx` (int64, -1 = skip that gradient: an id not admitted),
gradients `grads` (float32 (n, dim), one row per idx, distinct rows) and `scale` (the
gradients are multiplied by it first):

    sgd      w -= lr * g
    adagrad  a += g^2;  w -= lr * g / (sqrt(a) + eps)              a starts at initial_accumulator
    adam     t += 1 (this row's own count: lazy Adam, untouched rows neither move nor count)
             m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
             w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    ftrl     FTRL-Proximal (McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches",
             algorithm 1, with alpha = lr and a general lr_power p, -0.5 in the paper):
             sigma = ((n + g^2)^-p - n^-p) / lr;  z += g - sigma w;  n += g^2
             w = 0 if |z| <= l1, else -(z - sign(z) l1) / ((beta + n^-p) / lr + l2)
             (z and n start at 0: the initial row enters z through sigma w at its first step)

Each optimizer is one RowRule subclass in ROWS: its slots, hyper-parameters with their defaults
and ranges, and its kernels. Each kernel is numba (nogil), a module-level function (so numba's
cache finds it); `*_numpy` is its twin. The kernels trust their arguments:
SparseTable checks them once. Touched rows lie anywhere in a large table, so each kernel
prefetches the row it will update index.AHEAD entries later (a hint: the values are the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from pserver.errors import ConfigError
from pserver.registry import Registry
from pserver.sparse.index import prefetch_ahead


@dataclass(frozen=True)
class Param:
    """A hyper-parameter besides lr: its default and the range it must lie in."""
    default: float
    rule: str                       # the range in words, for errors: "> 0", "in [0, 1)"
    ok: Callable[[float], bool]


def nonnegative(default: float) -> Param:
    return Param(default, ">= 0", lambda v: v >= 0)


def unit(default: float) -> Param:
    return Param(default, "in [0, 1)", lambda v: 0 <= v < 1)


LR = Param(0.05, "> 0", lambda v: v > 0)     # every optimizer's (TableConfig.lr's default)


class RowRule:
    """One row optimizer: what a table keeps per row for it and the kernels that step it.

    A subclass per optimizer sets the class attributes and is registered in ROWS; everything
    else (SparseTable, its checkpoints, the config checks, the CLI) asks it rather than its name.
    """

    name = ""
    summary = ""
    slots: tuple[str, ...] = ()     # one block of dim columns each, after the row, in this order
    second_moments: tuple[str, ...] = ()   # slots summing or averaging g^2 (>= 0): float16 keeps their root
    params: dict[str, Param] = {}   # hyper-parameters besides lr, with their defaults
    kernel_params: tuple[str, ...] = ("lr",)   # what the kernels take after scale, in order
    kernels: tuple = ()             # (the numba kernel, its NumPy twin), module-level functions
    counts_steps = False            # keeps a per-row step count in `steps` (int64)

    @classmethod
    def initial_slots(cls, h: dict) -> tuple[float, ...]:
        """The value every column of each slot of a new row starts at, given the checked values."""
        return (0.0,) * len(cls.slots)

    @classmethod
    def check(cls, h: dict, what: str) -> None:
        """Checks across parameters, after each one's range (none by default)."""


ROWS = Registry("row optimizer", "--row-optimizer")


def hyper(name: str, lr: float, params: dict, what: str = "optimizer") -> dict:
    """lr and every hyper-parameter of optimizer `name`, defaults filled in, all checked."""
    rule = ROWS.get(name, what)
    unknown = sorted(set(params) - set(rule.params))
    if unknown:
        raise ConfigError(f"{what}: {name} takes no parameter {unknown[0]!r}; it takes "
                          f"{sorted(rule.params) or 'none besides lr'}")
    values = {"lr": lr, **{k: p.default for k, p in rule.params.items()}, **params}
    for key, v in values.items():
        p = LR if key == "lr" else rule.params[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not p.ok(v):
            raise ConfigError(f"{what}: {name} {key} must be a finite number {p.rule}, got {v!r}")
    rule.check(values, what)
    return {k: float(v) for k, v in values.items()}


def parse_params(text: str, what: str = "--row-params") -> dict:
    """KEY=VALUE[,KEY=VALUE...] (the form of --row-params) as {key: float}; "" is {}. Whether
    the optimizer takes each key, and its range, are hyper()'s to check."""
    params = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, eq, value = (t.strip() for t in item.partition("="))
        if not eq or not key:
            raise ConfigError(f"{what}: {item!r} is not KEY=VALUE (e.g. initial_accumulator=1e-6,eps=1e-8)")
        if key in params:
            raise ConfigError(f"{what}: {key} is given twice")
        try:
            params[key] = float(value)
        except ValueError:
            raise ConfigError(f"{what}: {key}={value!r} is not a number") from None
    return params


# -- row blocks ----------------------------------------------------------------------------------
# adagrad and adam update a row's blocks in scratch arrays of their own: with no aliasing between
# what they read and write, and error_model="numpy" (a division needs no zero check: numpy's
# semantics, the twins'), LLVM vectorizes the sqrt and the division (timings:
# bench/results/sparse/notes.md).

@njit(cache=True, nogil=True, inline="always")
def _load(data, r, block, out):
    """out[:] = block `block` of row r (0: the weights, k: the k-th slot), one block per loop."""
    at = block * out.shape[0]
    for j in range(out.shape[0]):
        out[j] = data[r, at + j]


@njit(cache=True, nogil=True, inline="always")
def _store(data, r, block, src):
    """The inverse of _load."""
    at = block * src.shape[0]
    for j in range(src.shape[0]):
        data[r, at + j] = src[j]


# -- sgd -----------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def sgd(data, steps, idx, grads, scale, lr):
    d, s, lr32 = grads.shape[1], np.float32(scale), np.float32(lr)
    for i in range(idx.shape[0]):
        prefetch_ahead(data, idx, i)
        r = idx[i]
        if r >= 0:
            for j in range(d):
                data[r, j] -= lr32 * (grads[i, j] * s)


def sgd_numpy(data, steps, idx, grads, scale, lr):
    rows, g = _touched(idx, grads, scale)
    d = grads.shape[1]
    data[rows, :d] -= np.float32(lr) * g


def _touched(idx, grads, scale):
    """(row numbers, their scaled float32 gradients) of the admitted entries of idx."""
    keep = idx >= 0
    return idx[keep], grads[keep] * np.float32(scale)


@ROWS.register
class SGD(RowRule):
    name, summary = "sgd", "w -= lr * g, no slots"
    kernels = (sgd, sgd_numpy)


# -- adagrad -------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, error_model="numpy")
def adagrad(data, steps, idx, grads, scale, lr, eps):
    d, s = grads.shape[1], np.float32(scale)
    lr32, eps32 = np.float32(lr), np.float32(eps)
    w, a = np.empty(d, np.float32), np.empty(d, np.float32)
    for i in range(idx.shape[0]):
        prefetch_ahead(data, idx, i)
        r = idx[i]
        if r >= 0:
            _load(data, r, 0, w)
            _load(data, r, 1, a)
            for j in range(d):
                g = grads[i, j] * s
                a[j] += g * g
                w[j] -= lr32 * g / (np.sqrt(a[j]) + eps32)
            _store(data, r, 0, w)
            _store(data, r, 1, a)


def adagrad_numpy(data, steps, idx, grads, scale, lr, eps):
    rows, g = _touched(idx, grads, scale)
    d = grads.shape[1]
    a = data[rows, d:2 * d] + g * g
    data[rows, d:2 * d] = a
    data[rows, :d] -= np.float32(lr) * g / (np.sqrt(a) + np.float32(eps))


@ROWS.register
class Adagrad(RowRule):
    name, summary = "adagrad", "a per-value sum of squared gradients scales each step"
    slots = ("accumulator",)
    second_moments = ("accumulator",)
    # MXNet's defaults: an accumulator that starts at 0, so the first step is lr g / (|g| + eps).
    # A row's gradient is of its batch's mean loss, of order 1 / batch: Keras's initial
    # accumulator of 0.1 is larger than a row's g^2 for thousands of steps and shrank every row
    # step about 100-fold at batch 512 (lr sync on 1M criteo-synthetic samples: test AUC 0.762
    # at row lr 0.05, 0.856 with 0).
    params = {"initial_accumulator": nonnegative(0.0), "eps": nonnegative(1e-7)}
    kernel_params = ("lr", "eps")
    kernels = (adagrad, adagrad_numpy)

    @classmethod
    def initial_slots(cls, h):
        return (h["initial_accumulator"],)

    @classmethod
    def check(cls, h, what):
        if h["initial_accumulator"] == 0 and h["eps"] == 0:
            raise ConfigError(f"{what}: adagrad needs initial_accumulator > 0 or eps > 0 "
                              f"(a zero gradient would divide 0 by 0)")


# -- adam ----------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, error_model="numpy")
def adam(data, steps, idx, grads, scale, lr, beta1, beta2, eps):
    d, s = grads.shape[1], np.float32(scale)
    b1, b2 = np.float32(beta1), np.float32(beta2)
    one_b1, one_b2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    lr32, eps32 = np.float32(lr), np.float32(eps)
    w, m, v = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
    for i in range(idx.shape[0]):
        prefetch_ahead(data, idx, i)
        r = idx[i]
        if r < 0:
            continue
        t = steps[r] + 1
        steps[r] = t
        # Bias corrections in float64 (beta2**t is close to 1 for small t), used as float32.
        inv_c1 = np.float32(1.0 / (1.0 - beta1 ** t))
        inv_c2 = np.float32(1.0 / (1.0 - beta2 ** t))
        _load(data, r, 0, w)
        _load(data, r, 1, m)
        _load(data, r, 2, v)
        for j in range(d):
            g = grads[i, j] * s
            m[j] = b1 * m[j] + one_b1 * g
            v[j] = b2 * v[j] + one_b2 * (g * g)
            w[j] -= lr32 * (m[j] * inv_c1) / (np.sqrt(v[j] * inv_c2) + eps32)
        _store(data, r, 0, w)
        _store(data, r, 1, m)
        _store(data, r, 2, v)


def adam_numpy(data, steps, idx, grads, scale, lr, beta1, beta2, eps):
    rows, g = _touched(idx, grads, scale)
    d = grads.shape[1]
    steps[rows] += 1
    t = steps[rows].astype(np.float64)[:, None]
    inv_c1 = (1.0 / (1.0 - beta1 ** t)).astype(np.float32)
    inv_c2 = (1.0 / (1.0 - beta2 ** t)).astype(np.float32)
    m = np.float32(beta1) * data[rows, d:2 * d] + np.float32(1.0 - beta1) * g
    v = np.float32(beta2) * data[rows, 2 * d:3 * d] + np.float32(1.0 - beta2) * (g * g)
    data[rows, d:2 * d], data[rows, 2 * d:3 * d] = m, v
    data[rows, :d] -= np.float32(lr) * (m * inv_c1) / (np.sqrt(v * inv_c2) + np.float32(eps))


@ROWS.register
class Adam(RowRule):
    name, summary = "adam", "Adam, lazy: each row counts and bias-corrects its own steps"
    slots = ("m", "v")
    second_moments = ("v",)
    params = {"beta1": unit(0.9), "beta2": unit(0.999), "eps": nonnegative(1e-8)}   # Keras's
    kernel_params = ("lr", "beta1", "beta2", "eps")
    kernels = (adam, adam_numpy)
    counts_steps = True


# -- ftrl ----------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _root(n, power):
    """n ** -power (power <= 0), with sqrt for the paper's -0.5."""
    return math.sqrt(n) if power == -0.5 else n ** -power


@njit(cache=True, nogil=True)
def ftrl(data, steps, idx, grads, scale, lr, beta, l1, l2, lr_power):
    # In float64 (sigma is a difference of nearly equal roots), stored as float32.
    d = grads.shape[1]
    for i in range(idx.shape[0]):
        prefetch_ahead(data, idx, i)
        r = idx[i]
        if r < 0:
            continue
        for j in range(d):
            g = np.float64(grads[i, j] * np.float32(scale))
            n_old = np.float64(data[r, 2 * d + j])
            n = n_old + g * g
            root = _root(n, lr_power)
            z = data[r, d + j] + g - (root - _root(n_old, lr_power)) / lr * data[r, j]
            w = 0.0
            if abs(z) > l1:
                w = -(z - math.copysign(l1, z)) / ((beta + root) / lr + l2)
            data[r, j], data[r, d + j], data[r, 2 * d + j] = w, z, n


def ftrl_numpy(data, steps, idx, grads, scale, lr, beta, l1, l2, lr_power):
    rows, g = _touched(idx, grads, scale)
    d = grads.shape[1]
    g = g.astype(np.float64)
    n_old = data[rows, 2 * d:3 * d].astype(np.float64)
    n = n_old + g * g
    root = n ** -lr_power
    z = data[rows, d:2 * d] + g - (root - n_old ** -lr_power) / lr * data[rows, :d]
    w = np.where(np.abs(z) > l1, -(z - np.sign(z) * l1) / ((beta + root) / lr + l2), 0.0)
    data[rows, :d], data[rows, d:2 * d], data[rows, 2 * d:3 * d] = w, z, n




@ROWS.register
class FTRL(RowRule):
    name, summary = "ftrl", "FTRL-Proximal (McMahan et al. 2013), whose l1 makes rows exactly 0"
    slots = ("z", "n")
    second_moments = ("n",)
    params = {"beta": nonnegative(1.0), "l1": nonnegative(0.0), "l2": nonnegative(0.0),   # the paper's
              "lr_power": Param(-0.5, "<= 0", lambda v: v <= 0)}
    kernel_params = ("lr", "beta", "l1", "l2", "lr_power")
    kernels = (ftrl, ftrl_numpy)


ROW_OPTIMIZERS = ROWS.names()
SLOTS = {name: ROWS.get(name).slots for name in ROWS}


class RowOptimizer:
    """A row optimizer with its checked hyper-parameters; `step` runs the kernel (or its twin)."""

    def __init__(self, name: str, lr: float, params: dict, backend: str = "numba",
                 what: str = "optimizer"):
        self.rule = ROWS.get(name, what)
        self.name, self.h = name, hyper(name, lr, params, what)
        self.slots, self.counts_steps = self.rule.slots, self.rule.counts_steps
        self.second_moments = tuple(k for k, s in enumerate(self.slots) if s in self.rule.second_moments)
        self.initial = self.rule.initial_slots(self.h)
        kernel, twin = self.rule.kernels
        self._step = kernel if backend == "numba" else twin
        self._args = tuple(self.h[k] for k in self.rule.kernel_params)

    def width(self, dim: int) -> int:
        """Columns of `data` per row: the row and its slots."""
        return dim * (1 + len(self.slots))

    def step(self, data, steps, idx, grads, scale: float) -> None:
        self._step(data, steps, idx, grads, float(scale), *self._args)
