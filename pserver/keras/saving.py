"""keras.saving.register_keras_serializable: a user's layer or subclassed Model class, known to
load_model."""

from __future__ import annotations

from pserver.errors import ConfigError
from pserver.keras._names import missing as _missing
from pserver.keras.models import Model
from pserver.layers import LAYERS, USER_LAYERS, Layer


def register_keras_serializable(package: str = "Custom", name: str | None = None):
    """@register_keras_serializable(): the decorated Layer (or keras.Model) subclass is built
    again by its class name when a model file names it (in a process that defined it). Its
    config is the constructor's arguments unless it overrides get_config/from_config."""
    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, (Layer, Model))):
            raise ConfigError(f"register_keras_serializable: {cls!r} is not a Layer or a Model subclass")
        if name not in (None, cls.__name__):
            raise ConfigError(f"register_keras_serializable: name={name!r}: pserver registers a layer "
                              f"by its class name ({cls.__name__})")
        key = cls.__name__
        if key in LAYERS:
            raise ConfigError(f"register_keras_serializable: {key} is a built-in layer's name; "
                              "rename the class")
        if key in USER_LAYERS:
            old = USER_LAYERS.get(key)
            if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ConfigError(f"register_keras_serializable: {key} is registered already "
                                  f"({old.__module__}.{old.__qualname__})")
            USER_LAYERS._entries.pop(key)     # the same class defined again (a module re-run)
        USER_LAYERS.add(key, f"{package}>{key}", cls)
        return cls
    return register


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["register_keras_serializable"]
