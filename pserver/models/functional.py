"""Functional: a model from its inputs and output (Keras's functional API), trained on a flat
parameter vector like Sequential, whose checks, loss, metrics, evaluation and summary it shares.

    x = keras.Input(shape=(784,)); h = Dense(64, activation="relu")(x)
    model = Functional(x, Dense(10)(layers.add([h, Dense(64)(h)])))

The graph is planned once per `training` value (pserver.models.graph). The layout is every
layer's weights in order of first use, "<layer>/<weight>" as Sequential's. Several inputs (a
list, or a dict by name) travel as one array: each sample's inputs flattened side by side (a
worker slices rows of it like any x); `pack` makes it from the arrays, the model splits it.
"""

from __future__ import annotations

import math

import numpy as np

from pserver.errors import ConfigError
from pserver.models import graph, graph_config, losses
from pserver.models.base import BatchBuffers, shaped_for
from pserver.models.sequential import Sequential, check_metrics
from pserver.ops.core import Symbolic


class Functional(Sequential):
    def __init__(self, inputs, outputs, name: str = "functional", loss="sparse_categorical_crossentropy",
                 backend: str = "cpu"):
        self._keys, self._inputs = _inputs(inputs, name)
        self._dict_inputs = isinstance(inputs, dict)
        outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        if len(outs) != 1 or not isinstance(outs[0], Symbolic):
            raise ConfigError(f"{name}: outputs: give one symbolic tensor (a layer's output); "
                              f"got {outputs!r} (several outputs are not supported yet)")
        super().__init__((), name=name, loss=loss, backend=backend)
        self._output = outs[0]
        self._plans: dict[bool, graph.Plan] = {}
        for layer in self._plan(False).layers:
            self._name(layer)                    # Keras's names, numbered within the model
            self.layers.append(layer)
        self._buffers = BatchBuffers(lambda n, dtype: _Buffers(self, n, dtype))

    def add(self, layer) -> None:
        raise ConfigError(f"{self.name}: a Functional model's layers are those its outputs were "
                          "computed with; call the layer on a tensor instead")

    def _plan(self, training: bool) -> graph.Plan:
        if training not in self._plans:
            plan = graph.Plan(self._inputs, self._output, training, self.name)
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
        self._fix_layout([self._packed_shape(), self._output.shape[1:]])
        last = self._output_layer()
        if self.output_activation != "linear" and self._plan(False).uses(self.layers.index(last)) > 1:
            raise ConfigError(f"{self.name}: {last.label} computes the output and is called elsewhere too; "
                              "its activation fuses into the loss there: give the output its own layer")
        self._built = True
        return self

    def _output_layer(self):
        step = self._plan(False).output_step()
        return None if step.layer is None else self._plan(False).layers[step.layer]

    def _packed_shape(self) -> tuple[int, ...]:
        if len(self._inputs) == 1:
            return self._inputs[0].shape[1:]
        return (sum(math.prod(x.shape[1:]) for x in self._inputs),)

    def get_config(self) -> dict:
        """The graph as JSON (pserver.models.graph_config), the loss and the metrics:
        `Sequential.from_config` (so a model file's loader) builds the same model."""
        config = graph_config.to_config(self._keys, self._inputs, self._output, self._layer_configs)
        return {"class_name": "Functional", "name": self.name, "dict_inputs": self._dict_inputs, **config,
                "loss": self.loss.get_config(), "metrics": list(self.metrics)}

    @classmethod
    def from_config(cls, config: dict, **kwargs) -> "Functional":
        try:
            keys, inputs, output = graph_config.from_config(config)
            model = cls(dict(zip(keys, inputs)) if config.get("dict_inputs") else inputs, output,
                        name=config.get("name", "functional"), loss=losses.get(config["loss"]), **kwargs)
        except (KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"a Functional model's config: {type(e).__name__} {e}") from None
        model.metrics = check_metrics(config.get("metrics"))
        return model

    @property
    def _takes_ids(self) -> bool:
        return any(x.dtype.kind in "iu" for x in self._inputs)

    # -- data ---------------------------------------------------------------------------------------

    def pack(self, x) -> np.ndarray:
        """The model's inputs (an array; several as a list in input order, or a dict by name)
        as one array of (n, *input_shape) rows (several: flattened side by side); ValueError
        naming the input and the shapes if one does not fit."""
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

    @staticmethod
    def _flat(key: str, inp: Symbolic, xi: np.ndarray, n: int) -> np.ndarray:
        """One input's samples as (n, features); ValueError naming it if they do not fit."""
        shaped = shaped_for(xi, inp.shape[1:]) if xi.ndim >= 1 else None
        if shaped is None or len(xi) != n:
            raise ValueError(f"input {key!r}: x has shape {xi.shape}; it takes (n, "
                             f"{', '.join(map(str, inp.shape[1:]))}) with n = {n}")
        return shaped.reshape(n, -1)

    def _fit_x(self, x) -> np.ndarray:
        return super()._fit_x(self.pack(x))

    def _unpack(self, x: np.ndarray, dtype) -> list[np.ndarray]:
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

    # -- running ------------------------------------------------------------------------------------

    def _forward(self, params, x, bufs, run, k=None) -> list:
        plan = self._plan(run.training)
        return graph.forward(plan, self.kernels if k is None else k, params, self._unpack(x, bufs.dtype),
                             bufs.of(plan), run)

    def _backward(self, params, grads, acts, bufs, k=None) -> None:
        plan = self._plan(True)
        graph.backward(plan, self.kernels if k is None else k, params, grads, acts, bufs.douts[-1],
                       bufs.of(plan))


class _Buffers:
    """A batch size's arrays: each plan's (pserver.models.graph.PlanBuffers), and `douts[-1]`,
    where the loss writes d loss / d output: the output layer's own dout when a layer makes it."""

    def __init__(self, model: Functional, n: int, dtype):
        self.model, self.n, self.dtype = model, n, dtype
        self._of: dict[int, graph.PlanBuffers] = {}

    def of(self, plan: graph.Plan) -> graph.PlanBuffers:
        if id(plan) not in self._of:
            self._of[id(plan)] = graph.PlanBuffers(plan, self.n, self.dtype)
        return self._of[id(plan)]

    @property
    def douts(self) -> list[np.ndarray]:
        plan = self.model._plan(True)
        last = plan.producer[plan.output]
        if plan.fused(last):
            return [self.of(plan).dout(last)]
        if "loss" not in self.__dict__:
            self.loss = np.empty((self.n, *self.model.output_shape), self.dtype)
        return [self.loss]


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


__all__ = ["Functional"]
