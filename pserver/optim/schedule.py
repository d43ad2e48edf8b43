"""Learning-rate schedules: a multiplier of the base lr as a function of the step.

The step is the shard's version before the update (0-based), so every shard of a model, and a
restarted shard, agree on the rate without any state of their own.

    constant                          1
    step:EVERY,GAMMA                  GAMMA ** (step // EVERY)
    warmup:STEPS                      (step + 1) / STEPS for the first STEPS steps, then 1
    cosine:TOTAL[,ALPHA[,WARMUP,START]]  Keras's CosineDecay (below)
    exponential:STEPS,RATE[,staircase]   Keras's ExponentialDecay: RATE ** (step / STEPS)
    inverse_time:STEPS,RATE[,staircase]  Keras's InverseTimeDecay: 1 / (1 + RATE * step / STEPS)
    piecewise:M0,B1,M1,...,Bk,Mk      Keras's PiecewiseConstantDecay: M0 until step B1, ...

The Keras forms are Keras's formulas (keras/src/optimizers/schedules) divided by the base lr:
pserver.keras.optimizers.schedules writes them, with lr set to the schedule's base rate.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

from pserver.errors import ConfigError
from pserver.registry import Registry

SCHEDULES = Registry("lr schedule", "--lr-schedule")   # the classes below, by name


@SCHEDULES.register
@dataclass(frozen=True)
class Constant:
    name, form = "constant", "constant"
    summary = "1: the base lr throughout (the default)"

    def __call__(self, step: int) -> float:
        return 1.0

    @classmethod
    def parse(cls, spec: str, parts: list[str]) -> Constant:
        _arity(spec, parts, 0, cls.form)
        return cls()

    @property
    def spec(self) -> str:
        return "constant"


@SCHEDULES.register
@dataclass(frozen=True)
class StepDecay:
    name, form = "step", "step:EVERY,GAMMA"
    summary = "GAMMA ** (step // EVERY)"

    every: int
    gamma: float

    def __call__(self, step: int) -> float:
        return self.gamma ** (step // self.every)

    @classmethod
    def parse(cls, spec, parts):
        _arity(spec, parts, 2, cls.form)
        gamma = _number(spec, parts[1], float)
        if not 0 < gamma <= 1:
            _bad(spec, "GAMMA must be in (0, 1]")
        return cls(_count(spec, parts[0], "EVERY"), gamma)

    @property
    def spec(self):
        return f"step:{self.every},{self.gamma!r}"


@SCHEDULES.register
@dataclass(frozen=True)
class Warmup:
    name, form = "warmup", "warmup:STEPS"
    summary = "(step + 1) / STEPS for the first STEPS steps, then 1"

    steps: int

    def __call__(self, step: int) -> float:
        # step 0 already trains, at 1/STEPS of the rate, rather than wasting a step at 0.
        return min(1.0, (step + 1) / self.steps)

    @classmethod
    def parse(cls, spec, parts):
        _arity(spec, parts, 1, cls.form)
        return cls(_count(spec, parts[0], "STEPS"))

    @property
    def spec(self):
        return f"warmup:{self.steps}"


@SCHEDULES.register
@dataclass(frozen=True)
class Cosine:
    name, form = "cosine", "cosine:TOTAL[,ALPHA[,WARMUP,START]]"
    summary = ("Keras's CosineDecay: START + (1 - START) * step / WARMUP for WARMUP steps, then "
               "(1 - ALPHA) * 0.5 * (1 + cos(pi * s / TOTAL)) + ALPHA, s = min(step - WARMUP, TOTAL)")

    total: int
    alpha: float = 0.0
    warmup: int = 0
    start: float = 1.0     # the rate at step 0 of the warmup, as a fraction of the base lr

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.start + (1.0 - self.start) * step / self.warmup
        s = min(step - self.warmup, self.total)
        return (1.0 - self.alpha) * 0.5 * (1.0 + math.cos(math.pi * s / self.total)) + self.alpha

    @classmethod
    def parse(cls, spec, parts):
        if len(parts) not in (1, 2, 4):
            _bad(spec, "expected cosine:TOTAL[,ALPHA[,WARMUP,START]]")
        alpha = _number(spec, parts[1], float) if len(parts) > 1 else 0.0
        if not 0 <= alpha <= 1:
            _bad(spec, "ALPHA must be in [0, 1]")
        warmup, start = 0, 1.0
        if len(parts) == 4:
            warmup, start = _number(spec, parts[2], int), _number(spec, parts[3], float)
            if warmup < 0 or start < 0:
                _bad(spec, "WARMUP and START must be >= 0")
        return cls(_count(spec, parts[0], "TOTAL"), alpha, warmup, start)

    @property
    def spec(self):
        tail = f",{self.warmup},{self.start!r}" if (self.warmup, self.start) != (0, 1.0) else ""
        return f"cosine:{self.total},{self.alpha!r}{tail}"


@SCHEDULES.register
@dataclass(frozen=True)
class Exponential:
    name, form = "exponential", "exponential:STEPS,RATE[,staircase]"
    summary = "Keras's ExponentialDecay: RATE ** (step / STEPS), the exponent floored with staircase"

    steps: float
    rate: float
    staircase: bool = False

    def __call__(self, step: int) -> float:
        return self.rate ** _progress(step, self.steps, self.staircase)

    @classmethod
    def parse(cls, spec, parts):
        return cls(*_decay_args(spec, parts))

    @property
    def spec(self):
        return f"{self.name}:{self.steps!r},{self.rate!r}" + (",staircase" if self.staircase else "")


@SCHEDULES.register
@dataclass(frozen=True)
class InverseTime(Exponential):
    name, form = "inverse_time", "inverse_time:STEPS,RATE[,staircase]"
    summary = "Keras's InverseTimeDecay: 1 / (1 + RATE * step / STEPS), step / STEPS floored with staircase"

    def __call__(self, step: int) -> float:
        return 1.0 / (1.0 + self.rate * _progress(step, self.steps, self.staircase))


@SCHEDULES.register
@dataclass(frozen=True)
class Piecewise:
    name, form = "piecewise", "piecewise:M0,B1,M1,...,Bk,Mk"
    summary = "Keras's PiecewiseConstantDecay: M0 while step <= B1, M1 while step <= B2, ..., then Mk"

    boundaries: tuple[int, ...]
    values: tuple[float, ...]

    def __call__(self, step: int) -> float:
        # Keras's: values[i] for boundaries[i-1] < step <= boundaries[i].
        return self.values[bisect.bisect_left(self.boundaries, step)]

    @classmethod
    def parse(cls, spec, parts):
        if len(parts) < 3 or len(parts) % 2 == 0:
            _bad(spec, "expected piecewise:M0,B1,M1,...,Bk,Mk (k >= 1)")
        values = tuple(_number(spec, p, float) for p in parts[0::2])
        boundaries = tuple(_number(spec, p, int) for p in parts[1::2])
        if any(v < 0 for v in values):
            _bad(spec, "each M must be >= 0")
        if any(a >= b for a, b in zip(boundaries, boundaries[1:])):
            _bad(spec, "the boundaries B must increase")
        return cls(boundaries, values)

    @property
    def spec(self):
        items = [repr(self.values[0])]
        for b, v in zip(self.boundaries, self.values[1:]):
            items += [str(b), repr(v)]
        return "piecewise:" + ",".join(items)


def _progress(step: int, steps: float, staircase: bool) -> float:
    p = step / steps
    return math.floor(p) if staircase else p


def _decay_args(spec: str, parts: list[str]) -> tuple[float, float, bool]:
    """STEPS, RATE and staircase of exponential and inverse_time."""
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "staircase"):
        _bad(spec, "expected STEPS,RATE or STEPS,RATE,staircase")
    steps, rate = _number(spec, parts[0], float), _number(spec, parts[1], float)
    if steps <= 0 or rate < 0:
        _bad(spec, "STEPS must be > 0 and RATE >= 0")
    return steps, rate, len(parts) == 3


def parse_schedule(spec: str) -> Callable[[int], float]:
    """The schedule for a `--lr-schedule` spec; a bad spec raises ConfigError quoting it."""
    text = spec.strip().lower() if isinstance(spec, str) else ""
    kind, colon, args = text.partition(":")
    parts = [a.strip() for a in args.split(",")] if colon else []
    if kind not in SCHEDULES:
        _bad(spec, f"expected one of {', '.join(SCHEDULES.forms())}")
    return SCHEDULES.get(kind).parse(spec, parts)


def _arity(spec: str, parts: list[str], n: int, form: str) -> None:
    if len(parts) != n:
        _bad(spec, f"expected {form}")


def _count(spec: str, text: str, what: str) -> int:
    value = _number(spec, text, int)
    if value < 1:
        _bad(spec, f"{what} must be a positive integer")
    return value


def _number(spec: str, text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        _bad(spec, f"{text!r} is not {'an integer' if kind is int else 'a number'}")
    if not math.isfinite(value):
        _bad(spec, f"{text!r} is not finite")
    return value


def _bad(spec, why: str):
    raise ConfigError(f"--lr-schedule: bad schedule {spec!r}: {why}")
