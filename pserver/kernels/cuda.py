"""Model math as numba.cuda kernels; `pserver.kernels.reference` holds their NumPy twins.

Importing this module imports numba.cuda, so nothing imports it until a model asks for the
"cuda" backend (`pserver.kernels.get_backend`). With NUMBA_ENABLE_CUDASIM=1 set before numba
is imported, the same kernels run in numba's CUDA simulator (slowly: one Python thread per
CUDA thread), which is how the tests run them on machines with no GPU.

Two layers:

    kernels      `@cuda.jit` functions on device arrays, each with its bounds checks:
                 the tiled products (`op(A) @ op(B)`, op = identity or transpose),
                 the product with a fused bias + ReLU epilogue, the column sum (bias
                 gradients), the ReLU backward mask, the per-row softmax cross-entropy
                 and MSE (loss terms and gradients) and the one-block loss reduction.
    launchers    plain functions that check shapes on the host, size the grid and launch on a
                 stream. `dense_forward`, `dense_param_grads`, `dense_backward`,
                 `relu_backward`, `softmax_xent` and `mse` have the same names, arguments and
                 in-place contracts as `pserver.kernels.cpu`, on device arrays, plus a
                 keyword-only `stream`.

Everything is float32 with C-contiguous device arrays, as the models keep them. Launches are
asynchronous on their stream; only `softmax_xent` and `mse` (which return the loss as a float,
as the CPU kernels do) wait for it. The device model uses the `*_into` forms, which leave the
loss on the device.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from numba import cuda, float32, float64

# numba warns when a launch has fewer than 128 blocks. Here that is by design (the loss
# reduction is one block) or the model's size (a 64-row batch through 256 units is 64 blocks):
# a warning per launch site would only be noise in every worker's log.
warnings.filterwarnings("ignore",
                        message=r"Grid size \d+ will likely result in GPU under-utilization")

# Output tile of the products: a TILE x TILE block of threads computes a TILE x TILE tile of C,
# reading TILE-wide strips of both operands through shared memory. 16 gives 256 threads per
# block and 2 x 16 x 17 x 4 B = 2.2 KB of shared memory, so many blocks fit on each SM.
TILE = 16
# Shared tiles are TILE x (TILE + 1); a shape must be a compile-time constant, so the sum is
# spelled out here rather than in the kernel (numba types `TILE + 1` as a run-time int64).
_TILE_PAD = TILE + 1
# Elementwise and column kernels: 32 threads along a row (one warp: coalesced reads of one row)
# times 8 rows = 256 threads per block.
BLOCK_X, BLOCK_Y = 32, 8
# Per-row kernels: one thread per sample row.
ROW_THREADS = 128
# The loss reduction runs in one block: the batch is at most a few thousand rows, a rounding
# error next to a launch, and one block keeps the sum's order (and so its value) fixed.
REDUCE_THREADS = 128


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


# -- the tiled product --------------------------------------------------------------------

def _tiled_product(trans_a: bool, trans_b: bool):
    """A device function: this thread's element of op(A) @ op(B), summed over K.

    The flags are closure constants, so numba compiles one branch-free function per form.
    The thread at (ty, tx) of block (by, bx) owns C[by*TILE + ty, bx*TILE + tx]; it must be
    called by every thread of the block, in bounds or not, since all of them load tiles and
    meet at the barriers.
    """

    @cuda.jit(device=True)
    def product(A, B, K):
        # +1 column: a transposed store writes a tile column, and the padding puts its 16
        # elements in 16 different shared-memory banks instead of one.
        sA = cuda.shared.array((TILE, _TILE_PAD), float32)
        sB = cuda.shared.array((TILE, _TILE_PAD), float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        r0, c0 = cuda.blockIdx.y * TILE, cuda.blockIdx.x * TILE
        acc = float32(0.0)
        for k0 in range(0, K, TILE):
            # sA[r, k] = op(A)[r0 + r, k0 + k]. Consecutive threads (tx) always read
            # consecutive addresses of the stored array (coalesced); for a transposed operand
            # the tile is transposed on its way into shared memory instead.
            if trans_a:
                i, j = k0 + ty, r0 + tx
            else:
                i, j = r0 + ty, k0 + tx
            v = A[i, j] if i < A.shape[0] and j < A.shape[1] else float32(0.0)
            if trans_a:
                sA[tx, ty] = v
            else:
                sA[ty, tx] = v
            # sB[k, c] = op(B)[k0 + k, c0 + c], the same way.
            if trans_b:
                i, j = c0 + ty, k0 + tx
            else:
                i, j = k0 + ty, c0 + tx
            v = B[i, j] if i < B.shape[0] and j < B.shape[1] else float32(0.0)
            if trans_b:
                sB[tx, ty] = v
            else:
                sB[ty, tx] = v
            # Both tiles complete before any thread reads them.
            cuda.syncthreads()
            # Out-of-range elements were loaded as 0, so a ragged last tile adds nothing.
            for k in range(TILE):
                acc += sA[ty, k] * sB[k, tx]
            # Every thread done reading before the next iteration overwrites the tiles.
            cuda.syncthreads()
        return acc

    return product


def _matmul_kernel(trans_a: bool, trans_b: bool):
    product = _tiled_product(trans_a, trans_b)

    @cuda.jit
    def matmul(A, B, C):
        """C[:] = op(A) @ op(B)."""
        acc = product(A, B, A.shape[0] if trans_a else A.shape[1])
        col, row = cuda.grid(2)
        if row < C.shape[0] and col < C.shape[1]:
            C[row, col] = acc

    return matmul


_product_nn = _tiled_product(False, False)


@cuda.jit
def matmul_bias_relu(A, B, bias, C, relu):
    """C[:] = A @ B + bias, then ReLU if `relu`: the dense layer's forward in one pass over C."""
    acc = _product_nn(A, B, A.shape[1])
    col, row = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        v = acc + bias[col]
        # `v < 0` (not `not v > 0`) keeps NaN, as the CPU kernel and the twin do.
        if relu and v < 0:
            v = float32(0.0)
        C[row, col] = v


# (trans_a, trans_b) -> kernel: the three forms a dense layer needs, and A.T @ B.T for completeness.
MATMUL = {(ta, tb): _matmul_kernel(ta, tb) for ta in (False, True) for tb in (False, True)}


# -- elementwise, column and row kernels ---------------------------------------------------

@cuda.jit
def relu_backward_kernel(dx, a):
    """dx *= (a > 0) in place; a is the ReLU's output."""
    col, row = cuda.grid(2)
    if row < dx.shape[0] and col < dx.shape[1] and not a[row, col] > 0:
        dx[row, col] = float32(0.0)


@cuda.jit
def column_sum_kernel(a, out):
    """out[:] = a summed over its rows (the bias gradient: dz summed over the batch).

    Block (BLOCK_X, BLOCK_Y): thread (ty, tx) sums rows ty, ty + BLOCK_Y, ... of column
    bx*BLOCK_X + tx, then row ty == 0 adds the BLOCK_Y partial sums in a fixed order.
    """
    part = cuda.shared.array((BLOCK_Y, BLOCK_X), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * BLOCK_X + tx
    acc = float32(0.0)
    if col < a.shape[1]:
        for i in range(ty, a.shape[0], BLOCK_Y):
            acc += a[i, col]
    part[ty, tx] = acc
    # Every partial sum of the block is in shared memory before row 0 reads them.
    cuda.syncthreads()
    if ty == 0 and col < a.shape[1]:
        for r in range(1, BLOCK_Y):
            acc += part[r, tx]
        out[col] = acc


@cuda.jit
def softmax_xent_rows(logits, y, dlogits, row_loss):
    """Row i: row_loss[i] = -log softmax(logits[i])[y[i]]; dlogits[i] = (softmax - onehot) / n.

    One thread per row: k (classes) is small for these models, and the row's max, sum and
    writes stay in one thread's registers. Rows are shifted by their max, so large logits do
    not overflow. A label outside [0, k) writes nothing outside the row: its loss is NaN and
    its gradient has no one-hot term (the models check labels on the host before upload).
    """
    i = cuda.grid(1)
    n, k = logits.shape
    if i >= n:
        return
    m = logits[i, 0]
    for j in range(1, k):
        if logits[i, j] > m:
            m = logits[i, j]
    s = float32(0.0)
    for j in range(k):
        e = math.exp(logits[i, j] - m)
        dlogits[i, j] = e
        s += e
    inv_n = float32(1.0) / float32(n)
    scale = inv_n / s
    for j in range(k):
        dlogits[i, j] *= scale
    label = y[i]
    if 0 <= label < k:
        row_loss[i] = math.log(s) - (logits[i, label] - m)
        dlogits[i, label] -= inv_n
    else:
        row_loss[i] = math.nan


@cuda.jit
def mse_rows(pred, y, dpred, row_loss):
    """Row i: row_loss[i] = (pred[i, 0] - y[i])^2; dpred[i, 0] = (pred[i, 0] - y[i]) / n."""
    i = cuda.grid(1)
    n = pred.shape[0]
    if i < n:
        r = pred[i, 0] - y[i]
        dpred[i, 0] = r / float32(n)
        row_loss[i] = r * r


@cuda.jit
def scaled_sum_kernel(values, scale, out):
    """out[0] = scale * sum(values), in float64, by one block of REDUCE_THREADS threads.

    Each thread sums a strided slice, then a tree halves the partial sums in shared memory.
    """
    part = cuda.shared.array(REDUCE_THREADS, float64)
    t = cuda.threadIdx.x
    acc = float64(0.0)
    for i in range(t, values.shape[0], REDUCE_THREADS):
        acc += values[i]
    part[t] = acc
    step = REDUCE_THREADS // 2
    while step > 0:
        # The partial sums of the previous level are all written before this level reads them.
        cuda.syncthreads()
        if t < step:
            part[t] += part[t + step]
        step //= 2
    if t == 0:
        out[0] = part[0] * scale


# -- launchers ------------------------------------------------------------------------------

def matmul(A, B, C, trans_a=False, trans_b=False, *, stream=0):
    """C[:] = op(A) @ op(B), op transposing its operand when the flag is set."""
    M, K = (A.shape[1], A.shape[0]) if trans_a else A.shape
    K2, N = (B.shape[1], B.shape[0]) if trans_b else B.shape
    if K != K2 or C.shape != (M, N):
        raise ValueError(f"matmul: op(A) is {(M, K)}, op(B) is {(K2, N)}, C is {C.shape}")
    if M and N:
        # One thread per element of C, TILE x TILE per block, blocks covering C's columns (x)
        # and rows (y); the last row and column of blocks may hang over C's edges.
        MATMUL[bool(trans_a), bool(trans_b)][(_blocks(N, TILE), _blocks(M, TILE)),
                                             (TILE, TILE), stream](A, B, C)


def dense_forward(x, W, b, out, relu, *, stream=0):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    n, o = out.shape
    if x.shape[1] != W.shape[0] or (x.shape[0], W.shape[1]) != (n, o) or b.shape != (o,):
        raise ValueError(f"dense_forward: x {x.shape}, W {W.shape}, b {b.shape}, out {out.shape}")
    if n and o:
        # As matmul: TILE x TILE threads per block, one per element of out.
        matmul_bias_relu[(_blocks(o, TILE), _blocks(n, TILE)), (TILE, TILE), stream](
            x, W, b, out, bool(relu))


def column_sum(a, out, *, stream=0):
    """out[:] = a summed over its rows."""
    if out.shape != (a.shape[1],):
        raise ValueError(f"column_sum: a {a.shape}, out {out.shape}")
    if a.shape[1]:
        # BLOCK_X columns per block (coalesced along a row), BLOCK_Y threads down each column.
        column_sum_kernel[_blocks(a.shape[1], BLOCK_X), (BLOCK_X, BLOCK_Y), stream](a, out)


def dense_param_grads(x, dz, dW, db, *, stream=0):
    """dW[:] = x.T @ dz, db[:] = dz summed over the batch. For a first layer: no input grad."""
    matmul(x, dz, dW, trans_a=True, stream=stream)
    column_sum(dz, db, stream=stream)


def relu_backward(dx, a, *, stream=0):
    """dx *= (a > 0) in place; a is the ReLU's output (or its input: same sign)."""
    if dx.shape != a.shape:
        raise ValueError(f"relu_backward: dx {dx.shape}, a {a.shape}")
    n, k = dx.shape
    if n and k:
        # One thread per element: BLOCK_X columns by BLOCK_Y rows per block.
        relu_backward_kernel[(_blocks(k, BLOCK_X), _blocks(n, BLOCK_Y)), (BLOCK_X, BLOCK_Y),
                             stream](dx, a)


def dense_backward(x, W, dz, dW, db, dx, relu, *, stream=0):
    """dense_param_grads, plus dx[:] = dz @ W.T, masked by (x > 0) if `relu`.

    `relu` says x is the output of a ReLU; then x > 0 exactly where the pre-activation was.
    """
    dense_param_grads(x, dz, dW, db, stream=stream)
    matmul(dz, W, dx, trans_b=True, stream=stream)
    if relu:
        relu_backward(dx, x, stream=stream)


def scaled_sum(values, scale, out, *, stream=0):
    """out[0] = scale * sum(values) (float64 device array of shape (1,)), on the device."""
    # One block (see REDUCE_THREADS); the kernel strides over any length.
    scaled_sum_kernel[1, REDUCE_THREADS, stream](values, float(scale), out)


def softmax_xent_into(logits, y, dlogits, row_loss, loss, *, stream=0):
    """dlogits as `softmax_xent`; the mean loss goes to loss[0] on the device (no wait).

    row_loss is float32 scratch of shape (n,); loss a float64 device array of shape (1,).
    """
    n, k = logits.shape
    if y.shape != (n,) or dlogits.shape != (n, k) or row_loss.shape != (n,) or n == 0:
        raise ValueError(f"softmax_xent: logits {logits.shape}, y {y.shape}, "
                         f"dlogits {dlogits.shape}, row_loss {row_loss.shape}")
    # One thread per row, ROW_THREADS rows per block.
    softmax_xent_rows[_blocks(n, ROW_THREADS), ROW_THREADS, stream](logits, y, dlogits, row_loss)
    scaled_sum(row_loss, 1.0 / n, loss, stream=stream)


def mse_into(pred, y, dpred, row_loss, loss, *, stream=0):
    """dpred as `mse`; the loss goes to loss[0] on the device (no wait)."""
    if pred.shape[1] != 1:
        raise ValueError("mse: pred must have one column")
    n = pred.shape[0]
    if y.shape != (n,) or dpred.shape != pred.shape or row_loss.shape != (n,) or n == 0:
        raise ValueError(f"mse: pred {pred.shape}, y {y.shape}, dpred {dpred.shape}, "
                         f"row_loss {row_loss.shape}")
    # One thread per row, ROW_THREADS rows per block.
    mse_rows[_blocks(n, ROW_THREADS), ROW_THREADS, stream](pred, y, dpred, row_loss)
    scaled_sum(row_loss, 0.5 / n, loss, stream=stream)


def softmax_xent(logits, y, dlogits, *, stream=0):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n. Waits."""
    return _loss_now(softmax_xent_into, logits, y, dlogits, stream)


def mse(pred, y, dpred, *, stream=0):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n. Waits."""
    return _loss_now(mse_into, pred, y, dpred, stream)


def _loss_now(into, out, y, dout, stream) -> float:
    # The CPU kernels' contract (return the loss) costs scratch and a wait: fine for tests and
    # one-off calls; the model keeps its scratch and waits once per step instead.
    row_loss = cuda.device_array(out.shape[0], np.float32, stream=stream)
    loss = cuda.device_array(1, np.float64, stream=stream)
    into(out, y, dout, row_loss, loss, stream=stream)
    host = loss.copy_to_host(stream=stream)
    if stream:  # an async copy on a stream: wait for it (the default stream's copy already did)
        stream.synchronize()
    return float(host[0])
