"""keras.Sequential, keras.Model and keras.models.load_model: Keras's model API over pserver's
models (pserver.models.Sequential, and Functional for keras.Model(inputs, outputs)).

The model here is a Keras user's: it holds its weights (`get_weights`), and `fit` trains them
on shards. Run plainly, fit starts the shards in this process (pserver.train(ps=N)); under
`pserver run` it joins the cluster as its rank (pserver.keras.cluster), with `batch_size` the
global batch split across the workers, as Keras's distribution strategies do; only the chief
(rank 0) prints. The layers and the training loop are pserver's (pserver.models.Sequential,
pserver.worker.loop); this module only speaks Keras's arguments, and refuses, by name, the
ones pserver does not support (docs/guide/keras.md has the table).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from pserver import api
from pserver.errors import ConfigError, DataError
from pserver.keras import callbacks as callbacks_module
from pserver.keras import cluster, data, optimizers
from pserver.keras._names import missing as _missing
from pserver.layers import activations, saving
from pserver.layers.base import Layer, as_shape, init_arguments
from pserver.layers.traced import TracedLayer, snake_case
from pserver.models import graph_config
from pserver.models import losses as _losses
from pserver.models.functional import Functional as _Functional
from pserver.models.functional import free_name
from pserver.models.sequential import Sequential as _Sequential
from pserver.ops.core import Symbolic, defer, deferred_order, replay, unknown
from pserver.persist import model_file

# The shards a plain script's fit starts in its own process.
OWN_SHARDS = 1


class _Initial:
    """A core model whose chief starts the shards from the Keras model's weights."""
    initial: np.ndarray | None = None

    def init_params(self, seed: int) -> np.ndarray:
        return super().init_params(seed) if self.initial is None else self.initial.copy()


class _Core(_Initial, _Sequential):
    """pserver's Sequential, started from the Keras model's weights."""


class _FunctionalCore(_Initial, _Functional):
    """pserver's Functional, started from the Keras model's weights."""


_input_names = iter(f"input_layer{'' if i == 0 else f'_{i}'}" for i in itertools.count())


def Input(shape=None, batch_size=None, dtype=None, sparse=None, batch_shape=None, name=None,  # noqa: N802
          tensor=None, **unsupported) -> Symbolic:
    """keras.Input(shape=(28, 28, 1)): a symbolic tensor with a batch of None, to call layers on
    (keras.Model(inputs, outputs)), or a Sequential's first entry (its input shape)."""
    _refuse("Input", unsupported, batch_size=batch_size, sparse=sparse, batch_shape=batch_shape,
            tensor=tensor)
    # A dimension None (sequences of any length): the model is made at its first data, for the
    # data's size (pserver.ops.core.defer), as every layer is built for one shape.
    none = isinstance(shape, (tuple, list)) and any(d is None for d in shape)
    shape = tuple(None if d is None else as_shape("Input: shape", (d,))[0] for d in shape) if none \
        else as_shape("Input: shape", shape)
    # "string": text for a lookup or text layer (pserver.layers.text), which the model runs first
    dtype = np.dtype(str) if dtype in ("string", "str", str) else np.dtype(dtype or "float32")
    if dtype.kind not in "fiuU":
        raise ConfigError(f"Input: dtype={dtype.name!r}: give a float or an integer type, or 'string'")
    x = Symbolic((None, *shape), dtype, name=name or next(_input_names))
    x.unknown = none
    return x


_stamps = itertools.count(1)       # _Model._w's: which model set a shared layer's weights last


class _Model:
    """What keras.Sequential and keras.Model share: weights, compile, fit, evaluate, predict,
    save and summary over a core model (`self._core`, a pserver Sequential or Functional)."""

    def __init__(self, core, name: str | None = None):
        self._built_core, self._name = core, name
        self._w = None
        self.optimizer: optimizers.Optimizer | None = None
        self.stop_training = False
        self.history = None
        self._compiled = False
        self._pending: dict | None = None      # compile's loss and metrics, until the core exists
        # A model with sparse tables: their rows after fit or load_model (a SavedModel's
        # memory-mapped tables), and the directory fit exported them to (gone with the model).
        self._tables: model_file.SavedModel | None = None
        self._tables_dir: tempfile.TemporaryDirectory | None = None

    @property
    def _core(self):
        if self._built_core is None:
            self._ready(None)
        return self._built_core

    @_core.setter
    def _core(self, core) -> None:
        self._built_core = core

    def core_model(self):
        """The pserver Sequential or Functional this model trains (built now if it is not yet):
        what `--model FILE.py:FUNCTION` takes from a builder that returns a Keras model."""
        return self._core

    @property
    def name(self) -> str:
        return self._name if self._built_core is None else self._core.name

    @property
    def layers(self) -> list[Layer]:
        return [*self._core.preprocessing_layers, *self._core.layers]

    @property
    def inputs(self) -> list:
        """Keras's: the model's keras.Input tensors, in order."""
        return _flat(self._structure(0))

    @property
    def outputs(self) -> list:
        """Keras's: the tensors the model computes, in order."""
        return _flat(self._structure(1))

    @property
    def input(self):
        """Keras's: the model's keras.Input, or its inputs as it was given them (a list or a dict)."""
        return self._given_form(0)

    @property
    def output(self):
        """Keras's: the model's output tensor, or its outputs as it was given them."""
        return self._given_form(1)

    def _given_form(self, k: int):
        if getattr(self, "_graph", None) is not None:
            return self._graph[k]
        form = self._structure(k)
        return form[0] if isinstance(form, list) and len(form) == 1 else form

    def _structure(self, k: int):
        """The graph's inputs (k=0) or outputs (1): a dict by name, else a list."""
        if getattr(self, "_subclassed", lambda: False)():
            raise ConfigError(f"{self.name}: a subclassed Model has no {('inputs', 'outputs')[k]} of its own "
                              "(its call is traced at the first data)")
        if getattr(self, "_graph", None) is not None:
            form = self._graph[k]
            return form if isinstance(form, dict) else _flat(form)
        core = self._core
        if not core._built:                   # a Sequential: its graph is made when it is built
            core.build()
        if k == 0:
            return dict(zip(core._keys, core._given)) if core._dict_inputs else list(core._given)
        return dict(zip(core.output_names, core._outputs)) if core._dict_outputs else list(core._outputs)

    def get_layer(self, name=None, index=None) -> Layer:
        """Keras's: a layer by its name in this model (summary()'s), or by its index in `layers`."""
        if (name is None) == (index is None):
            raise ConfigError("get_layer: give a name or an index, one of them")
        layers = self.layers
        if index is not None:
            if not isinstance(index, int) or not -len(layers) <= index < len(layers):
                raise ConfigError(f"get_layer: index {index!r}: the model has {len(layers)} layers")
            return layers[index]
        names = [self._core._lname(layer) for layer in layers]
        if name not in names:
            raise ConfigError(f"get_layer: no layer {name!r} (the model's: {', '.join(names)})")
        return layers[names.index(name)]

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None,
                weighted_metrics=None, run_eagerly=False, steps_per_execution=1, jit_compile="auto",
                auto_scale_loss=True) -> None:
        """Keras's compile: the optimizer (a name or a pserver.keras.optimizers object) goes to
        the shards; the loss by Keras's name or object; metrics: "accuracy" (also auc, r2). With
        several outputs: loss, loss_weights and metrics one for all, a list or a dict by output
        name, as Keras's (pserver.models.outputs)."""
        _refuse("compile", {}, weighted_metrics=weighted_metrics,
                run_eagerly=run_eagerly or None, steps_per_execution=None if steps_per_execution == 1
                else steps_per_execution, jit_compile=None if jit_compile in ("auto", True, False)
                else jit_compile, auto_scale_loss=None if auto_scale_loss is True else auto_scale_loss)
        if loss is None:
            raise ConfigError("compile: loss: give one (pserver does not train without a loss)")
        self.optimizer = optimizers.get(optimizer)
        if self._built_core is None:
            self._pending = {"loss": loss, "metrics": metrics, "loss_weights": loss_weights}
        else:
            self._core.compile(loss=loss, metrics=metrics, loss_weights=loss_weights)
        self._compiled = True

    def _ready(self, x) -> None:
        """A core traced from the data `x` (its shapes) when the model has none yet: a subclassed
        Model, or a Sequential with a layer of your own; x None: from the shapes it knows."""
        if self._built_core is not None:
            return
        core = self._trace(x)
        if core is None:
            raise ConfigError(f"{self.name}: not built yet: it is traced at its first data (fit, evaluate, "
                              "predict) or by model.build(input_shape)")
        self._built_core = core
        if self._pending is not None:
            core.compile(**self._pending)

    def _trace(self, x):
        """The core traced from `x`'s shapes, or None: a model made with its core (a Functional
        graph, a Sequential of built-in layers) has nothing to trace; Sequential and a subclassed
        Model override this."""
        return None

    def summary(self, line_length=None, positions=None, print_fn=None, expand_nested=False,
                show_trainable=False, layer_range=None) -> None:
        _refuse("summary", {}, positions=positions, expand_nested=expand_nested or None,
                show_trainable=show_trainable or None, layer_range=layer_range)
        if self._built_core is None and getattr(self, "_graph", None) is not None:
            for line in self.summary_text().splitlines():
                (print_fn or print)(line)
            return
        self._core.summary(line_length, print_fn)

    def summary_text(self) -> str:
        """summary()'s table as a string (what pserver's Sequential.summary() returned before).
        A model whose input has a dimension of unknown size, before its first data: its layers in
        the order they are called, their shapes and weights known once it is made."""
        if self._built_core is not None or getattr(self, "_graph", None) is None:
            return self._core.summary_text()
        inputs, outputs = self._graph
        order = deferred_order(_flat(outputs), {id(x) for x in _flat(inputs) if x.unknown})
        layers = list({id(t.node.fn): t.node.fn for t in order if isinstance(t.node.fn, Layer)}.values())
        rule, later = "_" * 65, "at the first data"
        lines = [f'Model: "{self.name}" (an input of unknown size: made at its first data)', rule,
                 f" {'Layer (type)':<29}{'Output Shape':<26}Param #", "=" * 65]
        taken: set[str] = set()
        for layer in layers:                  # named as the model will name them (dense, dense_1, ...)
            name = layer.name or free_name(layer.kind, taken)
            taken.add(name)
            lines += [f" {name + ' (' + type(layer).__name__ + ')':<29}{later:<26}?", ""]
        if layers:
            lines.pop()
        return "\n".join([*lines, "=" * 65, "Total params: ? (at the first data)", rule])

    def get_config(self) -> dict:
        return self._core.get_config()

    # -- weights --------------------------------------------------------------------------------

    # A layer two models hold (one called as a layer in the other: an encoder in its autoencoder)
    # has one set of weights, as in Keras, though each model trains its own flat vector: setting a
    # model's weights (fit, set_weights, load_weights) marks each of its layers with them and a
    # stamp, and a model reading its weights first takes those of its layers another model set
    # since it last did (_shared).
    @property
    def _w(self) -> np.ndarray | None:
        return self._w_value

    @_w.setter
    def _w(self, w: np.ndarray | None) -> None:
        self._w_value = w
        self._synced = next(_stamps)
        if w is not None and self._built_core is not None:
            for layer, views in zip(self._core.layers, self._core._per_layer(self._core.layout.views(w))):
                if views:
                    layer._set_by = (self._synced, views)

    def _weights(self) -> np.ndarray:
        if self._w is None:
            fresh = self._core.init_params(cluster.seed())
            self._w_value, self._synced = fresh, 0          # a layer another model set keeps its weights
            self._w = self._shared(fresh)                   # and the others are marked as this model's
        elif (shared := self._shared(self._w)) is not self._w:
            self._w = shared
        return self._w

    def _shared(self, w: np.ndarray) -> np.ndarray:
        """`w` with the weights of its layers that another model set since this one last did."""
        newer = [(i, layer._set_by[1]) for i, layer in enumerate(self._core.layers)
                 if getattr(layer, "_set_by", (0,))[0] > self._synced]
        if not newer:
            return w
        w = w.copy()
        mine = self._core._per_layer(self._core.layout.views(w))
        for i, theirs in newer:
            for name, view in mine[i].items():
                view[...] = theirs[name]
        return w

    def _sparse(self) -> bool:
        return bool(getattr(self._core, "sparse_tables", None))

    def _rows(self, what: str) -> dict:
        """predict's and evaluate's `rows` for a model with sparse tables: their rows as fit (or
        load_model) left them; a model that has neither has none to read."""
        if not self._sparse():
            return {}
        if self._tables is None:
            names = ", ".join(t.name for t in self._core.sparse_tables)
            raise ConfigError(f"{what}: the model's sparse tables ({names}) hold rows only once it "
                              "is trained: fit it first (or load a saved one)")
        return {"rows": self._tables.rows}

    def get_weights(self) -> list[np.ndarray]:
        """Each layer's weights in order (kernel, bias, ...), as Keras's: copies."""
        views = self._core.layout.views(self._weights())
        return [views[t.name].copy() for t in self._core.layout.tensors]

    def count_params(self) -> int:
        """The weights' values, as Keras's count_params: the dense tensors' (the moving statistics
        included, as Keras counts non-trainable weights). A sparse table's rows are not counted:
        they grow on the shards as ids come (Keras-RS's tables count vocabulary x dim)."""
        return int(self._core.layout.total)

    def set_weights(self, weights) -> None:
        tensors = self._core.layout.tensors
        weights = list(weights)
        if len(weights) != len(tensors):
            raise ConfigError(f"set_weights: {self.name} has {len(tensors)} weight arrays, "
                              f"got {len(weights)}")
        w = self._weights().copy()
        views = self._core.layout.views(w)
        for t, value in zip(tensors, weights):
            value = np.asarray(value)
            if value.shape != tuple(t.shape):
                raise ConfigError(f"set_weights: {t.name} has shape {tuple(t.shape)}, got {value.shape}")
            views[t.name][...] = value
        self._w = w

    @property
    def trainable(self) -> bool:
        return all(layer.trainable for layer in self.layers)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        """Freeze (False) or unfreeze every layer, as Keras's model.trainable; read when fit starts.
        On a cluster (pserver run) the shards keep the first fit's frozen weights: a later fit
        that freezes others is refused."""
        for layer in self.layers:
            layer.trainable = value

    @property
    def trainable_weights(self) -> list[np.ndarray]:
        """Copies of the weights training changes, in order (Keras's are variables)."""
        return self._split_weights()[0]

    @property
    def non_trainable_weights(self) -> list[np.ndarray]:
        """Copies of the weights training leaves as they are (frozen layers, add_weight(trainable=False))."""
        return self._split_weights()[1]

    def _split_weights(self) -> tuple[list, list]:
        frozen = set(self._core.frozen_weights())
        weights = zip(self._core.layout.tensors, self.get_weights())
        split: tuple[list, list] = ([], [])
        for t, value in weights:
            split[t.name in frozen].append(value)
        return split

    # -- training -------------------------------------------------------------------------------

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1):
        """Keras's fit on arrays, a generator of batches or a keras.utils.PyDataset (pserver.keras.
        data); returns a History (also `model.history`). sample_weight (one per sample) or
        class_weight ({class: weight}) weigh each sample's loss as Keras's: sum(w_i * loss_i) / n
        per batch; the weights go with their samples to every worker."""
        _refuse("fit", {}, validation_steps=validation_steps, validation_batch_size=validation_batch_size,
                validation_freq=None if validation_freq == 1 else validation_freq)
        if not self._compiled:
            raise ConfigError("fit: compile the model first (model.compile(optimizer=..., loss=...))")
        if shuffle not in (True, False):      # Keras's "batch" is for HDF5 files
            raise ConfigError(f"fit: shuffle must be True or False, got {shuffle!r}")
        if verbose not in ("auto", 0, 1, 2):
            raise ConfigError(f"fit: verbose must be 'auto', 0, 1 or 2, got {verbose!r}")
        if not 0 <= validation_split < 1:
            raise ConfigError(f"fit: validation_split must be in [0, 1), got {validation_split!r}")
        if validation_split and validation_data is not None:
            raise ConfigError("fit: give validation_split or validation_data, not both")
        place = cluster.current()
        workers, rank = (place.num_workers, place.rank) if place else (1, 0)
        if data.streamed(x):
            x, steps, val = self._fit_stream(x, y, batch_size, epochs, shuffle, sample_weight,
                                             class_weight, steps_per_epoch, validation_split,
                                             validation_data, rank, workers)
            y, per_worker = None, 1
            _refuse_stopping(callbacks, workers)
        else:
            x, y, steps, per_worker, val = self._fit_arrays(x, y, batch_size, sample_weight, class_weight,
                                                            steps_per_epoch, validation_split,
                                                            validation_data, workers)
        validation_data, has_validation, weighted = val.data, val.shown, val.weighted
        if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
            raise ConfigError(f"fit: initial_epoch={initial_epoch!r} must be in [0, epochs={epochs})")
        history = callbacks_module.History()
        user = list(callbacks or ())
        shown = verbose != 0 and rank == 0
        params = {"epochs": epochs, "verbose": verbose, "steps": steps}
        # Keras's order: the user's callbacks, then the epoch line and History, which so see
        # what the callbacks add to the logs (learning_rate)
        listeners = user + ([callbacks_module.EpochLine()] if shown else []) + [history]
        hooks = callbacks_module.CallbackList(listeners, self, params, self._core.metrics, initial_epoch,
                                              has_validation)
        self._core.initial = self._w
        if self._sparse():            # every rank keeps the final rows (worker.loop.keep_tables)
            self._tables_dir = tempfile.TemporaryDirectory(prefix="pserver-keras-tables-")
            hooks.tables_dir = os.path.join(self._tables_dir.name, "model")
        options = {"epochs": epochs - initial_epoch, "batch_size": per_worker, "seed": cluster.seed(),
                   "no_shuffle": not shuffle, **self.optimizer.gradient_clip()}
        # What the shards must run. The mode is not the script's to say: its own shard is sync, and
        # under `pserver run` the run's --mode (and --backup-workers, --staleness) decide.
        shard_settings = self.optimizer.settings()
        with _quiet(not shown or verbose == 2), self._weighted(weighted):      # 2: epoch lines only
            if place is None:
                api.train(self._core, x, y, ps=OWN_SHARDS, validation_data=validation_data,
                          callbacks=hooks, mode="sync", **options, **shard_settings)
            else:
                again = place.begin_fit() > 1     # the shards hold the earlier fit's finished data
                addresses = place.shards(shard_settings, meanwhile=api.preload)
                hooks.shard_settings = self.optimizer.settings()     # checked at Register (worker.loop)
                api.train(self._core, x, y, ps=list(addresses), rank=rank, num_workers=workers,
                          validation_data=validation_data, callbacks=hooks, no_resume=again, **options)
                place.fit_done()
        if hooks.weights is not None:
            self._w = hooks.weights
        if self._sparse():
            self._tables = model_file.load(hooks.tables_dir, model=self._core)
        self.history = history
        return history

    def _x(self, x, what: str) -> np.ndarray:
        """x as one array: a Functional's several inputs (a list, a dict by name) side by side."""
        self._ready(x)
        try:
            x = self._core.preprocess(x)          # lookup and text layers: their output, once
            if isinstance(self._core, _Sequential) and not self._sparse():
                return np.asarray(x)
            return self._core.pack(x)
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None

    def _arrays(self, x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
        x = self._x(x, what)
        if x.dtype.kind in "biu" and not self._core._takes_ids:
            x = x.astype(np.float32)
        try:
            y = self._core.labels(y)
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None
        if len(x) != len(y):
            raise DataError(f"{what}: x has {len(x)} samples, y {len(y)}")
        return x, y

    def _validation(self, validation_data, sample, weighted: bool) -> "_Validation":
        """fit's validation data (x, y) with y as training's (the weights' column when training or
        validation is weighted); without any, a sample the loop evaluates and fit does not show."""
        if validation_data is None:
            return _Validation(_weigh(sample, None, weighted), False, weighted)
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
            raise ConfigError("fit: validation_data: give (x_val, y_val) or (x_val, y_val, sample_weight)")
        val_x, val_y = self._arrays(*validation_data[:2], "fit: validation_data")
        val_sw = None if len(validation_data) == 2 else \
            self._sample_weights(val_y, validation_data[2], None, "fit: validation_data")
        weighted = weighted or val_sw is not None
        return _Validation(_weigh((val_x, val_y), val_sw, weighted), True, weighted)

    def _fit_arrays(self, x, y, batch_size, sample_weight, class_weight, steps_per_epoch, validation_split,
                    validation_data, workers: int):
        """fit's x and y arrays: (x, y with the weights' column when weighted, the global steps an
        epoch, the batch per worker, the validation)."""
        _refuse("fit", {}, steps_per_epoch=steps_per_epoch)
        if x is None or y is None:
            raise ConfigError("fit: give x and y (arrays), or x alone: a generator or a PyDataset")
        x, y = self._arrays(x, y, "fit")
        sw = self._sample_weights(y, sample_weight, class_weight, "fit")
        if validation_split:                  # the last fraction, before any shuffling (Keras's)
            at = int(math.ceil(len(x) * (1.0 - validation_split)))
            validation_data = (x[at:], y[at:], *(() if sw is None else (sw[at:],)))
            x, y, sw = x[:at], y[:at], None if sw is None else sw[:at]
        val = self._validation(validation_data, (x[:1], y[:1]), sw is not None)
        if val.weighted:                      # the weights travel as y's last column (Functional.unweigh)
            y = _with_weights(y, sw)
        batch_size = 32 if batch_size is None else batch_size
        if not isinstance(batch_size, int) or batch_size < workers or batch_size % workers:
            raise ConfigError(f"fit: batch_size={batch_size!r} is the global batch, split across "
                              f"{workers} worker(s): give a multiple of {workers}")
        steps = max(1, -(-len(x) // batch_size))       # the last global batch may be smaller
        # Fewer samples than a batch: one batch of all of them, as Keras (each worker its slice)
        per_worker = min(batch_size, len(x)) // workers
        if per_worker < 1:
            raise ConfigError(f"fit: {len(x)} training sample(s) for {workers} workers: each worker "
                              "needs one at least")
        return x, y, steps, per_worker, val

    def _fit_stream(self, x, y, batch_size, epochs, shuffle, sample_weight, class_weight, steps_per_epoch,
                    validation_split, validation_data, rank: int, workers: int):
        """fit's x a generator or a PyDataset: (this worker's batches per epoch, the steps an
        epoch or None, the validation), each batch made as arrays are (labels, weights)."""
        _refuse("fit: x is batches", {}, y=y, batch_size=batch_size, sample_weight=sample_weight,
                validation_split=validation_split or None)
        batches = data.Batches(x, steps_per_epoch, shuffle, rank, workers, cluster.seed())
        if not batches.dataset and batches.steps is None and epochs > 1:
            raise ConfigError("fit: a generator with epochs > 1 needs steps_per_epoch (the batches each "
                              "worker trains an epoch)")
        first_x, first_y = self._arrays(*batches.first[:2], "fit: batch 0")
        weighted = batches.first[2] is not None or class_weight is not None
        val = self._validation(validation_data, (first_x[:1], first_y[:1]), weighted)

        def convert(batch):
            bx, by = self._arrays(*batch[:2], "fit: a batch")
            if (batch[2] is None) != (batches.first[2] is None):
                raise DataError("fit: every batch has a sample_weight, or none does (as the first)")
            return bx, _weigh((bx, by), self._sample_weights(by, batch[2], class_weight, "fit: a batch"),
                              val.weighted)[1]
        batches.convert = convert
        return batches.epoch, batches.steps, val

    def _sample_weights(self, y: np.ndarray, sample_weight, class_weight, what: str) -> np.ndarray | None:
        """Each sample's weight, float32 (n,), from sample_weight or class_weight ({class:
        weight}, 1 for a class not named, as Keras's); None without either."""
        if sample_weight is None and class_weight is None:
            return None
        if sample_weight is not None and class_weight is not None:
            raise ConfigError(f"{what}: give sample_weight or class_weight, not both (as Keras)")
        if self._sparse() or self._core.several or self._core.steps > 1:
            raise ConfigError(f"{what}: sample_weight and class_weight are supported for a model with one "
                              "output without steps and no sparse tables")
        if class_weight is not None:
            if not isinstance(class_weight, dict) or self._core.task != "classification":
                raise ConfigError(f"{what}: class_weight must be a dict {{class: weight}} for a classifier, "
                                  f"got {type(class_weight).__name__}")
            sample_weight = [class_weight.get(int(c), 1.0) for c in np.round(y)]
        sw = np.asarray(sample_weight, dtype=np.float32)
        sw = sw[:, 0] if sw.ndim == 2 and sw.shape[1] == 1 else sw
        if sw.shape != (len(y),):
            raise DataError(f"{what}: sample_weight has shape {sw.shape}; give one weight per sample "
                            f"({len(y)},)")
        if not np.isfinite(sw).all():
            raise DataError(f"{what}: sample_weight has NaN or Inf values")
        return sw

    @contextlib.contextmanager
    def _weighted(self, on: bool):
        """The core reads y's last column as the sample weights while this runs."""
        self._core.sample_weighted = on
        try:
            yield
        finally:
            self._core.sample_weighted = False

    # -- inference ------------------------------------------------------------------------------

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """The model's outputs: probabilities after a softmax (sigmoid) last layer, as Keras's;
        several: a list in output order, or a dict by name for a dict of outputs."""
        _refuse("predict", {}, steps=steps, callbacks=callbacks)
        x = self._x(x, "predict")
        core = self._core
        out = core.predict(self._weights(), x, batch_size=batch_size or 4096, **self._rows("predict"))
        if not core.several:
            return activations.probabilities(core.output_activation, out)
        outs = [activations.probabilities(a, o) for a, o in zip(core.output_activations, out)]
        return dict(zip(core.output_names, outs)) if core._dict_outputs else outs

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False):
        """The loss and the compiled metrics, as Keras's: a scalar without metrics, else
        [loss, metric, ...], or a dict with return_dict=True."""
        _refuse("evaluate", {}, steps=steps, callbacks=callbacks)
        x, y = self._arrays(x, y, "evaluate")
        sw = self._sample_weights(y, sample_weight, None, "evaluate")
        with self._weighted(sw is not None):
            ev = self._core.evaluate(self._weights(), x, y if sw is None else _with_weights(y, sw),
                                     batch_size=batch_size or 4096, **self._rows("evaluate"))
        result = {"loss": ev["loss"], **{m: ev[m] for m in self._core.metrics if m in ev}}
        place = cluster.current()
        if verbose != 0 and (place is None or place.rank == 0):
            print(" - ".join(f"{k}: {v:.4f}" for k, v in result.items()), flush=True)
        if return_dict:
            return result
        return result["loss"] if len(result) == 1 else list(result.values())

    # -- files ----------------------------------------------------------------------------------

    def save(self, filepath, overwrite=True, **kwargs) -> None:
        """The model file (its layers' configs and the weights): load_model builds it again (a
        subclassed Model from its registered class and get_config, traced again)."""
        _refuse("save", kwargs)
        filepath = os.fspath(filepath)
        if not overwrite and os.path.exists(filepath):
            raise ConfigError(f"save: {filepath} exists (overwrite=False)")
        place = cluster.current()
        if place is not None and place.rank != 0:
            return                            # the chief's to write, as a Keras chief saves
        compiled = self.optimizer.get_config() if self.optimizer else None
        tables = None
        if self._rows("save"):                # a model with sparse tables: their rows too
            tables = {t.name: (t.ids, t.rows) for t in self._tables.tables}
        model_file.save(filepath, self._core, self._weights(), {"keras_optimizer": compiled}, {},
                        tables=tables)


    def save_weights(self, filepath, overwrite=True) -> None:
        """Keras's: the weights to a ".weights.h5" path (pserver's model file, which holds the
        layers' configs too), for load_weights."""
        if not os.fspath(filepath).endswith(".weights.h5"):
            raise ConfigError(f"save_weights: filepath={os.fspath(filepath)!r} must end in .weights.h5 "
                              "(as Keras)")
        self.save(filepath, overwrite=overwrite)

    def load_weights(self, filepath) -> None:
        """The weights of a file model.save or save_weights wrote for a model of this layout
        (ModelFileError naming the difference otherwise)."""
        filepath = os.fspath(filepath)
        meta, arrays = model_file.read(filepath)
        self._w = model_file.weights_of(filepath, meta, arrays, self._core.layout)


class Sequential(_Model):
    """keras.Sequential([keras.Input(shape=(28, 28, 1)), layers.Conv2D(32, 3), ...])."""

    def __init__(self, layers=None, trainable=True, name=None):
        super().__init__(_Core(name=name or "sequential", loss=_losses.Pending()))
        self._auto_named: set[int] = set()      # the layers this model named (dense, dense_1, ...)
        for layer in layers or ():
            self.add(layer)
        if trainable is not True:
            self.trainable = trainable

    def add(self, layer) -> None:
        if isinstance(layer, Symbolic) and layer.node is None:     # keras.Input: the input shape
            if self.layers:
                raise ConfigError("Sequential.add: keras.Input goes first")
            if not layer.unknown:              # a dimension None: built at the first data, on its shape
                self._core._input_shape = layer.shape[1:]
            return
        if getattr(layer, "name", None) is None:
            self._auto_named.add(id(layer))
        self._core.add(layer)

    def __call__(self, inputs, training=None):
        """Called on a model's tensors (a Sequential inside a layer's call, keras.io's feed-forward
        block): its layers in turn, as Keras's; the graph holds their weights (not this model)."""
        for layer in self.layers:       # named by the enclosing model (Keras's names are global)
            if id(layer) in self._auto_named:
                layer.name = None
        self._auto_named = set()
        x = inputs
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def build(self, input_shape=None) -> None:
        if input_shape is not None:          # Keras's includes the batch dimension
            input_shape = tuple(input_shape)[1:]
        self._core.build(input_shape)

    def _ready(self, x) -> None:
        """Without an input shape the layers are called at the first data, on its shape (Keras's
        deferred build)."""
        core = self._core
        if not core._built and x is not None and core._input_shape is None \
                and (not core.layers or core.layers[0].input_shape is None):
            shape = np.shape(x)[1:]
            if not shape and core.layers and getattr(core.layers[0], "preprocessing", False):
                shape = (1,)                  # a string (a value) per sample: Keras's (n,) text arrays
            core.build(shape)

    @classmethod
    def from_config(cls, config: dict) -> "Sequential":
        model = cls(name=config.get("name"))
        model._core = _Core.from_config(config)
        return model


class Model(_Model):
    """keras.Model(inputs, outputs): the layers and ops called from keras.Input tensors to the
    output, as one graph (pserver.models.Functional); inputs a tensor, a list or a dict by name.

    Or subclassed, as Keras's: layers made in __init__ (after super().__init__()) and used in
    `call(inputs, training=None)`, which is traced at the first data (or `build`) on
    keras.Input tensors of its shapes, once per training value, into the same graph."""

    def __init__(self, inputs=None, outputs=None, name=None, trainable=True, **unsupported):
        _refuse("Model", unsupported)
        if inputs is None and outputs is None and type(self).call is not Model.call:
            _refuse("Model", {}, trainable=None if trainable is True else trainable)   # no layers yet
            super().__init__(None, name or snake_case(type(self).__name__))
            return
        if inputs is None or outputs is None:
            raise ConfigError("Model: give inputs= and outputs= (keras.Input tensors and the tensor "
                              "computed from them), or subclass Model and define call")
        # As given (model.input, model.output); with an Input of unknown size, the calls the graph
        # is made of at the first data (_made_for), the core None until then.
        self._graph = (inputs, outputs)
        if unknown(inputs, outputs):
            super().__init__(None, name or "functional")
        else:
            super().__init__(_FunctionalCore(inputs, outputs, name=name or "functional",
                                             loss=_losses.Pending()))
        if trainable is not True:
            self.trainable = trainable

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._arguments = init_arguments(cls, args, kwargs)    # a subclass's automatic get_config
        return self

    def call(self, inputs, training=None):
        raise ConfigError(f"{self.name}: a subclassed keras.Model defines call(self, inputs)")

    @property
    def output_names(self) -> list[str]:
        """Keras's: each output's name (a dict's keys, else the layer that makes it)."""
        return list(self._core.output_names)

    def _subclassed(self) -> bool:
        return type(self).call is not Model.call

    def __call__(self, inputs, training=None, **kwargs):
        """A subclassed Model called on symbolic tensors, as a layer (one, shared by every call):
        how its graph is traced, and rebuilt from a model file."""
        if not self._subclassed():
            return self._called_as_layer(inputs, training, kwargs)
        if getattr(self, "_model_call", None) is None:
            self._model_call = ModelCall(self, name=self.name)
        return self._model_call(inputs, training=training, **kwargs)

    def _called_as_layer(self, inputs, training, kwargs):
        """keras.Model(inputs, outputs) called on tensors (Keras's "every model is callable, like a
        layer": an encoder in an autoencoder, an ensemble's members, a base model with
        training=False): its layers called again on them, in its graph's order
        (pserver.models.graph_config.inline). They are the same layers, so the two models share
        their weights, and the enclosing model lists them as its own (Keras lists the model as one
        layer). `training`, when given, is every one of its layer calls'."""
        if kwargs:
            raise ConfigError(f"{self.name}: takes no argument {sorted(kwargs)[0]!r} when called")
        if unknown(inputs):                  # made with the enclosing model, at its first data
            return defer(self, (inputs,), {"training": training}, f"model {self.name}")
        core = self._built_core
        struct = self._graph[0] if core is None else \
            dict(zip(core._keys, core._given)) if core._dict_inputs else list(core._given)
        given, xs = _matched(self.name, struct, inputs, "the call")
        if not all(isinstance(x, Symbolic) for x in xs):
            raise ConfigError(f"{self.name}: call it on tensors (keras.Input or a layer's output), "
                              f"got {inputs!r}")
        for g, x in zip(given, xs):
            if not _fits(g.shape[1:], x.shape[1:]):
                raise ConfigError(f"{self.name}: input {g.name!r} takes {g.shape}, called on {x.shape}")
        if core is None:                     # an Input of unknown size: the model made for these shapes
            example = [np.zeros((1, *x.shape[1:]), x.dtype) for x in xs]
            self._ready(example if len(example) > 1 else example[0])
            core = self._core
        outs = graph_config.inline(core._given, core._outputs, xs, training)
        if core._dict_outputs:
            return dict(zip(core.output_names, outs))
        return outs[0] if len(outs) == 1 else outs

    def get_config(self) -> dict:
        """A Functional's graph; a subclassed Model's name and, unless the subclass overrides
        get_config (calling this for the base), its constructor's arguments: Keras's automatic
        config, which from_config gives back to __init__. A file holds JSON values only: a
        subclass taking a layer or an array overrides get_config and from_config, as in Keras."""
        if not self._subclassed():
            return super().get_config()
        params = inspect.signature(type(self).__init__).parameters.values()
        takes_name = any(p.name == "name" or p.kind is p.VAR_KEYWORD for p in params)
        config = {"name": self.name} if takes_name else {}
        return config if type(self).get_config is not Model.get_config else {**config, **self._arguments}

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        """A Functional's config: the graph; else a subclass's: cls(**config), as Keras's."""
        if config.get("class_name") == "Functional" and cls.call is Model.call:
            model = cls.__new__(cls)
            _Model.__init__(model, _FunctionalCore.from_config(config))
            return model
        try:
            return cls(**config)
        except TypeError as e:
            raise ConfigError(f"{cls.__name__}: cannot be built again from its config {config!r} ({e}): "
                              "its get_config must give its __init__'s arguments, or it defines "
                              "from_config") from None

    def build(self, input_shape) -> None:
        """Trace a subclassed Model's call for inputs of `input_shape` (with the batch, as Keras's;
        a list of them for several inputs)."""
        several = isinstance(input_shape, list)
        shapes = input_shape if several else [input_shape]
        self._ready([np.zeros((1, *tuple(s)[1:]), np.float32) for s in shapes] if several else
                    np.zeros((1, *tuple(input_shape)[1:]), np.float32))

    def _ready(self, x) -> None:
        made = self._built_core is not None
        super()._ready(x)
        if made and x is not None and getattr(self, "_graph", None) is not None:
            self._same_size(x)

    def _same_size(self, x) -> None:
        """Data for a model made at its first data (an Input of unknown size) whose samples have
        another size there: one line saying so, where the first layer would name only its own
        shapes. pserver plans a model for one shape."""
        given = _flat(self._graph[0])
        if len(given) == 1 and not isinstance(x, dict):
            arrays = [x]
        else:
            try:
                given, arrays = _matched(self.name, self._graph[0], x, "the data")
            except ConfigError:
                return                            # the data's own check says what is wrong
        for g, made, a in zip(given, self._core._given, arrays):
            if g.unknown and isinstance(a, np.ndarray) and made.shape[1:] != a.shape[1:]:
                raise DataError(f"{self.name}: input {g.name!r} is keras.Input(shape={g.shape[1:]}), and the "
                                f"model was made at its first data for samples of shape {made.shape[1:]}; "
                                f"these have {a.shape[1:]}: pad or cut them to {made.shape[1:]} "
                                f"(pserver plans a model for one shape, Keras for any)")

    def _trace(self, x):
        if x is None:
            return None
        if getattr(self, "_graph", None) is not None:     # a graph of unknown size (the core is None)
            return self._made_for(x)
        def like(a, name=None):
            a = np.asarray(a)
            return Input(shape=a.shape[1:], name=name, dtype="int32" if a.dtype.kind in "iu" else "float32")

        if isinstance(x, dict):              # a dict by name: Inputs of those names, a dict to call
            args = {k: like(a, k) for k, a in x.items()}
        else:
            args = [like(a) for a in x] if isinstance(x, (list, tuple)) else like(x)
        return _FunctionalCore(args, self(args), name=self.name, loss=_losses.Pending())


    def _made_for(self, x) -> "_FunctionalCore":
        """A graph whose inputs have a dimension of unknown size, made for the data `x`: each such
        Input takes the data's size, and the calls recorded on it are made again on that
        (pserver.ops.core.replay)."""
        inputs, outputs = self._graph
        given, arrays = _matched(self.name, inputs, x, "the data")
        bound = {}
        for g, a in zip(given, arrays):
            if g.unknown:
                bound[id(g)] = _sized(self.name, g, np.asarray(a))
        sized = [bound.get(id(g), g) for g in given]
        new_inputs = dict(zip(inputs, sized)) if isinstance(inputs, dict) else \
            sized if isinstance(inputs, (list, tuple)) else sized[0]
        made = replay(_flat(outputs), bound)
        new_outputs = dict(zip(outputs, made)) if isinstance(outputs, dict) else \
            made if isinstance(outputs, (list, tuple)) else made[0]
        return _FunctionalCore(new_inputs, new_outputs, name=self.name, loss=_losses.Pending())


def _flat(form) -> list:
    """Tensors (or arrays) given as one, a list or tuple, or a dict by name: as a list, in order."""
    return list(form.values()) if isinstance(form, dict) else \
        list(form) if isinstance(form, (list, tuple)) else [form]


def _matched(model: str, inputs, values, what: str) -> tuple[list, list]:
    """A model's Inputs (`inputs`: one, a list, or a dict by name) in order, and `values`
    (tensors or arrays: one, a list in that order, or a dict by the Inputs' keys or names)
    matched to them."""
    given = _flat(inputs)
    if isinstance(values, dict):
        keys = list(inputs) if isinstance(inputs, dict) else [g.name for g in given]
        missing = [k for k in keys if k not in values]
        if missing:
            raise ConfigError(f"{model}: {what} has no input {missing[0]!r} (it has {sorted(values)})")
        found = [values[k] for k in keys]
    else:
        found = _flat(values)
    if len(found) != len(given):
        raise ConfigError(f"{model}: takes {len(given)} input(s), {what} has {len(found)}")
    return given, found


def _fits(dims: tuple, shape: tuple) -> bool:
    """Whether a sample of `shape` fits an Input's `dims` (a None takes any size)."""
    return len(dims) == len(shape) and all(d is None or d == n for d, n in zip(dims, shape))


def _sized(model: str, x: Symbolic, a: np.ndarray) -> Symbolic:
    """keras.Input `x`, whose shape has a dimension None, with the size the data `a` has there."""
    dims = x.shape[1:]
    if not _fits(dims, a.shape[1:]):
        raise ConfigError(f"{model}: input {x.name!r} is keras.Input(shape={dims}), the data's samples "
                          f"have shape {a.shape[1:]}")
    return Symbolic((None, *a.shape[1:]), x.dtype, name=x.name)


class ModelCall(TracedLayer):
    """A subclassed Model's call as a traced layer (the graph traces it per training value);
    the first row of the model's summary."""

    kind = "model_call"

    def __init__(self, model: Model, **kwargs):
        super().__init__(**kwargs)
        self.model = model

    def call(self, inputs, training=None):
        if "training" in inspect.signature(self.model.call).parameters:
            return self.model.call(inputs, training=training)
        return self.model.call(inputs)

    def saved_class(self) -> type:
        return type(self.model)          # a file names the model's class: rebuilt by its from_config

    def get_config(self) -> dict:
        return self.model.get_config()


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True) -> _Model:
    """A model file written by model.save (or by pserver with a Sequential or a Functional): the
    model built again from its layers' configs (a graph's: a keras.Model; a subclassed Model's:
    an instance of its class, from its get_config), with its weights, compiled as it was. Its
    layers are pserver's built-in ones and the classes registered in this process
    (keras.saving.register_keras_serializable): the file runs no code of its own, and a Lambda
    whose function is a Python lambda loads only with safe_mode=False, as Keras's;
    custom_objects ({name: class or function}) are found before the registries. A file whose
    model is built by code (a --model package.module:FUNCTION file) is no Sequential: with
    safe_mode=True (Keras's default) it is refused as unsafe (UnsafeModelFile), with
    safe_mode=False as not a Keras model (pserver.load_model(..., safe_mode=False) loads it). A
    file naming an unknown optimizer or layer, or malformed, raises ModelFileError naming it."""
    if not isinstance(safe_mode, bool):
        raise ConfigError(f"load_model: safe_mode must be True or False, got {safe_mode!r}")
    if not isinstance(compile, bool):
        raise ConfigError(f"load_model: compile must be True or False, got {compile!r}")
    filepath = os.fspath(filepath)
    meta, arrays = model_file.read(filepath)
    model_file.refuse_delta(filepath, meta)
    if not meta.get("sequential"):
        if safe_mode:
            model_file.refuse_code(filepath, meta)
        raise ConfigError(f"{filepath}: holds no Sequential's config (a --model file: use "
                          "pserver.load_model)")
    config = meta["sequential"]
    with saving.loading(safe_mode, custom_objects), model_file.model_file_errors(filepath):
        model = (Model if config.get("class_name") == "Functional" else Sequential).from_config(config)
    model = _subclassed(model, config)
    model._w = model_file.weights_of(filepath, meta, arrays, model._core.layout)
    if model._sparse():
        model._tables = model_file.load(filepath, model=model._core)
    with model_file.model_file_errors(filepath):
        opt = meta.get("keras_optimizer")
        if compile and opt is not None:
            model.optimizer = optimizers.from_settings(opt)
            model._compiled = True
    return model


def _subclassed(model: _Model, config: dict) -> _Model:
    """A subclassed Model's file holds its traced graph: the model called once on the inputs.
    load_model returns that model (of its class, as Keras's), the graph its core."""
    first = model.layers[0] if model.layers else None
    if (len(config.get("nodes", ())) != 1 or not isinstance(first, ModelCall)
            or first.model.name != config.get("name")):     # a Functional calling a subclassed Model
        return model
    inner = first.model
    inner._core = model._core
    return inner


def _refuse_stopping(callbacks, workers: int) -> None:
    """Batches from Python on a cluster have no coordinator to share the chief's logs and stop
    decision (docs/semantics.md): a callback that stops on its logs would stop one worker alone."""
    stopping = [c for c in callbacks or () if isinstance(c, (callbacks_module.EarlyStopping,
                                                             callbacks_module.TerminateOnNaN))]
    if stopping and workers > 1:
        raise ConfigError(f"fit: {type(stopping[0]).__name__} with a generator or a PyDataset on a cluster "
                          "is not supported (each worker's logs are its own: one worker would stop alone); "
                          "give arrays, or fit without it")


@dataclass(frozen=True)
class _Validation:
    data: tuple          # (x, y): y with the weights' column when `weighted`
    shown: bool          # given by the user (else a sample: the logs have no val_*)
    weighted: bool       # training or validation has sample weights


def _weigh(xy: tuple, sample_weight, weighted: bool) -> tuple:
    return (xy[0], _with_weights(xy[1], sample_weight)) if weighted else xy


def _with_weights(y: np.ndarray, sample_weight: np.ndarray | None) -> np.ndarray:
    """y with each sample's weight (1 without weights) as a second column, float32: labels
    are classes or targets, exact in float32 (classes up to 2**24)."""
    w = np.ones(len(y), np.float32) if sample_weight is None else sample_weight
    return np.column_stack([y, w]).astype(np.float32)


@contextlib.contextmanager
def _quiet(quiet: bool):
    """A worker other than the chief (or verbose=0) prints nothing; its errors still raise."""
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        old = sys.stderr
        sys.stderr = null
        try:
            yield
        finally:
            sys.stderr = old


def _refuse(where: str, unknown: dict, **given) -> None:
    """ConfigError naming the first argument pserver does not support (one not at its
    default: None here), or one Keras does not have."""
    if unknown:
        raise ConfigError(f"{where}: unexpected argument {sorted(unknown)[0]!r}")
    for name, value in given.items():
        if value is not None:
            raise ConfigError(f"{where}: {name}={value!r} is not supported by pserver "
                              "(docs/guide/keras.md lists what is)")


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Sequential", "Model", "Input", "load_model"]
