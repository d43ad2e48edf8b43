"""Keras's optimizer classes with Keras's names and defaults, as settings for the shards.

An optimizer object holds no state here: the shards run the update rule on their slices
(pserver.optim). Each maps to pserver's optimizer name and its settings (`settings()`, the
ServerConfig fields), which a fit gives to the shards it starts, or checks against those of
shards already running. An argument pserver cannot honour is refused, naming it.
"""

from __future__ import annotations

from pserver.errors import ConfigError, ModelFileError
from pserver.keras._names import missing as _missing

# Keras's arguments every optimizer takes, and the values that mean "not used".
_COMMON = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
           "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
           "loss_scale_factor": None, "gradient_accumulation_steps": None, "name": None}


class Optimizer:
    """The base: `learning_rate`, and Keras's common arguments (refused unless at their default)."""
    pserver_name = ""

    def __init__(self, learning_rate: float, **common):
        unknown = sorted(set(common) - set(_COMMON))
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unexpected argument {unknown[0]!r}")
        used = [k for k, v in common.items() if k != "name" and v != _COMMON[k]]
        if used:
            raise ConfigError(f"{type(self).__name__}: {used[0]}={common[used[0]]!r} is not supported "
                              "(pserver's shards run the plain update rule; docs/guide/keras.md)")
        if not isinstance(learning_rate, (int, float)) or isinstance(learning_rate, bool):
            raise ConfigError(f"{type(self).__name__}: learning_rate must be a number (schedules are "
                              f"not supported), got {learning_rate!r}")
        self.learning_rate = float(learning_rate)
        self.name = common.get("name") or type(self).__name__.lower()

    def settings(self) -> dict:
        """The shards' settings (ServerConfig's fields) for this optimizer."""
        return {"optimizer": self.pserver_name, "lr": self.learning_rate}

    def get_config(self) -> dict:
        return {"class_name": type(self).__name__, **self.settings()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings()})"


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

    def settings(self):
        if not self.momentum:
            return {"optimizer": "sgd", "lr": self.learning_rate}
        return {"optimizer": "momentum", "lr": self.learning_rate, "momentum": self.momentum,
                "nesterov": self.nesterov}


class Adam(Optimizer):
    """keras.optimizers.Adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07,
    amsgrad=False): pserver's adam, with bias correction."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-07, amsgrad=False,
                 **common):
        super().__init__(learning_rate, **common)
        if amsgrad:
            raise ConfigError("Adam: amsgrad=True is not supported")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def settings(self):
        return {"optimizer": "adam", "lr": self.learning_rate, "beta1": self.beta_1, "beta2": self.beta_2,
                "eps": self.epsilon}


# Keras's string names (compile(optimizer="adam")) with Keras's defaults.
_BY_NAME = {"sgd": SGD, "adam": Adam}
# Keras optimizers pserver's shards do not run (yet), refused by name.
_NOT_HERE = ("rmsprop", "adamw", "adagrad", "adadelta", "adamax", "nadam", "ftrl", "lion", "adafactor")


def get(spec) -> Optimizer:
    """An Optimizer from a Keras name ("adam") or an object of this module."""
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return _BY_NAME[spec.lower()]()
    if isinstance(spec, str) and spec.lower() in _NOT_HERE:
        raise ConfigError(f"compile: optimizer={spec!r} is not supported (pserver's dense optimizers: "
                          f"{', '.join(_BY_NAME)}); Keras's compile defaults to 'rmsprop': name one")
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
        if name == "adam":
            return Adam(config["lr"], config["beta1"], config["beta2"], config["eps"])
        return SGD(config["lr"], config.get("momentum", 0.0), config.get("nesterov", False))
    except ConfigError as e:
        raise ModelFileError(f"compiled optimizer {name}: {e}") from None


# What get_config() writes for each pserver optimizer (besides class_name), and its types.
_NUMBER = (int, float)
_FIELDS = {"sgd": {"lr": _NUMBER},
           "momentum": {"lr": _NUMBER, "momentum": _NUMBER, "nesterov": bool},
           "adam": {"lr": _NUMBER, "beta1": _NUMBER, "beta2": _NUMBER, "eps": _NUMBER}}


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Optimizer", "SGD", "Adam", "get", "from_settings"]
