"""Models: Sequential stacks of layers, the built-in definitions, and users' own.

    mlp      Dense + ReLU layers, default 784-256-256-10, softmax cross-entropy
    logreg   one Dense layer to k logits, softmax cross-entropy         (classification)
    linreg   one Dense layer to 1 output, mean squared error            (regression)
    cnn      the reference CNN: Conv2D(32, 3, relu), MaxPooling2D, Flatten, Dense(64, relu),
             Dense(10), on (28, 28, 1) images
    lr, fm, wide_deep, deepfm   click-through-rate models on Criteo records, with sparse
             embedding tables on the shards (pserver.models.ctr)
    FILE.py:FUNCTION or package.module:FUNCTION   a user's model (pserver.models.user)

`make_model` is how the CLI and the tests build one; `on_device` puts a model on a kernel
backend: "cpu" numba kernels, "reference" NumPy twins, or "cuda" (`pserver.models.cuda`,
imported only then, as it imports numba.cuda; what runs there: `pserver.models.cuda_support`).
"""

from __future__ import annotations

import math
import os

import numpy as np

from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.models import cuda_support, losses
from pserver.models.base import Model, fits, protocol_gaps, shaped_for
from pserver.models.cnn import cnn
from pserver.models.ctr import CTR_MODELS, ctr_model
from pserver.models.functional import Functional
from pserver.models.layout import Layout, TensorSpec
from pserver.models.linreg import linreg
from pserver.models.logreg import logreg
from pserver.models.mlp import mlp
from pserver.models.sequential import Sequential
from pserver.models.user import bare_file_error, check_spec, is_bare_file, is_user_spec, load_model
from pserver.registry import Registry

# The built-in models by --model name (a user's FILE.py:FUNCTION is not one: see check_model_spec).
MODELS = Registry("model", "--model")
MODELS.add("mlp", "Dense + ReLU layers (--hidden, default 256,256), softmax cross-entropy", mlp)
MODELS.add("logreg", "one Dense layer to k logits, softmax cross-entropy (classification)", logreg)
MODELS.add("linreg", "one Dense layer to 1 output, mean squared error (regression)", linreg,
           task="regression")
MODELS.add("cnn", "the reference CNN: Conv2D(32, 3), MaxPooling2D, Dense(64), Dense(10), on 28x28x1", cnn)
MODELS.add("lr", "Criteo: logistic regression over dense features and one sparse weight per id", ctr_model)
MODELS.add("fm", "Criteo: lr plus a factorization machine's pairwise term (--embedding-dim)", ctr_model)
MODELS.add("wide_deep", "Criteo: lr plus a deep tower over the ids' embeddings (--hidden)", ctr_model)
MODELS.add("deepfm", "Criteo: fm plus a deep tower over the same embeddings (--hidden)", ctr_model)
MODELS.add("dcn", "Criteo: DCN-v2, two FeatureCross layers over [embeddings, dense], then a tower (--hidden)",
           ctr_model)
MODELS.add("dlrm", "Criteo: DLRM, a bottom MLP's vector and the fields' rows by DotInteraction, then a tower "
           "(--hidden)", ctr_model)
DEFAULT_HIDDEN = (256, 256)   # the mlp's; the CTR models' deep towers have their own


def task_of(spec: str) -> str:
    """The task a --model spec trains for, as its registry entry says: "regression" or
    "classification" (the default, and a user's model's: its data says which it is)."""
    return MODELS.info(spec).get("task", "classification")


def make_model(name: str, input_shape, num_classes: int, *,
               hidden: tuple[int, ...] | None = None, backend: str = "cpu", **options):
    """Build a model by name (or FILE.py:FUNCTION) for inputs of `input_shape` (an int is a
    flat input); bad names and sizes raise ConfigError naming the flag.

    `options` are the CTR models' (embedding_dim, init_scale and the sparse tables' optimizer,
    lr, min_count, max_rows, ttl_steps, seed, optimizer_params, row_dtype, state_dtype: see
    pserver.models.ctr); a CTR model, or a user's that takes records (a graph with sparse
    Embedding layers), takes records, so its `input_shape` is () (one record per sample).
    """
    if name in CTR_MODELS:
        deep = hidden is not None and CTR_MODELS[name][1]   # lr and fm have no tower to size
        try:
            model = ctr_model(name, input_shape, num_classes, _hidden(hidden) if deep else None,
                              **options)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("--") else f"--model {name}: {msg}") from None
        return on_device(model, backend)
    if options:
        raise ConfigError(f"--model {name}: takes no sparse table options ({', '.join(options)}); "
                          f"those are for {', '.join(CTR_MODELS)}")
    records = is_user_spec(name) and tuple(input_shape) == ()
    shape = () if records else _input_shape(input_shape)
    if is_bare_file(name):
        raise bare_file_error(name, shape, num_classes)
    if is_user_spec(name):
        model = load_model(name, shape, num_classes)
    else:
        model = _builtin(name, shape, num_classes, hidden)
        try:
            model.build()
        except ConfigError as e:   # a cnn on flat data, say: the flag and the dataset's shape
            raise ConfigError(f"--model {name} for inputs of shape {shape}: {e}") from None
    return on_device(model, backend)


def on_device(model, backend: str):
    """The model computing with `backend`'s kernels (a user's protocol object: unchanged)."""
    if not isinstance(model, Functional):
        get_backend(backend)   # an unknown backend is still an error
        return model
    if backend == "cuda" and model.sparse_tables:
        raise ConfigError(f"--device cuda: {model.name} runs on the CPU (its rows come from the "
                          "shards batch by batch); use --device cpu")
    if backend == "cuda":
        model.build()
        cuda_support.check(model)   # before numba.cuda is imported: a model that cannot run says so
        get_backend("cuda")  # numba.cuda missing: a ConfigError naming --device, not a traceback
        from pserver.models.cuda import CudaModel
        return CudaModel(model)
    return model.use_backend(backend)


def check_model_spec(spec: str) -> None:
    """A built-in name, or a user's FILE.py:FUNCTION whose file exists (none of its code runs;
    a FILE.py without its function gets the list of them when the model is made)."""
    if is_user_spec(spec):
        check_spec(spec)
    elif is_bare_file(spec):
        if not os.path.isfile(spec):
            raise ConfigError(f"--model {spec}: no such file")
    elif spec not in MODELS:
        raise ConfigError(f"--model: unknown model {spec!r}; choose one of {', '.join(MODELS.names())}, "
                          "or FILE.py:FUNCTION or package.module:FUNCTION for your own")


def _builtin(name, shape, num_classes, hidden) -> Sequential:
    """The definition, not yet built (make_model builds it, naming the flag in errors)."""
    check_model_spec(name)
    flat = (math.prod(shape),)
    if name == "linreg":
        return linreg(flat)
    _check_positive("number of classes", num_classes)
    if num_classes < 2:
        raise ConfigError(f"{name} needs at least 2 classes, got {num_classes}")
    if name == "logreg":
        return logreg(flat, num_classes)
    if name == "cnn":
        return cnn(shape, num_classes)
    return mlp(flat, num_classes, hidden=_hidden(DEFAULT_HIDDEN if hidden is None else hidden))


def _hidden(hidden) -> tuple[int, ...]:
    hidden = tuple(hidden)
    if not hidden or not all(_is_positive_int(h) for h in hidden):
        raise ConfigError(f"--hidden: layer widths must be positive integers, got "
                          f"{','.join(map(str, hidden)) or 'nothing'}")
    return tuple(int(h) for h in hidden)


def _input_shape(input_shape) -> tuple[int, ...]:
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else (input_shape,)
    for d in shape:
        # These come from the dataset, not a flag, so the message names the quantity.
        _check_positive("input features", d)
    if not shape:
        raise ConfigError("input shape must have at least one dimension, got ()")
    return tuple(int(d) for d in shape)


def _is_positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


def _check_positive(what: str, v) -> None:
    if not _is_positive_int(v):
        raise ConfigError(f"{what} must be a positive integer, got {v!r}")


def from_config(config: dict, **kwargs) -> Sequential:
    """The model a saved definition describes: a Functional's (its class_name says so) or a
    Sequential's, so that every model file's definition is built by this one call."""
    kind = Functional if config.get("class_name") == "Functional" else Sequential
    return kind.from_config(config, **kwargs)


__all__ = ["MODELS", "make_model", "on_device", "check_model_spec", "Model", "Sequential", "Functional",
           "from_config",
           "Layout",
           "TensorSpec", "ctr_model",
           "losses", "task_of", "mlp", "logreg", "linreg", "cnn", "load_model", "protocol_gaps", "fits",
           "shaped_for"]
