"""A user's model from `--model path/to/file.py:build` or `--model package.module:build`.

`build` is called with `input_shape` (a tuple, without the batch dimension) and `num_classes`
(0 for regression) for each of them its signature accepts, by name or through **kwargs, and
with none otherwise. It returns a Sequential, a Functional, a `pserver.keras` Model or Sequential
(its graph trains), or any object with the model protocol (`pserver.models.base.PROTOCOL`).
Every mistake is one ConfigError line naming --model; an exception in the user's code names the
file, the line and the code on it. `--model FILE.py` without a function lists the functions of
the file that return a model (`builders`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import linecache
import os
import sys

from pserver.errors import ConfigError, PServerError
from pserver.models.base import protocol_gaps
from pserver.models.functional import Functional


def is_user_spec(spec: str) -> bool:
    return ":" in spec


def is_bare_file(spec: str) -> bool:
    """`--model FILE.py` without `:FUNCTION`."""
    return ":" not in spec and spec.endswith(".py")


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
        # A keras.Model or keras.Sequential (pserver.keras) trains as the graph it holds.
        core = getattr(model, "core_model", None)
        model = core() if callable(core) else model
        if isinstance(model, Functional):
            model.build()    # a layer that cannot work says so here, as this --model's error
    except PServerError as e:
        raise ConfigError(f"--model {spec}: {e}{where(e, module)}") from None
    except (Exception, SystemExit) as e:  # the user's code: any failure becomes one line, not a traceback
        raise ConfigError(f"--model {spec}: {attr}() raised {describe(e)}{where(e, module)}") from None
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
    except (Exception, SystemExit) as e:
        raise ConfigError(f"--model {spec}: importing {target} raised {describe(e)}"
                          f"{where(e, path=_origin(target))}") from None


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
    except (Exception, SystemExit) as e:  # the user's code: a SyntaxError, a raise or sys.exit at import
        del sys.modules[name]
        raise ConfigError(f"--model {spec}: importing {path} raised {describe(e)}"
                          f"{where(e, path=path)}") from None
    return module


def describe(e: BaseException) -> str:
    """'NameError: name 'x' is not defined'; a SyntaxError without its '(file, line N)', which
    `where` says; sys.exit as what it is (the command went on to exit 0 having done nothing)."""
    if isinstance(e, SystemExit):
        return (f"SystemExit (sys.exit({e.code!r})): a model file is imported, not run as a script; "
                "put what runs it under `if __name__ == \"__main__\":`")
    return f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"


def where(e: BaseException, module=None, path: str | None = None) -> str:
    """', at FILE line N: CODE' for the deepest line of the user's file (`path`, or the file of
    `module`) that `e` went through, or a SyntaxError's own line; '' when there is none."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return _at(e.filename, e.lineno, e.text)
    own = path or getattr(module, "__file__", None)
    if not own:
        return ""
    own, found, tb = os.path.abspath(own), None, e.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == own:
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return _at(*found) if found else ""


def _origin(target: str) -> str | None:
    """The file of module `target`, without running it (None if not found)."""
    try:
        found = importlib.util.find_spec(target)
    except Exception:   # noqa: BLE001 - a parent package that fails to import: no file to name
        return None
    return found.origin if found is not None else None


def _at(filename: str, lineno: int, text: str | None = None) -> str:
    code = (text if text is not None else linecache.getline(filename, lineno)).strip()
    return f", at {filename} line {lineno}" + (f": {code}" if code else "")


def builders(path: str, input_shape: tuple[int, ...], num_classes: int) -> list[str]:
    """The functions of the file at `path` that return a model when called as --model
    FILE.py:FUNCTION would call them (only those whose required arguments are among
    input_shape and num_classes are called)."""
    module = _import_file(path, path)
    found = []
    for attr, fn in vars(module).items():
        if (attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__
                or not _callable_with(fn, ("input_shape", "num_classes"))):
            continue
        try:
            model = fn(**_accepted(fn, {"input_shape": tuple(input_shape), "num_classes": num_classes}))
            if isinstance(model, Functional):
                model.build()
        except Exception:   # noqa: BLE001 - not a builder for this data: not listed
            continue
        if not protocol_gaps(model):
            found.append(attr)
    return found


def bare_file_error(path: str, input_shape: tuple[int, ...], num_classes: int) -> ConfigError:
    """What `--model FILE.py` (no function) gets: the functions to choose from."""
    if not os.path.isfile(path):
        return ConfigError(f"--model {path}: no such file")
    found = builders(path, input_shape, num_classes)
    if not found:
        return ConfigError(f"--model {path}: give the function that builds the model, as {path}:FUNCTION; "
                           f"no function in {path} returns a model for inputs of shape {tuple(input_shape)} "
                           f"and {num_classes} classes")
    return ConfigError(f"--model {path}: give the function that builds the model, as {path}:FUNCTION; in "
                       f"{path}, {', '.join(found)} return{'s' if len(found) == 1 else ''} one "
                       f"(--model {path}:{found[0]})")


def _callable_with(fn, offered: tuple[str, ...]) -> bool:
    """Whether every parameter of fn without a default is one of `offered`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in offered
               for p in params)


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


__all__ = ["is_user_spec", "is_bare_file", "is_path", "check_spec", "load_model", "builders",
           "bare_file_error"]
