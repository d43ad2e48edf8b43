"""What a model file holds of a layer beyond plain arguments: a Lambda's function, and the safe
mode that loading it runs under (Keras's).

A model file runs no code of its own: a Lambda's named function is one of a module this process
imported (pserver.layers.serialize/deserialize find layer classes the same way, by name). A
Python lambda is saved as its bytecode, as Keras saves it, and loaded only under
safe_mode(False) (load_model's safe_mode=False): loading it runs that code.
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


@contextlib.contextmanager
def safe_mode(safe: bool):
    """Inside: loading a config may run a lambda's saved code (and import a function's module)
    only when `safe` is False. Outside any scope: safe (a direct from_config fails closed)."""
    token = _SAFE.set(bool(safe))
    try:
        yield
    finally:
        _SAFE.reset(token)


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
        closure = [c.cell_contents for c in fn.__closure__ or ()]
        for value in [*closure, *(fn.__defaults__ or ())]:
            if not is_json(value):
                raise ConfigError(f"{where}: the lambda holds a value of type {type(value).__name__} from "
                                  "around it, which a model file cannot hold: write a layer of your own (a "
                                  "registered keras.layers.Layer subclass) instead")
        return {"class_name": "__lambda__",
                "config": {"code": base64.b64encode(marshal.dumps(fn.__code__)).decode("ascii"),
                           "defaults": list(fn.__defaults__) if fn.__defaults__ else None,
                           "closure": closure or None}, "module": fn.__module__}
    name, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if not (isinstance(fn, types.FunctionType) and name and module and "<locals>" not in name):
        raise ConfigError(f"{where}: its function {fn!r} is neither a lambda nor a function of a module, "
                          "which a model file can name")
    return {"class_name": "function", "config": name, "module": module}


def load_function(config: dict, where: str):
    """The function dump_function described. A lambda's code runs only with safe_mode=False
    (Keras's rule); a named function comes from its module as this process imported it (with
    safe_mode=False, the module is imported if it was not)."""
    kind, inner = config.get("class_name"), config.get("config")
    if kind == "__lambda__":
        if _SAFE.get():
            raise ConfigError(f"{where}: its function is a Python lambda, saved as bytecode: loading it runs "
                              "that code, which is disallowed by default; if you trust the file, load it "
                              "with load_model(..., safe_mode=False)")
        code = marshal.loads(base64.b64decode(inner["code"]))
        closure = tuple(types.CellType(v) for v in inner.get("closure") or ())
        module = sys.modules.get(config.get("module") or "__main__")
        return types.FunctionType(code, vars(module) if module else {"__builtins__": __builtins__},
                                  code.co_name, tuple(inner["defaults"]) if inner.get("defaults") else None,
                                  closure or None)
    if kind != "function" or not isinstance(inner, str):
        raise ConfigError(f"{where}: its function's config {config!r} is neither a lambda nor a function")
    module = config.get("module")
    if module not in sys.modules and not _SAFE.get():
        importlib.import_module(module)
    fn = sys.modules.get(module)
    for part in inner.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(f"{where}: its function {module}.{inner} is not in this process: import {module} "
                          "before loading (or load with safe_mode=False to let load_model import it)")
    return fn


__all__ = ["safe_mode", "is_json", "dump_function", "load_function"]
