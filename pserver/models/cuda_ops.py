"""The graph's ops on the GPU: for each op name a `pserver.ops.core.Op` whose forward and VJP
run `pserver.kernels.cuda` on device arrays, on one stream, as the NumPy op of that name
computes (pserver.ops is the twin). pserver.models.graph runs them in place of pserver.ops's
when the CUDA model passes them (`ops=`).

`DeviceOps(stream)` is one thread's table. An op's output is a device array made at its first
pass and reused by the same op at every later pass of that batch size (`begin`). A constant an
op was given (x * 2.0) goes to the device once. Which ops have a device form: pserver.models.cuda_support.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from pserver.kernels import cuda as K
from pserver.kernels import cuda_graph as G
from pserver.models.cuda_support import ACTIVATIONS, BINARY, COMPARISONS, GATHERS, RESHAPES, SOFTMAXES, UNARY
from pserver.models.cuda_support import axes as _axes
from pserver.ops import core


def _shape_of(name: str, x, **attrs) -> tuple:
    """The shape NumPy's op gives for an input of x's shape (a few bytes of host memory)."""
    return core.OPS[name].forward(np.empty(x.shape, np.uint8), **attrs).shape


class DeviceOps(dict):
    """Op name -> Op on device arrays, launching on `stream`."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self._consts: dict[int, tuple] = {}
        self._maps: dict[tuple, tuple] = {}    # a gather's index map, per op, shape and arguments
        self._pool: list | None = None      # begin() sets it
        self._next = 0
        for name in BINARY:
            self[name] = core.Op(name, self._binary(name), self._binary_vjp(name))
        for name in ACTIVATIONS:
            self[name] = core.Op(name, self._activation(name), self._activation_vjp(name))
        for name in RESHAPES:
            self[name] = core.Op(name, self._reshape(name), lambda g, out, x, **a: (g.reshape(x.shape),))
        for name in COMPARISONS:
            self[name] = core.Op(name, self._binary(name, G.compare), lambda g, out, a, b: (None, None),
                                 differentiable=(False, False))
        for name in UNARY:
            self[name] = core.Op(name, self._unary(name), self._unary_vjp(name))
        for name in SOFTMAXES:
            self[name] = core.Op(name, self._softmax(name == "log_softmax"),
                                 self._softmax_vjp(name == "log_softmax"))
        self["negative"] = core.Op("negative", self._negative, lambda g, out, x: (self._negative(g),))
        self["clip"] = core.Op("clip", self._clip, self._clip_vjp)
        self["where"] = core.Op("where", self._where, self._where_vjp, differentiable=(False, True, True))
        # A float cast: every device array is float32 already (cuda_support refuses the others).
        self["cast"] = core.Op("cast", lambda x, dtype: self.dev(x), lambda g, out, x, dtype: (g,))
        self["transpose"] = core.Op("transpose", self._transpose, self._transpose_vjp)
        self["max"] = core.Op("max", self._extreme("max"), self._extreme_vjp)
        self["min"] = core.Op("min", self._extreme("min"), self._extreme_vjp)
        self["concatenate"] = core.Op("concatenate", self._concatenate, self._concatenate_vjp)
        self["split"] = core.Op("split", self._split, self._split_vjp, multi=True)
        self["sum"] = core.Op("sum", self._reduce(False), self._reduce_vjp(False))
        self["mean"] = core.Op("mean", self._reduce(True), self._reduce_vjp(True))
        self["matmul"] = core.Op("matmul", self._matmul, self._matmul_vjp)
        for name in GATHERS:
            self[name] = core.Op(name, self._gather(name), self._gather_vjp(name),
                                 differentiable=(True, False) if name == "take" else None)
        self["stack"] = core.Op("stack", self._stack, self._stack_vjp)
        self["one_hot"] = core.Op("one_hot", self._one_hot, lambda g, out, x, **a: (None,),
                                  differentiable=(False,))

    # -- memory ------------------------------------------------------------------------------

    def begin(self, pool: list) -> None:
        """A pass starts: its ops' outputs reuse the buffers in `pool` (the last pass's of the
        same kind and batch size, pserver.models.cuda's _Batch keeps it) in the order they are
        asked for, which a plan repeats each pass, instead of new device memory per op and step."""
        self._pool, self._next = pool, 0

    def empty(self, shape):
        shape = tuple(int(d) for d in shape)
        pool, i = self._pool, self._next
        if pool is not None and i < len(pool) and pool[i].shape == shape:
            self._next += 1
            return pool[i]
        buf = cuda.device_array(shape, np.float32, stream=self.stream)
        if pool is not None:
            pool[i:i + 1] = [buf]          # replaces a buffer of another shape, or appends
            self._next += 1
        return buf

    def dev(self, a):
        """a on the device: a constant (a NumPy array) is copied there once."""
        if not isinstance(a, np.ndarray):
            return a
        if id(a) not in self._consts:      # the constant itself is kept, so its id stays its own
            host = np.ascontiguousarray(a, np.float32).reshape(a.shape or (1,))
            self._consts[id(a)] = (a, cuda.to_device(host, stream=self.stream))
        return self._consts[id(a)][1]

    # -- the ops -----------------------------------------------------------------------------

    def _binary(self, kind, launch=K.elementwise):
        """An element-wise op of two broadcast inputs: arithmetic, or (launch=G.compare) a
        comparison."""
        def forward(a, b):
            a, b = self.dev(a), self.dev(b)
            out = self.empty(np.broadcast_shapes(a.shape, b.shape))
            launch(kind, a, b, out, stream=self.stream)
            return out
        return forward

    def _binary_vjp(self, kind):
        def vjp(g, out, a, b):
            da, db = self.dev(a), self.dev(b)
            return tuple(None if isinstance(x, np.ndarray) else self._grad(kind, i, g, da, db, out)
                         for i, x in enumerate((a, b)))     # a constant takes no gradient
        return vjp

    def _grad(self, kind, which, g, a, b, out):
        dx = self.empty((a, b)[which].shape)
        G.elementwise_grad(kind, which, g, a, b, out, dx, stream=self.stream)
        return dx

    def _unary(self, kind):
        def forward(x):
            x = self.dev(x)
            out = self.empty(x.shape)
            G.unary(kind, x, out, stream=self.stream)
            return out
        return forward

    def _unary_vjp(self, kind):
        def vjp(g, out, x):
            dx = self.empty(x.shape)
            G.unary_grad(kind, g, self.dev(x), out, dx, stream=self.stream)
            return (dx,)
        return vjp

    def _clip(self, x, lo, hi):       # constant lo and hi of one element (cuda_support.refusal)
        x = self.dev(x)
        out = self.empty(x.shape)
        G.clip(x, float(lo.flat[0]), float(hi.flat[0]), out, stream=self.stream)
        return out

    def _clip_vjp(self, g, out, x, lo, hi):
        dx = self.empty(x.shape)
        G.clip_grad(g, self.dev(x), float(lo.flat[0]), float(hi.flat[0]), dx, stream=self.stream)
        return dx, None, None

    def _where(self, c, a, b):
        c, a, b = self.dev(c), self.dev(a), self.dev(b)
        out = self.empty(np.broadcast_shapes(c.shape, a.shape, b.shape))
        G.where(c, a, b, out, stream=self.stream)
        return out

    def _where_vjp(self, g, out, c, a, b):
        grads = [None]
        for take, x in ((True, a), (False, b)):
            if isinstance(x, np.ndarray):        # a constant takes no gradient
                grads.append(None)
                continue
            dx = self.empty(x.shape)
            G.where_grad(self.dev(c), g, take, dx, stream=self.stream)
            grads.append(dx)
        return tuple(grads)

    def _softmax(self, log: bool):
        def forward(x, axis=-1):
            x = self.dev(x)
            perm = self._last(axis, len(x.shape))
            if perm is None:
                out = self.empty(x.shape)
                G.softmax(x, out, log, stream=self.stream)
                return out
            x_t = self._transpose(x, perm)                          # along the last axis of a transpose
            out_t = self.empty(x_t.shape)
            G.softmax(x_t, out_t, log, stream=self.stream)
            return self._transpose(out_t, tuple(int(i) for i in np.argsort(perm)))
        return forward

    def _softmax_vjp(self, log: bool):
        def vjp(g, out, x, axis=-1):
            perm = self._last(axis, len(x.shape))
            if perm is None:
                dx = self.empty(x.shape)
                G.softmax_grad(g, out, dx, log, stream=self.stream)
                return (dx,)
            g_t = self._transpose(g, perm)
            dx_t = self.empty(g_t.shape)
            G.softmax_grad(g_t, self._transpose(out, perm), dx_t, log, stream=self.stream)
            return (self._transpose(dx_t, tuple(int(i) for i in np.argsort(perm))),)
        return vjp

    @staticmethod
    def _last(axis, rank: int) -> tuple | None:
        """The permutation that moves `axis` last (None: it is the last)."""
        axis = int(axis) % rank
        return None if axis == rank - 1 else (*(d for d in range(rank) if d != axis), axis)

    @staticmethod
    def _permutation(axes, rank: int) -> tuple:
        """np.transpose's `axes` (None: reversed) as non-negative axes."""
        return tuple(range(rank))[::-1] if axes is None else tuple(int(a) % rank for a in axes)

    def _transpose(self, x, axes=None):
        x = self.dev(x)
        axes = self._permutation(axes, len(x.shape))
        out = self.empty(tuple(x.shape[a] for a in axes))
        G.transpose(x, axes, out, stream=self.stream)
        return out

    def _transpose_vjp(self, g, out, x, axes=None):
        dx = self.empty(x.shape)
        inverse = np.argsort(self._permutation(axes, len(x.shape)))
        G.transpose(g, tuple(int(i) for i in inverse), dx, stream=self.stream)
        return (dx,)

    @staticmethod
    def _kept(x, axis) -> tuple[tuple, int]:
        """The shape a reduction of x over `axis` has with keepdims, and how many elements each
        of its elements reduces."""
        axes = _axes(axis, len(x.shape))
        kept = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
        return kept, int(np.prod([x.shape[d] for d in axes]))

    def _extreme(self, kind):
        def forward(x, axis=None, keepdims=False):
            x = self.dev(x)
            out = self.empty(self._kept(x, axis)[0])
            G.extreme_to(kind, x, out, stream=self.stream)
            return out if keepdims else out.reshape(_shape_of("sum", x, axis=axis))
        return forward

    def _extreme_vjp(self, g, out, x, axis=None, keepdims=False):
        kept = self._kept(x, axis)[0]
        dx = self.empty(x.shape)
        G.extreme_to_grad(self.dev(x), out.reshape(kept), g.reshape(kept), dx, stream=self.stream)
        return (dx,)

    def _negative(self, x):
        out = self.empty(x.shape)
        K.scale_by(self.dev(x), -1.0, out, stream=self.stream)
        return out

    def _activation(self, kind):
        def forward(x):
            out = self.empty(x.shape)
            K.activation_forward(kind, self.dev(x), out, stream=self.stream)
            return out
        return forward

    def _activation_vjp(self, kind):
        def vjp(g, out, x):          # in terms of the output: relu's out > 0 is its x > 0
            dx = self.empty(x.shape)
            K.activation_backward(kind, out, g, dx, stream=self.stream)
            return (dx,)
        return vjp

    def _reshape(self, name):
        def forward(x, **attrs):
            x = self.dev(x)
            return x.reshape(_shape_of(name, x, **attrs))
        return forward

    @staticmethod
    def _columns(a, axis: int):
        """a as (everything before axis, the rest): a block of columns of a concatenation."""
        rows = int(np.prod(a.shape[:axis]))
        return a.reshape(rows, a.size // rows)

    def _concatenate(self, *xs, axis=0):
        xs = [self.dev(x) for x in xs]
        ax = axis % len(xs[0].shape)
        out = self.empty(np.concatenate([np.empty(x.shape, np.uint8) for x in xs], axis=ax).shape)
        self._join(xs, out, ax)
        return out

    def _join(self, parts, out, ax: int) -> None:
        whole, start = self._columns(out, ax), 0
        for part in parts:
            cols = self._columns(part, ax)
            K.columns_into(cols, whole, start, stream=self.stream)
            start += cols.shape[1]

    def _pieces(self, whole, shapes, ax: int) -> list:
        wide, start, pieces = self._columns(whole, ax), 0, []
        for shape in shapes:
            piece = self.empty(shape)
            cols = self._columns(piece, ax)
            K.columns_from(wide, start, cols, stream=self.stream)
            pieces.append(piece)
            start += cols.shape[1]
        return pieces

    def _concatenate_vjp(self, g, out, *xs, axis=0):
        return tuple(self._pieces(g, [x.shape for x in xs], axis % len(g.shape)))

    def _split(self, x, indices_or_sections, axis=0):
        x = self.dev(x)
        shapes = [p.shape for p in np.split(np.empty(x.shape, np.uint8), indices_or_sections, axis=axis)]
        return self._pieces(x, shapes, axis % len(x.shape))

    def _split_vjp(self, gs, outs, x, indices_or_sections, axis=0):
        parts = []
        for g, o in zip(gs, outs):      # a piece nothing used contributes zeros
            if g is None:
                g = self.empty(o.shape)
                G.fill(g, 0.0, stream=self.stream)
            parts.append(g)
        dx = self.empty(x.shape)
        self._join(parts, dx, axis % len(x.shape))
        return (dx,)

    def _reduce(self, mean: bool):
        def forward(x, axis=None, keepdims=False):
            x = self.dev(x)
            kept, count = self._kept(x, axis)
            out = self.empty(kept)
            G.sum_to(x, out, 1.0 / count if mean else 1.0, stream=self.stream)
            return out if keepdims else out.reshape(_shape_of("sum", x, axis=axis))
        return forward

    def _reduce_vjp(self, mean: bool):
        def vjp(g, out, x, axis=None, keepdims=False):
            kept, count = self._kept(x, axis)
            dx = self.empty(x.shape)
            G.broadcast_to(g.reshape(kept), dx, 1.0 / count if mean else 1.0, stream=self.stream)
            return (dx,)
        return vjp

    @staticmethod
    def _rows(a):
        last = a.shape[len(a.shape) - 1]       # the simulator's shapes take no negative index
        return a.reshape(a.size // last, last)

    def _matmul(self, a, b):
        a, b = self.dev(a), self.dev(b)
        out = self.empty((*a.shape[:-1], b.shape[1]))
        K.matmul(self._rows(a), b, self._rows(out), stream=self.stream)
        return out

    def _matmul_vjp(self, g, out, a, b):
        g2, da, db = self._rows(g), None, None     # a constant takes no gradient
        if not isinstance(a, np.ndarray):
            da = self.empty(a.shape)
            K.matmul(g2, self.dev(b), self._rows(da), False, True, stream=self.stream)
        if not isinstance(b, np.ndarray):
            db = self.empty(b.shape)
            K.matmul(self._rows(self.dev(a)), g2, db, True, False, stream=self.stream)
        return da, db

    # -- ops that only move elements: a gather by an index map, and stack ------------------------

    def _index_map(self, name, x, args, attrs):
        """The device index map of op `name` on x's shape with these constant arguments: the
        NumPy op run on x's element positions (so it is the op's own indexing, whatever its
        key, axis or repeats), made once per shape and arguments."""
        key = (name, tuple(x.shape), tuple(id(a) for a in args), repr(sorted(attrs.items())))
        if key not in self._maps:
            positions = np.arange(x.size, dtype=np.int64).reshape(x.shape)
            index = np.ascontiguousarray(core.OPS[name].forward(positions, *args, **attrs), np.int64)
            self._maps[key] = (args, cuda.to_device(index.reshape(index.shape or (1,)), stream=self.stream))
        return self._maps[key][1]                 # the arguments kept: their ids stay theirs

    def _gather(self, name):
        def forward(x, *args, **attrs):          # take's indices: a constant (cuda_support.refusal)
            x = self.dev(x)
            index = self._index_map(name, x, args, attrs)
            out = self.empty(index.shape)
            G.gather(x, index, out, stream=self.stream)
            return out
        return forward

    def _gather_vjp(self, name):
        def vjp(g, out, x, *args, **attrs):
            index = self._index_map(name, x, args, attrs)
            dx = self.empty(x.shape)
            G.fill(dx, 0.0, stream=self.stream)
            G.scatter_add(g, index, dx, stream=self.stream)
            return (dx, *(None for _ in args))
        return vjp

    @staticmethod
    def _stacked(xs, axis):
        """(the axis of the stack, each input's shape with a 1 there): stack is a concatenation
        of the inputs so reshaped (never along the batch: cuda_support.refusal)."""
        ax = int(axis) % (len(xs[0].shape) + 1)
        return ax, (*xs[0].shape[:ax], 1, *xs[0].shape[ax:])

    def _stack(self, *xs, axis=0):
        xs = [self.dev(x) for x in xs]
        ax, one = self._stacked(xs, axis)
        out = self.empty((*one[:ax], len(xs), *one[ax + 1:]))
        self._join([x.reshape(one) for x in xs], out, ax)
        return out

    def _stack_vjp(self, g, out, *xs, axis=0):
        ax, one = self._stacked(xs, axis)
        return tuple(p.reshape(x.shape) for p, x in zip(self._pieces(g, [one] * len(xs), ax), xs))

    def _one_hot(self, x, num_classes, axis=-1, dtype="float32"):   # the last axis, a float dtype
        x = self.dev(x)
        out = self.empty((*x.shape, int(num_classes)))
        G.one_hot(x, out, stream=self.stream)
        return out


__all__ = ["DeviceOps"]
