"""Model math as numba CPU kernels; `pserver.kernels.reference` is the NumPy twin.

All kernels write into caller-owned buffers (the model preallocates them per batch size), so a
training step allocates nothing here but a convolution's scratch: im2col's two weight-gradient
blocks, each the size of its kernel, or Winograd's transformed kernel and one block's products
(its blocks are sized to about 1 MiB); the im2col matrix, or Winograd's transform of the input,
is the layer's, kept from the forward pass for the backward (conv2d_forward_cols);
conv2d_forward and conv2d_backward, as evaluation and the twins' API call them, make their own
(one per call, small next to its products).
Inputs are C-contiguous; float32 is what the models use.

Matrix products go through `np.dot(a, b, out)`, which numba lowers to BLAS gemm (scipy's
cython_blas). A transposed view of a C-contiguous array (`x.T`, `W.T`) is typed as an F-contiguous
array, and numba hands it to gemm with the transpose flag: no copy, and measured as fast as the
untransposed product. Only a non-contiguous ('A' layout) operand, such as a strided slice, makes
numba copy it first (with a NumbaPerformanceWarning). numba only switches on BLAS when scipy is
installed, hence the dependency.

numpy's wheel brings an OpenBLAS of its own, which the graph ops' products (pserver.ops's matmul)
use: two pools of BLAS threads, each spinning for a while after its call, fight over the cores
whenever a step alternates between them (a Dense's backward, then FeatureCross's matmul: 11.8 ms
for a pair of 512x192x192 products that take 1.0 ms alone, 2 threads each on 2 cores). So
numpy's pool runs one thread once this module loads (`single_numpy_blas`), where it is a
library apart from scipy's; the kernels' products keep every thread.

`nogil=True` lets a worker overlap a step with gRPC I/O in another thread. Every kernel runs on
the calling thread: a worker is one process per core, and numba's parallel=True is not used (its
default threading layer aborts when several threads call in at once; see pserver.optim).
"""

from __future__ import annotations

import os

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  (loads scipy's BLAS: the one numba's np.dot calls)
from numba import njit
from threadpoolctl import ThreadpoolController

# The graph layers' kernels (GRAPH_KERNELS) are memory-bound: NumPy's, the twin's own. (And the
# pooled embedding's combiner codes, which both backends share.)
from pserver.kernels.reference import (  # noqa: F401  (this backend's API)
    POOL_MEAN,
    POOL_SQRTN,
    POOL_SUM,
    batch_norm_backward,
    batch_norm_forward,
    batch_norm_statistics,
    batched_matmul,
    broadcast_to,
    columns_from,
    columns_into,
    deviation,
    elementwise,
    extreme_forward,
    fill,
    global_avgpool_backward,
    global_avgpool_forward,
    global_maxpool_backward,
    global_maxpool_forward,
    ids_into,
    layer_norm_backward,
    layer_norm_forward,
    scale_by,
    select_grad,
    sum_to,
    transpose,
    window_from,
    window_into,
)


def single_numpy_blas() -> int | None:
    """Set numpy's BLAS pool to one thread where it is not scipy's (numpy's and scipy's wheels
    each bundle an OpenBLAS); the threads it had, or None where there is one pool (a shared
    system BLAS, or one thread already) and nothing changed."""
    libs = ThreadpoolController().lib_controllers
    numpy_dir, scipy_dir = (os.path.dirname(os.path.dirname(m.__file__)) for m in (np, scipy))
    ours = [lib for lib in libs if lib.filepath.startswith(os.path.join(numpy_dir, "numpy"))]
    theirs = [lib for lib in libs if lib.filepath.startswith(os.path.join(scipy_dir, "scipy"))]
    if len(ours) != 1 or not theirs or ours[0].filepath in {lib.filepath for lib in theirs} \
            or ours[0].num_threads == 1:
        return None
    threads = ours[0].num_threads
    ours[0].set_num_threads(1)
    return threads


NUMPY_BLAS_THREADS = single_numpy_blas()


@njit(cache=True, nogil=True)
def dense_forward(x, W, b, out, relu):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    np.dot(x, W, out)
    _add_bias(out, b, relu)


@njit(cache=True, nogil=True)
def _add_bias(out, b, relu):
    """out[i] += b for every row i, then ReLU in place if `relu`."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            v = out[i, j] + b[j]
            # `v < 0` (not `not v > 0`) keeps NaN, as np.maximum does in the twin.
            if relu and v < 0:
                v = 0
            out[i, j] = v


@njit(cache=True, nogil=True)
def _column_sum(a, out):
    """out[:] = a summed over its rows. Row by row, so the reads are contiguous (the twin's
    a.sum(0) adds rows in this order too)."""
    out[:] = 0
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[j] += a[i, j]


@njit(cache=True, nogil=True)
def dense_param_grads(x, dz, dW, db):
    """dW[:] = x.T @ dz, db[:] = dz summed over the batch. For a first layer: no input grad."""
    np.dot(x.T, dz, dW)
    _column_sum(dz, db)


@njit(cache=True, nogil=True)
def relu_backward(dx, a):
    """dx *= (a > 0) in place; a is the ReLU's output (or its input: same sign)."""
    for i in range(dx.shape[0]):
        for j in range(dx.shape[1]):
            if not a[i, j] > 0:
                dx[i, j] = 0


@njit(cache=True, nogil=True)
def dense_backward(x, W, dz, dW, db, dx, relu):
    """dense_param_grads, plus dx[:] = dz @ W.T, masked by (x > 0) if `relu`.

    `relu` says x is the output of a ReLU; then x > 0 exactly where the pre-activation was,
    so the ReLU's backward fuses here with no extra buffer.
    """
    dense_param_grads(x, dz, dW, db)
    np.dot(dz, W.T, dx)
    if relu:
        relu_backward(dx, x)


@njit(cache=True, nogil=True)
def softmax_xent(logits, y, dlogits, row_loss=None):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n.

    logits (n, k), y (n,) int labels in [0, k), dlogits (n, k). Rows are shifted by their
    max before exp, so large logits do not overflow. row_loss (n,) float64, when given, gets
    each row's loss (for weighted losses: numba compiles the None case without the stores).
    """
    n, k = logits.shape
    inv_n = 1.0 / n
    total = 0.0
    for i in range(n):
        label = y[i]
        # numba does not bounds-check: a bad label would write outside dlogits.
        if label < 0 or label >= k:
            raise ValueError("softmax_xent: label out of range [0, num_classes)")
        m = logits[i].max()
        s = 0.0  # float64: a sum of k exps
        for j in range(k):
            e = np.exp(logits[i, j] - m)
            dlogits[i, j] = e
            s += e
        li = np.log(s) - (logits[i, label] - m)
        if row_loss is not None:
            row_loss[i] = li
        total += li
        scale = inv_n / s
        for j in range(k):
            dlogits[i, j] *= scale
        dlogits[i, label] -= inv_n
    return total * inv_n


@njit(cache=True, nogil=True)
def mse(pred, y, dpred, row_loss=None):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n. pred, dpred (n, 1), y (n,);
    row_loss (n,) float64, when given, gets each row's 0.5 * (pred - y)^2."""
    if pred.shape[1] != 1:
        raise ValueError("mse: pred must have one column")
    n = pred.shape[0]
    total = 0.0
    for i in range(n):
        r = pred[i, 0] - y[i]
        dpred[i, 0] = r / n
        li = np.float64(r) * r
        if row_loss is not None:
            row_loss[i] = 0.5 * li
        total += li
    return 0.5 * total / n


@njit(cache=True, nogil=True)
def _sigmoid(z):
    """1 / (1 + exp(-z)) from e = exp(-|z|) <= 1, so no exp overflows whatever z's sign."""
    e = np.exp(-abs(z))
    return 1 / (1 + e) if z >= 0 else e / (1 + e)


@njit(cache=True, nogil=True)
def sigmoid_bce(logits, y, dlogits, row_loss=None):
    """Mean binary cross-entropy from logits; dlogits[:] = (sigmoid(logits) - y) / n.

    logits and dlogits (n, 1) or (n,), y (n,) of 0/1 floats. Written as
    max(z, 0) - z*y + log(1 + exp(-|z|)), which neither overflows nor loses the small terms.
    row_loss (n,) float64, when given, gets each row's term.
    """
    z, d = logits.reshape(logits.size), dlogits.reshape(dlogits.size)
    n = z.shape[0]
    total = 0.0
    for i in range(n):
        v, t = z[i], y[i]
        d[i] = (_sigmoid(v) - t) / n
        li = max(v, 0) - v * t + np.log1p(np.exp(-abs(v)))
        if row_loss is not None:
            row_loss[i] = li
        total += li
    return total / n


# -- images: channels-last (N, H, W, C) ------------------------------------------------------
#
# Output position (oh, ow) reads the window whose top-left input element is
# (oh*stride_h - pad_top, ow*stride_w - pad_left); elements outside the image read as zero
# (conv), are never chosen (max pooling) or are not counted (average pooling).
#
# A convolution is im2col + gemm: each output pixel's window copied into a row of a
# (pixels, KH*KW*C) matrix, times the kernel as a (KH*KW*C, F) matrix. Direct loops (the
# filters innermost, vectorized) were measured too, on one thread: slower for the forward
# pass at every size tried, down to the 3x3x1 first layer of an image model (5.2 ms against
# 3.6 ms at batch 64), and no faster for the weight gradient (4.6 ms against 4.3 ms).
#
# Both passes go through the batch in blocks of whole images whose rows of the im2col matrix
# and of the output (or its gradient) fill about half a MiB (a core's L2 on the CPUs measured),
# each block built, multiplied and, backward, added back into dx while it is still in cache.
# On keras.io mnist_convnet's 32->64 convolution at batch 64 (Zen 3, AVX2, OpenBLAS, one
# thread) the input gradient's product ran at 31-34 GFLOP/s over the whole (7744, 288)
# matrix against 52-60 in blocks of 2-8 images; its first layer's weight gradient (3x3x1 to
# 32, ReLU mask and bias sum included) took 2.4 ms of CPU in blocks of 4 images, 2.9 whole.
_BLOCK_BYTES = 1 << 19


@njit(cache=True, nogil=True)
def _images_per_block(cols, f_n, pixels):
    """How many images make one block (at least one): `pixels` rows each of `cols` and of an
    output with `f_n` filters."""
    return max(1, _BLOCK_BYTES // max(1, pixels * (cols.shape[1] + f_n) * cols.itemsize))


@njit(cache=True, nogil=True)
def _im2col(img, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, back, n0, n1):
    """cols[r] = the window of output pixel r (n, oh, ow), flattened as (i, j, c), zero
    outside the image, for the images n0 <= n < n1; or, `back`, the reverse: each element
    of those rows added into img where it was read from (img zeroed by the caller)."""
    if back:
        _add_windows_back(img, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, n0, n1)
    else:
        _copy_windows(img, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, n0, n1)


@njit(cache=True, nogil=True)
def _copy_windows(img, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, n0, n1):
    """_im2col's copy. A window row that lies wholly inside the image is KW*C consecutive
    elements of img, copied between two views indexed from 0 by a range (no negative index to
    wrap, so the loop compiles to vector moves); cols is indexed flat. On the toy ResNet's
    convolutions (Zen 4, one thread, batch 32) that took the 26x26x32 input's im2col from 2.85
    to 1.18 ms and an 8x8x64 one's from 0.59 to 0.28 (same padding) and 0.31 to 0.07 ms (valid)
    against indexing cols[r] element by element, which kept the wrap check."""
    _, h_n, w_n, c_n = img.shape
    flat = img.reshape(img.size)
    cf = cols.reshape(cols.size)
    kc, width = kw * c_n, cols.shape[1]
    r = n0 * oh_n * ow_n
    for n in range(n0, n1):
        for oh in range(oh_n):
            for ow in range(ow_n):
                w0 = ow * stride_w - pad_left
                whole = w0 >= 0 and w0 + kw <= w_n
                for i in range(kh):
                    h, k = oh * stride_h - pad_top + i, r * width + i * kc
                    if h < 0 or h >= h_n:
                        for t in range(kc):
                            cf[k + t] = 0
                        continue
                    base = ((n * h_n + h) * w_n + w0) * c_n
                    if whole:
                        src, dst = flat[base:base + kc], cf[k:k + kc]
                        for t in range(kc):
                            dst[t] = src[t]
                    else:
                        for j in range(kw):
                            inside = 0 <= w0 + j < w_n
                            for t in range(j * c_n, (j + 1) * c_n):
                                cf[k + t] = flat[base + t] if inside else 0
                r += 1


@njit(cache=True, nogil=True)
def _add_windows_back(img, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, n0, n1):
    """_im2col's reverse (col2im): whole window rows added over two views indexed from 0, which
    made mnist_convnet's col2im 1.4x faster than element by element."""
    _, h_n, w_n, c_n = img.shape
    flat = img.reshape(img.size)
    kc = kw * c_n
    r = n0 * oh_n * ow_n
    for n in range(n0, n1):
        for oh in range(oh_n):
            for ow in range(ow_n):
                w0 = ow * stride_w - pad_left
                whole = w0 >= 0 and w0 + kw <= w_n
                row = cols[r]
                for i in range(kh):
                    h, k = oh * stride_h - pad_top + i, i * kc
                    if h < 0 or h >= h_n:
                        continue
                    base = ((n * h_n + h) * w_n + w0) * c_n
                    if whole:
                        win, part = flat[base:base + kc], row[k:k + kc]
                        for t in range(kc):
                            win[t] += part[t]
                    else:
                        for j in range(kw):
                            if 0 <= w0 + j < w_n:
                                for t in range(j * c_n, (j + 1) * c_n):
                                    flat[base + t] += row[k + t]
                r += 1


# -- Winograd F(2x2, 3x3) --------------------------------------------------------------------
#
# A 3x3 convolution of stride 1 (from enough channels, _winograd) computes each 2x2 block of
# output pixels (a tile) from the 4x4 patch of input under it, as Y = A^T [U . V] A with
# U = G g G^T (the kernel, per input and output channel) and V = B^T d B (the patch, per
# channel): 16 products of a (tiles, C) matrix by a (C, F) one, one per element xi of the 4x4
# transform, in place of one (pixels, 9C) by (9C, F): 2.25x fewer multiply-adds, and the
# input's transform V (4C a pixel) where im2col copies 9C. The backward pass stays in that
# domain: dM = A dY A^T per tile, dU[xi] = V[xi]^T dM[xi] (dw = G^T dU G) and dV[xi] =
# dM[xi] U[xi]^T, whose patches B dV B^T add back into dx (neighbouring tiles' patches overlap
# by two pixels). The transforms' coefficients are 0, +-1 and +-1/2, so the result is the
# direct convolution's up to float rounding (the tests hold both passes to the twin at 1e-4).
#
# Tiles go in blocks of whole images whose V and M rows fill about 1 MiB: the 16 products
# then read operands in cache, where OpenBLAS ran the (tiles, 32) by (32, 64) product of the
# toy ResNet's 26x26x32 layer at 142 GFLOP/s in blocks of 144-288 tiles and 82-85 over 576
# or more (Xeon, AVX-512, one thread).
_WINO_BYTES = 1 << 20


@njit(cache=True, nogil=True)
def _wino_tiles(oh_n, ow_n):
    """(tile rows, tile columns) of an OH x OW output: ceil(OH/2), ceil(OW/2)."""
    return (oh_n + 1) // 2, (ow_n + 1) // 2


@njit(cache=True, nogil=True)
def _winograd(w, out, stride_h, stride_w):
    """Whether conv2d takes the Winograd path: a 3x3 kernel of stride 1 from at least 16
    channels to at least 8, with V no larger than the im2col matrix it replaces in `cols`.
    Below 16 channels in, the transforms cost about what the products save: forward and
    backward at batch 32 on 28x28, one thread (bench/conv_paths.py, Xeon,
    bench/results/kernels/conv_paths.json), im2col over Winograd's time was 1.24 from 8
    channels to 32 but 0.94 from 8 to 64 (a scratch run before: 0.91 from 8 to 32), against
    1.17 from 16 to 16, 1.47 from 16 to 32 and 1.93 for the toy ResNet's 32 to 64."""
    kh, kw, c_n, f_n = w.shape
    _, oh_n, ow_n, _ = out.shape
    th, tw = _wino_tiles(oh_n, ow_n)
    return (kh == 3 and kw == 3 and stride_h == 1 and stride_w == 1 and c_n >= 16 and f_n >= 8
            and 16 * th * tw <= 9 * oh_n * ow_n)


@njit(cache=True, nogil=True)
def _wino_view(cols, n_, oh_n, ow_n, c_n):
    """V (16, tiles, C) over the front of `cols`, tiles = N * ceil(OH/2) * ceil(OW/2)."""
    th, tw = _wino_tiles(oh_n, ow_n)
    t = n_ * th * tw
    return cols.reshape(cols.size)[:16 * t * c_n].reshape((16, t, c_n))


@njit(cache=True, nogil=True)
def _wino_images(oh_n, ow_n, c_n, f_n, itemsize):
    """Images per block: V and M rows of its tiles within _WINO_BYTES (at least one)."""
    th, tw = _wino_tiles(oh_n, ow_n)
    return max(1, _WINO_BYTES // (16 * th * tw * (c_n + f_n) * itemsize))


@njit(cache=True, nogil=True)
def _wino_kernel(w, u):
    """u[xi, c, f] = (G g G^T)[xi] of w's (3, 3) filter g for each (c, f)."""
    _, _, c_n, f_n = w.shape
    half = w.dtype.type(0.5)
    for c in range(c_n):
        for f in range(f_n):
            for p in range(4):     # G's row p applied down each column of g
                if p == 0:
                    g0, g1, g2 = w[0, 0, c, f], w[0, 1, c, f], w[0, 2, c, f]
                elif p == 3:
                    g0, g1, g2 = w[2, 0, c, f], w[2, 1, c, f], w[2, 2, c, f]
                else:
                    s = 1 if p == 1 else -1
                    g0 = half * (w[0, 0, c, f] + s * w[1, 0, c, f] + w[2, 0, c, f])
                    g1 = half * (w[0, 1, c, f] + s * w[1, 1, c, f] + w[2, 1, c, f])
                    g2 = half * (w[0, 2, c, f] + s * w[1, 2, c, f] + w[2, 2, c, f])
                u[4 * p, c, f] = g0
                u[4 * p + 1, c, f] = half * (g0 + g1 + g2)
                u[4 * p + 2, c, f] = half * (g0 - g1 + g2)
                u[4 * p + 3, c, f] = g2


@njit(cache=True, nogil=True)
def _wino_kernel_grad(du, dw):
    """dw[:, :, c, f] = G^T du[:, c, f] G, du (16, C, F) the gradient of u."""
    _, c_n, f_n = du.shape
    half = du.dtype.type(0.5)
    r = np.empty(4, du.dtype)
    for c in range(c_n):
        for f in range(f_n):
            for i in range(3):    # G's column i over the rows p of du (as a 4x4 per xi)
                for q in range(4):
                    a0, a1, a2, a3 = du[q, c, f], du[4 + q, c, f], du[8 + q, c, f], du[12 + q, c, f]
                    r[q] = (a0 + half * (a1 + a2) if i == 0 else
                            half * (a1 - a2) if i == 1 else half * (a1 + a2) + a3)
                dw[i, 0, c, f] = r[0] + half * (r[1] + r[2])
                dw[i, 1, c, f] = half * (r[1] - r[2])
                dw[i, 2, c, f] = half * (r[1] + r[2]) + r[3]


@njit(cache=True, nogil=True, inline="always")
def _wino_bt(d0, d1, d2, d3, o0, o1, o2, o3):
    """B^T applied across four vectors of channels: (o0, o1, o2, o3) = (d0 - d2, d1 + d2,
    d2 - d1, d1 - d3), element by element."""
    for c in range(d0.shape[0]):
        a, b, cc, d = d0[c], d1[c], d2[c], d3[c]
        o0[c] = a - cc
        o1[c] = b + cc
        o2[c] = cc - b
        o3[c] = b - d


@njit(cache=True, nogil=True)
def _wino_input(x, v, pad_top, pad_left, th, tw, n0, n1):
    """v[xi, t] = (B^T d B)[xi] of tile t's 4x4 patch d of x (zero outside the image), for the
    tiles t of images n0 <= n < n1 (numbered over the batch). Channels innermost throughout,
    so each step is a vector operation."""
    _, h_n, w_n, c_n = x.shape
    zero = np.zeros(c_n, x.dtype)
    e = np.empty((4, 4, c_n), x.dtype)
    t = n0 * th * tw
    for n in range(n0, n1):
        for ty in range(th):
            for tx in range(tw):
                h0, w0 = 2 * ty - pad_top, 2 * tx - pad_left
                for i in range(4):     # each patch row times B
                    h = h0 + i
                    inside = 0 <= h < h_n
                    s0 = x[n, h, w0] if inside and 0 <= w0 < w_n else zero
                    s1 = x[n, h, w0 + 1] if inside and 0 <= w0 + 1 < w_n else zero
                    s2 = x[n, h, w0 + 2] if inside and 0 <= w0 + 2 < w_n else zero
                    s3 = x[n, h, w0 + 3] if inside and 0 <= w0 + 3 < w_n else zero
                    _wino_bt(s0, s1, s2, s3, e[i, 0], e[i, 1], e[i, 2], e[i, 3])
                for q in range(4):     # then B^T down each column
                    _wino_bt(e[0, q], e[1, q], e[2, q], e[3, q], v[q, t], v[4 + q, t], v[8 + q, t],
                             v[12 + q, t])
                t += 1


@njit(cache=True, nogil=True)
def _wino_output(m, out, bias, relu, th, tw, n0, n1):
    """out's pixels of the tiles of images n0..n1 = A^T m[:, t] A + bias, ReLU'd if `relu`
    (`v < 0` made 0 keeps NaN, as _add_bias); a tile's pixels past OH or OW are dropped."""
    _, oh_n, ow_n, f_n = out.shape
    r = np.empty((4, 2, f_n), m.dtype)
    t = 0
    for n in range(n0, n1):
        for ty in range(th):
            for tx in range(tw):
                for p in range(4):
                    m0, m1, m2, m3 = m[4 * p, t], m[4 * p + 1, t], m[4 * p + 2, t], m[4 * p + 3, t]
                    ra, rb = r[p, 0], r[p, 1]
                    for f in range(f_n):
                        ra[f] = m0[f] + m1[f] + m2[f]
                        rb[f] = m1[f] - m2[f] - m3[f]
                for a in range(2):
                    oh = 2 * ty + a
                    if oh >= oh_n:
                        continue
                    for b in range(2):
                        ow = 2 * tx + b
                        if ow >= ow_n:
                            continue
                        dst, q0, q1, q2, q3 = out[n, oh, ow], r[0, b], r[1, b], r[2, b], r[3, b]
                        if a == 0:
                            for f in range(f_n):
                                y = q0[f] + q1[f] + q2[f] + bias[f]
                                dst[f] = 0 if relu and y < 0 else y
                        else:
                            for f in range(f_n):
                                y = q1[f] - q2[f] - q3[f] + bias[f]
                                dst[f] = 0 if relu and y < 0 else y
                t += 1


@njit(cache=True, nogil=True)
def _wino_output_grad(dy, dm, th, tw, n0, n1):
    """dm[:, t] = A dY A^T of tile t's 2x2 block of dy (zero past OH or OW): the gradient of
    the tile's m, for images n0..n1."""
    _, oh_n, ow_n, f_n = dy.shape
    zero = np.zeros(f_n, dy.dtype)
    z = np.empty((2, 4, f_n), dy.dtype)
    t = 0
    for n in range(n0, n1):
        for ty in range(th):
            for tx in range(tw):
                for a in range(2):     # each row of the block times A^T
                    oh, ow = 2 * ty + a, 2 * tx
                    y0 = dy[n, oh, ow] if oh < oh_n else zero
                    y1 = dy[n, oh, ow + 1] if oh < oh_n and ow + 1 < ow_n else zero
                    z0, z1, z2, z3 = z[a, 0], z[a, 1], z[a, 2], z[a, 3]
                    for f in range(f_n):
                        z0[f] = y0[f]
                        z1[f] = y0[f] + y1[f]
                        z2[f] = y0[f] - y1[f]
                        z3[f] = -y1[f]
                for q in range(4):     # then A down each column
                    a0, a1 = z[0, q], z[1, q]
                    d0, d1, d2, d3 = dm[q, t], dm[4 + q, t], dm[8 + q, t], dm[12 + q, t]
                    for f in range(f_n):
                        d0[f] = a0[f]
                        d1[f] = a0[f] + a1[f]
                        d2[f] = a0[f] - a1[f]
                        d3[f] = -a1[f]
                t += 1


@njit(cache=True, nogil=True)
def _wino_input_grad(dv, dx, pad_top, pad_left, th, tw, n0, n1):
    """dx += B dv[:, t] B^T of each tile t of images n0..n1, at its patch's place (the part
    inside the image): the input's gradient from its transform's."""
    _, h_n, w_n, c_n = dx.shape
    e = np.empty((4, 4, c_n), dx.dtype)
    t = 0
    for n in range(n0, n1):
        for ty in range(th):
            for tx in range(tw):
                for q in range(4):     # B down each column of dv's 4x4: rows i of the patch
                    v0, v1, v2, v3 = dv[q, t], dv[4 + q, t], dv[8 + q, t], dv[12 + q, t]
                    e0, e1, e2, e3 = e[0, q], e[1, q], e[2, q], e[3, q]
                    for c in range(c_n):
                        e0[c] = v0[c]
                        e1[c] = v1[c] - v2[c] + v3[c]
                        e2[c] = v2[c] + v1[c] - v0[c]
                        e3[c] = -v3[c]
                h0, w0 = 2 * ty - pad_top, 2 * tx - pad_left
                for i in range(4):     # then each patch row times B^T, added where it lies
                    h = h0 + i
                    if h < 0 or h >= h_n:
                        continue
                    r0, r1, r2, r3 = e[i, 0], e[i, 1], e[i, 2], e[i, 3]
                    for j in range(4):
                        if not 0 <= w0 + j < w_n:
                            continue
                        dst = dx[n, h, w0 + j]
                        if j == 0:
                            for c in range(c_n):
                                dst[c] += r0[c]
                        elif j == 1:
                            for c in range(c_n):
                                dst[c] += r1[c] - r2[c] + r3[c]
                        elif j == 2:
                            for c in range(c_n):
                                dst[c] += r2[c] + r1[c] - r0[c]
                        else:
                            for c in range(c_n):
                                dst[c] -= r3[c]
                t += 1


@njit(cache=True, nogil=True)
def _wino_forward(x, w, b, out, cols, pad_top, pad_left, relu):
    """conv2d_forward_cols by Winograd F(2x2, 3x3), V kept in `cols` for the backward pass."""
    _, _, c_n, f_n = w.shape
    n_, oh_n, ow_n, _ = out.shape
    th, tw = _wino_tiles(oh_n, ow_n)
    per = th * tw
    v = _wino_view(cols, n_, oh_n, ow_n, c_n)
    u = np.empty((16, c_n, f_n), w.dtype)
    _wino_kernel(w, u)
    step = _wino_images(oh_n, ow_n, c_n, f_n, w.itemsize)
    m = np.empty((16, min(step, n_) * per, f_n), w.dtype)
    for n0 in range(0, n_, step):
        n1 = min(n0 + step, n_)
        t0, t1 = n0 * per, n1 * per
        _wino_input(x, v, pad_top, pad_left, th, tw, n0, n1)
        for xi in range(16):
            np.dot(v[xi, t0:t1], u[xi], m[xi, :t1 - t0])
        _wino_output(m, out, b, relu, th, tw, n0, n1)


@njit(cache=True, nogil=True)
def _wino_backward(cols, w, out, dy, dx, dw, db, pad_top, pad_left, relu):
    """conv2d_backward_cols from the V that _wino_forward left in `cols` (left unchanged)."""
    _, _, c_n, f_n = w.shape
    n_, oh_n, ow_n, _ = dy.shape
    th, tw = _wino_tiles(oh_n, ow_n)
    per, pixels = th * tw, oh_n * ow_n
    v = _wino_view(cols, n_, oh_n, ow_n, c_n)
    dy2 = dy.reshape((n_ * pixels, f_n))
    out2 = out.reshape(dy2.shape) if relu else dy2
    step = _wino_images(oh_n, ow_n, c_n, f_n, w.itemsize)
    rows = min(step, n_) * per
    dm = np.empty((16, rows, f_n), w.dtype)
    du, part = np.empty((16, c_n, f_n), w.dtype), np.empty((c_n, f_n), w.dtype)
    # The kernel's transform and dV's block serve dx alone: empty without it.
    u = np.empty((16 if dx is not None else 0, c_n, f_n), w.dtype)
    dv = np.empty((16, rows if dx is not None else 0, c_n), w.dtype)
    if dx is not None:
        _wino_kernel(w, u)
    db[:] = 0
    for n0 in range(0, n_, step):
        n1 = min(n0 + step, n_)
        t0, t1 = n0 * per, n1 * per
        _relu_grad_rows(dy2, out2, db, n0 * pixels, n1 * pixels, relu)
        _wino_output_grad(dy, dm, th, tw, n0, n1)
        for xi in range(16):
            if n0 == 0:
                np.dot(v[xi, t0:t1].T, dm[xi, :t1 - t0], du[xi])
            else:
                np.dot(v[xi, t0:t1].T, dm[xi, :t1 - t0], part)
                du[xi] += part
        if dx is not None:
            for xi in range(16):
                np.dot(dm[xi, :t1 - t0], u[xi].T, dv[xi, :t1 - t0])
            dx[n0:n1] = 0
            _wino_input_grad(dv, dx, pad_top, pad_left, th, tw, n0, n1)
    _wino_kernel_grad(du, dw)


@njit(cache=True, nogil=True)
def conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu):
    """out[:] = conv(x, w) + b, then ReLU if `relu`. x (N,H,W,C), w (KH,KW,C,F), out (N,OH,OW,F)."""
    kh, kw, c_n, _ = w.shape
    n_, oh_n, ow_n, _ = out.shape
    cols = np.empty((n_ * oh_n * ow_n, kh * kw * c_n), x.dtype)
    conv2d_forward_cols(x, w, b, out, cols, stride_h, stride_w, pad_top, pad_left, relu)


@njit(cache=True, nogil=True)
def _check_cols(cols, w, dy):
    if cols.shape != (dy.shape[0] * dy.shape[1] * dy.shape[2], w.shape[0] * w.shape[1] * w.shape[2]):
        raise ValueError("conv2d: cols must be (N*OH*OW, KH*KW*C)")


@njit(cache=True, nogil=True)
def conv2d_forward_cols(x, w, b, out, cols, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_forward that leaves its im2col matrix in `cols` (N*OH*OW, KH*KW*C), for
    conv2d_backward_cols to use rather than build it again (a training step's forward pass).
    A 3x3 convolution of stride 1 between enough channels (_winograd) goes by Winograd
    F(2x2, 3x3) and keeps the input's transform in `cols` instead."""
    _check_cols(cols, w, out)
    if _winograd(w, out, stride_h, stride_w):
        _wino_forward(x, w, b, out, cols, pad_top, pad_left, relu)
    else:
        _im2col_forward(x, w, b, out, cols, stride_h, stride_w, pad_top, pad_left, relu)


@njit(cache=True, nogil=True)
def _im2col_forward(x, w, b, out, cols, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_forward_cols by im2col + gemm, whatever the kernel."""
    kh, kw, c_n, f_n = w.shape
    n_, oh_n, ow_n, _ = out.shape
    w2 = w.reshape((kh * kw * c_n, f_n))
    out2 = out.reshape((n_ * oh_n * ow_n, f_n))
    pixels = oh_n * ow_n
    step = _images_per_block(cols, f_n, pixels)
    for n0 in range(0, n_, step):
        n1 = min(n0 + step, n_)
        _im2col(x, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, False, n0, n1)
        rows = out2[n0 * pixels:n1 * pixels]
        np.dot(cols[n0 * pixels:n1 * pixels], w2, rows)
        _add_bias(rows, b, relu)


@njit(cache=True, nogil=True)
def conv2d_backward(x, w, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left):
    """dw, db (and dx unless it is None) from dy = d loss / d pre-activation (N,OH,OW,F)."""
    kh, kw, c_n, _ = w.shape
    n_, oh_n, ow_n, _ = dy.shape
    cols = np.empty((n_ * oh_n * ow_n, kh * kw * c_n), x.dtype)
    if _winograd(w, dy, stride_h, stride_w):
        th, tw = _wino_tiles(oh_n, ow_n)
        _wino_input(x, _wino_view(cols, n_, oh_n, ow_n, c_n), pad_top, pad_left, th, tw, 0, n_)
    else:
        _im2col(x, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, False, 0, n_)
    conv2d_backward_cols(cols, w, dy, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, False)


@njit(cache=True, nogil=True)
def _relu_grad_rows(dy2, out2, db, r0, r1, relu):
    """db += rows r0:r1 of dy2 summed; `relu`: each made 0 first where out2 is not > 0
    (as relu_backward: a NaN output passes no gradient)."""
    for i in range(r0, r1):
        for j in range(dy2.shape[1]):
            g = dy2[i, j]
            if relu:
                g = g if out2[i, j] > 0 else 0
                dy2[i, j] = g
            db[j] += g


@njit(cache=True, nogil=True)
def conv2d_backward_cols(cols, w, out, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_backward from the im2col matrix conv2d_forward_cols left of x (not x itself):
    keras.io mnist_convnet's two im2col builds a step saved (0.57 and 0.93 ms of ~15 at batch
    64). With dx, `cols` is overwritten (it holds dy's windows then): use it once. `relu`:
    dy is the gradient of the ReLU's output `out` (the forward pass's), made the gradient
    of its input in place, in the pass that sums it for db (a pass over dy saved).

    Block by block (_images_per_block): dy's rows masked and summed, their share of dw, then
    their windows' gradients (into their rows of cols) added back into dx. dw is summed
    transposed, (F, KH*KW*C), in two scratch blocks the kernel's size: OpenBLAS ran that
    product 1.6x faster than the (KH*KW*C, F) one on mnist_convnet's 32->64 layer.
    A Winograd layer (_winograd) reads the input's transform from `cols` (and leaves it)."""
    _check_cols(cols, w, dy)
    if relu and out.shape != dy.shape:
        raise ValueError("conv2d: out must have dy's shape")
    if _winograd(w, dy, stride_h, stride_w):
        _wino_backward(cols, w, out, dy, dx, dw, db, pad_top, pad_left, relu)
    else:
        _im2col_backward(cols, w, out, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, relu)


@njit(cache=True, nogil=True)
def _im2col_backward(cols, w, out, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, relu):
    """conv2d_backward_cols from an im2col matrix, whatever the kernel."""
    kh, kw, c_n, f_n = w.shape
    n_, oh_n, ow_n, _ = dy.shape
    taps, pixels = kh * kw * c_n, oh_n * ow_n
    w2 = w.reshape((taps, f_n))
    dy2 = dy.reshape((n_ * pixels, f_n))
    out2 = out.reshape(dy2.shape) if relu else dy2
    dwt, part = np.empty((f_n, taps), dw.dtype), np.empty((f_n, taps), dw.dtype)
    db[:] = 0
    step = _images_per_block(cols, f_n, pixels)
    for n0 in range(0, n_, step):
        n1 = min(n0 + step, n_)
        r0, r1 = n0 * pixels, n1 * pixels
        _relu_grad_rows(dy2, out2, db, r0, r1, relu)
        np.dot(dy2[r0:r1].T, cols[r0:r1], dwt if n0 == 0 else part)
        if n0 > 0:
            dwt += part
        if dx is not None:
            # Pixel r's window gets dy2[r] @ w2.T (into cols, now free), added back where it was read.
            np.dot(dy2[r0:r1], w2.T, cols[r0:r1])
            dx[n0:n1] = 0
            _im2col(dx, cols, kh, kw, stride_h, stride_w, pad_top, pad_left, oh_n, ow_n, True, n0, n1)
    dw.reshape((taps, f_n))[:] = dwt.T


@njit(cache=True, nogil=True)
def maxpool2d_forward(x, out, argmax, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out[:] = each window's max; argmax[:] = its flat index h*W + w in the image.

    Ties go to the first element in row-major order (as TF). A window with no element inside
    the image gives 0 and index -1. A NaN that comes first in its window stays; a later one loses.
    """
    n_, h_n, w_n, c_n = x.shape
    _, oh_n, ow_n, _ = out.shape
    for n in range(n_):
        for oh in range(oh_n):
            h0, h1 = _window_range(oh, stride_h, pad_top, pool_h, h_n)
            for ow in range(ow_n):
                w0, w1 = _window_range(ow, stride_w, pad_left, pool_w, w_n)
                best, arg = out[n, oh, ow], argmax[n, oh, ow]
                if h0 >= h1 or w0 >= w1:
                    best[:] = 0
                    arg[:] = -1
                    continue
                if h1 - h0 == 2 and w1 - w0 == 2:
                    _max_of_four(x[n, h0, w0], x[n, h0, w0 + 1], x[n, h0 + 1, w0], x[n, h0 + 1, w0 + 1],
                                 h0 * w_n + w0, w_n, best, arg)
                    continue
                # The window's first element inside the image, then the rest in row-major
                # order; selects rather than branches, so the loop over channels vectorizes.
                best[:] = x[n, h0, w0]
                arg[:] = h0 * w_n + w0
                for h in range(h0, h1):
                    for w in range(w0, w1):
                        xr, idx = x[n, h, w], h * w_n + w
                        for c in range(c_n):
                            v, b = xr[c], best[c]
                            take = v > b
                            best[c] = v if take else b
                            arg[c] = idx if take else arg[c]


@njit(cache=True, nogil=True, inline="always")
def _max_of_four(a, b, c, d, first, w_n, best, arg):
    """A 2x2 window (the default pool) in one pass over the channels: rows a b / c d, the
    first at flat index `first`. The same order and selects as the general loop (ties and a
    leading NaN keep the earlier element), with nothing read back from best and arg: 2x
    faster on keras.io mnist_convnet's first pool (64x26x26x32: 0.45 ms against 0.86 ms)."""
    below = first + w_n
    for ch in range(best.shape[0]):
        va, vb, vc, vd = a[ch], b[ch], c[ch], d[ch]
        t1 = vb > va
        m1 = vb if t1 else va
        i1 = first + 1 if t1 else first
        t2 = vc > m1
        m2 = vc if t2 else m1
        i2 = below if t2 else i1
        t3 = vd > m2
        best[ch] = vd if t3 else m2
        arg[ch] = below + 1 if t3 else i2


@njit(cache=True, nogil=True)
def maxpool2d_backward(dy, argmax, dx):
    """dx[:] = 0, then each dy element added at its window's argmax (overlapping windows add)."""
    n_, h_n, w_n, c_n = dx.shape
    dxf = dx.reshape((n_, h_n * w_n, c_n))
    dxf[:] = 0
    for n in range(n_):
        for oh in range(dy.shape[1]):
            for ow in range(dy.shape[2]):
                for c in range(c_n):
                    a = argmax[n, oh, ow, c]
                    if a >= 0:
                        dxf[n, a, c] += dy[n, oh, ow, c]


@njit(cache=True, nogil=True)
def _window_range(o, stride, pad, pool, size):
    """[start, stop) of the window of output position o, clipped to the image."""
    start = o * stride - pad
    return max(start, 0), min(start + pool, size)


@njit(cache=True, nogil=True)
def avgpool2d_forward(x, out, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out[:] = mean of each window's elements inside the image (padding not counted, as TF).

    A window with no element inside the image gives 0.
    """
    n_, h_n, w_n, c_n = x.shape
    _, oh_n, ow_n, _ = out.shape
    for n in range(n_):
        for oh in range(oh_n):
            h0, h1 = _window_range(oh, stride_h, pad_top, pool_h, h_n)
            for ow in range(ow_n):
                w0, w1 = _window_range(ow, stride_w, pad_left, pool_w, w_n)
                acc = out[n, oh, ow]
                acc[:] = 0
                for h in range(h0, h1):
                    for w in range(w0, w1):
                        acc += x[n, h, w]
                count = max(h1 - h0, 0) * max(w1 - w0, 0)
                acc /= max(count, 1)


@njit(cache=True, nogil=True)
def avgpool2d_backward(dy, dx, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """dx[:] = each window's dy / its count, spread over its elements inside the image."""
    n_, h_n, w_n, c_n = dx.shape
    _, oh_n, ow_n, _ = dy.shape
    dx[:] = 0
    share = np.empty(c_n, dx.dtype)
    for n in range(n_):
        for oh in range(oh_n):
            h0, h1 = _window_range(oh, stride_h, pad_top, pool_h, h_n)
            for ow in range(ow_n):
                w0, w1 = _window_range(ow, stride_w, pad_left, pool_w, w_n)
                count = max(h1 - h0, 0) * max(w1 - w0, 0)
                share[:] = dy[n, oh, ow] / max(count, 1)
                for h in range(h0, h1):
                    for w in range(w0, w1):
                        dx[n, h, w] += share


# -- elementwise ------------------------------------------------------------------------------

RELU, SIGMOID, TANH, LINEAR = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def _kind_code(kind):
    """The activation's number: compared once per call, not once per element (a string
    comparison in the loop cost 10x the arithmetic, measured)."""
    if kind == "relu":
        return RELU
    if kind == "sigmoid":
        return SIGMOID
    if kind == "tanh":
        return TANH
    if kind == "linear":
        return LINEAR
    raise ValueError("activation: unknown kind; choose one of relu, sigmoid, tanh, linear")


@njit(cache=True, nogil=True)
def activation_forward(kind, x, out):
    """out[:] = f(x) for f = relu | sigmoid | tanh | linear; any shape."""
    code = _kind_code(kind)
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for i in range(xf.shape[0]):
        v = xf[i]
        if code == RELU:
            of[i] = 0 if v < 0 else v   # `v < 0` keeps NaN, as np.maximum does
        elif code == SIGMOID:
            of[i] = _sigmoid(v)
        elif code == TANH:
            of[i] = np.tanh(v)
        else:
            of[i] = v


@njit(cache=True, nogil=True)
def activation_backward(kind, y, dy, dx):
    """dx[:] = dy * f'(.), written in terms of the activation's output y."""
    code = _kind_code(kind)
    yf, gf, df = y.reshape(y.size), dy.reshape(dy.size), dx.reshape(dx.size)
    for i in range(yf.shape[0]):
        v, g = yf[i], gf[i]
        if code == RELU:
            df[i] = g if v > 0 else 0
        elif code == SIGMOID:
            df[i] = g * v * (1 - v)
        elif code == TANH:
            df[i] = g * (1 - v * v)
        else:
            df[i] = g


# splitmix64's constants (see reference.dropout_forward): uint64 throughout, since numba
# turns a uint64 mixed with a signed int into a float. The one compiled splitmix64: dropout's
# masks and pserver.sparse's id hashing and initial rows all call it.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@njit(cache=True, nogil=True)
def splitmix64(seed, index):
    """The index-th (0-based) output of splitmix64 seeded with `seed` (both uint64);
    reference.splitmix64 is its twin."""
    z = seed + (index + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def dropout_forward(x, out, mask, rate, seed):
    """mask[:] = 0 or 1/(1 - rate) per element (kept with probability 1 - rate); out = x * mask."""
    if not 0 <= rate < 1:
        raise ValueError("dropout: rate must be in [0, 1)")
    if seed < 0:
        raise ValueError("dropout: seed must be in [0, 2**63)")
    threshold = np.uint64(int(rate * (1 << 24)))
    scale = 1 / (1 - rate)
    key = np.uint64(seed)
    xf, of, mf = x.reshape(x.size), out.reshape(out.size), mask.reshape(mask.size)
    for i in range(xf.shape[0]):
        keep = splitmix64(key, np.uint64(i)) >> np.uint64(40) >= threshold
        mf[i] = scale if keep else 0
        of[i] = xf[i] * mf[i]


@njit(cache=True, nogil=True)
def dropout_backward(dy, mask, dx):
    """dx[:] = dy * mask."""
    gf, mf, df = dy.reshape(dy.size), mask.reshape(mask.size), dx.reshape(dx.size)
    for i in range(gf.shape[0]):
        df[i] = gf[i] * mf[i]


@njit(cache=True, nogil=True)
def copy(x, out):
    """out[:] = x, of the same shape (an identity layer: Dropout at inference or at rate 0)."""
    if x.shape != out.shape:
        raise ValueError("copy: x and out differ in shape")
    out[...] = x


# -- embedding ---------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _check_ids(ids, vocab):
    # numba does not bounds-check: a bad id would read or write outside the table.
    for v in ids.reshape(ids.size):
        if v < -1 or v >= vocab:
            raise ValueError("embedding: id out of range [0, vocabulary size) (or -1, padding)")


@njit(cache=True, nogil=True)
def embedding_forward(ids, table, out):
    """out[n, l] = table[ids[n, l]], zeros for -1 (padding). ids int (N, L) in [0, V) or -1,
    table (V, D), out (N, L, D)."""
    _check_ids(ids, table.shape[0])
    for n in range(ids.shape[0]):
        for l in range(ids.shape[1]):
            if ids[n, l] < 0:
                out[n, l] = 0
            else:
                out[n, l] = table[ids[n, l]]


@njit(cache=True, nogil=True)
def embedding_backward(ids, dy, dtable):
    """dtable[:] = 0, then dy[n, l] added to row ids[n, l] (repeated ids add; -1: none)."""
    _check_ids(ids, dtable.shape[0])
    dtable[:] = 0
    for n in range(ids.shape[0]):
        for l in range(ids.shape[1]):
            if ids[n, l] >= 0:
                dtable[ids[n, l]] += dy[n, l]


# -- pooled embedding: reference.py says the semantics (ids < 0 are padding) ------------------

@njit(cache=True, nogil=True)
def _check_pooled(ids, weights, vocab):
    if weights.shape != ids.shape:
        raise ValueError("pooled embedding: weights must have the ids' shape")
    for v in ids.reshape(ids.size):
        if v >= vocab:
            raise ValueError("embedding: id out of range [0, vocabulary size)")


@njit(cache=True, nogil=True)
def _pool_scale(ids, weights, n, combiner):
    """1 / sample n's divisor, 0 where that is 0."""
    if combiner == POOL_SUM:
        return 1.0
    d = 0.0
    for l in range(ids.shape[1]):
        if ids[n, l] >= 0:
            w = float(weights[n, l])
            d += w if combiner == POOL_MEAN else w * w
    if combiner == POOL_SQRTN:
        d = np.sqrt(d)
    return 0.0 if d == 0 else 1.0 / d


@njit(cache=True, nogil=True)
def pooled_embedding_forward(ids, weights, table, combiner, out):
    """out[n] = sum_l weights[n, l] table[ids[n, l]] / the combiner's divisor; ids < 0 are padding."""
    _check_pooled(ids, weights, table.shape[0])
    acc = np.empty(table.shape[1], np.float64)
    for n in range(ids.shape[0]):
        acc[:] = 0
        for l in range(ids.shape[1]):
            i = ids[n, l]
            if i >= 0:
                w = float(weights[n, l])
                row = table[i]
                for d in range(acc.shape[0]):
                    acc[d] += w * row[d]
        scale = _pool_scale(ids, weights, n, combiner)
        for d in range(acc.shape[0]):
            out[n, d] = acc[d] * scale


@njit(cache=True, nogil=True)
def pooled_embedding_backward(ids, weights, dy, combiner, dtable):
    """dtable[:] = 0, then weights[n, l] / divisor[n] * dy[n] added to row ids[n, l] (padding skipped)."""
    _check_pooled(ids, weights, dtable.shape[0])
    dtable[:] = 0
    for n in range(ids.shape[0]):
        scale = _pool_scale(ids, weights, n, combiner)
        for l in range(ids.shape[1]):
            i = ids[n, l]
            if i >= 0:
                f = np.float32(weights[n, l] * scale)
                row, g = dtable[i], dy[n]
                for d in range(row.shape[0]):
                    row[d] += f * g[d]


# -- factorization machine ---------------------------------------------------------------------

@njit(cache=True, nogil=True)
def fm_forward(v, out):
    """out[n] = sum over field pairs f < g of <v[n, f], v[n, g]>, computed as
    0.5 * sum_d ((sum_f v[n, f, d])^2 - sum_f v[n, f, d]^2): O(F k), not O(F^2 k) (Rendle 2010).
    v (N, F, K), out (N, 1)."""
    n_, f_n, k_n = v.shape
    of = out.reshape(out.size)
    s = np.empty(k_n, v.dtype)
    for n in range(n_):
        s[:] = 0
        sq = 0.0
        for f in range(f_n):
            for d in range(k_n):
                e = v[n, f, d]
                s[d] += e
                sq += e * e
        total = 0.0
        for d in range(k_n):
            total += s[d] * s[d]
        of[n] = 0.5 * (total - sq)


@njit(cache=True, nogil=True)
def fm_backward(v, dout, dv):
    """dv[n, f, d] = dout[n] * (sum_g v[n, g, d] - v[n, f, d]). v, dv (N, F, K), dout (N, 1)."""
    n_, f_n, k_n = v.shape
    df = dout.reshape(dout.size)
    s = np.empty(k_n, v.dtype)
    for n in range(n_):
        s[:] = 0
        for f in range(f_n):
            s += v[n, f]
        for f in range(f_n):
            for d in range(k_n):
                dv[n, f, d] = df[n] * (s[d] - v[n, f, d])


# -- recurrent layers (pserver.layers.recurrent; the layout is reference's) -------------------------
# The recurrence is sequential: per step one product h @ recurrent_kernel (BLAS, on the contiguous
# time-major rows hs[s]), then one fused pass over (batch, units) for the gates and states.

@njit(cache=True, nogil=True)
def _act(code, v):
    if code == RELU:
        return 0 if v < 0 else v
    if code == SIGMOID:
        return _sigmoid(v)
    if code == TANH:
        return np.tanh(v)
    return v


@njit(cache=True, nogil=True)
def _dact(code, y, g):
    """g * f'(.) at the activation's output y."""
    if code == RELU:
        return g if y > 0 else 0 * g
    if code == SIGMOID:
        return g * y * (1 - y)
    if code == TANH:
        return g * (1 - y * y)
    return g


@njit(cache=True, nogil=True)
def _add_rows_t(dz, rk, into, tmp, rmask, rkb):
    """into += dz @ rk.T (tmp: a buffer of into's shape); with recurrent dropout, gate block g's
    part times its mask: into += (dz[:, g] @ rk[:, g].T) * rmask[g]."""
    if rmask.shape[0] == 0:
        np.dot(dz, rk.T, tmp)
        into += tmp
        return
    u = rk.shape[0]
    block = np.empty((dz.shape[0], u), dz.dtype)
    for g in range(rmask.shape[0]):
        block[:] = dz[:, g * u:(g + 1) * u]
        np.dot(block, rkb[g].T, tmp)
        into += tmp * rmask[g]


@njit(cache=True, nogil=True)
def _blocks(rk, rmask):
    """rk's gate blocks (k, u, u), contiguous, for recurrent dropout (none without)."""
    u = rk.shape[0]
    out = np.empty((rmask.shape[0], u, u), rk.dtype)
    for g in range(rmask.shape[0]):
        out[g] = rk[:, g * u:(g + 1) * u]
    return out


@njit(cache=True, nogil=True)
def _recurrent_product(h, rk, z, rmask, rkb):
    """z = h @ rk; with recurrent dropout (Keras's, one mask per gate: rmask (k, n, u)) each gate's
    block z[:, g] = (h * rmask[g]) @ rk[:, g]."""
    if rmask.shape[0] == 0:
        np.dot(h, rk, z)
        return
    u = rk.shape[0]
    hm, zb = np.empty_like(h), np.empty_like(h)
    for g in range(rmask.shape[0]):
        hm[:] = h * rmask[g]
        np.dot(hm, rkb[g], zb)
        z[:, g * u:(g + 1) * u] = zb


@njit(cache=True, nogil=True)
def _masked(mask, b, t):
    """Whether sample b's input step t is masked (Keras's mask): its step keeps the states as
    they were. mask (n, T) in input order, 0 where masked; an empty mask masks nothing."""
    return mask.shape[0] > 0 and mask[b, t] == 0


@njit(cache=True, nogil=True)
def _carried(dhs, drec, dxw, s, b, t):
    """A masked step's backward: the state's gradient passes to the step before as it came, and
    the step's own products get none."""
    dhs[s, b] += dhs[s + 1, b]
    drec[s, b] = 0
    dxw[b, t] = 0


@njit(cache=True, nogil=True)
def simple_rnn_forward(xw, rk, hs, backwards, act, mask, rmask):
    n, T, u = xw.shape
    a = _kind_code(act)
    rkb = _blocks(rk, rmask)
    for s in range(T):
        t = T - 1 - s if backwards else s
        _recurrent_product(hs[s], rk, hs[s + 1], rmask, rkb)
        for b in range(n):
            if _masked(mask, b, t):
                hs[s + 1, b] = hs[s, b]
                continue
            for j in range(u):
                hs[s + 1, b, j] = _act(a, xw[b, t, j] + hs[s + 1, b, j])


@njit(cache=True, nogil=True)
def simple_rnn_backward(rk, hs, dhs, dxw, drec, backwards, act, mask, rmask):
    n, T, u = dxw.shape
    a = _kind_code(act)
    tmp = np.empty((n, u), dxw.dtype)
    rkb = _blocks(rk, rmask)
    for s in range(T - 1, -1, -1):
        t = T - 1 - s if backwards else s
        for b in range(n):
            if _masked(mask, b, t):
                _carried(dhs, drec, dxw, s, b, t)
                continue
            for j in range(u):
                dz = _dact(a, hs[s + 1, b, j], dhs[s + 1, b, j])
                drec[s, b, j] = dz
                dxw[b, t, j] = dz
        _add_rows_t(drec[s], rk, dhs[s], tmp, rmask, rkb)


@njit(cache=True, nogil=True)
def lstm_forward(xw, rk, hs, cs, gates, backwards, act, ract, mask, rmask):
    n, T, k = xw.shape
    u = rk.shape[0]
    a, ra = _kind_code(act), _kind_code(ract)
    z = np.empty((n, k), xw.dtype)
    rkb = _blocks(rk, rmask)
    for s in range(T):
        t = T - 1 - s if backwards else s
        _recurrent_product(hs[s], rk, z, rmask, rkb)
        for b in range(n):
            if _masked(mask, b, t):
                hs[s + 1, b], cs[s + 1, b] = hs[s, b], cs[s, b]
                continue
            for j in range(u):
                i = _act(ra, xw[b, t, j] + z[b, j])
                f = _act(ra, xw[b, t, u + j] + z[b, u + j])
                g = _act(a, xw[b, t, 2 * u + j] + z[b, 2 * u + j])
                o = _act(ra, xw[b, t, 3 * u + j] + z[b, 3 * u + j])
                c = f * cs[s, b, j] + i * g
                cs[s + 1, b, j] = c
                hs[s + 1, b, j] = o * _act(a, c)
                gates[s, b, j], gates[s, b, u + j] = i, f
                gates[s, b, 2 * u + j], gates[s, b, 3 * u + j] = g, o


@njit(cache=True, nogil=True)
def lstm_backward(rk, hs, cs, gates, dhs, dc, dxw, drec, backwards, act, ract, mask, rmask):
    n, T, k = dxw.shape
    u = rk.shape[0]
    a, ra = _kind_code(act), _kind_code(ract)
    tmp = np.empty((n, u), dxw.dtype)
    rkb = _blocks(rk, rmask)
    for s in range(T - 1, -1, -1):
        t = T - 1 - s if backwards else s
        for b in range(n):
            if _masked(mask, b, t):          # the cell state's gradient passes as it came (dc)
                _carried(dhs, drec, dxw, s, b, t)
                continue
            for j in range(u):
                i, f = gates[s, b, j], gates[s, b, u + j]
                g, o = gates[s, b, 2 * u + j], gates[s, b, 3 * u + j]
                dh, tc = dhs[s + 1, b, j], _act(a, cs[s + 1, b, j])
                dcs = dc[b, j] + _dact(a, tc, dh * o)
                dc[b, j] = dcs * f
                di, df = _dact(ra, i, dcs * g), _dact(ra, f, dcs * cs[s, b, j])
                dg, do = _dact(a, g, dcs * i), _dact(ra, o, dh * tc)
                drec[s, b, j], drec[s, b, u + j], dxw[b, t, j], dxw[b, t, u + j] = di, df, di, df
                drec[s, b, 2 * u + j], drec[s, b, 3 * u + j] = dg, do
                dxw[b, t, 2 * u + j], dxw[b, t, 3 * u + j] = dg, do
        _add_rows_t(drec[s], rk, dhs[s], tmp, rmask, rkb)


@njit(cache=True, nogil=True)
def gru_forward(xw, rk, rb, hs, gates, rh, backwards, act, ract, mask, rmask):
    n, T, k = xw.shape
    u = rk.shape[0]
    a, ra = _kind_code(act), _kind_code(ract)
    z = np.empty((n, k), xw.dtype)
    rkb = _blocks(rk, rmask)
    for s in range(T):
        t = T - 1 - s if backwards else s
        _recurrent_product(hs[s], rk, z, rmask, rkb)
        for b in range(n):
            if _masked(mask, b, t):
                hs[s + 1, b] = hs[s, b]
                continue
            for j in range(u):
                zg = _act(ra, xw[b, t, j] + z[b, j] + rb[j])
                r = _act(ra, xw[b, t, u + j] + z[b, u + j] + rb[u + j])
                rhv = z[b, 2 * u + j] + rb[2 * u + j]
                hh = _act(a, xw[b, t, 2 * u + j] + r * rhv)
                rh[s, b, j] = rhv
                gates[s, b, j], gates[s, b, u + j], gates[s, b, 2 * u + j] = zg, r, hh
                hs[s + 1, b, j] = zg * hs[s, b, j] + (1 - zg) * hh


@njit(cache=True, nogil=True)
def gru_backward(rk, hs, gates, rh, dhs, dxw, drec, backwards, act, ract, mask, rmask):
    n, T, k = dxw.shape
    u = rk.shape[0]
    a, ra = _kind_code(act), _kind_code(ract)
    tmp = np.empty((n, u), dxw.dtype)
    rkb = _blocks(rk, rmask)
    for s in range(T - 1, -1, -1):
        t = T - 1 - s if backwards else s
        for b in range(n):
            if _masked(mask, b, t):
                _carried(dhs, drec, dxw, s, b, t)
                continue
            for j in range(u):
                zg, r, hh, dh = gates[s, b, j], gates[s, b, u + j], gates[s, b, 2 * u + j], dhs[s + 1, b, j]
                dah = _dact(a, hh, dh * (1 - zg))
                dz = _dact(ra, zg, dh * (hs[s, b, j] - hh))
                dr = _dact(ra, r, dah * rh[s, b, j])
                drec[s, b, j], drec[s, b, u + j], drec[s, b, 2 * u + j] = dz, dr, dah * r
                dxw[b, t, j], dxw[b, t, u + j], dxw[b, t, 2 * u + j] = dz, dr, dah
                dhs[s, b, j] += dh * zg
        _add_rows_t(drec[s], rk, dhs[s], tmp, rmask, rkb)
