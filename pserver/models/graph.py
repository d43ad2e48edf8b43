"""A traced graph, planned once and run: forward through its steps, backward in reverse.

Tracing (keras.Input, a layer or an op called on symbolic tensors: pserver.ops.core) leaves
Nodes behind the outputs. `Plan` walks them back from the output once per `training` value:
a topological order of steps, each a fused layer (Dense, Conv2D, ...: its own forward and
backward through the kernels, its buffers preallocated per batch size) or an op
(pserver.ops.core.OPS: forward and vector-Jacobian product). A traced layer (a user's Layer,
Lambda) is traced again at each of its calls into op steps whose weight inputs are its weights.

Every tensor is a slot: the model's inputs first, then weights and constants, then each
step's output in order, so a one-output model's output is the last slot. Several outputs (a
keras.Model with a list or dict of them) each seed backward with their loss's gradient; backward
sums the gradients of a slot that feeds several steps (or is an output and feeds a step too), and
writes every weight's gradient into its view of grad_out.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer, Pass
from pserver.layers.traced import WeightTensor
from pserver.ops import core


class Step:
    """One node of the plan: `layer` (an index into Plan.layers) or `op`; its input slots and
    output slots (several for a multi-output op: split)."""

    def __init__(self, node: core.Node, ins: list[int], outs: list[int], layer: int | None):
        self.node, self.ins, self.outs, self.layer = node, ins, outs, layer
        self.op = None if layer is not None else core.op(node.op)
        self.fit = False        # Plan._count: an input that no layer made may need _fit

    @property
    def out(self) -> int:
        return self.outs[0]


class Plan:
    """The steps from `inputs` to `outputs` for one `training` value; layers in order of first use."""

    def __init__(self, inputs: list[core.Symbolic], outputs: list[core.Symbolic], training: bool, where: str):
        self.training, self.where = training, where
        self.slots: list[core.Symbolic | None] = list(inputs)
        self.index = {id(s): i for i, s in enumerate(inputs)}
        self.consts: dict[int, np.ndarray] = {}
        self.weight_slots: dict[int, tuple[int, str]] = {}     # slot -> (layer index, weight name)
        self.layers: list[Layer] = []
        self.steps: list[Step] = []
        self._alias: dict[int, core.Symbolic] = {}              # a traced call's output -> its trace's
        self.outputs = [self._slot(o) for o in outputs]
        self._count()
        for i, s in enumerate(self.outputs):
            what = "the output" if len(outputs) == 1 else f"output {i}"
            if self.producer[s] is None:
                raise ConfigError(f"{where}: {what} is not computed from the inputs by any layer or op")
            if self.outputs.index(s) != i:
                raise ConfigError(f"{where}: {what} is output {self.outputs.index(s)} again; give each "
                                  "tensor once")

    # -- planning ---------------------------------------------------------------------------------

    def _slot(self, t) -> int:
        if not isinstance(t, core.Symbolic):          # a constant an op was given
            self.slots.append(None)
            self.consts[len(self.slots) - 1] = t
            return len(self.slots) - 1
        while id(t) in self._alias:
            t = self._alias[id(t)]
        if id(t) in self.index:
            return self.index[id(t)]
        if isinstance(t, WeightTensor):
            return self._new(t, weight=(self._use(t.layer), t.weight))
        if t.node is None:
            raise ConfigError(f"{self.where}: {t} is not one of the model's inputs (give every keras.Input "
                              "the output depends on)")
        node = t.node
        ins = [self._slot(i) for i in node.inputs]           # inputs first: a topological order
        layer = node.layer
        if getattr(layer, "traced", False):
            self._use(layer)
            training = node.attrs.get("training", self.training)
            traced = layer.trace(node.inputs if layer.takes_list else node.inputs[0], bool(training),
                                 **node.attrs.get("kwargs", {}))
            for out, made in zip(node.outputs, traced, strict=True):    # every output at once: one trace
                self._alias[id(out)] = made
            return self._slot(self._alias[id(t)])
        li = None if layer is None else self._use(layer)
        # t's slot is made last, so that the model's output is the last slot
        outs = {id(o): self._new(o) for o in node.outputs if o is not t}
        outs[id(t)] = self._new(t)
        self.steps.append(Step(node, ins, [outs[id(o)] for o in node.outputs], li))
        return outs[id(t)]

    def _new(self, t: core.Symbolic, weight=None) -> int:
        self.index[id(t)] = len(self.slots)
        self.slots.append(t)
        if weight is not None:
            self.weight_slots[len(self.slots) - 1] = weight
        return len(self.slots) - 1

    def _use(self, layer: Layer) -> int:
        for i, known in enumerate(self.layers):
            if known is layer:
                return i
        self.layers.append(layer)
        return len(self.layers) - 1

    def _count(self) -> None:
        """Which slots need a gradient (needs_grad), how many steps (and losses) read each, and
        which step makes each."""
        n = len(self.slots)
        self.consumers, self.producer = [0] * n, [None] * n
        for i, step in enumerate(self.steps):
            for out in step.outs:
                self.producer[out] = i
            for s in step.ins:
                self.consumers[s] += 1
        self.frozen = None
        self.refresh_frozen()

    def refresh_frozen(self, force: bool = False) -> None:
        """needs_grad: the slots computed from a weight that training moves. A frozen layer's
        weights and a non-trainable weight need none, so the backward pass of a frozen base
        (every step before the first trainable weight) is skipped. Recomputed when a layer's
        `trainable` changed (cheap enough to ask every step), or when `force`d: the worker
        forces it when it registers (Functional.frozen_weights), which sees a sublayer's flag."""
        flags = tuple(layer.trainable for layer in self.layers)
        if flags == self.frozen and not force:
            return
        self.frozen = flags
        self.needs_grad = [i in self.weight_slots and _trains(self.layers[self.weight_slots[i][0]],
                                                              self.weight_slots[i][1])
                           for i in range(len(self.slots))]
        for step in self.steps:
            trains = step.layer is not None and _trains(self.layers[step.layer])
            for out in step.outs:
                self.needs_grad[out] = trains or any(self.needs_grad[s] for s in step.ins)
        for s in self.outputs:          # the loss reads each output: its dout is the loss's
            self.consumers[s] += 1
        for step in self.steps:
            # A layer's output is already what the next layer takes: only an input, a weight,
            # a constant or an op's output may need _fit (and a chain then skips it per step).
            step.fit = any(self.producer[s] is None or self.steps[self.producer[s]].op is not None
                           for s in step.ins)

    def uses(self, layer_index: int) -> int:
        return sum(1 for s in self.steps if s.layer == layer_index)

    def output_step(self, j: int) -> Step:
        """The step that makes output j."""
        return self.steps[self.producer[self.outputs[j]]]

    def fused(self, i: int) -> bool:
        """Step i is a layer with buffers of its own (not an op, not a reshape)."""
        step = self.steps[i]
        return step.layer is not None and not self.layers[step.layer].reshapes_only


class HostMemory:
    """Where PlanBuffers makes its arrays: NumPy's (pserver.models.cuda has the device's)."""

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    @staticmethod
    def put(a: np.ndarray):
        """A layer's scratch (made by NumPy) where the kernels read it."""
        return a


class PlanBuffers:
    """One plan's arrays for one batch size: each fused layer step's output, its scratch, and
    (at the first training step) its d loss / d output and the dx buffers it writes; made by
    `memory` (HostMemory, or a device's)."""

    def __init__(self, plan: Plan, n: int, dtype, memory=HostMemory):
        self.plan, self.n, self.dtype, self.memory = plan, n, dtype, memory
        self.outs, self.scratch, self.douts, self.dxs, self.tmp = {}, {}, {}, {}, {}
        self._direct: dict[int, object] = {}
        for i, step in enumerate(plan.steps):
            if plan.fused(i):
                layer = plan.layers[step.layer]
                rows = step.node.outputs[0].shape[0] or n      # 1: a layer on constants (Layer._constant)
                self.outs[i] = memory.empty((rows, *layer.output_shape), dtype)
                self.scratch[i] = {k: memory.put(a) for k, a in layer.scratch(rows, dtype).items()}

    def dout(self, i: int):
        if i not in self.douts:
            self.douts[i] = self.memory.empty(self.outs[i].shape, self.dtype)
        return self.douts[i]

    def direct(self, s: int):
        """The dout of the layer that made slot s when s feeds nothing else, through any
        reshaping layers between (a view of it, as Sequential's Flatten); None otherwise."""
        if s not in self._direct:
            plan, p = self.plan, self.plan.producer[s]
            found = None
            if p is not None and plan.consumers[s] == 1 and plan.fused(p):
                found = self.dout(p)
            elif p is not None and plan.consumers[s] == 1 and self._reshapes(p):
                below = self.direct(plan.steps[p].ins[0])
                found = None if below is None else below.reshape((self.n, *plan.slots[s].shape[1:]))
            self._direct[s] = found
        return self._direct[s]

    def _reshapes(self, i: int) -> bool:
        step = self.plan.steps[i]
        return step.layer is not None and self.plan.layers[step.layer].reshapes_only

    def dx(self, i: int, j: int):
        """Where step i writes d loss / d its input j: straight into the dout of the layer that
        made that input when it feeds nothing else (no copy, as Sequential), else a buffer."""
        s = self.plan.steps[i].ins[j]
        found = self.direct(s)
        if found is not None:
            return found
        if (i, j) not in self.dxs:
            shape = tuple(self.n if d is None else d for d in self.plan.slots[s].shape)
            self.dxs[(i, j)] = self.memory.empty(shape, self.dtype)
        return self.dxs[(i, j)]

    def tmp_grads(self, layer: int, like: dict) -> dict:
        """A shared layer's weight gradients of a second use, summed into the first's after."""
        if layer not in self.tmp:
            self.tmp[layer] = {k: np.empty_like(v) for k, v in like.items()}
        return self.tmp[layer]


def forward(plan: Plan, k, params: list[dict], xs: list[np.ndarray], bufs: PlanBuffers, run: Pass,
            ops: dict = core.OPS) -> list:
    """Every slot's value; the output's is the last. `ops`: the ops by name (a device's own:
    pserver.models.cuda_ops), the layers' math is `k`'s."""
    vals: list = [None] * len(plan.slots)
    vals[:len(xs)] = xs
    for s, (li, name) in plan.weight_slots.items():
        vals[s] = params[li][name]
    for s, c in plan.consts.items():
        vals[s] = c
    for i, step in enumerate(plan.steps):
        if step.op is not None:
            got = ops[step.op.name].forward(*(vals[s] for s in step.ins), **step.node.attrs)
            for s, v in zip(step.outs, got if step.op.multi else [got]):
                vals[s] = v
            continue
        layer = plan.layers[step.layer]
        if step.fit:            # the kernels take C-contiguous arrays of the model's dtype
            _fit_inputs(step, layer, vals, bufs.dtype)
        x = [vals[s] for s in step.ins] if layer.takes_list else vals[step.ins[0]]
        if layer.reshapes_only:
            vals[step.out] = x.reshape((x.shape[0], *layer.output_shape))
            continue
        training = bool(step.node.attrs.get("training", run.training))
        layer.forward(k, params[step.layer], x, bufs.outs[i], bufs.scratch[i],
                      run if training == run.training else Pass(training=training, seed=run.seed))
        vals[step.out] = bufs.outs[i]
    return vals


def _trains(layer: Layer, name: str | None = None) -> bool:
    """Whether training moves the layer's weights (one of them, `name`), as its flags say now.
    A sparse Embedding trains rows on the shards, not weights of the layout."""
    if getattr(layer, "sparse", False):
        return True
    frozen = layer.frozen_weights()
    return name not in frozen if name is not None else any(w.name not in frozen for w in layer.weights())


def backward(plan: Plan, k, params: list[dict], grads: list[dict], vals: list, dlosses: list,
             bufs: PlanBuffers, ops: dict = core.OPS) -> None:
    """Weight gradients into `grads` (views of grad_out), from d loss / d output, one array of
    `dlosses` per output."""
    plan.refresh_frozen()
    acc: list = [None] * len(plan.slots)
    for s, dloss in zip(plan.outputs, dlosses, strict=True):
        acc[s] = dloss
    written: set[int] = set()
    for i in range(len(plan.steps) - 1, -1, -1):
        step = plan.steps[i]
        if all(acc[s] is None for s in step.outs) or not plan.needs_grad[step.out]:
            continue
        if step.op is None:
            _layer_backward(plan, k, i, params, grads, vals, acc[step.out], acc, bufs, written, ops)
        else:
            _op_backward(plan, step, vals, acc, ops)
    # Through the kernels: on the GPU these are device arrays, which take no `view[...] = x`.
    for s, (li, name) in plan.weight_slots.items():
        if acc[s] is None:
            k.fill(grads[li][name], 0.0)
        else:
            k.copy(acc[s], grads[li][name])
    for li, layer in enumerate(plan.layers):      # a layer whose output took no gradient
        if li not in written and not layer.traced:
            for view in grads[li].values():
                k.fill(view, 0.0)


def _op_backward(plan: Plan, step: Step, vals: list, acc: list, ops: dict) -> None:
    if step.op.multi:
        g, out = [acc[s] for s in step.outs], [vals[s] for s in step.outs]
    else:
        g, out = acc[step.out], vals[step.out]
    gs = core.backward(ops[step.op.name], g, out, [vals[s] for s in step.ins], step.node.attrs)
    for s, gi in zip(step.ins, gs):
        if gi is not None and plan.needs_grad[s]:
            _add(acc, s, gi, ops)


def _layer_backward(plan, k, i, params, grads, vals, g, acc, bufs, written, ops) -> None:
    step = plan.steps[i]
    layer, li = plan.layers[step.layer], step.layer
    if layer.reshapes_only:
        _reshape_backward(plan, step, vals, g, acc, bufs, ops)
        return
    dout = bufs.dout(i)
    if g is not dout:
        k.copy(g, dout)
    _activity_gradient(layer, vals[step.out], dout)
    dxs = [bufs.dx(i, j) if plan.needs_grad[s] else None for j, s in enumerate(step.ins)]
    x = [vals[s] for s in step.ins] if layer.takes_list else vals[step.ins[0]]
    again = li in written          # kernels overwrite: a shared layer's second use sums after
    target = bufs.tmp_grads(li, grads[li]) if again else grads[li]
    layer.backward(k, params[li], target, x, bufs.outs[i], dout, dxs if layer.takes_list else dxs[0],
                   bufs.scratch[i])
    if again:
        for name, view in grads[li].items():
            view += target[name]
    written.add(li)
    for s, d in zip(step.ins, dxs):
        if d is not None:
            _add(acc, s, d, ops)


def _activity_gradient(layer, out, dout) -> None:
    """dout += the gradient of the layer's activity_regularizer: Keras's penalty of its output
    over the batch size (pserver.models.functional._activity adds the penalty to the loss)."""
    activity = getattr(layer, "activity_regularizer", None)
    if activity is not None:
        activity.add_gradient(out, dout, 1.0 / dout.shape[0])


def _reshape_backward(plan: Plan, step: Step, vals: list, g, acc: list, bufs: PlanBuffers, ops: dict) -> None:
    s = step.ins[0]
    if plan.needs_grad[s]:
        # g written into a view of the dout below (PlanBuffers.direct): that dout itself, no copy.
        below = bufs.direct(s) if g is bufs.direct(step.out) else None
        _add(acc, s, g.reshape(vals[s].shape) if below is None else below, ops)


def _add(acc: list, s: int, g: np.ndarray, ops: dict) -> None:
    # Out of place: an op's VJP may hand the same array to several inputs.
    acc[s] = g if acc[s] is None else ops["add"].forward(acc[s], g)


def _fit_inputs(step: Step, layer: Layer, vals: list, dtype) -> None:
    ids = getattr(layer, "takes_ids", False)
    for s in step.ins:
        vals[s] = _fit(vals[s], dtype, ids)


def _fit(a: np.ndarray, dtype, ids: bool) -> np.ndarray:
    """a as a layer takes it: C-contiguous, and in the model's float dtype unless it is ids.
    A device array (pserver.models.cuda) is the model's input, made so already."""
    if not isinstance(a, np.ndarray):
        return a
    if a.dtype != dtype and not (ids and a.dtype.kind in "iu"):
        return np.ascontiguousarray(a, dtype)
    return np.ascontiguousarray(a)


__all__ = ["HostMemory", "Plan", "PlanBuffers", "Step", "forward", "backward"]
