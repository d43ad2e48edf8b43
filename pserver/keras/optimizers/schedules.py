"""keras.optimizers.schedules: Keras's learning-rate schedules by Keras's names, arguments and
defaults, evaluated on the shards.

A schedule given as an optimizer's `learning_rate` becomes the shards' `lr` and `lr_schedule`
(pserver.optim.schedule: the same formula as a multiplier of lr), which the shards evaluate at
the global step (docs/semantics.md). Calling one here gives the rate at a step, by that same
formula. A LearningRateSchedule of your own is Python the shards cannot run: the optimizer
refuses it (`on_shards`).
"""

from __future__ import annotations

import math

from pserver.errors import ConfigError
from pserver.keras._names import missing as _missing
from pserver.optim import schedule as shard


class LearningRateSchedule:
    """Keras's base class. A subclass of your own is refused by the optimizers: the shards
    evaluate the rate, and they run only the schedules of this module."""

    def __call__(self, step):
        raise NotImplementedError(f"{type(self).__name__} must override __call__(self, step)")

    def get_config(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must override get_config()")

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)

    def on_shards(self) -> tuple[float, object]:
        """(the shards' lr, their schedule: a multiplier of lr by step)."""
        raise ConfigError(f"learning_rate={type(self).__name__}(...): a LearningRateSchedule of your own "
                          "cannot run on the shards, which evaluate the rate at the global step; use "
                          f"one of {', '.join(BUILT_IN)} (docs/guide/keras.md)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.get_config()})"


class _Builtin(LearningRateSchedule):
    """A schedule the shards run: __call__ is the shards' formula times their lr."""

    def __call__(self, step):
        base, rule = self.on_shards()
        return base * rule(int(step))

    def get_config(self):
        return dict(self._config)

    def on_shards(self):
        return self._on_shards


class ExponentialDecay(_Builtin):
    """initial_learning_rate * decay_rate ** (step / decay_steps) (the exponent floored with
    staircase)."""
    _rule = shard.Exponential

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="ExponentialDecay"):
        self._config = dict(initial_learning_rate=initial_learning_rate, decay_steps=decay_steps,
                            decay_rate=decay_rate, staircase=staircase, name=name)
        steps = _number(self, "decay_steps", decay_steps, lambda x: x > 0, "> 0")
        rate = _number(self, "decay_rate", decay_rate, lambda x: x >= 0, ">= 0")
        self._on_shards = (_base(self, "initial_learning_rate", initial_learning_rate),
                           self._rule(steps, rate, bool(staircase)))


class InverseTimeDecay(ExponentialDecay):
    """initial_learning_rate / (1 + decay_rate * step / decay_steps) (step / decay_steps floored
    with staircase)."""
    _rule = shard.InverseTime

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="InverseTimeDecay"):
        super().__init__(initial_learning_rate, decay_steps, decay_rate, staircase, name)


class PiecewiseConstantDecay(_Builtin):
    """values[0] while step <= boundaries[0], values[i] while step <= boundaries[i], then
    values[-1]. The shards' lr is the largest value (each value a fraction of it)."""

    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        self._config = dict(boundaries=list(boundaries), values=list(values), name=name)
        if len(boundaries) != len(values) - 1 or not boundaries:
            raise ConfigError(f"PiecewiseConstantDecay: give one more value than boundaries (and at least "
                              f"one boundary), got boundaries={boundaries!r}, values={values!r}")
        bounds = [_number(self, "boundaries", b, lambda x: x == int(x), "integers") for b in boundaries]
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"PiecewiseConstantDecay: boundaries must increase, got {boundaries!r}")
        vals = [_number(self, "values", v, lambda x: x >= 0, ">= 0") for v in values]
        top = _base(self, "the largest of values", max(vals))
        self._on_shards = (top, shard.Piecewise(tuple(int(b) for b in bounds), tuple(v / top for v in vals)))


class CosineDecay(_Builtin):
    """Keras's: with warmup_target, a linear warmup from initial_learning_rate to warmup_target
    over warmup_steps, then a cosine decay from it to alpha times it over decay_steps."""

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay",
                 warmup_target=None, warmup_steps=0):
        self._config = dict(initial_learning_rate=initial_learning_rate, decay_steps=decay_steps,
                            alpha=alpha, name=name, warmup_target=warmup_target, warmup_steps=warmup_steps)
        steps = _number(self, "decay_steps", decay_steps, lambda x: x > 0 and x == int(x), "an integer > 0")
        alpha = _number(self, "alpha", alpha, lambda x: 0 <= x <= 1, "in [0, 1]")
        if warmup_target is None:
            rule = shard.Cosine(int(steps), alpha)
            self._on_shards = (_base(self, "initial_learning_rate", initial_learning_rate), rule)
            return
        top = _base(self, "warmup_target", warmup_target)
        start = _number(self, "initial_learning_rate", initial_learning_rate, lambda x: x >= 0, ">= 0")
        warmup = _number(self, "warmup_steps", warmup_steps, lambda x: x >= 0 and x == int(x),
                         "an integer >= 0")
        self._on_shards = (top, shard.Cosine(int(steps), alpha, int(warmup), start / top))


BUILT_IN = ("ExponentialDecay", "PiecewiseConstantDecay", "CosineDecay", "InverseTimeDecay")


def _number(schedule, what: str, value, ok, wanted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not ok(value):
        raise ConfigError(f"{type(schedule).__name__}: {what} must be {wanted}, got {value!r}")
    return float(value)


def _base(schedule, what: str, value) -> float:
    """The shards' lr: a number > 0 (a schedule at 0 throughout trains nothing)."""
    return _number(schedule, what, value, lambda x: x > 0, "a number > 0 (the shards' lr)")


def serialize(schedule: LearningRateSchedule) -> dict:
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(config: dict) -> LearningRateSchedule:
    """A built-in schedule from serialize()'s dict; ConfigError naming what is wrong."""
    name = config.get("class_name") if isinstance(config, dict) else None
    if name not in BUILT_IN or not isinstance(config.get("config"), dict):
        raise ConfigError(f"learning-rate schedule {config!r}: expected one of {', '.join(BUILT_IN)}")
    try:
        return globals()[name].from_config(config["config"])
    except TypeError as e:
        raise ConfigError(f"learning-rate schedule {name}: {e}") from None


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["LearningRateSchedule", "ExponentialDecay", "PiecewiseConstantDecay", "CosineDecay",
           "InverseTimeDecay", "serialize", "deserialize"]
