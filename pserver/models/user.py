"""A user's model from `--model path/to/file.py:build` or `--model package.module:build`.

`build` is called with `input_shape` (a tuple, without the batch dimension) and `num_classes`
(0 for regression) for each of them its signature accepts, by name or through **kwargs, and
with none otherwise. It returns a Sequential or any object with the model protocol
(`pserver.models.base.PROTOCOL`). Every mistake is one ConfigError line naming --model.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys

from pserver.errors import ConfigError, PServerError
from pserver.models.base import protocol_gaps
from pserver.models.sequential import Sequential


def is_user_spec(spec: str) -> bool:
    return ":" in spec


def check_spec(spec: str) -> None:
    """The form of a user spec, and that its file exists, without running any of its code
    (so `launch` fails before it starts a process)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise ConfigError(f"--model {spec}: expected FILE.py:FUNCTION or package.module:FUNCTION")
    if is_path(target) and not os.path.isfile(target):
        raise ConfigError(f"--model {spec}: no such file {target}")


def is_path(target: str) -> bool:
    """Whether a spec's part before ':' names a file (FILE.py), not a module."""
    return target.endswith(".py") or os.sep in target or "/" in target


def load_model(spec: str, input_shape: tuple[int, ...], num_classes: int):
    """Import, call and check the user's build function."""
    check_spec(spec)
    target, _, attr = spec.rpartition(":")
    module = _import(spec, target)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"--model {spec}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"--model {spec}: {attr} is a {type(fn).__name__}, not a function")
    kwargs = _accepted(fn, {"input_shape": tuple(input_shape), "num_classes": num_classes})
    try:
        model = fn(**kwargs)
        if isinstance(model, Sequential):
            model.build()    # a layer that cannot work says so here, as this --model's error
    except PServerError as e:
        raise ConfigError(f"--model {spec}: {e}") from None
    except Exception as e:  # the user's code: any failure becomes one line, not a traceback
        raise ConfigError(f"--model {spec}: {attr}() raised {type(e).__name__}: {e}") from None
    gaps = protocol_gaps(model)
    if gaps:
        raise ConfigError(f"--model {spec}: {attr}() returned a {type(model).__name__}, not a "
                          f"Sequential or a model (it lacks {', '.join(gaps)})")
    return model


def _import(spec: str, target: str):
    if is_path(target):
        return _import_file(spec, target)
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise ConfigError(f"--model {spec}: cannot import {target} ({e})") from None
    except Exception as e:
        raise ConfigError(f"--model {spec}: importing {target} raised {type(e).__name__}: {e}") from None


def _import_file(spec: str, path: str):
    # A name of its own per file, so two model files called model.py do not collide.
    name = "pserver_user_model_" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: a SyntaxError or a raise at import time
        del sys.modules[name]
        raise ConfigError(f"--model {spec}: importing {path} raised {type(e).__name__}: {e}") from None
    return module


def _accepted(fn, offered: dict) -> dict:
    """The keyword arguments of `offered` that fn's signature takes."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


__all__ = ["is_user_spec", "is_path", "check_spec", "load_model"]
