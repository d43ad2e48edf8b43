"""What an op is, and how calling one either computes or records.

An `Op` is a pure function of arrays with its vector-Jacobian product: `forward(*xs, **attrs)`
returns one array; `vjp(g, out, *xs, **attrs)` returns, for each input, d loss / d input given
g = d loss / d out (None for an input that takes no gradient: an integer index, a constant).
Shapes include the batch dimension. Broadcasting follows NumPy's; a VJP sums its gradient back
to its input's shape (`unbroadcast`). A VJP's arrays may share memory with g or be read-only
views (add passes g on, sum broadcasts it): whoever accumulates them copies first.
An op with several outputs (split) has `multi=True`: its forward returns a list of arrays, its
vjp gets the list of their cotangents (None for an output nothing used) and the list of outputs.

`apply(name, *args, **attrs)` is what every public op (pserver.ops.add, ...) calls: on arrays it
runs `forward` now (eager, as keras.ops does on concrete tensors); when any argument is a
`Symbolic` (a graph being traced: keras.Input, a layer's output) it records a `Node` and returns
the symbolic outputs, whose shapes come from the op's `shape` function, or, without one, from
running `forward` on small arrays of ones (the dimensions that follow the batch size are the
batch: None). pserver.graph plans and runs the recorded nodes.

A keras.Input with a dimension of unknown size (`shape=(None,)`: sequences of any length) makes
a tensor whose `unknown` is True. An op or a layer called on one computes no shape: it records
its call (`defer`) and gives a `Deferred` tensor, and keras.Model makes the calls again on
Inputs of the data's shape at its first data (`replay`), so every layer is built once, for
one shape, as always.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pserver.errors import ConfigError


@dataclass(frozen=True)
class Op:
    """One differentiable op. `forward` and `vjp` see NumPy arrays (float32 in training, float64
    in the gradient checks); attrs are keyword-only plain values (axis=1, keepdims=True)."""
    name: str
    forward: Callable[..., np.ndarray]
    vjp: Callable[..., tuple]
    shape: Callable[..., tuple] | None = None     # (*input shapes, **attrs) -> output shape (None dims)
    differentiable: tuple[bool, ...] | None = None  # per input; None: every float input
    multi: bool = False                            # forward returns a list of arrays (split)


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is registered twice")
    OPS[op.name] = op
    return op


class Symbolic:
    """A tensor of a graph being traced: a shape (None for the batch), a dtype, and the node
    (with its output index) that makes it; an input's node is None."""

    def __init__(self, shape, dtype="float32", node: "Node | None" = None, index: int = 0, name: str = ""):
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.node, self.index, self.name = node, index, name
        # Keras's mask (its _keras_mask): a float32 tensor (batch, steps), 0 at a padded step, that
        # Embedding(mask_zero=True) and Masking make, layers with supports_masking pass on, and
        # the recurrent layers, attention and GlobalAveragePooling1D read; None: no mask.
        self.mask: "Symbolic | None" = None

    # A keras.Input with a dimension of unknown size sets it (a Deferred is one): see `defer`.
    unknown = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"<Symbolic {self.name or 'tensor'} shape={self.shape} dtype={self.dtype.name}>"

    # Python operators on a symbolic tensor record the same ops as pserver.ops's functions.
    def __add__(self, o): return apply("add", self, o)
    def __radd__(self, o): return apply("add", o, self)
    def __sub__(self, o): return apply("subtract", self, o)
    def __rsub__(self, o): return apply("subtract", o, self)
    def __mul__(self, o): return apply("multiply", self, o)
    def __rmul__(self, o): return apply("multiply", o, self)
    def __truediv__(self, o): return apply("divide", self, o)
    def __rtruediv__(self, o): return apply("divide", o, self)
    def __neg__(self): return apply("negative", self)
    def __matmul__(self, o): return apply("matmul", self, o)
    def __rmatmul__(self, o): return apply("matmul", o, self)
    def __pow__(self, o): return apply("power", self, o)
    def __rpow__(self, o): return apply("power", o, self)
    def __abs__(self): return apply("abs", self)
    # no __eq__/__ne__: a symbolic tensor stays hashable and compared by identity (a graph's dict keys)
    def __lt__(self, o): return apply("less", self, o)
    def __le__(self, o): return apply("less_equal", self, o)
    def __gt__(self, o): return apply("greater", self, o)
    def __ge__(self, o): return apply("greater_equal", self, o)
    def __getitem__(self, key): return apply("getitem", self, key=_plain_key(key))

    def __bool__(self):
        raise ConfigError("a symbolic tensor has no truth value while a graph is traced: Python "
                          "control flow on a tensor's values (if x > 0, while ...) cannot be traced; "
                          "use pserver.ops.where")


UNKNOWN = ("is computed from a keras.Input with a dimension of unknown size (None), so its shape is "
           "known at the model's first data, when keras.Model makes the graph for the data's shape")


class Deferred(Symbolic):
    """A tensor computed from a keras.Input with a dimension of unknown size: the call that makes
    it (its node, a Deferral), made again by `replay` on Inputs of the data's shape."""

    unknown = True

    def __init__(self, node: "Deferral"):
        self.node, self.index, self.name, self.mask = node, 0, "", None
        self.dtype = np.dtype("float32")

    @property
    def shape(self):
        raise ConfigError(f"{self.node.what}'s output {UNKNOWN}")

    def __iter__(self):
        raise ConfigError(f"{self.node.what}'s output cannot be unpacked: it {UNKNOWN} (a call that "
                          "returns several tensors is made then). Give keras.Input the size the data has")

    def __repr__(self) -> str:
        return f"<Symbolic from {self.node.what}, shape known at the first data>"


@dataclass(eq=False)
class Deferral:
    """A call on a tensor of unknown shape: `fn(*args, **kwargs)` (a layer, or an op through
    `apply`) made again by `replay`; `what` names it in errors."""
    fn: Callable
    args: tuple
    kwargs: dict
    what: str


def unknown(*values) -> bool:
    """Whether any of `values` (in lists, tuples and dicts too) is a tensor of unknown shape."""
    return any(t.unknown for t in _tensors(values))


def defer(fn: Callable, args: tuple, kwargs: dict, what: str) -> Deferred:
    """The call fn(*args, **kwargs), recorded, not made: its output is a Deferred tensor."""
    return Deferred(Deferral(fn, tuple(args), dict(kwargs), what))


def replay(outputs: list, bound: dict) -> list:
    """`outputs` (tensors) made again: every Deferred's call made, in an order where each comes
    after the calls it reads, on `bound` (id of a keras.Input of unknown size -> the Input of the
    data's shape that takes its place). A tensor of known shape stays as it is."""
    made = dict(bound)
    for t in deferred_order(outputs, set(bound)):
        node = t.node
        out = node.fn(*_swap(node.args, made), **_swap(node.kwargs, made))
        if not isinstance(out, Symbolic):
            raise ConfigError(f"{node.what} returns {type(out).__name__} (several tensors) on the data's "
                              "shape, which its call on a tensor of unknown size could not give back: give "
                              "keras.Input the size the data has")
        made[id(t)] = out
    return [made[id(o)] if o.unknown else o for o in outputs]


def deferred_order(outputs: list, inputs: set) -> list["Deferred"]:
    """The Deferred tensors `outputs` depend on, each after those its call reads (iterative:
    deep graphs); `inputs`: the ids of the keras.Inputs of unknown size they may read."""
    order, done = [], set(inputs)
    stack = [(o, False) for o in reversed(outputs) if o.unknown]
    while stack:
        t, ready = stack.pop()
        if id(t) in done:
            continue
        if not isinstance(t, Deferred):
            raise ConfigError("a keras.Input with a dimension of unknown size is used by the model but is "
                              "not one of its inputs")
        if not ready:
            stack.append((t, True))
            stack.extend((d, False) for d in _tensors((t.node.args, t.node.kwargs))
                         if d.unknown and id(d) not in done)
            continue
        done.add(id(t))
        order.append(t)
    return order


def _tensors(value) -> list:
    found, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Symbolic):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return found


def _swap(value, made: dict):
    """value with each tensor of unknown shape replaced by what `made` holds for it."""
    if isinstance(value, Symbolic):
        return made[id(value)] if value.unknown else value
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, made) for v in value)
    if isinstance(value, dict):
        return {k: _swap(v, made) for k, v in value.items()}
    return value


@dataclass(eq=False)
class Node:
    """One call recorded while tracing: an op by name (or a layer: pserver.graph sets `layer`),
    its inputs (Symbolic, or constants as arrays), its attrs, and its outputs."""
    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    layer: object = None


def _plain_key(key):
    """A __getitem__ key as a hashable plain value (slices as tuples), for a node's attrs."""
    if isinstance(key, tuple):
        return tuple(_plain_key(k) for k in key)
    if isinstance(key, slice):
        return ("slice", key.start, key.stop, key.step)
    if isinstance(key, Symbolic):
        raise ConfigError("indexing with a symbolic tensor: use pserver.ops.take")
    return key


def key_of(key):
    """_plain_key's inverse: the key NumPy indexes with."""
    if isinstance(key, tuple) and key and key[0] == "slice":
        return slice(*key[1:])
    if isinstance(key, tuple):
        return tuple(key_of(k) for k in key)
    return key


def unbroadcast(g: np.ndarray, shape: tuple) -> np.ndarray:
    """g summed over the dimensions that broadcasting added to, or stretched from 1 in, `shape`."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    stretched = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g


def op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ConfigError(f"no op {name!r} (known: {', '.join(sorted(OPS))})") from None


def apply(name: str, *args, **attrs):
    """Run op `name` on arrays now, or record it when any argument is symbolic (a list of
    symbolic tensors for a multi-output op)."""
    o = op(name)
    like = _float_dtype(args)
    if not any(isinstance(a, Symbolic) for a in args):
        arrays = [_array(a, like) for a in args]
        return _run(o, arrays, attrs, [a.shape for a in arrays])
    if unknown(args):
        if o.multi:
            raise ConfigError(f"op {name}: its input {UNKNOWN}, and its outputs are counted when the graph "
                              "is made: give keras.Input the size the data has")
        return defer(functools.partial(apply, name), args, attrs, f"op {name}")
    inputs = [a if isinstance(a, Symbolic) else _array(a, like) for a in args]
    node = Node(name, inputs, dict(attrs))
    specs = infer(o, inputs, attrs)
    for index, (shape, dtype) in enumerate(specs if o.multi else [specs]):
        node.outputs.append(Symbolic(shape, dtype, node, index))
    return list(node.outputs) if o.multi else node.outputs[0]


def backward(o: Op, g, out, xs: list, attrs: dict) -> list:
    """o's VJP with None for each input that takes no gradient: not a float array (an index, a
    mask, an integer constant), or marked so by `o.differentiable`."""
    grads = o.vjp(g, out, *xs, **attrs)
    keep = o.differentiable or (True,) * len(xs)
    return [gx if k and np.issubdtype(_dtype(x), np.floating) else None
            for gx, x, k in zip(grads, xs, keep)]


def _dtype(x) -> np.dtype:
    """x's dtype without np.asarray where it has one: a device array (pserver.models.cuda_ops)
    stays where it is."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def ids(indices: np.ndarray) -> np.ndarray:
    """An index tensor as integers: Keras casts float ids (an id Input is often float32)."""
    return indices if np.issubdtype(indices.dtype, np.integer) else indices.astype(np.int64)


def _float_dtype(args) -> np.dtype | None:
    """The float dtype a Python number among `args` takes: the tensors' (x * 2 stays float32,
    as in Keras and NumPy's own scalars), None when no argument is a float tensor."""
    dtypes = [a.dtype for a in args if isinstance(a, (Symbolic, np.ndarray))
              and np.issubdtype(a.dtype, np.floating)]
    return np.result_type(*dtypes) if dtypes else None


def _array(a, like: np.dtype | None = None):
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, (float, int)) and not isinstance(a, bool) and like is not None:
        return np.asarray(a, dtype=like)
    if isinstance(a, (bool, int, float, np.generic)):
        return np.asarray(a, dtype=np.float32 if isinstance(a, float) else None)
    if isinstance(a, (list, tuple)):
        return np.asarray(a)
    raise ConfigError(f"an op's argument {a!r} ({type(a).__name__}) is not a tensor, an array or a number")


def _run(o: Op, arrays: list, attrs: dict, shapes: list):
    """o's forward; an input it cannot take (shapes that do not broadcast, an axis out of range)
    raises ConfigError naming the op, the input shapes (None: the batch) and the attrs."""
    try:
        return o.forward(*arrays, **attrs)
    except ConfigError:
        raise
    except Exception as e:
        raise _refusal(o, shapes, attrs, e) from None


def _refusal(o: Op, shapes: list, attrs: dict, e: Exception) -> ConfigError:
    given = "".join(f", {k}={v!r}" for k, v in attrs.items())
    return ConfigError(f"op {o.name}: inputs of shapes {', '.join(map(str, shapes))}{given} do not "
                       f"fit ({type(e).__name__}: {e})")


def infer(o: Op, inputs: list, attrs: dict):
    """The output's shape (None for the batch) and dtype, from `o.shape` when it has one, else by
    running forward on ones at two batch sizes; a mismatch raises ConfigError naming the op and
    the input shapes. A multi-output op gets a list of (shape, dtype), one per output."""
    shapes = [i.shape for i in inputs]
    if o.shape is not None:
        dtype = np.result_type(*(i.dtype for i in inputs))
        try:
            out = o.shape(*shapes, **attrs)
        except ConfigError:
            raise
        except Exception as e:
            raise _refusal(o, shapes, attrs, e) from None
        return [(tuple(s), dtype) for s in out] if o.multi else (tuple(out), dtype)
    runs = [_run(o, [_ones(i, batch) for i in inputs], attrs, shapes) for batch in (2, 3)]
    if not o.multi:
        return _spec(o, *runs)
    return [_spec(o, a, b) for a, b in zip(*runs)]


def _spec(o: Op, a: np.ndarray, b: np.ndarray) -> tuple[tuple, np.dtype]:
    """One output's shape and dtype from its values at batch sizes 2 and 3: a dimension that
    changed with the batch is the batch (None)."""
    if a.ndim != b.ndim:
        raise ConfigError(f"op {o.name}: its output's rank depends on the batch size")
    return tuple(None if da != db else da for da, db in zip(a.shape, b.shape)), a.dtype


def _ones(i, batch: int) -> np.ndarray:
    if not isinstance(i, Symbolic):
        return i
    shape = tuple(batch if d is None else d for d in i.shape)
    if np.issubdtype(i.dtype, np.integer):
        return np.zeros(shape, i.dtype)
    return np.ones(shape, i.dtype)


__all__ = ["Op", "OPS", "register", "op", "apply", "backward", "Symbolic", "Node", "unbroadcast", "infer",
           "key_of", "ids", "Deferred", "unknown", "defer", "replay", "deferred_order"]
