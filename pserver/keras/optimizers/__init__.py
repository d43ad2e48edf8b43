"""Keras's optimizer classes with Keras's names and defaults, as settings for the shards.

An optimizer object holds no state here: the shards run the update rule on their slices
(pserver.optim). Each maps to pserver's optimizer name and its settings (`settings()`, the
ServerConfig fields), which a fit gives to the shards it starts, or checks against those of
shards already running. An argument pserver cannot honour is refused, naming it.
"""

from __future__ import annotations

from pserver.errors import ConfigError, ModelFileError
from pserver.keras._names import missing as _missing
from pserver.keras.optimizers import schedules

# Keras's arguments every optimizer takes, and the values that mean "not used".
_COMMON = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
           "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
           "loss_scale_factor": None, "gradient_accumulation_steps": None, "name": None}
_CLIPS = ("clipnorm", "clipvalue", "global_clipnorm")


def _rate(owner: str, learning_rate):
    """learning_rate as a float, or the schedule (one the shards run: one of your own is refused)."""
    if isinstance(learning_rate, schedules.LearningRateSchedule):
        learning_rate.on_shards()
        return learning_rate
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        return float(learning_rate)
    raise ConfigError(f"{owner}: learning_rate must be a number or a schedule of keras.optimizers.schedules, "
                      f"got {learning_rate!r}")


def _clips(owner: str, given: dict) -> dict:
    """The clipping arguments given: at most one (Keras's rule), a number > 0."""
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ConfigError(f"{owner}: only one of clipnorm, clipvalue and global_clipnorm can be set, "
                          f"got {', '.join(given)}")
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ConfigError(f"{owner}: {k} must be a number > 0, got {v!r}")
    return {k: float(v) for k, v in given.items()}


class Optimizer:
    """The base: `learning_rate` (a number or a schedule of keras.optimizers.schedules), the
    clipping arguments, and Keras's other common arguments (refused unless at their default).

    clipvalue is the shards' (on the step's aggregated gradient); clipnorm and global_clipnorm
    are each worker's, on its gradient before the push (`gradient_clip`; docs/semantics.md)."""
    pserver_name = ""

    def __init__(self, learning_rate, **common):
        unknown = sorted(set(common) - set(_COMMON))
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unexpected argument {unknown[0]!r}")
        used = [k for k, v in common.items() if k not in ("name", *_CLIPS) and v != _COMMON[k]]
        if used:
            raise ConfigError(f"{type(self).__name__}: {used[0]}={common[used[0]]!r} is not supported "
                              "(pserver's shards run the plain update rule; docs/guide/keras.md)")
        self.clips = _clips(type(self).__name__, {k: common.get(k) for k in _CLIPS})
        self.learning_rate = _rate(type(self).__name__, learning_rate)
        self.name = common.get("name") or type(self).__name__.lower()

    def settings(self) -> dict:
        """The shards' settings (ServerConfig's fields) for this optimizer: its rule's, the rate
        (a schedule's base lr and its --lr-schedule), and clipvalue when given."""
        if isinstance(self.learning_rate, schedules.LearningRateSchedule):
            lr, rule = self.learning_rate.on_shards()
            rate = {"lr": lr, "lr_schedule": rule.spec}
        else:
            rate = {"lr": self.learning_rate}
        clip = {"clipvalue": self.clips["clipvalue"]} if "clipvalue" in self.clips else {}
        return {"optimizer": self.pserver_name, **rate} | self._rule() | clip

    def _rule(self) -> dict:
        """The update rule's name and hyper-parameters, as ServerConfig's fields."""
        return {}

    def gradient_clip(self) -> dict:
        """What each worker clips before its push (WorkerConfig's clipnorm, global_clipnorm)."""
        return {k: v for k, v in self.clips.items() if k != "clipvalue"}

    def get_config(self) -> dict:
        config = {"class_name": type(self).__name__, **self.settings(), **self.gradient_clip()}
        if isinstance(self.learning_rate, schedules.LearningRateSchedule):
            config["keras_schedule"] = schedules.serialize(self.learning_rate)
        return config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings() | self.gradient_clip()})"


class SGD(Optimizer):
    """keras.optimizers.SGD(learning_rate=0.01, momentum=0.0, nesterov=False): pserver's sgd,
    or momentum (heavy-ball or Nesterov) when momentum > 0."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, **common):
        super().__init__(learning_rate, **common)
        if not 0 <= momentum < 1:
            raise ConfigError(f"SGD: momentum must be in [0, 1), got {momentum!r}")
        if nesterov and not momentum:
            raise ConfigError("SGD: nesterov=True needs momentum > 0")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def _rule(self):
        if not self.momentum:
            return {"optimizer": "sgd"}
        return {"optimizer": "momentum", "momentum": self.momentum, "nesterov": self.nesterov}


class Adam(Optimizer):
    """keras.optimizers.Adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07,
    amsgrad=False): pserver's adam, with bias correction."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=False,
                 **common):
        super().__init__(learning_rate, **common)
        if amsgrad:
            raise ConfigError("Adam: amsgrad=True is not supported")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _rule(self):
        return {"optimizer": "adam", "beta1": self.beta_1, "beta2": self.beta_2, "eps": self.epsilon}


class AdamW(Adam):
    """keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999,
    epsilon=1e-07, amsgrad=False): pserver's adamw, Keras's rule with its decoupled weight decay."""

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-07,
                 amsgrad=False, **common):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, **common)
        if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
            raise ConfigError(f"AdamW: weight_decay must be a number >= 0, got {weight_decay!r}")
        self.weight_decay = float(weight_decay)

    def _rule(self):
        return super()._rule() | {"optimizer": "adamw", "weight_decay": self.weight_decay}


class RMSprop(Optimizer):
    """keras.optimizers.RMSprop(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-07,
    centered=False): pserver's rmsprop, Keras's rule."""

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-07, centered=False,
                 **common):
        super().__init__(learning_rate, **common)
        self.rho, self.momentum, self.epsilon = float(rho), float(momentum), float(epsilon)
        self.centered = bool(centered)

    def _rule(self):
        return {"optimizer": "rmsprop", "rho": self.rho, "momentum": self.momentum, "eps": self.epsilon,
                "centered": self.centered}


class Adagrad(Optimizer):
    """keras.optimizers.Adagrad(learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-07):
    pserver's adagrad, Keras's rule."""

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-07, **common):
        super().__init__(learning_rate, **common)
        self.initial_accumulator_value, self.epsilon = float(initial_accumulator_value), float(epsilon)

    def _rule(self):
        return {"optimizer": "adagrad", "initial_accumulator": self.initial_accumulator_value,
                "eps": self.epsilon}


# Keras's string names (compile(optimizer="adam")) with Keras's defaults.
_BY_NAME = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "rmsprop": RMSprop, "adagrad": Adagrad}
# Keras optimizers pserver's shards do not run (yet), refused by name.
_NOT_HERE = ("adadelta", "adamax", "nadam", "ftrl", "lion", "adafactor")


def get(spec) -> Optimizer:
    """An Optimizer from a Keras name ("adam") or an object of this module."""
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return _BY_NAME[spec.lower()]()
    if isinstance(spec, str) and spec.lower() in _NOT_HERE:
        raise ConfigError(f"compile: optimizer={spec!r} is not supported (pserver's dense optimizers: "
                          f"{', '.join(_BY_NAME)})")
    raise ConfigError(f"compile: optimizer={spec!r}: give a name ({', '.join(_BY_NAME)}) or a "
                      "pserver.keras.optimizers object")


def from_settings(config: dict) -> Optimizer:
    """The object get_config() described (a model file's compiled optimizer). ModelFileError
    naming what is wrong: an optimizer these classes do not write, a missing or mistyped field."""
    if not isinstance(config, dict):
        raise ModelFileError(f"compiled optimizer: {config!r} is not an optimizer's config")
    name = config.get("optimizer")
    needs = _FIELDS.get(name) if isinstance(name, str) else None
    if needs is None:
        raise ModelFileError(f"compiled optimizer: {name!r} is not one pserver.keras writes "
                             f"({', '.join(_FIELDS)})")
    for field, kind in needs.items():
        value = config.get(field)
        if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool):
            raise ModelFileError(f"compiled optimizer {name}: {field}={value!r}: expected a "
                                 f"{'bool' if kind is bool else 'number'}")
    try:
        return _rebuild(name, config)
    except ConfigError as e:
        raise ModelFileError(f"compiled optimizer {name}: {e}") from None


def _rebuild(name: str, config: dict) -> Optimizer:
    """The optimizer from its checked fields, its schedule (the Keras object get_config wrote
    beside the shards' lr and spec) and its clipping."""
    lr = schedules.deserialize(config["keras_schedule"]) if "keras_schedule" in config else config["lr"]
    return _BUILD[name](config | {"lr": lr}, {k: config[k] for k in _CLIPS if k in config})


# What get_config() writes for each pserver optimizer (besides class_name), and its types.
_NUMBER = (int, float)
_FIELDS = {"sgd": {"lr": _NUMBER},
           "momentum": {"lr": _NUMBER, "momentum": _NUMBER, "nesterov": bool},
           "adam": {"lr": _NUMBER, "beta1": _NUMBER, "beta2": _NUMBER, "eps": _NUMBER},
           "adamw": {"lr": _NUMBER, "beta1": _NUMBER, "beta2": _NUMBER, "eps": _NUMBER,
                     "weight_decay": _NUMBER},
           "rmsprop": {"lr": _NUMBER, "rho": _NUMBER, "momentum": _NUMBER, "eps": _NUMBER, "centered": bool},
           "adagrad": {"lr": _NUMBER, "initial_accumulator": _NUMBER, "eps": _NUMBER}}
# The object from those fields, once checked (lr: the number, or the schedule), and the clipping.
_BUILD = {"sgd": lambda c, k: SGD(c["lr"], **k),
          "momentum": lambda c, k: SGD(c["lr"], c["momentum"], c["nesterov"], **k),
          "adam": lambda c, k: Adam(c["lr"], c["beta1"], c["beta2"], c["eps"], **k),
          "adamw": lambda c, k: AdamW(c["lr"], c["weight_decay"], c["beta1"], c["beta2"], c["eps"], **k),
          "rmsprop": lambda c, k: RMSprop(c["lr"], c["rho"], c["momentum"], c["eps"], c["centered"], **k),
          "adagrad": lambda c, k: Adagrad(c["lr"], c["initial_accumulator"], c["eps"], **k)}


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "get", "from_settings"]
