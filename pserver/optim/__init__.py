"""Optimizers that a shard runs over its 1-D float32 slice of the parameters.

    sgd        w -= lr * g
    momentum   heavy-ball or Nesterov momentum            state: v
    adam       Adam with bias correction                  state: m, v
    adamw      Keras's AdamW: decoupled weight decay      state: m, v
    rmsprop    Keras's RMSprop (momentum, centered)       state: velocity, momentum, average_gradient
    adagrad    Keras's Adagrad                            state: accumulator

Each rule lives in its own module as a numba kernel (`update`) and a NumPy twin
(`update_numpy`); the classes here hold the hyper-parameters and the state arrays, pick the
kernel by `backend` ("numba" or "numpy"), and scale lr by the schedule at each step. The
kernels compile with error_model="numpy": under numba's default every division checks its
divisor for zero, which keeps LLVM from vectorizing the loop (Adam over the reference CNN's
347,146 weights: 0.902 -> 0.128 ms, bit for bit the same; bench/optim_kernels.py).
--weight-decay is L2 added to the gradient (coupled) for every rule but adamw's, where it is
decoupled, as Keras's AdamW. --clipvalue clips the step's gradient element-wise before the rule
(Keras's clipvalue, on the aggregated gradient). --momentum, --eps and --weight-decay left unset take the
optimizer's own default (`Optimizer.defaults`: Keras's for rmsprop, adamw and adagrad).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from pserver.errors import ConfigError
from pserver.optim import adagrad, adam, adamw, momentum, rmsprop, sgd
from pserver.optim.schedule import SCHEDULES, parse_schedule
from pserver.registry import Registry

OPTIMIZERS = Registry("optimizer", "--optimizer")   # the classes below, by name
OPTIM_BACKENDS = ("numba", "numpy")
# Above this many elements a step is split into contiguous pieces run on several threads.
# The kernels are element-wise and release the GIL, so the pieces run truly in parallel
# and the result is bit-identical to one call. (numba's parallel=True is not used: its
# default threading layer aborts when several gRPC threads call in at once, as Hogwild does.)
PARALLEL_MIN_ELEMENTS = 1 << 20
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="optim")
    return _POOL


class Optimizer:
    """An update rule with its state for `size` elements; `step` applies it in place."""

    name = ""
    summary = ""  # one line for OPTIMIZERS' table
    rule = sgd  # the module with update / update_numpy / STATE
    state_hint = "another --optimizer"  # what makes a checkpoint's state arrays differ from this one's
    # The values of the flags several rules share, when not given (None): see with_defaults.
    defaults = {"momentum": 0.9, "eps": 1e-8, "weight_decay": 0.0}

    def __init__(self, size: int, *, lr: float, schedule: Callable[[int], float],
                 weight_decay: float = 0.0, clipvalue: float = 0.0, backend: str = "numba"):
        self.size, self.lr, self.schedule = int(size), float(lr), schedule
        self.weight_decay, self.backend = float(weight_decay), backend
        self.clipvalue = float(clipvalue)     # 0: no clipping
        self._update = self.rule.update if backend == "numba" else self.rule.update_numpy
        # Live state arrays (not copies): the server checkpoints them, load_state refills them.
        self.state = {k: np.zeros(self.size, dtype=np.float32) for k in self.state_names()}
        # The [start, end) ranges a step updates: all of it but the frozen (non-trainable) weights.
        self.ranges: tuple[tuple[int, int], ...] = ((0, self.size),)

    def freeze(self, frozen) -> None:
        """Leave the [start, end) ranges of `frozen` (sorted, disjoint, within the slice) as they
        are, and their state: Keras's non-trainable weights, a frozen layer's."""
        ranges, at = [], 0
        for a, b in frozen:
            if a > at:
                ranges.append((at, a))
            at = max(at, b)
        if at < self.size:
            ranges.append((at, self.size))
        self.ranges = tuple(ranges)

    def state_names(self) -> tuple[str, ...]:
        """The state arrays this optimizer keeps (and checkpoints, by these names)."""
        return self.rule.STATE

    @classmethod
    def checked(cls, size: int, common: dict, *, nesterov: bool, **_) -> Optimizer:
        """This optimizer from make_optimizer's arguments, after checking the ones it takes (and
        that it is not given --nesterov, which only momentum takes)."""
        _no_nesterov(cls.name, nesterov)
        return cls(size, **common)

    def step(self, w: np.ndarray, g: np.ndarray, t: int) -> None:
        """Apply update number t (0-based: the shard's version before it) to w, in place."""
        for what, a in (("w", w), ("g", g)):
            # The kernels trust sizes and dtypes; a float64 g would also compile a new variant.
            if a.dtype != np.float32 or a.shape != (self.size,):
                raise ValueError(f"{self.name}: {what} is {a.dtype}{list(a.shape)}, "
                                 f"needs float32[{self.size}]")
        t, lr = int(t), self.lr * self.schedule(int(t))
        if self.clipvalue:      # a copy: g may be the caller's (a push's buffer, a test's array)
            g = np.clip(g, np.float32(-self.clipvalue), np.float32(self.clipvalue))
        for a, b in self.ranges:
            self._apply_range(w, g, t, lr, a, b)

    def _apply_range(self, w, g, t, lr, start, end) -> None:
        """The rule on [start, end): on several threads when it is large (bit-identical)."""
        # os.cpu_count() reads /sys (11 us a call): asked only of a range large enough to split.
        large = self.backend == "numba" and end - start >= PARALLEL_MIN_ELEMENTS
        pieces = (os.cpu_count() or 1) if large else 1
        bounds = np.linspace(start, end, pieces + 1).astype(int) if pieces > 1 else [start, end]
        if (start, end) == (0, self.size) and len(bounds) == 2:
            self._apply(w, g, self.state, t, lr)          # the whole arrays: no views to make
            return
        parts = [(w[a:b], g[a:b], {k: v[a:b] for k, v in self.state.items()})
                 for a, b in zip(bounds, bounds[1:])]
        if len(parts) == 1:
            self._apply(*parts[0], t, lr)
            return
        for f in [_pool().submit(self._apply, *part, t, lr) for part in parts]:
            f.result()

    def _apply(self, w, g, state, t, lr):
        raise NotImplementedError

    def load_state(self, state: dict) -> None:
        """Copy checkpointed state arrays into this optimizer's, after checking them all."""
        if sorted(state) != sorted(self.state):
            raise ConfigError(f"optimizer state: {self.name} keeps {sorted(self.state)}, "
                              f"the checkpoint has {sorted(state)} (was it saved with {self.state_hint}?)")
        arrays = {k: np.asarray(v) for k, v in state.items()}
        for k, a in arrays.items():
            if a.shape != (self.size,) or a.dtype.kind != "f":
                raise ConfigError(f"optimizer state: {self.name} {k!r} is {a.dtype}"
                                  f"{list(a.shape)}, needs float32[{self.size}]")
        for k, a in arrays.items():
            np.copyto(self.state[k], a, casting="same_kind")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, lr={self.lr}, schedule={self.schedule})"


@OPTIMIZERS.register
class SGD(Optimizer):
    name, rule = "sgd", sgd
    summary = "w -= lr * (g + weight_decay * w)"

    def _apply(self, w, g, state, t, lr):
        self._update(w, g, lr, self.weight_decay)


@OPTIMIZERS.register
class Momentum(Optimizer):
    name, rule = "momentum", momentum
    summary = "heavy-ball momentum (--momentum), or Nesterov's (--nesterov)"

    def __init__(self, size, *, momentum: float = 0.9, nesterov: bool = False, **kw):
        super().__init__(size, **kw)
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    @classmethod
    def checked(cls, size, common, *, momentum, nesterov, **_):
        _check("--momentum", momentum, "in [0, 1)", lambda x: 0 <= x < 1)
        return cls(size, momentum=momentum, nesterov=nesterov, **common)

    def _apply(self, w, g, state, t, lr):
        self._update(w, g, state["v"], lr, self.momentum, self.nesterov, self.weight_decay)


@OPTIMIZERS.register
class Adam(Optimizer):
    name, rule = "adam", adam
    summary = "Adam with bias correction (--beta1, --beta2, --eps)"

    def __init__(self, size, *, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 **kw):
        super().__init__(size, **kw)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    @classmethod
    def checked(cls, size, common, *, nesterov, beta1, beta2, eps, **_):
        _no_nesterov(cls.name, nesterov)
        _check("--beta1", beta1, "in [0, 1)", lambda x: 0 <= x < 1)
        _check("--beta2", beta2, "in [0, 1)", lambda x: 0 <= x < 1)
        _check("--eps", eps, "a number > 0", lambda x: x > 0)
        return cls(size, beta1=beta1, beta2=beta2, eps=eps, **common)

    def _apply(self, w, g, state, t, lr):
        # The bias correction counts this update too: t + 1 >= 1.
        self._update(w, g, state["m"], state["v"], lr, self.beta1, self.beta2,
                     self.eps, t + 1, self.weight_decay)


@OPTIMIZERS.register
class AdamW(Adam):
    name, rule = "adamw", adamw
    summary = ("Keras's AdamW: Adam with decoupled weight decay w -= lr * wd * w "
               "(--weight-decay, default 0.004)")
    defaults = Adam.defaults | {"eps": 1e-7, "weight_decay": 0.004}   # Keras's


@OPTIMIZERS.register
class RMSprop(Optimizer):
    name, rule = "rmsprop", rmsprop
    summary = "Keras's RMSprop (--rho, --momentum, --eps, --centered)"
    defaults = Optimizer.defaults | {"momentum": 0.0, "eps": 1e-7}   # Keras's
    state_hint = "another --optimizer, or another --momentum (0 or not) or --centered"

    def __init__(self, size, *, rho: float = 0.9, momentum: float = 0.0, eps: float = 1e-7,
                 centered: bool = False, **kw):
        # Set before the base allocates the state: which arrays exist depends on them.
        self.rho, self.momentum, self.eps = float(rho), float(momentum), float(eps)
        self.centered = bool(centered)
        super().__init__(size, **kw)

    def state_names(self):
        return rmsprop.state_names(self.momentum, self.centered)

    @classmethod
    def checked(cls, size, common, *, nesterov, rho, momentum, eps, centered, **_):
        _no_nesterov(cls.name, nesterov)
        _check("--rho", rho, "in [0, 1)", lambda x: 0 <= x < 1)
        _check("--momentum", momentum, "in [0, 1)", lambda x: 0 <= x < 1)
        _check("--eps", eps, "a number > 0", lambda x: x > 0)
        return cls(size, rho=rho, momentum=momentum, eps=eps, centered=centered, **common)

    def _apply(self, w, g, state, t, lr):
        # An array the configuration does not keep goes in empty (the kernel never reads it).
        self._update(w, g, state["velocity"], state.get("momentum", _NONE),
                     state.get("average_gradient", _NONE), lr, self.rho, self.momentum, self.eps,
                     self.centered, self.weight_decay)


@OPTIMIZERS.register
class Adagrad(Optimizer):
    name, rule = "adagrad", adagrad
    summary = "Keras's Adagrad (--initial-accumulator, --eps)"
    defaults = Optimizer.defaults | {"eps": 1e-7}   # Keras's

    def __init__(self, size, *, initial_accumulator: float = 0.1, eps: float = 1e-7, **kw):
        super().__init__(size, **kw)
        self.initial_accumulator, self.eps = float(initial_accumulator), float(eps)
        self.state["accumulator"].fill(self.initial_accumulator)   # Keras starts it there, not at 0

    @classmethod
    def checked(cls, size, common, *, nesterov, initial_accumulator, eps, **_):
        _no_nesterov(cls.name, nesterov)
        _check("--initial-accumulator", initial_accumulator, "a number >= 0", lambda x: x >= 0)
        _check("--eps", eps, "a number > 0", lambda x: x > 0)
        return cls(size, initial_accumulator=initial_accumulator, eps=eps, **common)

    def _apply(self, w, g, state, t, lr):
        self._update(w, g, state["accumulator"], lr, self.eps, self.weight_decay)


_NONE = np.zeros(0, dtype=np.float32)   # a state array an optimizer's settings do not keep
SHARED = ("momentum", "eps", "weight_decay")   # flags several rules take, defaults per rule


def with_defaults(name: str, values: dict) -> dict:
    """`values` (flags by config field name) with each shared flag that is None (not given)
    at optimizer `name`'s default: --momentum is 0.9 for momentum but 0 for rmsprop, --eps
    1e-8 for adam but Keras's 1e-7 for the others, --weight-decay 0.004 for adamw."""
    defaults = OPTIMIZERS.get(name).defaults
    return values | {k: defaults[k] for k in SHARED if k in values and values[k] is None}


def make_optimizer(name: str, size: int, *, lr: float, schedule: str = "constant",
                   momentum: float | None = None, nesterov: bool = False, beta1: float = 0.9,
                   beta2: float = 0.999, eps: float | None = None, weight_decay: float | None = None,
                   rho: float = 0.9, centered: bool = False, initial_accumulator: float = 0.1,
                   clipvalue: float = 0.0, backend: str = "numba") -> Optimizer:
    """Build an optimizer by name; bad names and values raise ConfigError naming the flag.
    momentum, eps and weight_decay left None take the optimizer's defaults (with_defaults)."""
    cls = OPTIMIZERS.get(name)
    if backend not in OPTIM_BACKENDS:
        raise ConfigError(f"optimizer backend: unknown {backend!r}; "
                          f"choose one of {', '.join(OPTIM_BACKENDS)}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"optimizer size must be an integer >= 0, got {size!r}")
    shared = with_defaults(name, dict(momentum=momentum, eps=eps, weight_decay=weight_decay))
    _check("--lr", lr, "a number > 0", lambda x: x > 0)
    _check("--weight-decay", shared["weight_decay"], "a number >= 0", lambda x: x >= 0)
    _check("--clipvalue", clipvalue, "a number >= 0 (0: none)", lambda x: x >= 0)
    common = dict(lr=lr, schedule=parse_schedule(schedule), weight_decay=shared["weight_decay"],
                  clipvalue=clipvalue, backend=backend)
    return cls.checked(size, common, momentum=shared["momentum"], nesterov=nesterov, beta1=beta1,
                       beta2=beta2, eps=shared["eps"], rho=rho, centered=centered,
                       initial_accumulator=initial_accumulator)


def _check(flag: str, value, wanted: str, ok: Callable[[float], bool]) -> None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x) or not ok(x):
        raise ConfigError(f"{flag}: must be {wanted}, got {value!r}")


def _no_nesterov(name: str, nesterov: bool) -> None:
    if nesterov:
        raise ConfigError(f"--nesterov: applies to --optimizer momentum only, not {name!r}")


__all__ = ["OPTIMIZERS", "OPTIM_BACKENDS", "SCHEDULES", "Optimizer", "SGD", "Momentum", "Adam", "AdamW",
           "RMSprop", "Adagrad", "make_optimizer", "with_defaults", "parse_schedule"]
