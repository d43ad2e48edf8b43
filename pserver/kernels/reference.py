"""Model math in plain NumPy: the twin that every compiled kernel is tested against.

Same names, signatures and in-place contracts as `pserver.kernels.cpu`, so a model is written
once against either module. These work for any float dtype (the model tests check gradients in
float64 through this module); the compiled kernels are built and timed for float32.
"""

from __future__ import annotations

import numpy as np


def dense_forward(x, W, b, out, relu):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    np.dot(x, W, out=out)
    out += b
    if relu:
        # np.maximum keeps NaN, as the compiled kernel does, so a blow-up stays visible.
        np.maximum(out, 0, out=out)


def dense_param_grads(x, dz, dW, db):
    """dW[:] = x.T @ dz, db[:] = dz summed over the batch. For a first layer: no input grad."""
    np.dot(x.T, dz, out=dW)
    dz.sum(axis=0, out=db)


def dense_backward(x, W, dz, dW, db, dx, relu):
    """dense_param_grads, plus dx[:] = dz @ W.T, masked by (x > 0) if `relu`.

    `relu` says x is the output of a ReLU; then x > 0 exactly where the pre-activation was,
    so the ReLU's backward fuses here with no extra buffer.
    """
    dense_param_grads(x, dz, dW, db)
    np.dot(dz, W.T, out=dx)
    if relu:
        relu_backward(dx, x)


def relu_backward(dx, a):
    """dx *= (a > 0) in place; a is the ReLU's output (or its input: same sign)."""
    dx[~(a > 0)] = 0


def softmax_xent(logits, y, dlogits, row_loss=None):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n.

    logits (n, k), y (n,) int labels in [0, k), dlogits (n, k). Rows are shifted by their
    max before exp, so large logits do not overflow. row_loss (n,), when given, gets each
    row's loss.
    """
    n, k = logits.shape
    if n and (y.min() < 0 or y.max() >= k):
        raise ValueError("softmax_xent: label out of range [0, num_classes)")
    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=dlogits)
    s = dlogits.sum(axis=1, dtype=np.float64)
    rows = np.arange(n)
    terms = np.log(s) - z[rows, y]
    if row_loss is not None:
        row_loss[:] = terms
    loss = float(np.sum(terms) / n)
    dlogits *= (1.0 / (n * s))[:, None].astype(dlogits.dtype)
    dlogits[rows, y] -= dlogits.dtype.type(1.0 / n)
    return loss


def mse(pred, y, dpred, row_loss=None):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n. pred, dpred (n, 1), y (n,);
    row_loss (n,), when given, gets each row's 0.5 * (pred - y)^2."""
    if pred.shape[1] != 1:
        raise ValueError("mse: pred must have one column")
    n = pred.shape[0]
    r = pred[:, 0] - y
    dpred[:, 0] = r / dpred.dtype.type(n)
    terms = r.astype(np.float64) ** 2
    if row_loss is not None:
        row_loss[:] = 0.5 * terms
    return float(0.5 * np.sum(terms) / n)


# -- twins of the CUDA kernels that have no CPU counterpart above ---------------------------

def matmul(a, b, out, trans_a=False, trans_b=False):
    """out[:] = op(a) @ op(b), op transposing its operand when the flag is set."""
    np.dot(a.T if trans_a else a, b.T if trans_b else b, out=out)


def column_sum(a, out):
    """out[:] = a summed over its rows (a bias gradient: dz summed over the batch)."""
    a.sum(axis=0, out=out)


def scaled_sum(values, scale) -> float:
    """scale * sum(values), summed in float64: the loss reduction over per-row terms."""
    return float(scale * np.sum(values, dtype=np.float64))


def _sigmoid(z):
    """1 / (1 + exp(-z)) from e = exp(-|z|) <= 1, so no exp overflows whatever z's sign."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1 / (1 + e), e / (1 + e)).astype(z.dtype)


def sigmoid_bce(logits, y, dlogits, row_loss=None):
    """Mean binary cross-entropy from logits; dlogits[:] = (sigmoid(logits) - y) / n.

    logits and dlogits (n, 1) or (n,), y (n,) of 0/1 floats. Written as
    max(z, 0) - z*y + log(1 + exp(-|z|)), which neither overflows nor loses the small terms.
    row_loss (n,), when given, gets each row's term.
    """
    z = logits.reshape(-1)
    n = z.shape[0]
    t = y.reshape(-1).astype(z.dtype)
    p = _sigmoid(z)
    dlogits.reshape(-1)[:] = (p - t) / dlogits.dtype.type(n)
    terms = np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))
    if row_loss is not None:
        row_loss[:] = terms
    return float(np.sum(terms, dtype=np.float64) / n)


# -- images: channels-last (N, H, W, C), windows placed by stride and padding ----------------
#
# Output position (oh, ow) reads the window whose top-left input element is
# (oh*stride_h - pad_top, ow*stride_w - pad_left); elements outside the image read as zero
# (conv), are never chosen (max pooling) or are not counted (average pooling). These twins
# copy the input into a zero-padded buffer large enough for every window, then loop over the
# kernel offsets (a few) with whole-array operations over everything else.

def _padded_shape(x_shape, out_hw, kernel, stride, pad):
    """Shape of a padded buffer that holds the image at (pad_top, pad_left) and every window."""
    n, h, w, c = x_shape
    hp = max(pad[0] + h, (out_hw[0] - 1) * stride[0] + kernel[0])
    wp = max(pad[1] + w, (out_hw[1] - 1) * stride[1] + kernel[1])
    return n, hp, wp, c


def _pad(x, out_hw, kernel, stride, pad):
    xp = np.zeros(_padded_shape(x.shape, out_hw, kernel, stride, pad), x.dtype)
    xp[:, pad[0]:pad[0] + x.shape[1], pad[1]:pad[1] + x.shape[2]] = x
    return xp


def _window(xp, i, j, out_hw, stride):
    """The (N, OH, OW, C) view of xp at kernel offset (i, j): element (oh, ow) of every window."""
    return xp[:, i:i + (out_hw[0] - 1) * stride[0] + 1:stride[0],
              j:j + (out_hw[1] - 1) * stride[1] + 1:stride[1]]


def _inside(size, out, stride, pad, offset):
    """(out,) input coordinate of each window at this kernel offset, and whether it is inside."""
    pos = np.arange(out) * stride - pad + offset
    return pos, (pos >= 0) & (pos < size)


def conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu):
    """out[:] = conv(x, w) + b, then ReLU if `relu`. x (N,H,W,C), w (KH,KW,C,F), out (N,OH,OW,F)."""
    kh, kw = w.shape[:2]
    hw, stride = out.shape[1:3], (stride_h, stride_w)
    xp = _pad(x, hw, (kh, kw), stride, (pad_top, pad_left))
    out[:] = b
    for i in range(kh):
        for j in range(kw):
            out += _window(xp, i, j, hw, stride) @ w[i, j]
    if relu:
        np.maximum(out, 0, out=out)   # keeps NaN, as the compiled kernels do


def conv2d_backward(x, w, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left):
    """dw, db (and dx unless it is None) from dy = d loss / d pre-activation (N,OH,OW,F)."""
    kh, kw, c, f = w.shape
    hw, stride, pad = dy.shape[1:3], (stride_h, stride_w), (pad_top, pad_left)
    xp = _pad(x, hw, (kh, kw), stride, pad)
    dyf = dy.reshape(-1, f)
    dxp = np.zeros_like(xp) if dx is not None else None
    for i in range(kh):
        for j in range(kw):
            dw[i, j] = _window(xp, i, j, hw, stride).reshape(-1, c).T @ dyf
            if dxp is not None:
                _window(dxp, i, j, hw, stride)[...] += dy @ w[i, j].T
    dyf.sum(axis=0, out=db)
    if dx is not None:
        dx[:] = dxp[:, pad[0]:pad[0] + x.shape[1], pad[1]:pad[1] + x.shape[2]]


def _cols_of(xp, hw, kernel, stride):
    """The im2col matrix (N*OH*OW, KH*KW*C): each output pixel's window, flattened (i, j, c)."""
    return np.concatenate([_window(xp, i, j, hw, stride).reshape(-1, xp.shape[3])
                           for i in range(kernel[0]) for j in range(kernel[1])], axis=1)


def conv2d_forward_cols(x, w, b, out, cols, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_forward, and its im2col matrix (N*OH*OW, KH*KW*C) of x into `cols`."""
    kernel, hw, stride = w.shape[:2], out.shape[1:3], (stride_h, stride_w)
    want = (out.shape[0] * hw[0] * hw[1], kernel[0] * kernel[1] * w.shape[2])
    if cols.shape != want:
        raise ValueError("conv2d: cols must be (N*OH*OW, KH*KW*C)")
    cols[:] = _cols_of(_pad(x, hw, kernel, stride, (pad_top, pad_left)), hw, kernel, stride)
    conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu)


def conv2d_backward_cols(cols, w, out, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_backward from x's im2col matrix (conv2d_forward_cols's) instead of x; `relu`:
    dy, the gradient of the ReLU's output `out`, made that of its input first, in place."""
    if relu:
        relu_backward(dy, out)
    kh, kw, c, f = w.shape
    hw, stride, pad = dy.shape[1:3], (stride_h, stride_w), (pad_top, pad_left)
    if cols.shape != (dy.shape[0] * hw[0] * hw[1], kh * kw * c):
        raise ValueError("conv2d: cols must be (N*OH*OW, KH*KW*C)")
    dyf = dy.reshape(-1, f)
    dw.reshape(-1, f)[:] = cols.T @ dyf
    dyf.sum(axis=0, out=db)
    if dx is not None:
        dxp = np.zeros(_padded_shape(dx.shape, hw, (kh, kw), stride, pad), dx.dtype)
        back = (dyf @ w.reshape(-1, f).T).reshape(*dy.shape[:3], kh, kw, c)
        for i in range(kh):
            for j in range(kw):
                _window(dxp, i, j, hw, stride)[...] += back[:, :, :, i, j]
        dx[:] = dxp[:, pad[0]:pad[0] + dx.shape[1], pad[1]:pad[1] + dx.shape[2]]


def maxpool2d_forward(x, out, argmax, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out[:] = each window's max; argmax[:] = its flat index h*W + w in the image.

    Ties go to the first element in row-major order (as TF). A window with no element inside
    the image (possible only with padding larger than any 'same' padding) gives 0 and index -1.
    A NaN that comes first in its window stays (a blow-up stays visible); a later one loses.
    """
    _, h, w, _ = x.shape
    hw, stride = out.shape[1:3], (stride_h, stride_w)
    xp = _pad(x, hw, (pool_h, pool_w), stride, (pad_top, pad_left))
    best = np.zeros(out.shape, x.dtype)
    arg = np.full(out.shape, -1, np.int32)
    for i in range(pool_h):
        rows, row_in = _inside(h, hw[0], stride_h, pad_top, i)
        for j in range(pool_w):
            cols, col_in = _inside(w, hw[1], stride_w, pad_left, j)
            v = _window(xp, i, j, hw, stride)
            inside = (row_in[:, None] & col_in[None, :])[None, :, :, None]
            take = inside & ((arg < 0) | (v > best))
            best = np.where(take, v, best)
            arg = np.where(take, (rows[:, None] * w + cols[None, :])[None, :, :, None], arg)
    out[:] = best
    argmax[:] = arg


def maxpool2d_backward(dy, argmax, dx):
    """dx[:] = 0, then each dy element added at its window's argmax (overlapping windows add)."""
    n, h, w, c = dx.shape
    dx[:] = 0
    chosen = argmax >= 0
    batch, _, _, chan = np.nonzero(chosen)
    np.add.at(dx.reshape(n, h * w, c), (batch, argmax[chosen], chan), dy[chosen])


def _window_counts(h, w, hw, pool, stride, pad):
    """(OH, OW) number of each window's elements inside the image (average pooling's divisor)."""
    rows = sum(_inside(h, hw[0], stride[0], pad[0], i)[1].astype(np.int64) for i in range(pool[0]))
    cols = sum(_inside(w, hw[1], stride[1], pad[1], j)[1].astype(np.int64) for j in range(pool[1]))
    return rows[:, None] * cols[None, :]


def avgpool2d_forward(x, out, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out[:] = mean of each window's elements inside the image (padding not counted, as TF).

    A window with no element inside the image gives 0.
    """
    hw, pool, stride, pad = out.shape[1:3], (pool_h, pool_w), (stride_h, stride_w), (pad_top, pad_left)
    xp = _pad(x, hw, pool, stride, pad)
    total = np.zeros(out.shape, x.dtype)
    for i in range(pool_h):
        for j in range(pool_w):
            total += _window(xp, i, j, hw, stride)
    count = _window_counts(x.shape[1], x.shape[2], hw, pool, stride, pad)
    out[:] = total / np.maximum(count, 1)[None, :, :, None].astype(x.dtype)


def avgpool2d_backward(dy, dx, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """dx[:] = each window's dy / its count, spread over its elements inside the image."""
    hw, pool, stride, pad = dy.shape[1:3], (pool_h, pool_w), (stride_h, stride_w), (pad_top, pad_left)
    count = _window_counts(dx.shape[1], dx.shape[2], hw, pool, stride, pad)
    share = dy / np.maximum(count, 1)[None, :, :, None].astype(dy.dtype)
    dxp = np.zeros(_padded_shape(dx.shape, hw, pool, stride, pad), dx.dtype)
    for i in range(pool_h):
        for j in range(pool_w):
            _window(dxp, i, j, hw, stride)[...] += share
    dx[:] = dxp[:, pad[0]:pad[0] + dx.shape[1], pad[1]:pad[1] + dx.shape[2]]


# -- elementwise ------------------------------------------------------------------------------

ACTIVATIONS = ("relu", "sigmoid", "tanh", "linear")


def _check_kind(kind):
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation: unknown kind {kind!r}; choose one of {', '.join(ACTIVATIONS)}")


def activation_forward(kind, x, out):
    """out[:] = f(x) for f = relu | sigmoid | tanh | linear; any shape."""
    _check_kind(kind)
    if kind == "relu":
        np.maximum(x, 0, out=out)
    elif kind == "sigmoid":
        out[:] = _sigmoid(x)
    elif kind == "tanh":
        np.tanh(x, out=out)
    else:
        out[:] = x


def activation_backward(kind, y, dy, dx):
    """dx[:] = dy * f'(.), written in terms of the activation's output y."""
    _check_kind(kind)
    if kind == "relu":
        dx[:] = np.where(y > 0, dy, 0)
    elif kind == "sigmoid":
        dx[:] = dy * y * (1 - y)
    elif kind == "tanh":
        dx[:] = dy * (1 - y * y)
    else:
        dx[:] = dy


# Dropout's mask comes from a counter-based generator, so every backend draws the same mask
# for a seed without sharing state: element i keeps iff the top 24 bits of the i-th output of
# splitmix64 seeded with `seed` are >= dropout_threshold(rate). (splitmix64: Steele, Lea and
# Flood 2014, the generator Java's SplittableRandom uses.)
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL2 = 0x94D049BB133111EB


def dropout_threshold(rate, seed) -> int:
    """The 24-bit integer a draw must reach to keep its element: P(keep) = 1 - rate (to 2^-24).

    Checks both arguments: the seed is a non-negative int64 (what the compiled kernels take).
    """
    if not 0 <= rate < 1:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
    if not 0 <= seed < 1 << 63:
        raise ValueError(f"dropout: seed must be in [0, 2**63), got {seed}")
    return int(rate * (1 << 24))


def splitmix64(seed, index):
    """The index-th (0-based) output of splitmix64 seeded with `seed`: uint64 array like index."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (index.astype(np.uint64) + np.uint64(1)) * np.uint64(SPLITMIX_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_MUL1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_MUL2)
        return z ^ (z >> np.uint64(31))


def dropout_forward(x, out, mask, rate, seed):
    """mask[:] = 0 or 1/(1 - rate) per element (kept with probability 1 - rate); out = x * mask."""
    threshold = np.uint64(dropout_threshold(rate, seed))
    keep = splitmix64(seed, np.arange(x.size)) >> np.uint64(40) >= threshold
    mask.reshape(-1)[:] = np.where(keep, 1 / (1 - rate), 0)
    np.multiply(x, mask, out=out)


def dropout_backward(dy, mask, dx):
    """dx[:] = dy * mask."""
    np.multiply(dy, mask, out=dx)


def copy(x, out):
    """out[:] = x, of the same shape (an identity layer: Dropout at inference or at rate 0)."""
    if x.shape != out.shape:
        raise ValueError("copy: x and out differ in shape")
    np.copyto(out, x)


# -- the graph's layers: merges and global pooling (memory-bound: NumPy on the host) -----------

ELEMENTWISE = ("add", "subtract", "multiply", "divide", "maximum", "minimum")
# The kinds the graph's other CUDA kernels take (pserver.kernels.cuda_graph's unary and compare,
# numbered in this order there; named here, where a CPU-only install can read them): their NumPy
# twins are pserver.ops.math's ops of these names.
UNARY = ("exp", "log", "sqrt", "square", "abs")
COMPARISONS = ("greater", "greater_equal", "less", "less_equal", "equal", "not_equal")


def elementwise(kind, a, b, out):
    """out[:] = a (kind) b, NumPy's broadcasting (out may be a or b)."""
    if kind not in ELEMENTWISE:
        raise ValueError(f"elementwise: unknown kind {kind!r}; choose one of {', '.join(ELEMENTWISE)}")
    getattr(np, kind)(a, b, out=out)


def layer_norm_forward(x, gamma, beta, epsilon, y, scale, out):
    """Each row of x (rows, d) standardized: y = (x - mean) * scale with scale = 1 / sqrt(var +
    epsilon) (rows, 1), the biased variance as Keras's; out = y * gamma + beta (either None: not
    applied). pserver.ops.nn's moments and standardized, over the last axis."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    _standardized(x, mean, var, epsilon, gamma, beta, y, scale, out)


def _standardized(x, mean, var, epsilon, gamma, beta, y, scale, out):
    """The normalizations' common end: scale = 1 / sqrt(var + epsilon), y = (x - mean) * scale,
    out = y * gamma + beta (either None: not applied)."""
    scale[...] = 1 / np.sqrt(var + epsilon)
    y[...] = (x - mean) * scale
    if gamma is not None:
        np.multiply(y, gamma, out=out)
    else:
        np.copyto(out, y)
    if beta is not None:
        out += beta


def _affine_grads(dout, y, gamma, dgamma, dbeta):
    """dbeta and dgamma (None: not asked for) as sums over the rows; returns dy = dout * gamma."""
    if dbeta is not None:
        dbeta[...] = dout.sum(axis=0)
    if gamma is None:
        return dout
    if dgamma is not None:
        dgamma[...] = (dout * y).sum(axis=0)
    return dout * gamma


def layer_norm_backward(dout, y, scale, gamma, dgamma, dbeta, dx):
    """layer_norm_forward's gradients from dout (rows, d): dgamma, dbeta (d,) (None: not asked
    for) and dx (rows, d; None: not asked for): pserver.ops.nn.standardize_vjp of dy = dout * gamma."""
    dy = _affine_grads(dout, y, gamma, dgamma, dbeta)
    if dx is not None:
        dx[...] = scale * (dy - dy.mean(axis=-1, keepdims=True) - y * (dy * y).mean(axis=-1, keepdims=True))


def _region(big, starts, small):
    """The region of big (n, h, w, c) that small (n, h', w', c) covers from row, column `starts`."""
    (a, b), (h, w) = starts, small.shape[1:3]
    return big[:, a:a + h, b:b + w, :]


def window_into(src, dst, starts):
    """dst[:, a:a + h, b:b + w, :] = src (n, h, w, c), (a, b) = starts: the rest of dst untouched
    (ZeroPadding's forward, Cropping's backward)."""
    _region(dst, starts, src)[...] = src


def window_from(src, starts, dst):
    """dst[:] = src[:, a:a + h, b:b + w, :] for dst (n, h, w, c) (Cropping's forward, ZeroPadding's
    backward)."""
    np.copyto(dst, _region(src, starts, dst))


def deviation(var, floor, out):
    """out[:] = max(sqrt(var), floor): Normalization's divisor from its variance."""
    np.maximum(np.sqrt(var), out.dtype.type(floor), out=out)


def batched_matmul(x, y, out, trans_x=False, trans_y=False):
    """out[b] = op(x[b]) @ op(y[b]) for each b of the first axis, op the transpose of a (batch,
    rows, cols) operand's last two axes where asked (Dot's products and their gradients)."""
    np.matmul(x.transpose(0, 2, 1) if trans_x else x, y.transpose(0, 2, 1) if trans_y else y, out=out)


def batch_norm_forward(x, gamma, beta, mean, var, training, epsilon, y, scale, out):
    """Each column (channel) of x (rows, c) standardized: in training with the batch's mean and
    biased variance, written to mean and var (c,); otherwise with the mean and var given (the
    moving ones). scale (c,) = 1 / sqrt(var + epsilon), y = (x - mean) * scale, out = y * gamma +
    beta (either None: not applied). pserver.ops.nn's moments and standardized, over the rows."""
    if training:
        mean[...] = x.mean(axis=0)
        centred = x - mean
        var[...] = np.mean(centred * centred, axis=0)
    _standardized(x, mean, var, epsilon, gamma, beta, y, scale, out)


def batch_norm_backward(dout, y, scale, gamma, training, dgamma, dbeta, sums, dx):
    """batch_norm_forward's gradients from dout (rows, c): dgamma, dbeta (c,) (None: not asked
    for) and dx (rows, c; None: not asked for): in training standardize_vjp over the rows of
    dy = dout * gamma, else dy * scale (the moments are constants). sums (2, c): scratch."""
    dy = _affine_grads(dout, y, gamma, dgamma, dbeta)
    if dx is None:
        return
    if not training:
        np.multiply(dy, scale, out=dx)
        return
    sums[0], sums[1] = dy.mean(axis=0), (dy * y).mean(axis=0)
    dx[...] = scale * (dy - sums[0] - y * sums[1])


def batch_norm_statistics(mean, var, moving_mean, dmean, dvar):
    """What a pass's moving-statistics slots carry to the shards (pserver.server.statistics):
    dmean = mean - moving_mean, dvar = var + dmean ** 2 (all (c,))."""
    np.subtract(mean, moving_mean, out=dmean)
    np.add(var, np.square(dmean), out=dvar)


def ids_into(x, ids, padding=None):
    """ids[:] = x as integers (an id input may come as floats: a batch on the GPU is float32),
    with -1 (the lookups' padding) where x holds `padding` (None: no padding id)."""
    if x.shape != ids.shape:
        raise ValueError(f"ids_into: x {x.shape}, ids {ids.shape}")
    np.copyto(ids, x, casting="unsafe")
    if padding is not None:
        ids[x == padding] = -1


def fill(a, value):
    """a[:] = value."""
    a[...] = value


def scale_by(x, c, out):
    """out[:] = c * x (out may be x)."""
    np.multiply(x, x.dtype.type(c), out=out)


def extreme_forward(kind, xs, out, which):
    """out[:] = the element-wise max (kind "max") or min of the arrays xs; which[:] = the index
    of the first of them holding it (int32), where the gradient goes."""
    stack = np.stack(xs)
    which[...] = (np.argmax if kind == "max" else np.argmin)(stack, axis=0)
    np.copyto(out, np.take_along_axis(stack, which[None].astype(np.intp), axis=0)[0])


def select_grad(dy, which, i, dx):
    """dx[:] = dy where which == i, else 0."""
    np.multiply(dy, which == i, out=dx)


def columns_into(src, dst, start):
    """dst[:, start:start + w] = src, for src (rows, w) and dst (rows, W)."""
    dst[:, start:start + src.shape[1]] = src


def columns_from(src, start, dst):
    """dst[:] = src[:, start:start + w], for src (rows, W) and dst (rows, w)."""
    np.copyto(dst, src[:, start:start + dst.shape[1]])


def transpose(x, axes, out):
    """out[:] = np.transpose(x, axes)."""
    np.copyto(out, np.transpose(x, axes))


def sum_to(g, out, scale=1.0):
    """out[:] = scale * g summed over the axes that broadcasting out's shape to g's stretches."""
    shape = (1,) * (g.ndim - out.ndim) + out.shape
    axes = tuple(i for i, (o, n) in enumerate(zip(shape, g.shape)) if o == 1 and n != 1)
    np.multiply(g.sum(axis=axes, keepdims=True).reshape(out.shape), out.dtype.type(scale), out=out)


def broadcast_to(x, out, scale=1.0):
    """out[:] = scale * x broadcast to out's shape (sum_to's VJP)."""
    np.multiply(np.broadcast_to(x, out.shape), out.dtype.type(scale), out=out)


def global_avgpool_forward(x, out):
    """out[:] = x's mean over its positions: x (n, positions, c), out (n, c)."""
    np.mean(x, axis=1, out=out)


def global_avgpool_backward(dy, dx):
    """dx[:] = dy / positions at every position: dy (n, c), dx (n, positions, c)."""
    dx[...] = dy[:, None, :] / dx.shape[1]


def global_maxpool_forward(x, out, argmax):
    """out[:] = x's max over its positions; argmax[:] = the first position holding it (int32)."""
    argmax[...] = x.argmax(axis=1)
    out[...] = np.take_along_axis(x, argmax[:, None].astype(np.intp), 1)[:, 0]


def global_maxpool_backward(dy, argmax, dx):
    """dx[:] = 0, and dy at each (sample, channel)'s argmax."""
    dx[...] = 0
    np.put_along_axis(dx, argmax[:, None].astype(np.intp), dy[:, None, :], 1)


# -- embedding ---------------------------------------------------------------------------------

PADDING = -1   # an id of -1 is padding: embedding_forward gives it zeros, embedding_backward no gradient


def _check_ids(ids, vocab):
    if ids.size and (ids.min() < PADDING or ids.max() >= vocab):
        raise ValueError(f"embedding: id out of range [0, {vocab}) (or -1, padding)")


def embedding_forward(ids, table, out):
    """out[n, l] = table[ids[n, l]], zeros where ids[n, l] is -1 (padding). ids int (N, L) in
    [0, V) or -1, table (V, D), out (N, L, D)."""
    _check_ids(ids, table.shape[0])
    pad = ids == PADDING
    if pad.all():
        out[...] = 0
        return
    np.take(table, np.where(pad, 0, ids), axis=0, out=out)
    out[pad] = 0


def embedding_backward(ids, dy, dtable):
    """dtable[:] = 0, then dy[n, l] added to row ids[n, l] (repeated ids add; padding: none)."""
    _check_ids(ids, dtable.shape[0])
    dtable[:] = 0
    keep = ids.reshape(-1) != PADDING
    np.add.at(dtable, ids.reshape(-1)[keep], dy.reshape(-1, dtable.shape[1])[keep])


# -- pooled embedding (a list feature: several ids per sample, one vector out) -----------------
#
# ids (N, L), weights (N, L) float32, table (V, D), out (N, D). An id < 0 is padding: it reads
# nothing and its weight counts nowhere. combiner POOL_SUM, POOL_MEAN or POOL_SQRTN (as
# TensorFlow's embedding_lookup_sparse and Keras-RS): sample n's vector is
# sum_l w[n, l] table[ids[n, l]] divided by 1, by sum_l w[n, l], or by sqrt(sum_l w[n, l]^2),
# over its ids that are not padding. A list with no ids, or whose divisor is 0, gives zeros (as
# Keras-RS's divide_no_nan).

POOL_SUM, POOL_MEAN, POOL_SQRTN = 0, 1, 2
COMBINERS = {"sum": POOL_SUM, "mean": POOL_MEAN, "sqrtn": POOL_SQRTN}


def _check_pooled(ids, weights, vocab):
    if weights.shape != ids.shape:
        raise ValueError(f"pooled embedding: weights {weights.shape} must have the ids' shape {ids.shape}")
    if ids.size and ids.max() >= vocab:
        raise ValueError(f"embedding: id out of range [0, {vocab})")


def _pool_scale(ids, weights, combiner):
    """What each sample's weighted sum is multiplied by (1 / its divisor, 0 where that is 0), and
    the weights with padding's made 0: float64 (N,) and (N, L)."""
    w = np.where(ids >= 0, weights, 0).astype(np.float64)
    if combiner == POOL_SUM:
        return np.ones(ids.shape[0]), w
    d = w.sum(1) if combiner == POOL_MEAN else np.sqrt((w * w).sum(1))
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0), w


def pooled_embedding_forward(ids, weights, table, combiner, out):
    """out[n] = sum_l weights[n, l] table[ids[n, l]] / the combiner's divisor; ids < 0 are padding."""
    _check_pooled(ids, weights, table.shape[0])
    scale, w = _pool_scale(ids, weights, combiner)
    rows = table[np.where(ids >= 0, ids, 0)].astype(np.float64)
    out[...] = (w[..., None] * rows).sum(1) * scale[:, None]


def pooled_embedding_backward(ids, weights, dy, combiner, dtable):
    """dtable[:] = 0, then weights[n, l] / divisor[n] * dy[n] added to row ids[n, l] (padding skipped)."""
    _check_pooled(ids, weights, dtable.shape[0])
    scale, w = _pool_scale(ids, weights, combiner)
    per = (w * scale[:, None])[..., None] * dy[:, None, :].astype(np.float64)      # (N, L, D)
    acc = np.zeros(dtable.shape, np.float64)
    keep = ids >= 0
    np.add.at(acc, ids[keep], per[keep])
    dtable[...] = acc


# -- factorization machine ---------------------------------------------------------------------

def fm_forward(v, out):
    """out[n] = sum over field pairs f < g of <v[n, f], v[n, g]>, computed as
    0.5 * sum_d ((sum_f v[n, f, d])^2 - sum_f v[n, f, d]^2): O(F k), not O(F^2 k) (Rendle 2010).
    v (N, F, K), out (N, 1)."""
    s = v.sum(axis=1)
    out.reshape(-1)[:] = 0.5 * ((s * s).sum(axis=1) - (v * v).sum(axis=(1, 2)))


def fm_backward(v, dout, dv):
    """dv[n, f, d] = dout[n] * (sum_g v[n, g, d] - v[n, f, d]). v, dv (N, F, K), dout (N, 1)."""
    dv[:] = dout.reshape(-1, 1, 1) * (v.sum(axis=1, keepdims=True) - v)


# -- recurrent layers (pserver.layers.recurrent) ---------------------------------------------------
# One layout for the three cells. xw (n, T, k*u) is x @ kernel + bias for every step at once (one
# matmul, the layer's); the recurrence runs time-major: hs (T+1, n, u) holds the initial state in
# hs[0] and step s's output in hs[s + 1] (LSTM's cell state likewise in cs), gates (T, n, k*u)
# each step's gates after their activations. Step s reads input step t = T-1-s under go_backwards
# (`backwards`), else s. Backward takes dhs (T+1, n, u): d loss / d hs[s + 1] from outside the
# layer; it adds the recurrence's gradient in place, leaving d loss / d initial state in dhs[0]
# (and in dc, which comes in as d loss / d last cell state). It writes dxw (n, T, k*u), d loss /
# d xw in input order, and drec (T, n, k*u), the gradient of the recurrent product h @
# recurrent_kernel (+ GRU's recurrent bias), so that d recurrent_kernel = hs[:T]^T drec.
# Activations by name as activation_forward's; their derivatives come from their outputs.

def _act(kind, v):
    out = np.empty_like(v)
    activation_forward(kind, v, out)
    return out


def _dact(kind, y, g):
    """g * f'(.) at the activation's output y."""
    out = np.empty_like(g)
    activation_backward(kind, y, g, out)
    return out


def _step(t_steps, s, backwards):
    return t_steps - 1 - s if backwards else s


def _keep(mask, t, like):
    """(n, 1): 1 where input step t counts, 0 where Keras's mask (n, T) masks it (an empty mask:
    every step counts). A masked step keeps the states as they were."""
    if mask.shape[0] == 0:
        return np.ones((like.shape[0], 1), like.dtype)
    return (mask[:, t] != 0).astype(like.dtype)[:, None]


def _product(h, rk, rmask):
    """h @ rk; with recurrent dropout (one mask per gate, rmask (k, n, u)) each gate's block of
    columns is (h * rmask[g]) @ rk[:, g] (Keras's implementation 1)."""
    if rmask.shape[0] == 0:
        return h @ rk
    u = rk.shape[0]
    return np.concatenate([(h * rmask[g]) @ rk[:, g * u:(g + 1) * u] for g in range(rmask.shape[0])], axis=1)


def _product_back(dz, rk, rmask):
    """The gradient of _product's h: dz @ rk.T, each gate's part times its mask."""
    if rmask.shape[0] == 0:
        return dz @ rk.T
    u = rk.shape[0]
    blocks = [slice(g * u, (g + 1) * u) for g in range(rmask.shape[0])]
    return sum((dz[:, b] @ rk[:, b].T) * m for b, m in zip(blocks, rmask))


def simple_rnn_forward(xw, rk, hs, backwards, act, mask, rmask):
    """hs[s + 1] = act(xw[:, t] + hs[s] @ rk), or hs[s] where step t is masked."""
    T = xw.shape[1]
    for s in range(T):
        t = _step(T, s, backwards)
        keep = _keep(mask, t, hs[s])
        hs[s + 1] = keep * _act(act, xw[:, t] + _product(hs[s], rk, rmask)) + (1 - keep) * hs[s]


def simple_rnn_backward(rk, hs, dhs, dxw, drec, backwards, act, mask, rmask):
    T = dxw.shape[1]
    for s in range(T - 1, -1, -1):
        t = _step(T, s, backwards)
        keep, dh = _keep(mask, t, hs[s]), dhs[s + 1]
        dz = keep * _dact(act, hs[s + 1], dh)
        drec[s] = dxw[:, t] = dz
        dhs[s] += _product_back(dz, rk, rmask) + (1 - keep) * dh


def lstm_forward(xw, rk, hs, cs, gates, backwards, act, ract, mask, rmask):
    """Keras's LSTM, gates i, f, c, o: c = f * c' + i * act(z_c), h = o * act(c); a masked step
    keeps h and c."""
    T, u = xw.shape[1], rk.shape[0]
    for s in range(T):
        t = _step(T, s, backwards)
        keep = _keep(mask, t, hs[s])
        z = xw[:, t] + _product(hs[s], rk, rmask)
        g = gates[s]
        g[:, :2 * u] = _act(ract, z[:, :2 * u])
        g[:, 2 * u:3 * u] = _act(act, z[:, 2 * u:3 * u])
        g[:, 3 * u:] = _act(ract, z[:, 3 * u:])
        c = g[:, u:2 * u] * cs[s] + g[:, :u] * g[:, 2 * u:3 * u]
        cs[s + 1] = keep * c + (1 - keep) * cs[s]
        hs[s + 1] = keep * (g[:, 3 * u:] * _act(act, c)) + (1 - keep) * hs[s]


def lstm_backward(rk, hs, cs, gates, dhs, dc, dxw, drec, backwards, act, ract, mask, rmask):
    T, u = dxw.shape[1], rk.shape[0]
    for s in range(T - 1, -1, -1):
        keep = _keep(mask, _step(T, s, backwards), hs[s])
        g, dh, dc_in = gates[s], keep * dhs[s + 1], dc.copy()
        dc *= keep
        i, f, c_in, o = g[:, :u], g[:, u:2 * u], g[:, 2 * u:3 * u], g[:, 3 * u:]
        tc = _act(act, cs[s + 1])
        dcs = dc + _dact(act, tc, dh * o)
        dz = drec[s]
        dz[:, :u] = _dact(ract, i, dcs * c_in)
        dz[:, u:2 * u] = _dact(ract, f, dcs * cs[s])
        dz[:, 2 * u:3 * u] = _dact(act, c_in, dcs * i)
        dz[:, 3 * u:] = _dact(ract, o, dh * tc)
        dc[...] = dcs * f + (1 - keep) * dc_in
        dxw[:, _step(T, s, backwards)] = dz
        dhs[s] += _product_back(dz, rk, rmask) + (1 - keep) * dhs[s + 1]


def gru_forward(xw, rk, rb, hs, gates, rh, backwards, act, ract, mask, rmask):
    """Keras 3's GRU with reset_after=True (the cuDNN form), gates z, r, h: the recurrent
    product hs[s] @ rk + rb is taken whole, its h part (kept in rh) scaled by r after;
    h = z * h' + (1 - z) * hh."""
    T, u = xw.shape[1], rk.shape[0]
    for s in range(T):
        x, r_all, g = xw[:, _step(T, s, backwards)], _product(hs[s], rk, rmask) + rb, gates[s]
        g[:, :2 * u] = _act(ract, x[:, :2 * u] + r_all[:, :2 * u])
        rh[s] = r_all[:, 2 * u:]
        g[:, 2 * u:] = _act(act, x[:, 2 * u:] + g[:, u:2 * u] * rh[s])
        z, keep = g[:, :u], _keep(mask, _step(T, s, backwards), hs[s])
        hs[s + 1] = keep * (z * hs[s] + (1 - z) * g[:, 2 * u:]) + (1 - keep) * hs[s]


def gru_backward(rk, hs, gates, rh, dhs, dxw, drec, backwards, act, ract, mask, rmask):
    T, u = dxw.shape[1], rk.shape[0]
    for s in range(T - 1, -1, -1):
        t = _step(T, s, backwards)
        keep = _keep(mask, t, hs[s])
        g, dh = gates[s], keep * dhs[s + 1]
        z, r, hh = g[:, :u], g[:, u:2 * u], g[:, 2 * u:]
        dah = _dact(act, hh, dh * (1 - z))
        dr = drec[s]
        dr[:, :u] = dxw[:, t, :u] = _dact(ract, z, dh * (hs[s] - hh))
        dr[:, u:2 * u] = dxw[:, t, u:2 * u] = _dact(ract, r, dah * rh[s])
        dxw[:, t, 2 * u:] = dah
        dr[:, 2 * u:] = dah * r
        dhs[s] += dh * z + _product_back(dr, rk, rmask) + (1 - keep) * dhs[s + 1]
