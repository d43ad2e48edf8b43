"""Weight regularizers with Keras's names (keras.regularizers): a penalty added to the loss,
and its gradient added to the weights' gradient, by the model (pserver.models.functional).

    L1(l1=0.01)            l1 * sum(|w|)              gradient l1 * sign(w)
    L2(l2=0.01)            l2 * sum(w ** 2)           gradient 2 * l2 * w
    L1L2(l1=0.0, l2=0.0)   the sum of both

Keras's strings: "l1", "l2", "l1_l2" (L1L2 at its defaults, 0 and 0, as Keras's get gives).
"""

from __future__ import annotations

import math

import numpy as np

from pserver.errors import ConfigError


class Regularizer:
    """Keras's base. The built-ins are L1L2's; a regularizer of your own is refused by `get`
    (its penalty would need a gradient the model cannot trace)."""

    def __call__(self, w: np.ndarray) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define its penalty, __call__(w)")

    def add_gradient(self, w: np.ndarray, g: np.ndarray, scale: float = 1.0) -> None:
        """g += scale * d penalty / d w."""
        raise NotImplementedError(f"{type(self).__name__} must define add_gradient(w, g, scale)")

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


class L1L2(Regularizer):
    def __init__(self, l1=0.0, l2=0.0):
        self.l1, self.l2 = _factor("l1", l1), _factor("l2", l2)

    def __call__(self, w):
        w = w.astype(np.float64, copy=False)
        return self.l1 * float(np.sum(np.abs(w))) + self.l2 * float(np.dot(w.ravel(), w.ravel()))

    def add_gradient(self, w, g, scale: float = 1.0):
        if self.l1:
            g += np.float32(scale * self.l1) * np.sign(w)
        if self.l2:
            g += np.float32(scale * 2 * self.l2) * w

    def get_config(self):
        return {"l1": self.l1, "l2": self.l2}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.get_config()})"


class L1(L1L2):
    def __init__(self, l1=0.01):
        super().__init__(l1=l1)

    def get_config(self):
        return {"l1": self.l1}


class L2(L1L2):
    def __init__(self, l2=0.01):
        super().__init__(l2=l2)

    def get_config(self):
        return {"l2": self.l2}


_NAMED = {"l1": L1, "l2": L2, "l1_l2": L1L2, "L1": L1, "L2": L2, "L1L2": L1L2}


def _factor(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ConfigError(f"regularizer: {name} must be a number >= 0, got {value!r}")
    return float(value)


def get(spec, owner: str) -> L1L2 | None:
    """None, or the regularizer a Keras name, a config dict or an object of this module gives;
    `owner` names the argument in the error."""
    if spec is None or isinstance(spec, L1L2):
        return spec
    if isinstance(spec, str) and spec in _NAMED:
        return _NAMED[spec]()
    if isinstance(spec, dict) and spec.get("class_name") in _NAMED:
        return _NAMED[spec["class_name"]].from_config(spec.get("config") or {})
    raise ConfigError(f"{owner}: {spec!r} is not supported; give L1, L2, L1L2 or \"l1\", \"l2\", "
                      "\"l1_l2\" (a regularizer of your own: its gradient is not traced)")


__all__ = ["Regularizer", "L1", "L2", "L1L2", "get"]
