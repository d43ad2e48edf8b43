"""The graph's kernels on the GPU: element-wise arithmetic (and power) and comparisons with
broadcasting and the arithmetic's gradients, the unary math (exp, log, sqrt, square, abs), clip
and where, softmax and log_softmax along the last axis, sums, maxima and minima to a shape and
broadcasts from one, transposes, column blocks (concatenate, split), a gather by an index map and
its scatter-add (slices, take, tile, repeat), one_hot, the merge layers' max/min, and global pooling.
`pserver.kernels.cuda` exports the GRAPH_KERNELS among these launchers (the layers call them as
`k.elementwise(...)` on any backend); the rest are for the ops' device forms
(pserver.models.cuda_ops), whose NumPy twins are the ops themselves (pserver.ops).

Every kernel runs one thread per element of a flat view (ELEMENT_THREADS per block). Shapes
and element strides travel as tuples of RANK ints, padded on the left (shape 1, stride 0), so
each kernel compiles once whatever the rank; a stride of 0 is a broadcast axis.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64

from pserver.kernels import reference
from pserver.kernels.cuda_grid import ELEMENT_THREADS, _blocks, _flat, fill_kernel

# The highest rank a broadcast, a sum to a shape or a broadcast from one takes (the batch and
# five more axes).
RANK = 6
# elementwise's kinds and then compare's (a comparison gives 1.0 where true, 0.0 where false:
# every device array is float32, and where's condition and a cast of a mask read them so), as
# the kernels number them. unary's: reference.UNARY's order.
COMPARISONS, UNARY = reference.COMPARISONS, reference.UNARY
CODES = {kind: i for i, kind in enumerate(reference.ELEMENTWISE + COMPARISONS)}
# power, an op's device form only (the layers' backends have no power): numbered after the rest
POWER = "power"
CODES[POWER] = len(CODES)
ARITHMETIC = (*reference.ELEMENTWISE, POWER)


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
    if code == 5:
        return a if (a != a or a <= b) else b
    if code == 6:
        return float32(a > b)
    if code == 7:
        return float32(a >= b)
    if code == 8:
        return float32(a < b)
    if code == 9:
        return float32(a <= b)
    if code == 10:
        return float32(a == b)
    if code == 11:
        return float32(a != b)
    return math.pow(a, b)


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
    if code == 5:
        return float32(a <= b) if which == 0 else float32(a > b)
    if which == 0:                   # power: b a**(b-1); out log(a), 0 where a <= 0 (as the op's)
        return b * math.pow(a, b - float32(1.0))
    return out * math.log(a) if a > 0 else float32(0.0)


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


@cuda.jit(device=True)
def _unary(code, x):
    if code == 0:
        return math.exp(x)
    if code == 1:
        return math.log(x)
    if code == 2:
        return math.sqrt(x)
    if code == 3:
        return x * x
    return abs(x)


@cuda.jit(device=True)
def _unary_partial(code, x, out):
    """d out / d x, as pserver.ops.math's: in terms of the output where that is cheaper; abs's
    is sign(x), 0 at 0."""
    if code == 0:
        return out
    if code == 1:
        return float32(1.0) / x
    if code == 2:
        return float32(0.5) / out
    if code == 3:
        return float32(2.0) * x
    return float32(x > 0) - float32(x < 0)


@cuda.jit
def unary_kernel(code, x, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = _unary(code, x[i])


@cuda.jit
def unary_grad_kernel(code, g, x, out, dx):
    i = cuda.grid(1)
    if i < dx.shape[0]:
        dx[i] = g[i] * _unary_partial(code, x[i], out[i])


@cuda.jit
def clip_kernel(x, lo, hi, out):
    """np.clip's order: below lo gives lo, then above hi gives hi (so lo > hi gives hi); NaN
    stays NaN."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = x[i]
        if v < lo:
            v = lo
        if v > hi:
            v = hi
        out[i] = v


@cuda.jit
def clip_grad_kernel(g, x, lo, hi, dx):
    """The gradient where lo <= x <= hi, 0 where x was clipped (pserver.ops.math's _clip_vjp)."""
    i = cuda.grid(1)
    if i < dx.shape[0]:
        v = x[i]
        dx[i] = float32(0.0) if (v < lo or v > hi) else g[i]


@cuda.jit
def where_kernel(c, a, b, out, shape, sc, sa, sb):
    i = cuda.grid(1)
    if i < out.shape[0]:
        ic, ia = _offsets(i, shape, sc, sa)
        _, ib = _offsets(i, shape, sc, sb)
        out[i] = a[ia] if c[ic] != 0 else b[ib]


@cuda.jit
def where_grad_kernel(c, g, dfull, shape, sc, take):
    """dfull = g where the condition is `take` (x1's share, or x2's), at the output's shape."""
    i = cuda.grid(1)
    if i < dfull.shape[0]:
        ic, _ = _offsets(i, shape, sc, sc)
        dfull[i] = g[i] if (c[ic] != 0) == take else float32(0.0)


@cuda.jit
def ids_kernel(x, ids, has_padding, padding):
    i = cuda.grid(1)
    if i < ids.shape[0]:
        v = x[i]
        ids[i] = -1 if has_padding and v == padding else int64(v)


@cuda.jit(device=True)
def _moments(x, k, of_column):
    """The mean and biased variance (two passes) of row k of x (rows, d), or of its column k."""
    n = x.shape[0] if of_column else x.shape[1]
    total = float32(0.0)
    for i in range(n):
        total += x[i, k] if of_column else x[k, i]
    mean = total / float32(n)
    total = float32(0.0)
    for i in range(n):
        c = (x[i, k] if of_column else x[k, i]) - mean
        total += c * c
    return mean, total / float32(n)


@cuda.jit
def layer_norm_rows_kernel(x, gamma, beta, has_gamma, has_beta, epsilon, y, scale, out):
    """One thread per row of x (rows, d): its mean and biased variance, then y, scale, out, as
    reference.layer_norm_forward."""
    r = cuda.grid(1)
    if r < x.shape[0]:
        n = x.shape[1]
        mean, var = _moments(x, r, False)
        s = float32(1.0) / math.sqrt(var + epsilon)
        scale[r, 0] = s
        for j in range(n):
            v = (x[r, j] - mean) * s
            y[r, j] = v
            if has_gamma:
                v = v * gamma[j]
            if has_beta:
                v = v + beta[j]
            out[r, j] = v


@cuda.jit(device=True)
def _column_sums(dout, y, j, dgamma, dbeta, want_gamma, want_beta):
    """The sums over the rows of column j of dout * y (gamma's gradient, into dgamma[j] when
    wanted) and of dout (beta's, into dbeta[j]); returns both."""
    g = float32(0.0)
    b = float32(0.0)
    for r in range(dout.shape[0]):
        g += dout[r, j] * y[r, j]
        b += dout[r, j]
    if want_gamma:
        dgamma[j] = g
    if want_beta:
        dbeta[j] = b
    return g, b


@cuda.jit
def layer_norm_params_kernel(dout, y, dgamma, dbeta, has_gamma, has_beta):
    """One thread per column j: dgamma[j] = sum over rows of dout * y, dbeta[j] = of dout."""
    j = cuda.grid(1)
    if j < dout.shape[1]:
        _column_sums(dout, y, j, dgamma, dbeta, has_gamma, has_beta)


@cuda.jit
def layer_norm_dx_kernel(dout, y, scale, gamma, has_gamma, dx):
    """One thread per row: dx = scale * (dy - mean(dy) - y * mean(dy * y)), dy = dout * gamma."""
    r = cuda.grid(1)
    if r < dout.shape[0]:
        n = dout.shape[1]
        a = float32(0.0)
        b = float32(0.0)
        for j in range(n):
            dy = dout[r, j] * gamma[j] if has_gamma else dout[r, j]
            a += dy
            b += dy * y[r, j]
        a = a / float32(n)
        b = b / float32(n)
        for j in range(n):
            dy = dout[r, j] * gamma[j] if has_gamma else dout[r, j]
            dx[r, j] = scale[r, 0] * (dy - a - y[r, j] * b)


@cuda.jit
def deviation_kernel(var, floor, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = max(math.sqrt(var[i]), floor)


@cuda.jit
def window_kernel(big, small, a, b, into):
    """One thread per element of small (n, h, w, c): it is big's element at (row + a, column + b);
    `into`: written there, else read from there."""
    i = cuda.grid(1)
    if i < small.size:
        c = small.shape[3]
        w = small.shape[2]
        h = small.shape[1]
        ch = i % c
        col = (i // c) % w
        row = (i // (c * w)) % h
        n = i // (c * w * h)
        if into:
            big[n, row + a, col + b, ch] = small[n, row, col, ch]
        else:
            small[n, row, col, ch] = big[n, row + a, col + b, ch]


@cuda.jit
def batched_matmul_kernel(x, y, out, trans_x, trans_y):
    """One thread per element of out (batch, m, k): the dot of op(x)'s row and op(y)'s column."""
    i = cuda.grid(1)
    if i < out.size:
        m, k = out.shape[1], out.shape[2]
        b = i // (m * k)
        r = (i // k) % m
        c = i % k
        inner = x.shape[1] if trans_x else x.shape[2]
        acc = float32(0.0)
        for d in range(inner):
            a = x[b, d, r] if trans_x else x[b, r, d]
            acc += a * (y[b, c, d] if trans_y else y[b, d, c])
        out[b, r, c] = acc


@cuda.jit
def batch_norm_moments_kernel(x, mean, var):
    """One thread per column of x (rows, c): its mean and biased variance (two passes)."""
    j = cuda.grid(1)
    if j < x.shape[1]:
        mean[j], var[j] = _moments(x, j, True)


@cuda.jit
def batch_norm_apply_kernel(x, mean, var, gamma, beta, has_gamma, has_beta, epsilon, y, scale, out):
    """One thread per element of x (rows, c) flat: y, out, and (row 0's threads) scale."""
    i = cuda.grid(1)
    if i < x.size:
        c = mean.shape[0]
        j = i % c
        s = float32(1.0) / math.sqrt(var[j] + epsilon)
        if i < c:
            scale[j] = s
        v = (x[i // c, j] - mean[j]) * s
        y[i // c, j] = v
        if has_gamma:
            v = v * gamma[j]
        if has_beta:
            v = v + beta[j]
        out[i // c, j] = v


@cuda.jit
def batch_norm_sums_kernel(dout, y, gamma, has_gamma, dgamma, dbeta, want_gamma, want_beta, sums):
    """One thread per column j: dgamma[j] = sum over rows of dout * y, dbeta[j] = of dout, and
    sums[0, j], sums[1, j] = the means over rows of dy and of dy * y (dy = dout * gamma)."""
    j = cuda.grid(1)
    if j < dout.shape[1]:
        g, b = _column_sums(dout, y, j, dgamma, dbeta, want_gamma, want_beta)
        k = gamma[j] if has_gamma else float32(1.0)
        n = float32(dout.shape[0])
        sums[0, j] = b * k / n
        sums[1, j] = g * k / n


@cuda.jit
def batch_norm_dx_kernel(dout, y, scale, gamma, has_gamma, sums, training, dx):
    """One thread per element: dx = scale * (dy - mean(dy) - y * mean(dy * y)) in training, else
    dy * scale, dy = dout * gamma."""
    i = cuda.grid(1)
    if i < dx.size:
        c = scale.shape[0]
        r = i // c
        j = i % c
        dy = dout[r, j] * gamma[j] if has_gamma else dout[r, j]
        if training:
            dx[r, j] = scale[j] * (dy - sums[0, j] - y[r, j] * sums[1, j])
        else:
            dx[r, j] = dy * scale[j]


@cuda.jit
def batch_norm_statistics_kernel(mean, var, moving_mean, dmean, dvar):
    j = cuda.grid(1)
    if j < mean.shape[0]:
        d = mean[j] - moving_mean[j]
        dmean[j] = d
        dvar[j] = var[j] + d * d


@cuda.jit
def softmax_rows_kernel(x, out, log):
    """One thread per row of x (rows, last axis): softmax, or log_softmax, of the row, shifted by
    its max as pserver.ops.nn's."""
    r = cuda.grid(1)
    if r < x.shape[0]:
        n = x.shape[1]
        top = x[r, 0]
        for j in range(1, n):
            top = max(top, x[r, j])
        total = float32(0.0)
        for j in range(n):
            total += math.exp(x[r, j] - top)
        if log:
            shift = top + math.log(total)
            for j in range(n):
                out[r, j] = x[r, j] - shift
        else:
            for j in range(n):
                out[r, j] = math.exp(x[r, j] - top) / total


@cuda.jit
def softmax_rows_grad_kernel(g, out, dx, log):
    """softmax's VJP out * (g - sum(g * out)), or log_softmax's g - exp(out) * sum(g), per row."""
    r = cuda.grid(1)
    if r < g.shape[0]:
        n = g.shape[1]
        total = float32(0.0)
        for j in range(n):
            total += g[r, j] if log else g[r, j] * out[r, j]
        for j in range(n):
            if log:
                dx[r, j] = g[r, j] - math.exp(out[r, j]) * total
            else:
                dx[r, j] = out[r, j] * (g[r, j] - total)


@cuda.jit
def gather_kernel(x, index, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[index[i]]


@cuda.jit
def scatter_add_kernel(g, index, dx):
    i = cuda.grid(1)
    if i < g.shape[0]:
        cuda.atomic.add(dx, index[i], g[i])


@cuda.jit
def one_hot_kernel(x, classes, out):
    """out (ids, classes) flat: 1.0 where the id, truncated to an integer as the op's cast does,
    is the class; an id outside [0, classes) gives a row of zeros."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = float32(int64(x[i // classes]) == i % classes)


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


@cuda.jit(device=True)
def _group_size(fshape, tshape):
    """How many elements of a tensor of fshape reduce into one of tshape (1 on each axis
    reduced)."""
    count = 1
    for d in range(RANK):
        if tshape[d] != fshape[d]:
            count *= fshape[d]
    return count


@cuda.jit(device=True)
def _member(j, r, fshape, tshape):
    """The flat index, in a tensor of fshape, of the r-th element that reduces into element j of
    one of tshape."""
    at, stride = 0, 1
    for d in range(RANK - 1, -1, -1):
        if tshape[d] != fshape[d]:
            k = r % fshape[d]
            r //= fshape[d]
        else:
            k = j % tshape[d]
            j //= tshape[d]
        at += k * stride
        stride *= fshape[d]
    return at


@cuda.jit
def sum_to_kernel(full, out, fshape, tshape, scale):
    """out[j] = scale * the sum of the elements of full that broadcasting from out's shape
    (tshape: 1 on each axis summed) maps to j. One thread per out element."""
    j = cuda.grid(1)
    if j >= out.shape[0]:
        return
    acc = float32(0.0)
    for r in range(_group_size(fshape, tshape)):
        acc += full[_member(j, r, fshape, tshape)]
    out[j] = acc * scale


@cuda.jit
def extreme_to_kernel(full, out, fshape, tshape, is_max):
    """out[j] = the max (min) of the elements of full that reduce into j; NaN wins, as NumPy's."""
    j = cuda.grid(1)
    if j >= out.shape[0]:
        return
    best = full[_member(j, 0, fshape, tshape)]
    for r in range(1, _group_size(fshape, tshape)):
        v = full[_member(j, r, fshape, tshape)]
        if best == best and (v != v or (v > best if is_max else v < best)):
            best = v
    out[j] = best


@cuda.jit
def extreme_to_grad_kernel(full, out, g, dfull, fshape, tshape):
    """dfull = g[j] shared equally among the elements of j's group that equal out[j] (ties, as
    pserver.ops.reduce's), 0 at the others. One thread per out element."""
    j = cuda.grid(1)
    if j >= out.shape[0]:
        return
    size = _group_size(fshape, tshape)
    hits = 0
    for r in range(size):
        hits += full[_member(j, r, fshape, tshape)] == out[j]
    share = g[j] / float32(hits)
    for r in range(size):
        at = _member(j, r, fshape, tshape)
        dfull[at] = share if full[at] == out[j] else float32(0.0)


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


def _code(kind, kinds=reference.ELEMENTWISE, name="elementwise") -> int:
    if kind not in kinds:
        raise ValueError(f"{name}: unknown kind {kind!r}; choose one of {', '.join(kinds)}")
    return CODES[kind]


def _broadcast_shape(name, a, b, out) -> tuple:
    shape = np.broadcast_shapes(a.shape, b.shape)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: a {a.shape}, b {b.shape}, out {out.shape}")
    return shape


# -- launchers ----------------------------------------------------------------------------------

def elementwise(kind, a, b, out, *, stream=0):
    """out[:] = a (kind) b with NumPy's broadcasting (out may be a or b); `kind` one of
    reference.ELEMENTWISE, or "power" (an op's device form: the layers' backends lack it)."""
    code, shape = _code(kind, ARITHMETIC), _broadcast_shape("elementwise", a, b, out)
    _launch(binary_kernel, out.size, stream, code, _flat(a), _flat(b), _flat(out), _padded(shape, 1),
            _strides(a.shape, shape), _strides(b.shape, shape))


def elementwise_grad(kind, which, g, a, b, out, dx, *, stream=0):
    """dx[:] = g * d out / d (a if which == 0 else b), summed back to that input's shape:
    the VJP of `elementwise` (out its result). g and out have out's shape."""
    code, shape = _code(kind, ARITHMETIC), _broadcast_shape("elementwise_grad", a, b, out)
    if dx.shape != (a, b)[which].shape or g.shape != shape:
        raise ValueError(f"elementwise_grad: g {g.shape}, input {which} {(a, b)[which].shape}, dx {dx.shape}")
    full = dx if dx.shape == shape else cuda.device_array(shape, np.float32, stream=stream)
    _launch(binary_grad_kernel, full.size, stream, code, which, _flat(g), _flat(a), _flat(b), _flat(out),
            _flat(full), _padded(shape, 1), _strides(a.shape, shape), _strides(b.shape, shape))
    if full is not dx:
        sum_to(full, dx, stream=stream)


def compare(kind, a, b, out, *, stream=0):
    """out[:] = 1.0 where a (kind) b holds, else 0.0, with NumPy's broadcasting: a comparison
    of COMPARISONS on float32 device arrays, which carry no booleans."""
    code, shape = _code(kind, COMPARISONS, "compare"), _broadcast_shape("compare", a, b, out)
    _launch(binary_kernel, out.size, stream, code, _flat(a), _flat(b), _flat(out), _padded(shape, 1),
            _strides(a.shape, shape), _strides(b.shape, shape))


def unary(kind, x, out, *, stream=0):
    """out[:] = kind(x), a kind of UNARY (out may be x)."""
    if x.shape != out.shape:
        raise ValueError(f"unary: x {x.shape}, out {out.shape}")
    _launch(unary_kernel, out.size, stream, UNARY.index(_unary_kind(kind)), _flat(x), _flat(out))


def unary_grad(kind, g, x, out, dx, *, stream=0):
    """dx[:] = g * d kind(x) / dx, with out = kind(x): the VJP of `unary`."""
    if not g.shape == x.shape == out.shape == dx.shape:
        raise ValueError(f"unary_grad: g {g.shape}, x {x.shape}, out {out.shape}, dx {dx.shape}")
    _launch(unary_grad_kernel, dx.size, stream, UNARY.index(_unary_kind(kind)), _flat(g), _flat(x),
            _flat(out), _flat(dx))


def _unary_kind(kind) -> str:
    if kind not in UNARY:
        raise ValueError(f"unary: unknown kind {kind!r}; choose one of {', '.join(UNARY)}")
    return kind


def clip(x, lo, hi, out, *, stream=0):
    """out[:] = np.clip(x, lo, hi) for numbers lo and hi (out may be x)."""
    if x.shape != out.shape:
        raise ValueError(f"clip: x {x.shape}, out {out.shape}")
    _launch(clip_kernel, out.size, stream, _flat(x), float32(lo), float32(hi), _flat(out))


def clip_grad(g, x, lo, hi, dx, *, stream=0):
    """dx[:] = g where lo <= x <= hi, else 0: clip's VJP to x."""
    if not g.shape == x.shape == dx.shape:
        raise ValueError(f"clip_grad: g {g.shape}, x {x.shape}, dx {dx.shape}")
    _launch(clip_grad_kernel, dx.size, stream, _flat(g), _flat(x), float32(lo), float32(hi), _flat(dx))


def where(c, a, b, out, *, stream=0):
    """out[:] = a where c != 0, else b, all three broadcast to out's shape."""
    shape = np.broadcast_shapes(c.shape, a.shape, b.shape)
    if tuple(out.shape) != shape:
        raise ValueError(f"where: c {c.shape}, a {a.shape}, b {b.shape}, out {out.shape}")
    _launch(where_kernel, out.size, stream, _flat(c), _flat(a), _flat(b), _flat(out), _padded(shape, 1),
            _strides(c.shape, shape), _strides(a.shape, shape), _strides(b.shape, shape))


def where_grad(c, g, take: bool, dx, *, stream=0):
    """dx[:] = g where (c != 0) == take, else 0, summed back to dx's shape: where's VJP to x1
    (take True) or x2."""
    shape = tuple(g.shape)
    if np.broadcast_shapes(c.shape, dx.shape, shape) != shape:
        raise ValueError(f"where_grad: c {c.shape}, g {g.shape}, dx {dx.shape}")
    full = dx if dx.shape == shape else cuda.device_array(shape, np.float32, stream=stream)
    _launch(where_grad_kernel, full.size, stream, _flat(c), _flat(g), _flat(full), _padded(shape, 1),
            _strides(c.shape, shape), bool(take))
    if full is not dx:
        sum_to(full, dx, stream=stream)


def ids_into(x, ids, padding=None, *, stream=0):
    """ids[:] = x as integers (int64 ids from a float32 batch), -1 where x holds `padding`
    (None: no padding id)."""
    if x.shape != ids.shape:
        raise ValueError(f"ids_into: x {x.shape}, ids {ids.shape}")
    _launch(ids_kernel, ids.size, stream, _flat(x), _flat(ids), padding is not None,
            float32(0 if padding is None else padding))


def _or_unused(a, like):
    """a, or (for None) one element of the device array `like`, which the kernel is told not to
    read."""
    return a if a is not None else like.reshape(like.size)[:1]


def layer_norm_forward(x, gamma, beta, epsilon, y, scale, out, *, stream=0):
    """reference.layer_norm_forward on device arrays: x, y, out (rows, d), scale (rows, 1),
    gamma and beta (d,) or None."""
    if not x.shape == y.shape == out.shape or tuple(scale.shape) != (x.shape[0], 1) or len(x.shape) != 2:
        raise ValueError(f"layer_norm_forward: x {x.shape}, y {y.shape}, scale {scale.shape}, "
                         f"out {out.shape}")
    _launch(layer_norm_rows_kernel, x.shape[0], stream, x, _or_unused(gamma, x), _or_unused(beta, x),
            gamma is not None, beta is not None, float32(epsilon), y, scale, out)


def layer_norm_backward(dout, y, scale, gamma, dgamma, dbeta, dx, *, stream=0):
    """reference.layer_norm_backward on device arrays (dgamma, dbeta or dx None: not written)."""
    if dout.shape != y.shape or len(dout.shape) != 2 or (dx is not None and dx.shape != dout.shape):
        raise ValueError(f"layer_norm_backward: dout {dout.shape}, y {y.shape}")
    if dgamma is not None or dbeta is not None:
        _launch(layer_norm_params_kernel, dout.shape[1], stream, dout, y, _or_unused(dgamma, y),
                _or_unused(dbeta, y), dgamma is not None and gamma is not None, dbeta is not None)
    if dx is not None:
        _launch(layer_norm_dx_kernel, dout.shape[0], stream, dout, y, scale, _or_unused(gamma, y),
                gamma is not None, dx)


def _check_window(name, big, starts, small):
    a, b = (int(v) for v in starts)
    if len(big.shape) != 4 or len(small.shape) != 4 or big.shape[0] != small.shape[0] or \
            big.shape[3] != small.shape[3] or a < 0 or b < 0 or a + small.shape[1] > big.shape[1] or \
            b + small.shape[2] > big.shape[2]:
        raise ValueError(f"{name}: {small.shape} at {(a, b)} is not inside {big.shape}")
    return a, b


def deviation(var, floor, out, *, stream=0):
    """reference.deviation on device arrays of one size."""
    if var.size != out.size:
        raise ValueError(f"deviation: var {var.shape}, out {out.shape}")
    _launch(deviation_kernel, out.size, stream, _flat(var), float32(floor), _flat(out))


def window_into(src, dst, starts, *, stream=0):
    """reference.window_into on device arrays."""
    a, b = _check_window("window_into", dst, starts, src)
    _launch(window_kernel, src.size, stream, dst, src, a, b, True)


def window_from(src, starts, dst, *, stream=0):
    """reference.window_from on device arrays."""
    a, b = _check_window("window_from", src, starts, dst)
    _launch(window_kernel, dst.size, stream, src, dst, a, b, False)


def batched_matmul(x, y, out, trans_x=False, trans_y=False, *, stream=0):
    """reference.batched_matmul on device arrays (batch, rows, cols)."""
    xs = (x.shape[0], *(x.shape[1:][::-1] if trans_x else x.shape[1:])) if len(x.shape) == 3 else ()
    ys = (y.shape[0], *(y.shape[1:][::-1] if trans_y else y.shape[1:])) if len(y.shape) == 3 else ()
    if not xs or not ys or xs[0] != ys[0] or xs[2] != ys[1] or tuple(out.shape) != (xs[0], xs[1], ys[2]):
        raise ValueError(f"batched_matmul: x {x.shape} (transposed: {trans_x}), y {y.shape} "
                         f"(transposed: {trans_y}), out {out.shape}")
    _launch(batched_matmul_kernel, out.size, stream, x, y, out, bool(trans_x), bool(trans_y))


def batch_norm_forward(x, gamma, beta, mean, var, training, epsilon, y, scale, out, *, stream=0):
    """reference.batch_norm_forward on device arrays: x, y, out (rows, c), mean, var, scale (c,),
    gamma and beta (c,) or None."""
    c = x.shape[1] if len(x.shape) == 2 else -1
    if not x.shape == y.shape == out.shape or not tuple(mean.shape) == tuple(var.shape) == \
            tuple(scale.shape) == (c,):
        raise ValueError(f"batch_norm_forward: x {x.shape}, y {y.shape}, out {out.shape}, mean {mean.shape}, "
                         f"var {var.shape}, scale {scale.shape}")
    if training:
        _launch(batch_norm_moments_kernel, c, stream, x, mean, var)
    _launch(batch_norm_apply_kernel, x.size, stream, x, mean, var, _or_unused(gamma, mean),
            _or_unused(beta, mean), gamma is not None, beta is not None, float32(epsilon), y, scale, out)


def batch_norm_backward(dout, y, scale, gamma, training, dgamma, dbeta, sums, dx, *, stream=0):
    """reference.batch_norm_backward on device arrays (dgamma, dbeta or dx None: not written)."""
    if dout.shape != y.shape or len(dout.shape) != 2 or (dx is not None and dx.shape != dout.shape) or \
            tuple(sums.shape) != (2, dout.shape[1]):
        raise ValueError(f"batch_norm_backward: dout {dout.shape}, y {y.shape}, sums {sums.shape}")
    unused = scale
    _launch(batch_norm_sums_kernel, dout.shape[1], stream, dout, y, _or_unused(gamma, unused),
            gamma is not None, _or_unused(dgamma, unused), _or_unused(dbeta, unused),
            dgamma is not None and gamma is not None, dbeta is not None, sums)
    if dx is not None:
        _launch(batch_norm_dx_kernel, dx.size, stream, dout, y, scale, _or_unused(gamma, unused),
                gamma is not None, sums, bool(training), dx)


def batch_norm_statistics(mean, var, moving_mean, dmean, dvar, *, stream=0):
    """reference.batch_norm_statistics on device arrays."""
    _launch(batch_norm_statistics_kernel, mean.size, stream, mean, var, moving_mean, dmean, dvar)


def _rows_of(name, *arrays):
    """Each array as (rows, its last axis), all of one shape."""
    if len({tuple(a.shape) for a in arrays}) != 1 or len(arrays[0].shape) == 0 or arrays[0].size == 0:
        raise ValueError(f"{name}: {[tuple(a.shape) for a in arrays]}")
    last = arrays[0].shape[len(arrays[0].shape) - 1]      # the simulator's shapes take no negative index
    return [a.reshape(a.size // last, last) for a in arrays]


def softmax(x, out, log=False, *, stream=0):
    """out[:] = softmax (log_softmax with log) of x along its last axis."""
    x2, out2 = _rows_of("softmax", x, out)
    _launch(softmax_rows_kernel, x2.shape[0], stream, x2, out2, bool(log))


def softmax_grad(g, out, dx, log=False, *, stream=0):
    """dx[:] = the VJP of `softmax` (log_softmax with log) at g, from its output."""
    g2, out2, dx2 = _rows_of("softmax_grad", g, out, dx)
    _launch(softmax_rows_grad_kernel, g2.shape[0], stream, g2, out2, dx2, bool(log))


def _reduced_to(name, full, out):
    if np.broadcast_shapes(out.shape, full.shape) != tuple(full.shape) or len(out.shape) != len(full.shape):
        raise ValueError(f"{name}: {full.shape} does not reduce to {out.shape} (keepdims)")


def extreme_to(kind, x, out, *, stream=0):
    """out[:] = the max (kind "max") or min of x over the axes where out (keepdims) has 1."""
    _reduced_to("extreme_to", x, out)
    _launch(extreme_to_kernel, out.size, stream, _flat(x), _flat(out), _padded(x.shape, 1),
            _padded(out.shape, 1), kind == "max")


def extreme_to_grad(x, out, g, dx, *, stream=0):
    """dx[:] = g shared equally among the elements of x equal to their group's extreme `out`
    (keepdims, g of its shape), 0 elsewhere: extreme_to's VJP."""
    _reduced_to("extreme_to_grad", x, out)
    if g.shape != out.shape or dx.shape != x.shape:
        raise ValueError(f"extreme_to_grad: x {x.shape}, out {out.shape}, g {g.shape}, dx {dx.shape}")
    _launch(extreme_to_grad_kernel, out.size, stream, _flat(x), _flat(out), _flat(g), _flat(dx),
            _padded(x.shape, 1), _padded(out.shape, 1))


def transpose(x, axes, out, *, stream=0):
    """out[:] = np.transpose(x, axes)."""
    axes = tuple(int(a) % len(x.shape) for a in axes)
    if sorted(axes) != list(range(len(x.shape))) or tuple(out.shape) != tuple(x.shape[a] for a in axes):
        raise ValueError(f"transpose: x {x.shape} by {axes} into {out.shape}")
    strides = _strides(x.shape, x.shape)[RANK - len(axes):]
    _launch(broadcast_kernel, out.size, stream, _flat(x), _flat(out), _padded(out.shape, 1),
            _padded([strides[a] for a in axes], 0), float32(1.0))


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


def gather(x, index, out, *, stream=0):
    """out.flat[i] = x.flat[index.flat[i]]: the forward of an op that only moves elements (a slice,
    take with constant indices, tile, repeat), whose index map is the op run on x's positions."""
    if tuple(index.shape) != tuple(out.shape):
        raise ValueError(f"gather: index {index.shape}, out {out.shape}")
    _launch(gather_kernel, out.size, stream, _flat(x), _flat(index), _flat(out))


def scatter_add(g, index, dx, *, stream=0):
    """dx.flat[index.flat[i]] += g.flat[i] (atomically: an element taken twice gets both): gather's
    VJP into a dx the caller zeroed."""
    if tuple(index.shape) != tuple(g.shape):
        raise ValueError(f"scatter_add: index {index.shape}, g {g.shape}")
    _launch(scatter_add_kernel, g.size, stream, _flat(g), _flat(index), _flat(dx))


def one_hot(x, out, *, stream=0):
    """out (x's shape, classes) = x's ids (float32) one-hot along the last axis."""
    classes = out.shape[len(out.shape) - 1]
    if tuple(out.shape) != (*x.shape, classes):
        raise ValueError(f"one_hot: x {x.shape}, out {out.shape}")
    _launch(one_hot_kernel, out.size, stream, _flat(x), classes, _flat(out))


__all__ = ["RANK", "COMPARISONS", "UNARY", "POWER", "elementwise", "elementwise_grad", "compare", "unary",
           "unary_grad", "clip", "clip_grad", "where", "where_grad", "softmax", "softmax_grad", "extreme_to",
           "extreme_to_grad", "transpose", "ids_into", "layer_norm_forward", "layer_norm_backward",
           "batch_norm_forward", "batch_norm_backward", "batch_norm_statistics", "batched_matmul",
           "window_into", "window_from", "deviation", "sum_to", "broadcast_to", "fill", "scale_by",
           "extreme_forward", "select_grad", "columns_into", "columns_from", "global_avgpool_forward",
           "global_avgpool_backward", "global_maxpool_forward", "global_maxpool_backward", "gather",
           "scatter_add", "one_hot"]
