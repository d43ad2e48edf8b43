"""Learning-rate schedules: a multiplier of the base lr as a function of the step.

The step is the shard's version before the update (0-based), so every shard of a model, and a
restarted shard, agree on the rate without any state of their own.

    constant            1
    step:EVERY,GAMMA    GAMMA ** (step // EVERY)
    warmup:STEPS        (step + 1) / STEPS for the first STEPS steps, then 1
    cosine:TOTAL        0.5 * (1 + cos(pi * step / TOTAL)) until TOTAL, then 0
"""

from __future__ import annotations

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


@SCHEDULES.register
@dataclass(frozen=True)
class StepDecay:
    name, form = "step", "step:EVERY,GAMMA"
    summary = "GAMMA ** (step // EVERY)"

    every: int
    gamma: float

    def __call__(self, step: int) -> float:
        return self.gamma ** (step // self.every)


@SCHEDULES.register
@dataclass(frozen=True)
class Warmup:
    name, form = "warmup", "warmup:STEPS"
    summary = "(step + 1) / STEPS for the first STEPS steps, then 1"

    steps: int

    def __call__(self, step: int) -> float:
        # step 0 already trains, at 1/STEPS of the rate, rather than wasting a step at 0.
        return min(1.0, (step + 1) / self.steps)


@SCHEDULES.register
@dataclass(frozen=True)
class Cosine:
    name, form = "cosine", "cosine:TOTAL"
    summary = "0.5 * (1 + cos(pi * step / TOTAL)) until TOTAL, then 0"

    total: int

    def __call__(self, step: int) -> float:
        if step >= self.total:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * step / self.total))


def parse_schedule(spec: str) -> Callable[[int], float]:
    """The schedule for a `--lr-schedule` spec; a bad spec raises ConfigError quoting it."""
    text = spec.strip().lower() if isinstance(spec, str) else ""
    kind, _, args = text.partition(":")
    parts = [a.strip() for a in args.split(",")] if args else []
    if kind == "constant" and not args:
        return Constant()
    if kind == "step" and len(parts) == 2:
        gamma = _number(spec, parts[1], float)
        if not 0 < gamma <= 1:
            _bad(spec, "GAMMA must be in (0, 1]")
        return StepDecay(_count(spec, parts[0], "EVERY"), gamma)
    if kind == "warmup" and len(parts) == 1:
        return Warmup(_count(spec, parts[0], "STEPS"))
    if kind == "cosine" and len(parts) == 1:
        return Cosine(_count(spec, parts[0], "TOTAL"))
    _bad(spec, f"expected one of {', '.join(SCHEDULES.forms())}")


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
