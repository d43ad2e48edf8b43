"""What a Keras name pserver.keras lacks gets: one line naming it and pointing at the table of
what is supported (docs/guide/keras.md), not a bare AttributeError. Each pserver.keras module
sets `__getattr__ = missing(__name__)` (PEP 562: called only for names the module lacks)."""

from __future__ import annotations

from pserver.errors import NotInKeras

TABLE = "docs/guide/keras.md"     # the table of what pserver.keras supports


def missing(module: str):
    keras_name = "keras" + module[len("pserver.keras"):]

    def __getattr__(name: str):   # noqa: N807 (the module hook's name)
        if name.startswith("_"):          # Python's own probes (__path__, __wrapped__, ...)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise NotInKeras(f"{keras_name}.{name} is not supported by pserver.keras (yet); the table "
                         f"of what is: {TABLE}")
    return __getattr__


__all__ = ["missing", "TABLE"]
