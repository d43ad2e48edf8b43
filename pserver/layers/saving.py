"""What a model file holds of a layer beyond plain arguments: a Lambda's function, and the safe
mode that loading it runs under (Keras's).

A model file runs no code of its own: a Lambda's named function is one of a module this process
imported (pserver.layers.serialize/deserialize find layer classes the same way, by name), or one
load_model's custom_objects give. A Python lambda is saved as its bytecode, as Keras saves it, and
loaded only under loading(safe_mode=False): loading it runs that code.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import importlib
import marshal
import sys
import types

from pserver.errors import ConfigError

_SAFE = contextvars.ContextVar("pserver_safe_mode", default=True)
_CUSTOM: contextvars.ContextVar[dict] = contextvars.ContextVar("pserver_custom_objects", default={})


@contextlib.contextmanager
def loading(safe_mode: bool = True, custom_objects: dict | None = None):
    """Inside: loading a config may run a lambda's saved code (and import a function's module)
    only when `safe_mode` is False; outside any scope it is safe (a direct from_config fails
    closed). `custom_objects` (Keras's load_model argument): classes and functions by name,
    found before the registries."""
    custom = dict(custom_objects or {})
    bad = next((k for k, v in custom.items() if not isinstance(k, str) or not callable(v)), None)
    if bad is not None:
        raise ConfigError(f"load_model: custom_objects: give classes and functions by name, got "
                          f"{bad!r}: {custom[bad]!r}")
    tokens = _SAFE.set(bool(safe_mode)), _CUSTOM.set(custom)
    try:
        yield
    finally:
        _SAFE.reset(tokens[0])
        _CUSTOM.reset(tokens[1])


def custom_object(*names):
    """What load_model's custom_objects gives for the first of `names` it has (None if none)."""
    given = _CUSTOM.get()
    return next((given[n] for n in names if n in given), None)


def is_json(value) -> bool:
    """Whether `value` is what JSON holds (a config's values: numbers, strings, lists, dicts)."""
    if isinstance(value, (list, tuple)):
        return all(is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


# -- a Lambda's function ----------------------------------------------------------------------------

def dump_function(fn, where: str) -> dict:
    """A Lambda's function as JSON, as Keras writes it: a Python lambda as its bytecode, its
    defaults and closure ("__lambda__"); a named function by its module and name ("function")."""
    if isinstance(fn, types.LambdaType) and fn.__name__ == "<lambda>":
        return _dump_lambda(fn, where)
    name, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if not (isinstance(fn, types.FunctionType) and name and module and "<locals>" not in name):
        raise ConfigError(f"{where}: its function {fn!r} is neither a lambda nor a function of a module, "
                          "which a model file can name")
    return {"class_name": "function", "config": name, "module": module}


def _dump_lambda(fn, where: str) -> dict:
    closure = [c.cell_contents for c in fn.__closure__ or ()]
    for value in [*closure, *(fn.__defaults__ or ())]:
        if not is_json(value):
            raise ConfigError(f"{where}: the lambda holds a value of type {type(value).__name__} from around "
                              "it, which a model file cannot hold: write a layer of your own (a registered "
                              "keras.layers.Layer subclass) instead")
    return {"class_name": "__lambda__", "module": fn.__module__,
            "config": {"code": base64.b64encode(marshal.dumps(fn.__code__)).decode("ascii"),
                       "defaults": list(fn.__defaults__) if fn.__defaults__ else None,
                       "closure": closure or None}}


def load_function(config: dict, where: str):
    """The function dump_function described. A lambda's code runs only with safe_mode=False
    (Keras's rule); a named function comes from its module as this process imported it (with
    safe_mode=False, the module is imported if it was not)."""
    kind, inner, module = config.get("class_name"), config.get("config"), config.get("module")
    if kind == "__lambda__":
        return _load_lambda(inner, module, where)
    if kind != "function" or not isinstance(inner, str) or not isinstance(module, str):
        raise ConfigError(f"{where}: its function's config {config!r} is neither a lambda nor a function")
    if module not in sys.modules and not _SAFE.get():
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{where}: its function's module {module} cannot be imported ({e})") from None
    fn = custom_object(inner) or sys.modules.get(module)
    for part in inner.split(".") if fn is sys.modules.get(module) else ():
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(f"{where}: its function {module}.{inner} is not in this process: import {module} "
                          "before loading (or load with safe_mode=False to let load_model import it)")
    return fn


def _load_lambda(inner: dict, module: str | None, where: str):
    """The lambda's function again, its globals those of the module it was written in as this
    process has it (a script's: this __main__), as Keras's func_load."""
    if _SAFE.get():
        raise ConfigError(f"{where}: its function is a Python lambda, saved as bytecode: loading it runs "
                          "that code, which is disallowed by default; if you trust the file, load it with "
                          "load_model(..., safe_mode=False)")
    code = marshal.loads(base64.b64decode(inner["code"]))
    closure = tuple(types.CellType(v) for v in inner.get("closure") or ())
    found = sys.modules.get(module or "__main__")
    defaults = tuple(inner["defaults"]) if inner.get("defaults") else None
    return types.FunctionType(code, vars(found) if found else {"__builtins__": __builtins__}, code.co_name,
                              defaults, closure or None)


__all__ = ["loading", "custom_object", "is_json", "dump_function", "load_function"]
