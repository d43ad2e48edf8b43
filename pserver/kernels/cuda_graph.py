"""The graph's kernels on the GPU: element-wise arithmetic with broadcasting and its gradients,
sums to a shape and broadcasts from one, column blocks (concatenate, split), the merge layers'
max/min, and global pooling. `pserver.kernels.cuda` exports the GRAPH_KERNELS among these
launchers (the layers call them as `k.elementwise(...)` on any backend); the rest
(elementwise_grad, sum_to, broadcast_to, fill) are for the ops' device forms
(pserver.models.cuda_ops), whose NumPy twins are the ops themselves (pserver.ops).

Every kernel runs one thread per element of a flat view (ELEMENT_THREADS per block). Shapes
and element strides travel as tuples of RANK ints, padded on the left (shape 1, stride 0), so
each kernel compiles once whatever the rank; a stride of 0 is a broadcast axis.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from pserver.kernels import reference
from pserver.kernels.cuda_grid import ELEMENT_THREADS, _blocks, _flat, fill_kernel

# The highest rank a broadcast, a sum to a shape or a broadcast from one takes (the batch and
# five more axes).
RANK = 6
# elementwise's kinds, as the kernels number them.
CODES = {kind: i for i, kind in enumerate(reference.ELEMENTWISE)}


def _launch(kernel, count, stream, *args):
    """kernel over a flat grid of `count` threads, ELEMENT_THREADS per block."""
    if count:
        kernel[_blocks(count, ELEMENT_THREADS), ELEMENT_THREADS, stream](*args)


# -- kernels ------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _apply(code, a, b):
    if code == 0:
        return a + b
    if code == 1:
        return a - b
    if code == 2:
        return a * b
    if code == 3:
        return a / b
    if code == 4:      # NaN in either wins, as NumPy's maximum
        return a if (a != a or a >= b) else b
    return a if (a != a or a <= b) else b


@cuda.jit(device=True)
def _partial(code, which, a, b, out):
    """d out / d a (which == 0) or d out / d b, as pserver.ops.math's VJPs: a tie sends the
    gradient of maximum and minimum to a."""
    if code == 0:
        return float32(1.0)
    if code == 1:
        return float32(1.0) if which == 0 else float32(-1.0)
    if code == 2:
        return b if which == 0 else a
    if code == 3:
        return float32(1.0) / b if which == 0 else -out / b
    if code == 4:
        return float32(a >= b) if which == 0 else float32(a < b)
    return float32(a <= b) if which == 0 else float32(a > b)


@cuda.jit(device=True)
def _offsets(i, shape, sa, sb):
    """The elements of a and b that output element i reads."""
    ia = 0
    ib = 0
    for d in range(RANK - 1, -1, -1):
        k = i % shape[d]
        i //= shape[d]
        ia += k * sa[d]
        ib += k * sb[d]
    return ia, ib


@cuda.jit
def binary_kernel(code, a, b, out, shape, sa, sb):
    i = cuda.grid(1)
    if i < out.shape[0]:
        ia, ib = _offsets(i, shape, sa, sb)
        out[i] = _apply(code, a[ia], b[ib])


@cuda.jit
def binary_grad_kernel(code, which, g, a, b, out, dfull, shape, sa, sb):
    """dfull = g * d out / d (a or b), at the output's shape."""
    i = cuda.grid(1)
    if i < dfull.shape[0]:
        ia, ib = _offsets(i, shape, sa, sb)
        dfull[i] = g[i] * _partial(code, which, a[ia], b[ib], out[i])


@cuda.jit
def sum_to_kernel(full, out, fshape, tshape, scale):
    """out[j] = scale * the sum of the elements of full that broadcasting from out's shape
    (tshape: 1 on each axis summed) maps to j. One thread per out element."""
    j = cuda.grid(1)
    if j >= out.shape[0]:
        return
    count = 1
    for d in range(RANK):
        if tshape[d] != fshape[d]:
            count *= fshape[d]
    acc = float32(0.0)
    for r in range(count):
        rj, rr, at, stride = j, r, 0, 1
        for d in range(RANK - 1, -1, -1):
            if tshape[d] != fshape[d]:
                k = rr % fshape[d]
                rr //= fshape[d]
            else:
                k = rj % tshape[d]
                rj //= tshape[d]
            at += k * stride
            stride *= fshape[d]
        acc += full[at]
    out[j] = acc * scale


@cuda.jit
def broadcast_kernel(src, out, shape, ss, scale):
    i = cuda.grid(1)
    if i < out.shape[0]:
        at, _ = _offsets(i, shape, ss, ss)
        out[i] = src[at] * scale


@cuda.jit
def scale_kernel(x, c, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[i] * c


@cuda.jit
def extreme_step_kernel(is_max, x, index, out, which):
    """Input `index` of a Maximum (Minimum): where it beats the extreme so far (strictly, so
    the first input holding it keeps it), it and its index go in; input 0 starts them."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = x[i]
        if index == 0 or (v > out[i] if is_max else v < out[i]):
            out[i] = v
            which[i] = index


@cuda.jit
def select_grad_kernel(dy, which, index, dx):
    i = cuda.grid(1)
    if i < dx.shape[0]:
        dx[i] = dy[i] if which[i] == index else float32(0.0)


@cuda.jit
def columns_kernel(wide, narrow, start, into):
    """Between narrow (rows, w) and columns start .. start + w of wide (rows, W); one thread
    per element of narrow."""
    i = cuda.grid(1)
    w = narrow.shape[1]
    if i < narrow.shape[0] * w:
        r, c = i // w, i % w
        if into:
            wide[r, start + c] = narrow[r, c]
        else:
            narrow[r, c] = wide[r, start + c]


@cuda.jit
def global_avgpool_kernel(x, out):
    """One thread per (sample, channel): the mean over positions."""
    i = cuda.grid(1)
    c_n = x.shape[2]
    if i < x.shape[0] * c_n:
        n, c = i // c_n, i % c_n
        acc = float32(0.0)
        for p in range(x.shape[1]):
            acc += x[n, p, c]
        out[n, c] = acc / float32(x.shape[1])


@cuda.jit
def global_maxpool_kernel(x, out, argmax):
    """One thread per (sample, channel): the max over positions and the first holding it."""
    i = cuda.grid(1)
    c_n = x.shape[2]
    if i < x.shape[0] * c_n:
        n, c = i // c_n, i % c_n
        best, arg = x[n, 0, c], 0
        for p in range(1, x.shape[1]):
            if x[n, p, c] > best:
                best, arg = x[n, p, c], p
        out[n, c] = best
        argmax[n, c] = arg


@cuda.jit
def global_pool_backward_kernel(dy, argmax, dx, is_max):
    """One thread per element of dx (n, positions, c): dy / positions (average), or dy at
    the argmax and 0 elsewhere (max)."""
    i = cuda.grid(1)
    p_n, c_n = dx.shape[1], dx.shape[2]
    if i < dx.shape[0] * p_n * c_n:
        n, p, c = i // (p_n * c_n), (i // c_n) % p_n, i % c_n
        if is_max:
            dx[n, p, c] = dy[n, c] if argmax[n, c] == p else float32(0.0)
        else:
            dx[n, p, c] = dy[n, c] / float32(p_n)


# -- shapes, on the host ------------------------------------------------------------------------

def _padded(values, fill) -> tuple:
    values = tuple(int(v) for v in values)
    if len(values) > RANK:
        raise ValueError(f"the graph's CUDA kernels take tensors of rank at most {RANK}, got {len(values)}")
    return (fill,) * (RANK - len(values)) + values


def _strides(shape, out_shape) -> tuple:
    """Element strides of a C-contiguous array of `shape` read at `out_shape` (broadcast: 0)."""
    shape = _padded(shape, 1)
    strides, acc = [0] * RANK, 1
    for d in range(RANK - 1, -1, -1):
        strides[d] = 0 if shape[d] == 1 else acc
        acc *= shape[d]
    return tuple(strides)


def _code(kind) -> int:
    if kind not in CODES:
        raise ValueError(f"elementwise: unknown kind {kind!r}; choose one of {', '.join(CODES)}")
    return CODES[kind]


def _broadcast_shape(name, a, b, out) -> tuple:
    shape = np.broadcast_shapes(a.shape, b.shape)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: a {a.shape}, b {b.shape}, out {out.shape}")
    return shape


# -- launchers ----------------------------------------------------------------------------------

def elementwise(kind, a, b, out, *, stream=0):
    """out[:] = a (kind) b with NumPy's broadcasting (out may be a or b)."""
    code, shape = _code(kind), _broadcast_shape("elementwise", a, b, out)
    _launch(binary_kernel, out.size, stream, code, _flat(a), _flat(b), _flat(out), _padded(shape, 1),
            _strides(a.shape, shape), _strides(b.shape, shape))


def elementwise_grad(kind, which, g, a, b, out, dx, *, stream=0):
    """dx[:] = g * d out / d (a if which == 0 else b), summed back to that input's shape:
    the VJP of `elementwise` (out its result). g and out have out's shape."""
    code, shape = _code(kind), _broadcast_shape("elementwise_grad", a, b, out)
    if dx.shape != (a, b)[which].shape or g.shape != shape:
        raise ValueError(f"elementwise_grad: g {g.shape}, input {which} {(a, b)[which].shape}, dx {dx.shape}")
    full = dx if dx.shape == shape else cuda.device_array(shape, np.float32, stream=stream)
    _launch(binary_grad_kernel, full.size, stream, code, which, _flat(g), _flat(a), _flat(b), _flat(out),
            _flat(full), _padded(shape, 1), _strides(a.shape, shape), _strides(b.shape, shape))
    if full is not dx:
        sum_to(full, dx, stream=stream)


def sum_to(g, out, scale=1.0, *, stream=0):
    """out[:] = scale * g summed over the axes that broadcasting out's shape to g's stretches
    (pserver.ops.core.unbroadcast's; a sum or mean over axes, keepdims)."""
    if np.broadcast_shapes(out.shape, g.shape) != tuple(g.shape):
        raise ValueError(f"sum_to: g {g.shape} does not broadcast from out {out.shape}")
    _launch(sum_to_kernel, out.size, stream, _flat(g), _flat(out), _padded(g.shape, 1),
            _padded(out.shape, 1), float32(scale))


def broadcast_to(x, out, scale=1.0, *, stream=0):
    """out[:] = scale * x broadcast to out's shape (sum_to's VJP)."""
    if np.broadcast_shapes(x.shape, out.shape) != tuple(out.shape):
        raise ValueError(f"broadcast_to: x {x.shape} does not broadcast to out {out.shape}")
    _launch(broadcast_kernel, out.size, stream, _flat(x), _flat(out), _padded(out.shape, 1),
            _strides(x.shape, out.shape), float32(scale))


def fill(a, value, *, stream=0):
    """a[:] = value."""
    _launch(fill_kernel, a.size, stream, _flat(a), float32(value))


def scale_by(x, c, out, *, stream=0):
    """out[:] = c * x (out may be x)."""
    if x.shape != out.shape:
        raise ValueError(f"scale: x {x.shape}, out {out.shape}")
    _launch(scale_kernel, out.size, stream, _flat(x), float32(c), _flat(out))


def extreme_forward(kind, xs, out, which, *, stream=0):
    """out[:] = the element-wise max (kind "max") or min of xs; which[:] = the index of the
    first input holding it (int32). One launch per input, in order."""
    if any(x.shape != out.shape for x in xs) or which.shape != out.shape:
        raise ValueError(f"extreme_forward: xs {[x.shape for x in xs]}, out {out.shape}, which {which.shape}")
    for index, x in enumerate(xs):
        _launch(extreme_step_kernel, out.size, stream, kind == "max", _flat(x), int32(index), _flat(out),
                _flat(which))


def select_grad(dy, which, i, dx, *, stream=0):
    """dx[:] = dy where which == i, else 0."""
    if dy.shape != dx.shape or which.shape != dx.shape:
        raise ValueError(f"select_grad: dy {dy.shape}, which {which.shape}, dx {dx.shape}")
    _launch(select_grad_kernel, dx.size, stream, _flat(dy), _flat(which), int32(i), _flat(dx))


def _check_columns(name, wide, narrow, start):
    if len(wide.shape) != 2 or len(narrow.shape) != 2 or wide.shape[0] != narrow.shape[0] \
            or not 0 <= start <= wide.shape[1] - narrow.shape[1]:
        raise ValueError(f"{name}: {wide.shape} and {narrow.shape} at column {start}")


def columns_into(src, dst, start, *, stream=0):
    """dst[:, start:start + w] = src, for src (rows, w) and dst (rows, W)."""
    _check_columns("columns_into", dst, src, start)
    _launch(columns_kernel, src.size, stream, dst, src, start, True)


def columns_from(src, start, dst, *, stream=0):
    """dst[:] = src[:, start:start + w], for src (rows, W) and dst (rows, w)."""
    _check_columns("columns_from", src, dst, start)
    _launch(columns_kernel, dst.size, stream, src, dst, start, False)


def _check_pool(name, x, out):
    if len(x.shape) != 3 or tuple(out.shape) != (x.shape[0], x.shape[2]) or x.shape[1] == 0:
        raise ValueError(f"{name}: x {x.shape}, out {out.shape}")


def global_avgpool_forward(x, out, *, stream=0):
    """out[:] = x's mean over its positions: x (n, positions, c), out (n, c)."""
    _check_pool("global_avgpool_forward", x, out)
    _launch(global_avgpool_kernel, out.size, stream, x, out)


def global_avgpool_backward(dy, dx, *, stream=0):
    """dx[:] = dy / positions at every position: dy (n, c), dx (n, positions, c)."""
    _check_pool("global_avgpool_backward", dx, dy)
    _launch(global_pool_backward_kernel, dx.size, stream, dy, dy, dx, False)   # dy: an unread argmax


def global_maxpool_forward(x, out, argmax, *, stream=0):
    """out[:] = x's max over its positions; argmax[:] = the first position holding it (int32)."""
    _check_pool("global_maxpool_forward", x, out)
    if argmax.shape != out.shape:
        raise ValueError(f"global_maxpool_forward: out {out.shape}, argmax {argmax.shape}")
    _launch(global_maxpool_kernel, out.size, stream, x, out, argmax)


def global_maxpool_backward(dy, argmax, dx, *, stream=0):
    """dx[:] = dy at each (sample, channel)'s argmax, 0 elsewhere."""
    _check_pool("global_maxpool_backward", dx, dy)
    _launch(global_pool_backward_kernel, dx.size, stream, dy, argmax, dx, True)


__all__ = ["RANK", "elementwise", "elementwise_grad", "sum_to", "broadcast_to", "fill", "scale_by",
           "extreme_forward", "select_grad", "columns_into", "columns_from", "global_avgpool_forward",
           "global_avgpool_backward", "global_maxpool_forward", "global_maxpool_backward"]
