"""Functional: the graph model every model is (Keras's functional API); `Sequential` is its
chain. It trains on a flat parameter vector and owns the checks, loss, metrics, evaluation and
summary of every model.

    x = keras.Input(shape=(784,)); h = Dense(64, activation="relu")(x)
    model = Functional(x, Dense(10)(layers.add([h, Dense(64)(h)])))

The layout is every layer's weights end to end in order of first use, named "<layer>/<weight>"
("dense/kernel", "conv2d/bias"), so shards, modes, checkpoints and the data plane see one flat
vector of named tensors whatever the layers are. The graph is planned once per `training` value
(pserver.models.graph); every layer writes its gradient straight into its views of `grad_out`,
and activations, deltas and scratch are preallocated per thread and batch size. Several inputs
(a list, or a dict by name) travel as one array: each sample's inputs flattened side by side (a
worker slices rows of it like any x); `pack` makes it from the arrays, the model splits it.
Several outputs (a list, or a dict by name) each have a loss, and their labels travel as one
array the same way (pserver.models.outputs).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.kernels import get_backend
from pserver.layers import serialize
from pserver.layers.activations import probabilities
from pserver.layers.base import Layer, Pass
from pserver.models import graph, graph_config, losses, metrics
from pserver.models.base import BatchBuffers, Model, shaped_for
from pserver.models.layout import Layout
from pserver.models.metrics import compiled as compiled_metrics
from pserver.models.outputs import Heads, chunk_scores, scores
from pserver.models.sparse_graph import SparseProtocol, list_paddings, pad_lists
from pserver.ops.core import Symbolic, unknown


class Functional(SparseProtocol, Model):
    """Functional(inputs, outputs): the layers and ops called from keras.Input tensors to the
    output (or outputs: a list, or a dict by name). The loss is sparse categorical cross-entropy
    from logits (for every output) unless `compile(loss=...)` says otherwise. With dict inputs
    and sparse Embedding layers it takes records and speaks the sparse model protocol
    (pserver.models.sparse_graph).
    """

    def __init__(self, inputs, outputs, name: str = "functional", loss="sparse_categorical_crossentropy",
                 backend: str = "cpu"):
        self._setup(name, loss, backend)
        self._connect(inputs, outputs)

    def _setup(self, name: str, loss, backend: str) -> None:
        """What every model starts with (Sequential's too, whose graph is made at build)."""
        self.name = name
        self._built = False
        self.layers: list[Layer] = []
        # Lookup and text layers called on an input (pserver.layers.text): they run on the data
        # before the graph (preprocess), whose input is then their output.
        self.preprocessing_layers: list[Layer] = []
        self.loss = losses.get(loss)
        self.output_activations = ["linear"]   # a softmax/sigmoid fused into the loss: see losses
        self.metrics: list[str] = []
        self.metric_objects: list[metrics.Metric] = []    # those with a state of sums (metrics.Metric)
        # Keras's sample_weight (keras fit and evaluate set it while they run): y then carries
        # each sample's weight as a last column, so the weights travel wherever rows of y go.
        self.sample_weighted = False
        self.use_backend(backend)
        self._seeds = itertools.count()
        self._plans: dict[bool, graph.Plan] = {}
        self._sparse = None
        self._buffers = BatchBuffers(lambda n, dtype: ModelBuffers(self, n, dtype))
        self._views_kept: dict[int, tuple] = {}       # _layer_views: id(flat) -> (flat, views)
        self._aliases: dict[int, str] = {}            # _lname: id(layer) -> its name here, where not its own
        self._regs: tuple | None = None

    def _connect(self, inputs, outputs) -> None:
        """The graph from `inputs` to `outputs`; its layers (in order of first use) named."""
        if unknown(inputs, outputs):
            raise ConfigError(f"{self.name}: an input has a dimension of unknown size (None): "
                              "pserver.keras.Model makes such a graph at its first data, for its size")
        self._keys, self._inputs = _inputs(inputs, self.name)
        self._given = list(self._inputs)            # the keras.Inputs, as the config names them
        self._preprocessed = _preprocessed(self._given, outputs, self.name)
        for i, out in self._preprocessed.items():
            self._inputs[i] = out
        self._dict_inputs = isinstance(inputs, dict)
        self._dict_outputs = isinstance(outputs, dict)
        outs = list(outputs.values()) if self._dict_outputs else (
            list(outputs) if isinstance(outputs, (list, tuple)) else [outputs])
        bad = next((o for o in outs if not isinstance(o, Symbolic)), None)
        if not outs or bad is not None:
            raise ConfigError(f"{self.name}: outputs: give symbolic tensors (layers' outputs: one, a list "
                              f"or a dict by name); got {bad if outs else outputs!r}")
        self._outputs = outs
        self.layers = []
        for layer in self._plan(False).layers:
            self._name(layer)                    # Keras's names, numbered within the model
            self.layers.append(layer)
        self.preprocessing_layers = [out.node.layer for out in self._preprocessed.values()]
        for layer in self.preprocessing_layers:
            self._name(layer)
        self._alias()
        self.output_names = list(outputs) if self._dict_outputs else self._layer_names()
        if len(outs) > 1 and not isinstance(self.loss, Heads):      # one loss for every output
            self.loss = Heads.compiled(self.output_names, self.loss, None, None, self.name,
                                       self._dict_outputs)
        self.output_activations = ["linear"] * len(outs)

    def _layer_names(self) -> list[str]:
        """The outputs' names as Keras's: the layer that makes each (an op's: output_<j>)."""
        plan = self._plan(False)
        names = [f"output_{j}" if plan.output_step(j).layer is None
                 else plan.layers[plan.output_step(j).layer].name for j in range(len(plan.outputs))]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConfigError(f"{self.name}: two outputs are made by {dup!r}; give the outputs as a "
                              "dict by name")
        return names

    @property
    def several(self) -> bool:
        """Whether the model has several outputs: its loss is then their Heads."""
        return isinstance(self.loss, Heads)

    @property
    def output_activation(self) -> str:
        """A one-output model's last activation fused into its loss (predict applies it)."""
        (activation,) = self.output_activations
        return activation

    def add(self, layer) -> None:
        raise ConfigError(f"{self.name}: a Functional model's layers are those its outputs were "
                          "computed with; call the layer on a tensor instead")

    def compile(self, optimizer=None, loss="sparse_categorical_crossentropy",
                metrics=None, loss_weights=None) -> "Functional":
        """The loss and the metrics (accuracy, plus AUC for a binary loss; r2 for regression).
        Several outputs: loss, loss_weights and metrics as Keras's (pserver.models.outputs).
        The optimizer runs on the shards: this model takes none (pserver.keras's Sequential
        and Model take one and give it to the shards they start, or checks it against theirs)."""
        if optimizer is not None:
            raise ConfigError(f"compile: optimizer={optimizer!r}: the optimizer runs on the shards; "
                              "give it to them (pserver serve --optimizer adam --lr 0.001, or "
                              "pserver.train(..., optimizer='adam', lr=0.001)), or use "
                              "pserver.keras.Sequential, whose fit starts them")
        if self.several:
            self.loss = Heads.compiled(self.output_names, loss, loss_weights, metrics, self.name,
                                       self._dict_outputs)
            self.metrics = self.loss.log_names()
        elif loss_weights is not None:
            raise ConfigError(f"{self.name}: compile: loss_weights is for a model with several outputs")
        else:
            self.metrics, self.metric_objects = compiled_metrics(metrics)
            self.loss = losses.get(loss)
        if self._built:
            self._check_loss(self._shapes[1:])
            self._link_loss()
        return self

    def use_backend(self, backend: str) -> "Functional":
        """Compute with this kernel module: "cpu" (numba) or "reference" (NumPy)."""
        if backend == "cuda":
            raise ConfigError(f"{type(self).__name__}.use_backend: for cuda use pserver.models.on_device")
        self.backend, self.kernels = backend, get_backend(backend)
        return self

    def _plan(self, training: bool) -> graph.Plan:
        if training not in self._plans:
            plan = graph.Plan(self._inputs, self._outputs, training, self.name)
            if self._plans and [id(x) for x in plan.layers] != [id(x) for x in self.layers]:
                raise ConfigError(f"{self.name}: its layers differ between training and inference")
            unused = [x for i, x in enumerate(self._inputs) if plan.consumers[i] == 0]
            if unused:
                raise ConfigError(f"{self.name}: the output does not depend on the input {unused[0]}")
            self._plans[training] = plan
        return self._plans[training]

    # -- building ---------------------------------------------------------------------------------

    def build(self, input_shape=None) -> "Functional":
        if self._built:
            return self
        self._check_names()
        for layer in self.preprocessing_layers:     # their vocabularies are in the layout now
            layer.lock(self.name)
        self._fix_layout([self._packed_shape(), *(o.shape[1:] for o in self._outputs)])
        self._check_fused()
        self._check_statistics()
        self._find_sparse()
        self._built = True
        return self

    def _check_fused(self) -> None:
        """An output whose activation fuses into its loss computes logits: refused where anything
        else would read them (the layer called elsewhere, or its output feeding another layer)."""
        plan = self._plan(False)
        for j, activation in enumerate(self.output_activations):
            last = self._output_layer(j)
            if activation == "linear":
                continue
            if plan.uses(self.layers.index(last)) > 1:
                raise ConfigError(f"{self.name}: {last.label} computes the output and is called elsewhere "
                                  "too; its activation fuses into the loss there: give the output its own "
                                  "layer")
            if plan.consumers[plan.outputs[j]] > 1:
                raise ConfigError(f"{self.name}: {last.label} computes an output and feeds another layer "
                                  f"too; its activation='{activation}' fuses into the loss: make the output "
                                  "a linear layer then Activation, and feed the other layer the linear one")

    def _check_statistics(self) -> None:
        """A layer with moving statistics (BatchNormalization) called twice would push the sum of
        two batches' statistics as one: refused."""
        plan = self._plan(True)
        for i, layer in enumerate(plan.layers):
            if plan.uses(i) > 1 and any(w.momentum is not None for w in layer.weights()):
                raise ConfigError(f"{self.name}: {layer.label} is called {plan.uses(i)} times; its moving "
                                  "statistics take one batch per step: give each call its own layer")

    def _layout_of(self, weights: list[list]) -> Layout:
        """Every layer's weights (`weights`, per layer) in order, the moving statistics marked."""
        named = [(f"{self._lname(layer)}/{w.name}", w) for layer, ws in zip(self.layers, weights) for w in ws]
        layout = Layout.of((name, w.shape) for name, w in named).with_statistics(
            {name: w.momentum for name, w in named if w.momentum is not None})
        if not self.preprocessing_layers:
            return layout
        configs = json.dumps(self._layer_configs(self.preprocessing_layers), sort_keys=True)
        return dataclasses.replace(layout, vocabularies=hashlib.sha256(configs.encode()).hexdigest()[:16])

    def _fix_layout(self, shapes: list[tuple[int, ...]]) -> None:
        """The layout (every layer's weights, in order) and the loss on the outputs; `shapes`:
        the input's first, then each output's."""
        weights = [layer.weights() for layer in self.layers]
        layout = self._layout_of(weights)
        if layout.total == 0:
            raise ConfigError(f"{self.name}: has no parameters to train (layers: "
                              f"{', '.join(layer.name for layer in self.layers)})")
        for j, shape in enumerate(shapes[1:]):
            if len(shape) != 1 and (len(shapes) > 2 or not shape):
                raise ConfigError(f"{self.name}: {self._output_label(j)} outputs {shape}; outputs with "
                                  "steps are supported for a model with one output: end with Flatten() "
                                  "and Dense(...)")
        self._check_loss(shapes[1:])
        self._link_loss()
        self._shapes, self._layout, self._weights = shapes, layout, weights
        self._views_kept = {}
        self._regs = None             # _regularizers, found again for the new weights

    def _check_loss(self, shapes) -> None:
        """Each output's units against its loss."""
        for j, (loss, shape) in enumerate(zip(self._each_loss(), shapes)):
            where = f"{self.name}: {self._output_label(j)}" if self.several else self.name
            loss.check_outputs(shape[-1], where)

    def _each_loss(self) -> list[losses.Loss]:
        return self.loss.losses if self.several else [self.loss]

    def _output_layer(self, j: int):
        step = self._plan(False).output_step(j)
        return None if step.layer is None else self._plan(False).layers[step.layer]

    def _output_label(self, j: int) -> str:
        last = self._output_layer(j)
        if not self.several:
            return "the output" if last is None else f"the last layer ({last.label})"
        return f"the output {self.output_names[j]!r}" + ("" if last is None else f" ({last.label})")

    def _link_loss(self) -> None:
        """A softmax (sigmoid) last layer before a cross-entropy: the layer computes logits and
        the loss takes them (fused, stable); predict applies the activation. A softmax anywhere
        else is refused: no kernel computes it, or its gradient, on its own. Each output so."""
        lasts = [self._output_layer(j) for j in range(len(self._outputs))]
        for layer in self.layers:
            if all(layer is not last for last in lasts) and getattr(layer, "activation", None) == "softmax":
                raise ConfigError(f"{self.name}: {layer.label}: activation='softmax' is supported on the "
                                  "last layer only (before a categorical cross-entropy)")
        self.output_activations = [self._link_output(j, last, loss)
                                   for j, (last, loss) in enumerate(zip(lasts, self._each_loss()))]

    def _link_output(self, j: int, last, loss: losses.Loss) -> str:
        """Output j's activation fused into its loss ("linear": none)."""
        if not hasattr(last, "activation"):
            return "linear"
        declared = getattr(last, "declared_activation", last.activation)
        last.declared_activation = declared
        fused = loss.check_activation(declared, f"{self.name}: {self._output_label(j)}")
        last.activation = "linear" if fused else declared
        return declared if fused else "linear"

    def _packed_shape(self) -> tuple[int, ...]:
        if len(self._inputs) == 1:
            return self._inputs[0].shape[1:]
        return (sum(math.prod(x.shape[1:]) for x in self._inputs),)

    def get_config(self) -> dict:
        """The graph as JSON (pserver.models.graph_config), the loss and the metrics:
        `pserver.models.from_config` (so a model file's loader) builds the same model."""
        config = graph_config.to_config(self._keys, self._given, self._outputs, self._layer_configs)
        several = ({"dict_outputs": self._dict_outputs, "output_names": self.output_names}
                   if self.several else {})
        return {"class_name": "Functional", "name": self.name, "dict_inputs": self._dict_inputs, **config,
                **several, "loss": self.loss.get_config(), "metrics": list(self.metrics),
                **metrics.objects_config(self.metric_objects)}

    @classmethod
    def from_config(cls, config: dict, **kwargs) -> "Functional":
        name = config.get("name", "functional")
        try:
            keys, inputs, outputs = graph_config.from_config(config)
            if "outputs" in config:       # several: a Heads
                loss = Heads.from_config(config["loss"], name)
                if config.get("dict_outputs"):
                    outputs = dict(zip(config["output_names"], outputs))
            else:
                loss, outputs = losses.get(config["loss"]), outputs[0]
            model = cls(dict(zip(keys, inputs)) if config.get("dict_inputs") else inputs, outputs,
                        name=name, loss=loss, **kwargs)
        except (KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"a Functional model's config: {type(e).__name__} {e}") from None
        if model.several:
            model.metrics = model.loss.log_names()
        else:
            model.metrics, model.metric_objects = metrics.restored(config)
        return model

    def _layer_configs(self, layers: list[Layer]) -> list[dict]:
        """Each layer's class name and config (pserver.layers.serialize), named as in this model."""
        entries = [serialize(layer, self.name) for layer in layers]
        for layer, entry in zip(layers, entries):
            if id(layer) in self._aliases and isinstance(entry["config"].get("name"), str):
                entry["config"]["name"] = self._aliases[id(layer)]
        return entries

    def _name(self, layer: Layer) -> None:
        """Keras's default names (dense, dense_1, ...), numbered within this model."""
        if layer.name:
            return
        taken = {other.name for other in [*self.preprocessing_layers, *self.layers]}
        layer.name, layer._auto_named = free_name(layer.kind, taken), True

    def _lname(self, layer: Layer) -> str:
        """The layer's name in this model: its own, but where a layer another model named (one
        called as a layer here) has a name taken here, the next free one (dense_1, ...), as
        Keras's names are unique in a session. Its weights are named with it ("dense_1/kernel")."""
        return self._aliases.get(id(layer), layer.name)

    def _alias(self) -> None:
        self._aliases = {}
        taken: set[str] = set()
        for layer in [*self.preprocessing_layers, *self.layers]:
            name = layer.name
            if name in taken and getattr(layer, "_auto_named", False):
                name = self._aliases[id(layer)] = free_name(layer.kind, taken, first=1)
            taken.add(name)

    def _check_names(self) -> None:
        names = [self._lname(layer) for layer in [*self.preprocessing_layers, *self.layers]]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ConfigError(f"{self.name}: two layers are named {dup!r}")

    @property
    def layout(self) -> Layout:
        return self.build()._layout

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Without the batch dimension, as Keras's."""
        return self.build()._shapes[0]

    @property
    def output_shape(self):
        """(units,); several outputs: a list of them, as Keras's."""
        shapes = self.build()._shapes[1:]
        return list(shapes) if self.several else shapes[0]

    @property
    def task(self) -> str:
        return self.loss.task

    @property
    def num_classes(self) -> int:
        if self.task != "classification":
            return 0
        return max(2, self.output_shape[-1])

    @property
    def in_features(self) -> int:
        return int(np.prod(self.input_shape))

    def summary(self, line_length: int | None = None, print_fn=None) -> None:
        """Keras's table (its plain-text form): layer (type), output shape, parameter count,
        and the totals; printed, or given line by line to print_fn, as Keras's. Returns None,
        as Keras's does: `summary_text()` is the same table as a string."""
        if line_length is not None:
            raise ConfigError("summary: line_length is not supported (docs/guide/keras.md)")
        for line in self.summary_text().splitlines():
            (print_fn or print)(line)

    def frozen_weights(self) -> list[str]:
        """The layout's tensors training leaves as they are (a frozen layer's, a non-trainable
        weight's), as the layers say now: the shards are told when a worker registers. A sparse
        table's rows cannot be frozen (its rows' optimizer runs on the shards: refused)."""
        self.build()
        sparse = next((x for x in self.layers if not x.trainable and getattr(x, "sparse", False)), None)
        if sparse is not None:
            raise ConfigError(f"{self.name}: {sparse.label} is frozen (trainable=False), but its rows live "
                              "on the shards, which train every row pushed: freeze dense layers only")
        for plan in self._plans.values():      # what the backward pass skips, as the layers say now
            plan.refresh_frozen(force=True)
        return [f"{self._lname(layer)}/{w}" for layer in self.layers for w in layer.frozen_weights()]

    def summary_text(self) -> str:
        sizes = {t.name: t.size for t in self.layout.tensors}
        rule, cols = "_" * 65, (29, 26, 10)

        def row(*cells):
            return " " + "".join(f"{c:<{w}}" for c, w in zip(cells, cols)).rstrip()

        lines = [f'Model: "{self.name}"', rule, row("Layer (type)", "Output Shape", "Param #"), "=" * 65]
        for layer in self.preprocessing_layers:
            shape = str((None, *layer.output_shape))
            lines += [row(f"{self._lname(layer)} ({type(layer).__name__})", shape, "0"), ""]
        for i, layer in enumerate(self.layers):
            n = sum(v for k, v in sizes.items() if k.startswith(self._lname(layer) + "/"))
            lines.append(row(f"{self._lname(layer)} ({type(layer).__name__})",
                             str((None, *layer.output_shape)), f"{n}"))
            lines.append("" if i < len(self.layers) - 1 else "=" * 65)
        total = self.layout.total
        frozen = sum(sizes[name] for name in self.frozen_weights())
        lines += [f"Total params: {total:,}", f"Trainable params: {total - frozen:,}",
                  f"Non-trainable params: {frozen:,}", rule]
        return "\n".join(lines)

    # -- parameters ----------------------------------------------------------------------------

    def init_params(self, seed: int) -> np.ndarray:
        """Each weight from its initialiser, in layout order, from one generator seeded `seed`."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.layout.total, dtype=np.float32)
        views = self.layout.views(flat)
        for layer, weights in zip(self.layers, self._weights):
            for w in weights:
                w.initializer(rng, views[f"{self._lname(layer)}/{w.name}"])
        return flat

    def _layer_views(self, flat: np.ndarray) -> list[dict]:
        """_per_layer(layout.views(flat)), kept for the last two arrays: a worker hands the same
        weights and gradient arrays every step. A copy of the list (callers replace entries)."""
        hit = self._views_kept.get(id(flat))
        if hit is None or hit[0] is not flat:
            hit = (flat, self._per_layer(self.layout.views(flat)))
            if len(self._views_kept) >= 2:
                self._views_kept.pop(next(iter(self._views_kept)))
            self._views_kept[id(flat)] = hit          # its views keep flat (and so its id) alive
        return list(hit[1])

    def _per_layer(self, flat_views: dict) -> list[dict]:
        """Each layer's views by short name ("kernel"), from the model's ("dense/kernel")."""
        return [{w.name: flat_views[f"{self._lname(layer)}/{w.name}"] for w in weights}
                for layer, weights in zip(self.layers, self._weights)]

    # -- training ------------------------------------------------------------------------------

    def loss_and_grad(self, w, x, y, grad_out, seed: int | None = None, sparse=None):
        """Mean loss of the batch; its gradient into grad_out. `seed` draws dropout masks
        (the worker derives one per rank and step); None takes the next of a counter. A model
        with sparse tables takes the batch's rows as `sparse`, a TableLookup per table, and
        writes their gradients into them (pserver.models.sparse_graph)."""
        y, sample_weight = self.unweigh(y)
        x, y = self._check_batch(w, x, y)
        # A strided grad_out would make layout.views copy, and the gradient would be lost.
        if grad_out.shape != w.shape or grad_out.dtype != w.dtype or not grad_out.flags.c_contiguous:
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector of shape {w.shape}, "
                             f"got {grad_out.dtype} {grad_out.shape} with strides {grad_out.strides}")
        run = Pass(training=True, seed=next(self._seeds) if seed is None else int(seed))
        if self.sparse_tables:
            return self._sparse_step(w, x, y, grad_out, sparse, run) + self._regularize(w, grad_out)
        params, grads = self._layer_views(w), self._layer_views(grad_out)
        bufs = self._buffers(x.shape[0], w.dtype)
        ins = self._forward(params, x, bufs, run)
        loss = self.output_loss([ins[s] for s in self._plan(True).outputs], y, sample_weight, bufs.dlosses)
        self._backward(params, grads, ins, bufs)
        return loss + self._regularize(w, grad_out) + self._activity(ins) / x.shape[0]

    def output_loss(self, outs: list, y, sample_weight, dlosses: list) -> float:
        """The batch's loss from its outputs' values `outs` (in output order), d loss / d each
        output into `dlosses`, and the batch's metrics (batch_correct, batch_metric_sums; several
        outputs: batch_sums). The CUDA model calls it on the outputs it brought to the host."""
        if self.several:
            loss = self.loss(self.kernels, outs, y, dlosses)
            self.batch_sums = self._batch_sums(outs, y)
            return float(loss)
        if self.task == "classification":   # the batch's accuracy, for Keras's per-epoch metric
            self.batch_correct = metrics.accuracy(outs[0], y)
        self.batch_metric_sums = self.metric_sums(outs[0], y)
        return float(losses.weighted(self.loss, self.kernels, outs[0], y, dlosses[0], sample_weight))

    def _activity(self, vals: list, training: bool = True) -> float:
        """The layers' activity_regularizer penalties on their outputs in `vals`, summed (Keras
        divides by the batch size: the caller does)."""
        return sum(reg(vals[out]) for reg, out in self._regularizers()[1 + bool(training)])

    def _regularize(self, w, grad_out=None) -> float:
        """The weights' regularization penalty, which Keras adds to the loss (keras.regularizers:
        kernel_regularizer, ...); its gradient is added to grad_out when given."""
        total = 0.0
        for reg, a, b in self._regularizers()[0]:
            total += reg(w[a:b])
            if grad_out is not None:
                reg.add_gradient(w[a:b], grad_out[a:b])
        return total

    def _regularizers(self) -> tuple[list, list, list]:
        """(each weight regularizer with its [start, end) in the flat vector; the activity
        regularizers with the slot each reads, at inference, in training), found once per build:
        every step asks, and a model without any must pay nothing for them."""
        if self._regs is None:
            built, offsets = self.build(), self.layout.offsets()
            weights = [(weight.regularizer, *offsets[f"{self._lname(layer)}/{weight.name}"])
                       for layer, ws in zip(built.layers, built._weights) for weight in ws
                       if weight.regularizer is not None]
            activity = [[(reg, st.out) for st in plan.steps if st.op is None
                         for reg in [getattr(plan.layers[st.layer], "activity_regularizer", None)]
                         if reg is not None] for plan in (self._plan(False), self._plan(True))]
            self._regs = (weights, *activity)
        return self._regs

    def metric_sums(self, out: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The compiled Metric objects' sums over a batch (one vector; empty without any), on
        the outputs as the model states them (probabilities after a fused softmax or sigmoid)."""
        if not self.metric_objects:
            return np.zeros(0)
        rows = out.reshape(-1, out.shape[-1])             # an output with steps: per element
        stated = probabilities(self.output_activation, rows.astype(np.float64))
        return metrics.sums_of(self.metric_objects, stated, y.reshape(-1) if out.ndim > 2 else y)

    def _batch_sums(self, outs: list, y: np.ndarray) -> dict:
        """A batch's per-output logs, as sums over its samples (each loss x n, the samples an
        accuracy counts right), for Keras's per-epoch training logs."""
        n, sums = len(y), {}
        for name, value in self.loss.loss_logs(self.loss.last).items():
            sums[name] = value * n
        for name, ms, out, yj in zip(self.output_names, self.loss.metrics, outs, self.loss.split(y, y.dtype)):
            if "accuracy" in ms:
                sums[f"{name}_accuracy"] = float(metrics.accuracy(out, yj))
        return sums

    def _forward(self, params, x, bufs, run, k=None) -> list:
        plan = self._plan(run.training)
        return graph.forward(plan, self.kernels if k is None else k, params, self._unpack(x, bufs.dtype),
                             bufs.of(plan), run)

    def _backward(self, params, grads, acts, bufs, k=None) -> None:
        plan = self._plan(True)
        graph.backward(plan, self.kernels if k is None else k, params, grads, acts, bufs.dlosses,
                       bufs.of(plan))

    # -- data and checks ----------------------------------------------------------------------

    @property
    def _takes_ids(self) -> bool:
        return any(x.dtype.kind in "iu" for x in self._inputs)

    def preprocess(self, x):
        """The data as the graph takes it: each input that a lookup or text layer reads
        (pserver.layers.text) through that layer, now; the others as given (one array, several
        as a list or a dict by name, as `pack` takes them). pserver.keras's fit, evaluate and
        predict call it once on the user's data; the workers, the wire and the shards see its
        result only. ValueError naming the input if one does not fit."""
        # (a Sequential's first layer, before it is built)
        if not any(getattr(layer, "preprocessing", False) for layer in [*self.preprocessing_layers,
                                                                         *self.layers[:1]]):
            return x
        self.build()
        if isinstance(x, dict):
            at = {k: i for i, k in enumerate(self._keys)}
            return {k: self._through(at.get(k), v) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and len(self._inputs) > 1:
            return [self._through(i, v) for i, v in enumerate(x)]
        return self._through(0, x)

    def _through(self, i: int | None, x):
        """Input i's data through the layer that reads it (as it is when none does)."""
        out = self._preprocessed.get(i)
        if out is None:
            return x
        given, layer = self._given[i], out.node.layer
        a = np.asarray(x, dtype=object if given.dtype.kind in "USO" else None)
        shaped = shaped_for(a, given.shape[1:]) if a.ndim >= 1 else None
        if shaped is None:
            raise ValueError(f"input {self._keys[i]!r}: x has shape {a.shape}; {layer.label} takes (n, "
                             f"{', '.join(map(str, given.shape[1:]))})")
        return layer.apply(shaped)

    def pack(self, x) -> np.ndarray:
        """The model's inputs (an array; several as a list in input order, or a dict by name)
        as one array of (n, *input_shape) rows (several: flattened side by side); ValueError
        naming the input and the shapes if one does not fit. A model with sparse tables takes
        records instead (SparseProtocol._pack_records)."""
        if self.build()._sparse is not None:
            return self._pack_records(x)
        x = self._padded(x)
        if len(self._inputs) == 1:
            return np.asarray(x[self._keys[0]] if isinstance(x, dict) else x)
        if isinstance(x, dict):
            missing = [k for k in self._keys if k not in x]
            if missing:
                raise ValueError(f"x has no input {missing[0]!r} (the model's: {', '.join(self._keys)})")
            x = [x[k] for k in self._keys]
        if not isinstance(x, (list, tuple)):
            return np.asarray(x)                 # packed already (a worker's slice of rows)
        if len(x) != len(self._inputs):
            raise ValueError(f"x has {len(x)} arrays; {self.name} takes {len(self._inputs)} inputs "
                             f"({', '.join(self._keys)})")
        parts = [self._flat(key, inp, np.asarray(xi), len(x[0]))
                 for key, inp, xi in zip(self._keys, self._inputs, x)]
        ids = self._takes_ids and not all(x.dtype.kind in "iu" for x in self._inputs)
        return np.concatenate(parts, axis=1, dtype=np.float64 if ids else None)

    def input_paddings(self) -> dict:
        """Each model input's list padding, by name: the id an Embedding reading it takes as
        padding (mask_zero: 0; padding_id), or 0.0 for a list's weights; inputs without none."""
        self.build()
        pads = list_paddings(self._plan(False), len(self._keys))
        return {self._keys[i]: pad for i, pad in pads.items()}

    def _padded(self, x):
        """x with each list feature given as Python lists padded (sparse_graph.pad_lists): the
        inputs a pooling Embedding with padding reads, and their lists' weights."""
        pads = list_paddings(self._plan(False), len(self._keys))
        if not pads:
            return x
        if isinstance(x, dict):
            return {k: pad_lists(v, self._inputs[self._keys.index(k)].shape[1:], pads[self._keys.index(k)], k)
                    if k in self._keys and self._keys.index(k) in pads else v for k, v in x.items()}
        if isinstance(x, (list, tuple)) and len(x) == len(self._keys) and len(self._keys) > 1:
            return [pad_lists(v, inp.shape[1:], pads[i], key) if i in pads else v
                    for i, (key, inp, v) in enumerate(zip(self._keys, self._inputs, x))]
        if len(self._keys) == 1 and 0 in pads:
            return pad_lists(x, self._inputs[0].shape[1:], pads[0], self._keys[0])
        return x

    @staticmethod
    def _flat(key: str, inp: Symbolic, xi: np.ndarray, n: int) -> np.ndarray:
        """One input's samples as (n, features); ValueError naming it if they do not fit."""
        shaped = shaped_for(xi, inp.shape[1:]) if xi.ndim >= 1 else None
        if shaped is None or len(xi) != n:
            raise ValueError(f"input {key!r}: x has shape {xi.shape}; it takes (n, "
                             f"{', '.join(map(str, inp.shape[1:]))}) with n = {n}")
        return shaped.reshape(n, -1)

    def _unpack(self, x, dtype) -> list[np.ndarray]:
        if isinstance(x, list):                  # one array per input already (sparse_graph)
            return x
        if len(self._inputs) == 1:
            return [x]
        parts, at = [], 0
        for inp in self._inputs:
            size = math.prod(inp.shape[1:])
            kind = inp.dtype if inp.dtype.kind in "iu" else dtype
            parts.append(np.ascontiguousarray(x[:, at:at + size].reshape(len(x), *inp.shape[1:]), kind))
            at += size
        return parts

    def _check_ids(self, x) -> None:
        """Ids against the Embedding each input feeds straight into (DataError before step 1)."""
        plan, xs = self._plan(False), self._unpack(x, np.float32)
        for step in plan.steps:
            layer = None if step.layer is None else plan.layers[step.layer]
            if hasattr(layer, "check_ids") and step.ins[0] < len(xs):
                layer.check_ids(xs[step.ins[0]])

    def unweigh(self, y) -> tuple[np.ndarray, np.ndarray | None]:
        """(labels, sample weights): y's last column split off while the model is weighted
        (`sample_weighted`), else (y, None)."""
        if not self.sample_weighted:
            return y, None
        y = np.asarray(y)
        if y.ndim != 2 or y.shape[1] != 2:
            raise ValueError(f"y has shape {y.shape}; a model trained with sample weights takes "
                             "(n, 2) rows: each sample's label and weight")
        return y[:, 0], np.ascontiguousarray(y[:, 1])

    def _check_batch(self, w, x, y):
        """x as C-contiguous (n, *input_shape) (records for a sparse model), y as the loss's
        labels; else ValueError."""
        if self.sparse_tables:
            return self._check_records(w, x, y)
        self._check_w(w)
        x, y = self._fit(x, y)
        y = np.ascontiguousarray(y, dtype=self.loss.label_dtype(w.dtype))
        return np.ascontiguousarray(x, dtype=None if self._takes_ids else w.dtype), y

    def _check_w(self, w) -> None:
        if w.shape != (self.layout.total,) or w.dtype.kind != "f":
            raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}; "
                             f"{self.name} needs float ({self.layout.total},)")

    def _fit_x(self, x) -> np.ndarray:
        """x reshaped to the input; ValueError naming the layer and the shapes if it does not fit."""
        x = self.build().pack(x)
        first = self.layers[0].label
        shaped = shaped_for(x, self.input_shape) if x.ndim >= 1 and x.shape[0] > 0 else None
        if shaped is None:
            raise ValueError(f"x has shape {x.shape}; {first} takes (n >= 1, "
                             f"{', '.join(map(str, self.input_shape))})")
        if x.dtype.kind not in "biuf":
            hint = (" (the lookup and text layers' output: model.preprocess(x) makes it; pserver.keras's "
                    "fit, evaluate and predict call it)" if self.preprocessing_layers else "")
            raise ValueError(f"x has dtype {x.dtype}; {first} takes numbers{hint}")
        return shaped

    def _fit(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """x reshaped to the input; ValueError naming the layer and the shapes if it does not
        fit, or if a label is outside what the last layer and the loss take."""
        shaped = self._fit_x(x)
        return shaped, self._labels(self.labels(y), shaped.shape[0], "rows")

    @property
    def steps(self) -> int:
        """The labels each sample has: 1, or an output with steps' (n, ..., units): its
        elements but the units (Keras's losses and accuracy average over all of them)."""
        shapes = self.build()._shapes[1:]
        return 1 if len(shapes) > 1 else math.prod(shapes[0][:-1])

    def labels(self, y) -> np.ndarray:
        """y as the loss takes it (one-hot rows as classes, pserver.models.losses); an output
        with steps: each sample's labels flattened, (n, steps), as they travel and train."""
        if self.several:
            return self.loss.labels(y)
        rank = len(self.build()._shapes[1])
        y = self.loss.labels(y, rank)
        return y.reshape(len(y), -1) if rank > 1 and y.ndim > 1 else y

    def _labels(self, y: np.ndarray, n: int, what: str) -> np.ndarray:
        """y, checked: a label per sample (a column per output when there are several; a row of
        steps for an output with steps), each one its output and loss take."""
        per_step = len(self._shapes[1]) > 1 and not self.several
        if y.shape[:1] != (n,) or y.ndim != (2 if self.several or per_step else 1) or (
                per_step and y.shape[1] != self.steps):
            steps = f" and {self.steps} labels per sample ({self._output_label(0)} outputs " \
                    f"{self._shapes[1]})" if per_step else ""
            outputs, wanted = len(self._shapes) - 1, ""
            if self.several:
                wanted = (f"; a model with {outputs} outputs takes a column of labels for each, "
                          f"({n}, {outputs})")
            elif not per_step and y.shape[:1] == (n,):
                wanted = f"; it takes one label per sample, ({n},)"
            raise ValueError(f"y has shape {y.shape}; x has {n} {what}{steps}{wanted}")
        ys = self.loss.split(y, y.dtype) if self.several else [y]
        for j, (loss, yj) in enumerate(zip(self._each_loss(), ys)):
            self._check_labels(j, loss, yj)
        return y

    def _check_labels(self, j: int, loss: losses.Loss, y: np.ndarray) -> None:
        """Output j's labels against its units and loss; ValueError naming the first bad one."""
        if loss.task != "classification" or not y.size:
            return
        hi = 1 if isinstance(loss, losses.BinaryCrossentropy) else self._shapes[1 + j][-1] - 1
        if y.dtype.kind in "iu" and 0 <= y.min() and y.max() <= hi:
            return                              # every step's case: two reductions, no masks
        bad = (y < 0) | (y > hi) | (~np.isfinite(y) if loss.soft_labels else y != np.floor(y))
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), y.shape)
            raise ValueError(f"label out of range: y[{', '.join(map(str, i))}] = {y[i].item()!r}; "
                             f"{self._output_label(j)} with {loss.name} takes 0..{hi}")

    def check_data(self, x: np.ndarray, y: np.ndarray, what: str = "data") -> np.ndarray:
        """Everything about a whole dataset that would fail later, now; x reshaped to fit.

        The shape against the input, labels against the outputs, NaN or Inf in x, ids
        against an Embedding's input_dim: DataError naming `what`, the layer and the shapes.
        """
        if self.sparse_tables:
            return self._check_record_data(x, y, what)
        try:
            x, y = self._fit(x, self.unweigh(y)[0])
            if self._takes_ids:
                self._check_ids(x)
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None
        if not self._takes_ids and x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            raise DataError(f"{what}: x has NaN or Inf values in {int(bad.sum())} samples, the "
                            f"first at index {int(np.argmax(bad))}")
        return x

    # -- evaluation ----------------------------------------------------------------------------

    def predict(self, w, x, batch_size=4096, rows=None):
        """The last layer's outputs for every sample of x, (n, units) in w's dtype: logits for
        a classifier (argmax is the class), the prediction for regression. Several outputs: a
        list of them, in output order. `rows` as for evaluate (a model with sparse tables)."""
        if self.sparse_tables:
            return self._sparse_predict(w, x, batch_size, rows)
        self._check_w(w)
        x = np.ascontiguousarray(self._fit_x(x), dtype=None if self._takes_ids else w.dtype)
        params = self._per_layer(self.layout.views(w))
        outs = [np.empty((x.shape[0], *shape), w.dtype) for shape in self._shapes[1:]]
        batch_size = self._chunk(batch_size, w.dtype)
        slots = self._plan(False).outputs
        for a in range(0, x.shape[0], batch_size):
            xb = x[a:a + batch_size]
            vals = self._forward(params, xb, self._buffers(len(xb), w.dtype), Pass(training=False))
            for out, s in zip(outs, slots):
                out[a:a + len(xb)] = vals[s]
        return outs if self.several else outs[0]

    def _chunk(self, batch_size: int, dtype) -> int:
        """How many samples evaluation and prediction run at once: at most `batch_size`, and
        few enough that their arrays (EVAL_CHUNK_BYTES) stay in a core's cache. The results
        are the same per sample whatever the chunk; only the time differs."""
        elements = sum(layer.forward_elements() for layer in self.build().layers)
        per_sample = elements * np.dtype(dtype).itemsize
        return max(1, min(int(batch_size), EVAL_CHUNK_BYTES // max(per_sample, 1)))

    def evaluate(self, w, x, y, batch_size=4096, threads=1, rows=None):
        """Loss plus accuracy (and AUC for a binary loss), or r2 for regression, over all of x.
        `threads`: run the chunks on that many threads (the kernels release the GIL), each with
        its own buffers; the result is the same whatever the number (chunks summed in order).
        A model with sparse tables takes `rows(ids per table)`, the batch's TableLookups with the
        rows filled (the worker pulls them from the shards), for each batch_size records."""
        if self.sparse_tables:
            return _penalized(self._sparse_evaluate(w, x, y, batch_size, rows), self._regularize(w))
        self._check_w(w)           # before its views: a wrong w gets the one-line error, as before
        params = self._per_layer(self.layout.views(w))

        def forward(xb):
            return self._forward(params, xb, self._buffers(xb.shape[0], w.dtype), Pass(training=False))

        return self.evaluate_with(forward, w, x, y, self._chunk(batch_size, w.dtype), threads)

    def evaluate_with(self, forward, w, x, y, batch_size: int, threads: int = 1) -> dict:
        """evaluate's logs, each chunk of `batch_size` samples run by `forward(xb)`, which gives
        every slot's value (at least the outputs', on the host): the CPU's pass here, the GPU's
        in the CUDA model, which scores its outputs as the CPU does."""
        y, sample_weight = self.unweigh(y)
        x, y = self._check_batch(w, x, y)
        n = x.shape[0]
        starts = range(0, n, batch_size)
        parts: list = [None] * len(starts)
        heads = list(zip(self._each_loss(), self.loss.split(y, w.dtype) if self.several else [y]))
        slots = self._plan(False).outputs

        activity: list = [0.0] * len(starts)
        sums: list = [np.zeros(0)] * len(starts)       # the Metric objects' (one output)

        def chunk(i: int) -> None:
            a = starts[i]
            xb = x[a:a + batch_size]
            vals = forward(xb)
            sw = None if sample_weight is None else sample_weight[a:a + batch_size]
            parts[i] = [chunk_scores(self.kernels, loss, vals[s], yj[a:a + batch_size], sw)
                        for (loss, yj), s in zip(heads, slots)]
            activity[i] = self._activity(vals, training=False)
            if not self.several:
                sums[i] = self.metric_sums(vals[slots[0]], y[a:a + batch_size])

        each_index(chunk, len(starts), threads)
        each = [scores(loss, [p[j] for p in parts], yj) for j, (loss, yj) in enumerate(heads)]
        each[0].update(metrics.values_of(self.metric_objects, np.sum(sums, axis=0)))
        penalty = self._regularize(w) + sum(activity) / n
        return _penalized(self.loss.logs(each) if self.several else each[0], penalty)


def _penalized(logs: dict, penalty: float) -> dict:
    """Evaluation's logs with the regularization penalty in the (total) loss, as Keras's."""
    return logs | {"loss": logs["loss"] + penalty} if penalty else logs


def each_index(fn, count: int, threads: int) -> None:
    """fn(i) for i in range(count): in this thread, or, threads > 1, on that many threads. The
    first exception raises here once every thread is done."""
    threads = max(1, min(int(threads), count))
    if threads == 1:
        for i in range(count):
            fn(i)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads, thread_name_prefix="pserver-eval") as pool:
        list(pool.map(fn, range(count)))


# Evaluation and prediction run the data in chunks whose arrays (each layer's output, a
# convolution's im2col matrix) take about this many bytes, so they stay in cache: keras.io's
# mnist_convnet (bench/keras_mnist_convnet.py) evaluated its 6,000 validation images on one core
# in 1.09 s of CPU in chunks of 4096 and 0.49 s in chunks of 8 or 16 (13 at this budget).
EVAL_CHUNK_BYTES = 4 << 20

class ModelBuffers:
    """A batch size's arrays: each plan's (pserver.models.graph.PlanBuffers, made by `memory`),
    and `dlosses`, where the loss writes d loss / d each output: the output layer's own dout
    when a layer makes it (`dloss`: a one-output model's)."""

    def __init__(self, model: Functional, n: int, dtype, memory=graph.HostMemory):
        self.model, self.n, self.dtype, self.memory = model, n, dtype, memory
        self._of: dict[int, graph.PlanBuffers] = {}

    def of(self, plan: graph.Plan) -> graph.PlanBuffers:
        if id(plan) not in self._of:
            self._of[id(plan)] = graph.PlanBuffers(plan, self.n, self.dtype, self.memory)
        return self._of[id(plan)]

    @property
    def dloss(self):
        (dloss,) = self.dlosses
        return dloss

    @property
    def dlosses(self) -> list:
        if "_dlosses" not in self.__dict__:
            plan = self.model._plan(True)
            self._dlosses = [self._dloss(plan, j) for j in range(len(plan.outputs))]
        return self._dlosses

    def _dloss(self, plan: graph.Plan, j: int):
        last = plan.producer[plan.outputs[j]]
        if plan.fused(last):
            return self.of(plan).dout(last)
        return self.memory.empty((self.n, *self.model._shapes[1 + j]), self.dtype)


def _preprocessed(inputs: list[Symbolic], outputs, name: str) -> dict[int, Symbolic]:
    """{input index: the output of the lookup or text layer that reads it} (pserver.layers.text:
    they run on the data before the graph); ConfigError for one called elsewhere than on an
    input, or on an input that another layer reads too."""
    outs = list(outputs.values()) if isinstance(outputs, dict) else (
        list(outputs) if isinstance(outputs, (list, tuple)) else [outputs])
    nodes = graph_config.topological([o for o in outs if isinstance(o, Symbolic)])
    reads = collections.Counter(id(t) for node in nodes for t in node.inputs)
    at = {id(x): i for i, x in enumerate(inputs)}
    found = {}
    for node in nodes:
        if not getattr(node.layer, "preprocessing", False):
            continue
        source = node.inputs[0]
        if id(source) not in at or reads[id(source)] > 1:
            raise ConfigError(f"{name}: {node.layer.label} runs on the data before the model: call it on a "
                              "keras.Input that no other layer reads")
        found[at[id(source)]] = node.outputs[0]
    return found


def free_name(kind: str, taken: set[str], first: int = 0) -> str:
    """Keras's default name for a layer of `kind` not in `taken`: kind, kind_1, kind_2, ... (from
    kind_<first>)."""
    n = first
    while (name := kind if n == 0 else f"{kind}_{n}") in taken:
        n += 1
    return name


def _inputs(inputs, name: str) -> tuple[list[str], list[Symbolic]]:
    """The inputs in order and their keys (a dict's, else the Inputs' names)."""
    if isinstance(inputs, dict):
        keys, xs = list(inputs), list(inputs.values())
    else:
        xs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        keys = [x.name if isinstance(x, Symbolic) and x.name else f"input_{i}" for i, x in enumerate(xs)]
    bad = [x for x in xs if not isinstance(x, Symbolic) or x.node is not None]
    if bad or not xs:
        raise ConfigError(f"{name}: inputs: give keras.Input(...) tensors, got {bad[0] if bad else inputs!r}")
    if len(set(keys)) != len(keys) or len({id(x) for x in xs}) != len(xs):
        raise ConfigError(f"{name}: inputs: two inputs share a name or are the same tensor "
                          f"({', '.join(keys)})")
    return keys, xs


__all__ = ["Functional", "free_name"]
