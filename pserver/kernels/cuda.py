"""Model math as numba.cuda kernels; `pserver.kernels.reference` holds their NumPy twins.

Importing this module imports numba.cuda, so nothing imports it until a model asks for the
"cuda" backend (`pserver.kernels.get_backend`). With NUMBA_ENABLE_CUDASIM=1 set before numba
is imported, the same kernels run in numba's CUDA simulator (slowly: one Python thread per
CUDA thread), which is how the tests run them on machines with no GPU.

Two layers:

    kernels      `@cuda.jit` functions on device arrays, each with its bounds checks:
                 the tiled products (`op(A) @ op(B)`, op = identity or transpose),
                 the product with a fused bias + ReLU epilogue, the column sum (bias
                 gradients), the ReLU backward mask, the per-row softmax cross-entropy,
                 binary cross-entropy and MSE (loss terms and gradients), the one-block
                 loss reduction; and the layers' kernels: convolution (forward, weight
                 gradient, input gradient), max and average pooling, activations,
                 dropout and embedding lookups. The convolutions run as implicit GEMM
                 (pserver.kernels.cuda_gemm) unless CONV_KERNEL = "direct" picks the direct
                 kernels here.
    launchers    plain functions that check shapes on the host, size the grid and launch on a
                 stream. Every name in `pserver.kernels.KERNELS` is here with the same
                 arguments and in-place contracts as in `pserver.kernels.cpu`, on device
                 arrays, plus a keyword-only `stream`.

Everything is float32 with C-contiguous device arrays, as the models keep them. Launches are
asynchronous on their stream; only `softmax_xent`, `sigmoid_bce` and `mse` (which return the
loss as a float, as the CPU kernels do) wait for it. The device model uses the `*_into` forms,
which leave the loss on the device. Where the CPU kernels raise on bad data they cannot see
without a copy to the host (an embedding id out of range), these keep every write in bounds
and make the result NaN instead.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from numba import cuda, float32, float64, uint64

from pserver.kernels import cuda_gemm, reference

# The graph layers' kernels (pserver.kernels.GRAPH_KERNELS) live in their own module; part of this API.
from pserver.kernels.cuda_graph import (  # noqa: F401
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
from pserver.kernels.cuda_grid import ELEMENT_THREADS, _blocks, _flat, fill_kernel


# numba warns when a launch has fewer than 128 blocks. Here that is by design (the loss
# reduction is one block) or the model's size (a 64-row batch through 256 units is 64 blocks):
# a warning per launch site would only be noise in every worker's log.
# numba-cuda 0.30 on a GPU wraps the message in terminal bold codes (the simulator does not warn
# at all), hence the leading `.*`: without it every worker's log repeated it at every size.
def quiet_low_occupancy() -> None:
    warnings.filterwarnings("ignore",
                            message=r".*Grid size \d+ will likely result in GPU under-utilization")


quiet_low_occupancy()

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


# -- the register-blocked products -----------------------------------------------------------
#
# The tiled product above computes one element of C per thread: per multiply-add it reads two
# floats from shared memory, so shared-memory bandwidth, not arithmetic, bounds it. These
# kernels give each thread a TM x TN block of C held in registers. A block of
# (BN / TN) x (BM / TM) = 16 x 16 threads computes a BM x BN tile of C; per step along K it
# stages a BK-deep strip of op(A) (BM x BK) and op(B) (BK x BN) in shared memory, and each thread
# then reads TM + TN floats per k for TM * TN multiply-adds. Thread (ty, tx) owns rows
# ty + i * 16 and columns tx + j * 16 of the tile (strided, not contiguous): a warp's 32 threads
# then read 16 consecutive floats of the B strip and 2 of the A strip (broadcasts), so shared
# memory serves every read without bank conflicts, and C is written 16 floats at a time.
# In the `contig` layout (the 128 tile) a thread owns runs of 4 consecutive rows and columns
# instead (_owned), and reads each run with one 128-bit shared load: 4 loads per k for 8 x 8
# multiply-adds, against 16 in the strided layout.
# Shared strips are stored k-major (BK rows of BM + 4): for the operand loaded along K (A as
# stored, B transposed), the 4 extra floats per row spread a warp's stores over the banks
# (bank 4k + w: at most 2 threads share one with 16-deep strips, instead of all 16 of a column).

BLOCKED_THREADS = 16          # threads along each side of a block: 256 per block


def _strip_loader(width: int, bk: int, k_rows: bool):
    """Device functions (pos, at) for one operand's strip: `width` along M (or N) by bk along K.

    pos(e) -> (k, w): where element e of the strip goes. Consecutive e walk along the operand
    as it is stored, so the loads coalesce: along w when K indexes its rows (`k_rows`: A
    transposed, or B as it is), along k otherwise. at(X, e, w0, k0) -> the element's value,
    X[k0 + k, w0 + w] or X[w0 + w, k0 + k], and 0 outside X.
    """

    @cuda.jit(device=True)
    def pos(e):
        return (e // width, e % width) if k_rows else (e % bk, e // bk)

    @cuda.jit(device=True)
    def at(X, e, w0, k0):
        k, w = pos(e)
        i, j = (k0 + k, w0 + w) if k_rows else (w0 + w, k0 + k)
        return X[i, j] if i < X.shape[0] and j < X.shape[1] else float32(0.0)

    return pos, at


@cuda.jit(device=True)
def _owned(t, i):
    """The tile row (column) of thread t's i-th row (column) in the `contig` layout: runs of 4,
    the runs of the 16 threads side by side, then the next run 64 further (so that a warp's
    128-bit loads of a strip row touch consecutive 16-byte words, without bank conflicts)."""
    return (i // 4) * (4 * BLOCKED_THREADS) + t * 4 + i % 4


def _blocked_product(bm: int, bn: int, bk: int, trans_a: bool, trans_b: bool, prefetch: bool,
                     contig: bool = False):
    """A device function: acc[i, j] = (op(A) @ op(B))[r0 + ty + 16 i, c0 + tx + 16 j], summed
    over K (acc is zeroed first); with `contig`, at [r0 + _owned(ty, i), c0 + _owned(tx, j)].

    bm, bn, bk and the flags are closure constants: numba compiles one branch-free function per
    form. The loops over TM and TN have constant lengths and the compiler unrolls them, so that
    `acc`, `a` and `b` live in registers (the loop over one strip's BK stays a loop). With
    `prefetch`, each thread loads its share of the next strip from global memory into registers
    before it computes on the current one, so those loads are in flight during the multiply-adds
    instead of between two barriers. Every thread of the block must call it (all of them load
    strips and meet at the barriers).
    """
    tm, tn = bm // BLOCKED_THREADS, bn // BLOCKED_THREADS
    if contig and (tm % 4 or tn % 4):
        raise ValueError(f"contig needs runs of 4 floats per thread; a {bm} x {bn} tile gives {tm} x {tn}")
    threads = BLOCKED_THREADS * BLOCKED_THREADS
    a_loads, b_loads = bm * bk // threads, bn * bk // threads
    a_rows, b_rows = bm + 4, bn + 4           # padded strip rows (see above)

    a_pos, a_at = _strip_loader(bm, bk, trans_a)          # A stored K x M when transposed
    b_pos, b_at = _strip_loader(bn, bk, not trans_b)      # B stored K x N unless transposed

    @cuda.jit(device=True)
    def product(A, B, K, acc):
        sA = cuda.shared.array((bk, a_rows), float32, alignment=16)
        sB = cuda.shared.array((bk, b_rows), float32, alignment=16)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        ra = cuda.local.array(a_loads, float32)    # the next strip, on its way (prefetch)
        rb = cuda.local.array(b_loads, float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        t = ty * BLOCKED_THREADS + tx
        r0, c0 = cuda.blockIdx.y * bm, cuda.blockIdx.x * bn
        for i in range(tm):
            for j in range(tn):
                acc[i, j] = float32(0.0)
        if prefetch:
            for s in range(a_loads):
                ra[s] = a_at(A, t + s * threads, r0, 0)
            for s in range(b_loads):
                rb[s] = b_at(B, t + s * threads, c0, 0)
        for k0 in range(0, K, bk):
            # sA[k, m] = op(A)[r0 + m, k0 + k] and sB[k, n] = op(B)[k0 + k, c0 + n].
            for s in range(a_loads):
                k, m = a_pos(t + s * threads)
                sA[k, m] = ra[s] if prefetch else a_at(A, t + s * threads, r0, k0)
            for s in range(b_loads):
                k, n = b_pos(t + s * threads)
                sB[k, n] = rb[s] if prefetch else b_at(B, t + s * threads, c0, k0)
            # Both strips complete before any thread reads them.
            cuda.syncthreads()
            if prefetch:
                for s in range(a_loads):
                    ra[s] = a_at(A, t + s * threads, r0, k0 + bk)
                for s in range(b_loads):
                    rb[s] = b_at(B, t + s * threads, c0, k0 + bk)
            # Out-of-range elements were loaded as 0, so a ragged last strip adds nothing.
            for k in range(bk):
                for i in range(tm):
                    a[i] = sA[k, _owned(ty, i) if contig else ty + i * BLOCKED_THREADS]
                for j in range(tn):
                    b[j] = sB[k, _owned(tx, j) if contig else tx + j * BLOCKED_THREADS]
                for i in range(tm):
                    for j in range(tn):
                        acc[i, j] += a[i] * b[j]
            # Every thread done reading before the next step overwrites the strips.
            cuda.syncthreads()

    return product


def _store_tile(bm: int, fused: bool, contig: bool = False):
    """A device function: this thread's block of C from `acc`, in bounds; with `fused` (a
    closure constant), plus bias[col] and then ReLU if `relu`. `contig`: as _blocked_product."""
    tm = bm // BLOCKED_THREADS

    @cuda.jit(device=True)
    def store(C, acc, bias, relu):
        r0, c0 = cuda.blockIdx.y * bm, cuda.blockIdx.x * bm
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x
        for i in range(tm):
            row = r0 + (_owned(ty, i) if contig else ty + i * BLOCKED_THREADS)
            if row < C.shape[0]:
                for j in range(tm):
                    col = c0 + (_owned(tx, j) if contig else tx + j * BLOCKED_THREADS)
                    if col < C.shape[1]:
                        v = acc[i, j]
                        if fused:
                            v += bias[col]
                            # `v < 0` keeps NaN, as the tiled kernel does.
                            if relu and v < 0:
                                v = float32(0.0)
                        C[row, col] = v

    return store


def _blocked_kernels(bm: int, bk: int, prefetch: bool, contig: bool = False):
    """{(trans_a, trans_b): C[:] = op(A) @ op(B)} and the dense forward (x @ W + bias, ReLU),
    for square bm x bm tiles of C."""
    tm = bm // BLOCKED_THREADS
    store, store_fused = _store_tile(bm, False, contig), _store_tile(bm, True, contig)

    def plain(trans_a, trans_b):
        product = _blocked_product(bm, bm, bk, trans_a, trans_b, prefetch, contig)

        @cuda.jit
        def matmul(A, B, C):
            """C[:] = op(A) @ op(B)."""
            acc = cuda.local.array((tm, tm), float32)
            product(A, B, A.shape[0] if trans_a else A.shape[1], acc)
            store(C, acc, C, False)      # no bias: C stands in for it, never read

        return matmul

    product_nn = _blocked_product(bm, bm, bk, False, False, prefetch, contig)

    @cuda.jit
    def dense(A, B, bias, C, relu):
        """C[:] = A @ B + bias, then ReLU if `relu`."""
        acc = cuda.local.array((tm, tm), float32)
        product_nn(A, B, A.shape[1], acc)
        store_fused(C, acc, bias, relu)

    return {(ta, tb): plain(ta, tb) for ta in (False, True) for tb in (False, True)}, dense


# Variants by name: b<tile side>k<strip depth>, p: the next strip prefetched into registers,
# c: each thread's rows and columns in runs of 4 (_owned), read with 128-bit shared loads.
# b64k16p: 64 x 64 tiles of C (4 x 4 floats per thread, strided), strips 16 deep (2 x 16 x 68
# floats: 8.7 KB of shared memory per block); 88 to 108 registers per thread by form.
# b128k16pc: 128 x 128 tiles (8 x 8 floats per thread, in runs of 4), strips 16 deep (17 KB);
# 172 to 193 registers, so one block per multiprocessor. Neither spills (ptxas, sm_90).
# These two won sweeps of every variant on an H100 and an H200 (bench/results/gpu/notes.md).
BLOCKED_VARIANTS = {f"b{tile}k{bk}{'p' if pre else ''}{'c' if con else ''}":
                    (tile, *_blocked_kernels(tile, bk, pre, con))
                    for tile, bk, pre, con in ((64, 16, True, False), (128, 16, True, True))}
# Tile side -> the variant tile_for uses for it (the other variants are at the commits named
# in bench/results/gpu/notes.md): a name here or in cuda_gemm.VARIANTS. The 128 tile is
# cuda_gemm's g128k8cwr2sa: 128 x 128, strips 8 deep, runs of 4 placed per warp, at most 128
# registers so that 2 blocks fit on a multiprocessor, and the reduction split where its tiles
# leave multiprocessors idle (see SPLIT_MIN_K); the fastest 128 tile timed (runs 7 and 8).
BLOCKED_CHOICE = {64: "b64k16p", 128: "g128k8cwr2sa"}


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


@cuda.jit(device=True)
def _block_sum(part, t, acc):
    """The sum of every thread's `acc` over a block of REDUCE_THREADS threads (thread t puts
    its own in part[t]; a tree then halves the partial sums in place). Every thread of the
    block must call it, since all meet at its barriers; the result is right in thread 0 only.
    """
    part[t] = acc
    step = REDUCE_THREADS // 2
    while step > 0:
        # The partial sums of the previous level are all written before this level reads them.
        cuda.syncthreads()
        if t < step:
            part[t] += part[t + step]
        step //= 2
    return part[0]


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
    total = _block_sum(part, t, acc)
    if t == 0:
        out[0] = total * scale


# -- images: channels-last (N, H, W, C), one thread per output element ------------------------
#
# Output position (oh, ow) reads the window whose top-left input element is
# (oh*stride_h - pad_top, ow*stride_w - pad_left), as in the CPU kernels. Each kernel takes a
# flat 1-D grid over the elements it writes (ELEMENT_THREADS per block) and decodes the flat
# index into (n, h, w, c) itself. Backward passes gather: the thread that owns an input
# element sums over the windows that read it, so no two threads write one element and no
# atomics are needed (the sums' order, and so their value, is fixed).

# Threads per block of the flat element kernels.
@cuda.jit(device=True)
def _unflatten4(i, shape):
    """(a, b, c, d) of flat index i in a C-ordered array of `shape` (4-D)."""
    d = i % shape[3]
    i //= shape[3]
    c = i % shape[2]
    i //= shape[2]
    return i // shape[1], i % shape[1], c, d


@cuda.jit(device=True)
def _window_range(o, stride, pad, pool, size):
    """[start, stop) of the window of output position o, clipped to the image (may be empty)."""
    start = o * stride - pad
    return max(start, 0), min(start + pool, size)


@cuda.jit(device=True)
def _first_window(pos, pad, pool, stride, out_size):
    """[first, stop) of the output positions whose window covers input position pos."""
    p = pos + pad
    # o*stride <= p < o*stride + pool  <=>  (p - pool) // stride < o <= p // stride
    first = max((p - pool) // stride + 1, 0) if p >= pool else 0
    return first, min(p // stride + 1, out_size)


@cuda.jit
def conv2d_forward_kernel(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu):
    """out[n, oh, ow, f] = b[f] + sum over the window of x * w[:, :, :, f], then ReLU if `relu`."""
    i = cuda.grid(1)
    if i >= out.size:
        return
    n, oh, ow, f = _unflatten4(i, out.shape)
    acc = b[f]
    for ki in range(w.shape[0]):
        h = oh * stride_h - pad_top + ki
        if 0 <= h < x.shape[1]:
            for kj in range(w.shape[1]):
                col = ow * stride_w - pad_left + kj
                if 0 <= col < x.shape[2]:
                    for c in range(x.shape[3]):
                        acc += x[n, h, col, c] * w[ki, kj, c, f]
    # `acc < 0` (not `not acc > 0`) keeps NaN, as the CPU kernel and the twin do.
    if relu and acc < 0:
        acc = float32(0.0)
    out[n, oh, ow, f] = acc


@cuda.jit
def conv2d_dw_kernel(x, dy, dw, stride_h, stride_w, pad_top, pad_left):
    """dw[ki, kj, c, f] = sum over every output pixel of x at tap (ki, kj, c) times dy[.., f].

    One block per element of dw: its REDUCE_THREADS threads take strided slices of the
    N*OH*OW pixels, then a tree adds their partial sums in shared memory.
    """
    part = cuda.shared.array(REDUCE_THREADS, float32)
    t = cuda.threadIdx.x
    ki, kj, c, f = _unflatten4(cuda.blockIdx.x, dw.shape)
    oh_n, ow_n = dy.shape[1], dy.shape[2]
    acc = float32(0.0)
    for r in range(t, dy.shape[0] * oh_n * ow_n, REDUCE_THREADS):
        ow = r % ow_n
        oh = (r // ow_n) % oh_n
        n = r // (ow_n * oh_n)
        h, col = oh * stride_h - pad_top + ki, ow * stride_w - pad_left + kj
        if 0 <= h < x.shape[1] and 0 <= col < x.shape[2]:
            acc += x[n, h, col, c] * dy[n, oh, ow, f]
    total = _block_sum(part, t, acc)
    if t == 0:
        dw[ki, kj, c, f] = total


@cuda.jit
def conv2d_dx_kernel(w, dy, dx, stride_h, stride_w, pad_top, pad_left):
    """dx[n, h, col, c] = sum over the windows that read it of dy[n, oh, ow, :] . w[ki, kj, c, :]."""
    i = cuda.grid(1)
    if i >= dx.size:
        return
    n, h, col, c = _unflatten4(i, dx.shape)
    acc = float32(0.0)
    oh0, oh1 = _first_window(h, pad_top, w.shape[0], stride_h, dy.shape[1])
    ow0, ow1 = _first_window(col, pad_left, w.shape[1], stride_w, dy.shape[2])
    for oh in range(oh0, oh1):
        ki = h + pad_top - oh * stride_h
        for ow in range(ow0, ow1):
            kj = col + pad_left - ow * stride_w
            for f in range(w.shape[3]):
                acc += dy[n, oh, ow, f] * w[ki, kj, c, f]
    dx[n, h, col, c] = acc


@cuda.jit
def maxpool2d_forward_kernel(x, out, argmax, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out = the window's max, argmax = its flat index h*W + w; the CPU kernel's tie and NaN rules."""
    i = cuda.grid(1)
    if i >= out.size:
        return
    n, oh, ow, c = _unflatten4(i, out.shape)
    h0, h1 = _window_range(oh, stride_h, pad_top, pool_h, x.shape[1])
    w0, w1 = _window_range(ow, stride_w, pad_left, pool_w, x.shape[2])
    best, arg = float32(0.0), -1
    if h0 < h1 and w0 < w1:
        best, arg = x[n, h0, w0, c], h0 * x.shape[2] + w0
        for h in range(h0, h1):
            for col in range(w0, w1):
                v = x[n, h, col, c]
                if v > best:
                    best, arg = v, h * x.shape[2] + col
    out[n, oh, ow, c] = best
    argmax[n, oh, ow, c] = arg


@cuda.jit
def maxpool2d_backward_kernel(dy, argmax, dx):
    """dx[n, a // W, a % W, c] += dy[n, oh, ow, c] for a = argmax[n, oh, ow, c] (dx zeroed first).

    A scatter, as the CPU kernel: the argmax is all it knows of the windows. The add is atomic
    since overlapping windows can choose one element; with windows that do not overlap (the
    usual pool == stride) every element gets at most one add, so the result is exact.
    """
    i = cuda.grid(1)
    if i >= dy.size:
        return
    n, oh, ow, c = _unflatten4(i, dy.shape)
    a = argmax[n, oh, ow, c]
    if 0 <= a < dx.shape[1] * dx.shape[2]:
        cuda.atomic.add(dx, (n, a // dx.shape[2], a % dx.shape[2], c), dy[n, oh, ow, c])


@cuda.jit(device=True)
def _window_count(o, stride, pad, pool, size):
    start, stop = _window_range(o, stride, pad, pool, size)
    return max(stop - start, 0)


@cuda.jit
def avgpool2d_forward_kernel(x, out, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """out = mean of the window's elements inside the image (0 for a window with none)."""
    i = cuda.grid(1)
    if i >= out.size:
        return
    n, oh, ow, c = _unflatten4(i, out.shape)
    h0, h1 = _window_range(oh, stride_h, pad_top, pool_h, x.shape[1])
    w0, w1 = _window_range(ow, stride_w, pad_left, pool_w, x.shape[2])
    acc = float32(0.0)
    for h in range(h0, h1):
        for col in range(w0, w1):
            acc += x[n, h, col, c]
    count = max(h1 - h0, 0) * max(w1 - w0, 0)
    out[n, oh, ow, c] = acc / float32(max(count, 1))


@cuda.jit
def avgpool2d_backward_kernel(dy, dx, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left):
    """dx[n, h, w, c] = sum over the windows that hold it of dy / the window's count."""
    i = cuda.grid(1)
    if i >= dx.size:
        return
    n, h, col, c = _unflatten4(i, dx.shape)
    acc = float32(0.0)
    oh0, oh1 = _first_window(h, pad_top, pool_h, stride_h, dy.shape[1])
    ow0, ow1 = _first_window(col, pad_left, pool_w, stride_w, dy.shape[2])
    for oh in range(oh0, oh1):
        rows = _window_count(oh, stride_h, pad_top, pool_h, dx.shape[1])
        for ow in range(ow0, ow1):
            count = rows * _window_count(ow, stride_w, pad_left, pool_w, dx.shape[2])
            acc += dy[n, oh, ow, c] / float32(max(count, 1))
    dx[n, h, col, c] = acc


# -- elementwise (flat 1-D views), embedding, binary cross-entropy ---------------------------

# Activation kinds as the kernels take them (the launchers map the names).
ACTIVATION_CODES = {"relu": 0, "sigmoid": 1, "tanh": 2, "linear": 3}


@cuda.jit(device=True)
def _sigmoid(z):
    """1 / (1 + exp(-z)) from e = exp(-|z|) <= 1, so no exp overflows whatever z's sign."""
    e = math.exp(-abs(z))
    # float32 constants throughout: numba widens float32 with an int to float64.
    one = float32(1.0)
    return one / (one + e) if z >= 0 else e / (one + e)


@cuda.jit
def activation_forward_kernel(code, x, out):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    v = x[i]
    if code == 0:
        out[i] = float32(0.0) if v < 0 else v   # `v < 0` keeps NaN
    elif code == 1:
        out[i] = _sigmoid(v)
    elif code == 2:
        out[i] = math.tanh(v)
    else:
        out[i] = v


@cuda.jit
def activation_backward_kernel(code, y, dy, dx):
    i = cuda.grid(1)
    if i >= y.shape[0]:
        return
    v, g = y[i], dy[i]
    if code == 0:
        dx[i] = g if v > 0 else float32(0.0)
    elif code == 1:
        dx[i] = g * v * (float32(1.0) - v)
    elif code == 2:
        dx[i] = g * (float32(1.0) - v * v)
    else:
        dx[i] = g


_NAN32 = float32(math.nan)   # a float32 constant: math.nan alone makes a select float64

# splitmix64's constants (see pserver.kernels.reference.dropout_forward), as uint64.
_GAMMA = uint64(0x9E3779B97F4A7C15)
_MUL1 = uint64(0xBF58476D1CE4E5B9)
_MUL2 = uint64(0x94D049BB133111EB)


@cuda.jit
def dropout_forward_kernel(x, out, mask, threshold, scale, seed):
    """mask[i] = scale if the i-th splitmix64 draw's top 24 bits reach threshold, else 0."""
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    z = seed + (uint64(i) + uint64(1)) * _GAMMA
    z = (z ^ (z >> uint64(30))) * _MUL1
    z = (z ^ (z >> uint64(27))) * _MUL2
    z = z ^ (z >> uint64(31))
    m = scale if z >> uint64(40) >= threshold else float32(0.0)
    mask[i] = m
    out[i] = x[i] * m


@cuda.jit
def multiply_kernel(a, b, out):
    """out = a * b, element by element (dropout's backward)."""
    i = cuda.grid(1)
    if i < a.shape[0]:
        out[i] = a[i] * b[i]


@cuda.jit
def embedding_forward_kernel(ids, table, out):
    """out[n, l, :] = table[ids[n, l], :]; -1 (padding) gives zeros, another id outside [0, V)
    a row of NaN."""
    i = cuda.grid(1)
    if i >= out.size:
        return
    d = i % out.shape[2]
    r = i // out.shape[2]
    n, pos = r // out.shape[1], r % out.shape[1]
    row = ids[n, pos]
    out[n, pos, d] = table[row, d] if 0 <= row < table.shape[0] else (float32(0.0) if row == -1 else _NAN32)


@cuda.jit
def embedding_backward_kernel(ids, dy, dtable):
    """dtable[ids[n, l], :] += dy[n, l, :]; ids outside [0, V) are skipped.

    Atomic adds: a repeated id is a row that several threads add to, and a gather over the
    ids per table row would read every id for every row.
    """
    i = cuda.grid(1)
    if i >= dy.size:
        return
    d = i % dy.shape[2]
    r = i // dy.shape[2]
    n, pos = r // dy.shape[1], r % dy.shape[1]
    row = ids[n, pos]
    if 0 <= row < dtable.shape[0]:
        cuda.atomic.add(dtable, (row, d), dy[n, pos, d])


@cuda.jit
def sigmoid_bce_rows(z, y, dz, row_loss):
    """Row i: row_loss[i] = the binary cross-entropy of logit z[i]; dz[i] = (sigmoid - y) / n."""
    i = cuda.grid(1)
    n = z.shape[0]
    if i < n:
        v, t = z[i], y[i]
        dz[i] = (_sigmoid(v) - t) / float32(n)
        row_loss[i] = max(v, float32(0.0)) - v * t + math.log1p(math.exp(-abs(v)))


# -- launchers ------------------------------------------------------------------------------

def matmul(A, B, C, trans_a=False, trans_b=False, *, stream=0):
    """C[:] = op(A) @ op(B), op transposing its operand when the flag is set."""
    M, K = (A.shape[1], A.shape[0]) if trans_a else A.shape
    K2, N = (B.shape[1], B.shape[0]) if trans_b else B.shape
    if K != K2 or C.shape != (M, N):
        raise ValueError(f"matmul: op(A) is {(M, K)}, op(B) is {(K2, N)}, C is {C.shape}")
    if M and N:
        matmul_tiled(A, B, C, trans_a, trans_b, tile_for(M, N, K), stream=stream)


def matmul_tiled(A, B, C, trans_a, trans_b, tile, *, stream=0):
    """matmul with a chosen kernel: tile 16 (one element of C per thread), 64 or 128 (register-
    blocked, BLOCKED_CHOICE), or a name in BLOCKED_VARIANTS or cuda_gemm.VARIANTS; shapes already
    checked. Blocks cover C's columns (x) and rows (y) (cuda_gemm's: rows along x); the last row
    and column of blocks may hang over C's edges."""
    M, N = C.shape
    if tile == TILE:
        MATMUL[bool(trans_a), bool(trans_b)][(_blocks(N, TILE), _blocks(M, TILE)),
                                             (TILE, TILE), stream](A, B, C)
    elif _gemm_name(tile):
        cuda_gemm.matmul(A, B, C, trans_a, trans_b, _gemm_name(tile), stream=stream)
    else:
        side, forms, _ = _blocked(tile)
        forms[bool(trans_a), bool(trans_b)][
            (_blocks(N, side), _blocks(M, side)), (BLOCKED_THREADS, BLOCKED_THREADS), stream](A, B, C)


def _gemm_name(tile):
    """The cuda_gemm variant a tile side or name stands for, or None (a BLOCKED_VARIANTS one)."""
    name = BLOCKED_CHOICE.get(tile) if isinstance(tile, int) else tile
    return name if name in cuda_gemm.VARIANTS else None


def _blocked(tile):
    """(side, forms, dense) of a tile side (the chosen variant) or of a variant's name."""
    return BLOCKED_VARIANTS[BLOCKED_CHOICE[tile] if isinstance(tile, int) else tile]


# Per blocked tile side: (blocks that fit on one multiprocessor at once, by registers: 256
# threads of b64k16p take 88-108 registers each, of b128k16pc 172-193; the time of one such
# wave, relative to a wave of 128 tiles). A wave of 64 tiles does half a 128 wave's work, at
# 16.8 TFLOP/s against 20.4 for full 128 waves: 0.5 * 20.4 / 16.8 = 0.61 (run-4, H200, timed
# with b128k16pc, and kept for its successors until the sizes between are timed with them:
# bench/results/gpu/notes.md).
WAVES = {64: (2, 0.61), 128: (1, 1.0)}


# Split-K where the 64 tile leaves multiprocessors idle: the 128 tile with its reduction split
# in 4 (BLOCKED_CHOICE[128]: 64 tiles x 4 slices) keeps them busy at n = 1024. Only products
# split (dense_forward does not), and only a reduction at least SPLIT_MIN_K long: the split's
# second launch costs host time, so it pays only where the product's device time is above that
# (from K = 2048 on an H100; the timings are in bench/results/gpu/notes.md, runs 8 and 9).
SPLIT_MIN_K = 2048


def _splits_128() -> bool:
    """Whether BLOCKED_CHOICE[128] is a cuda_gemm variant that splits the reduction."""
    name = _gemm_name(128)
    return name is not None and cuda_gemm.VARIANTS[name].splitk != 1


def tile_for(M: int, N: int, K: int = 0) -> int:
    """The side of C's tile per block for an M x N product with a reduction K long (0: not a
    plain product, as dense_forward, which does not split). 16, the one-element-per-thread
    kernel, when the 64 tile's blocks do not give every multiprocessor one: its many small
    blocks keep a small product (or a narrow one with a long K, as a weight gradient x.T @ dz)
    spread over the GPU. 128 (split-K) when the 64 tile's blocks give every multiprocessor one
    but fill less than one wave of WAVES[64] per multiprocessor and K >= SPLIT_MIN_K (a 1024 x
    1024 product with K >= 2048 on 132 multiprocessors). Otherwise the blocked tile whose waves (WAVES)
    take least time: a partly idle last wave costs as much as a full one. On the H200 this
    picked the faster of the two tiles at every size timed, 1024 to 4096
    (bench/results/gpu/README.md)."""
    if FORCE_TILE is not None:
        return FORCE_TILE
    sms = _multiprocessors()
    blocks64 = _blocks(M, 64) * _blocks(N, 64)
    if blocks64 < sms:
        return TILE
    if K >= SPLIT_MIN_K and blocks64 < sms * WAVES[64][0] and _splits_128():
        return 128

    def waves(side):
        per_sm, unit = WAVES[side]
        return _blocks(_blocks(M, side) * _blocks(N, side), sms * per_sm) * unit

    return min(sorted(BLOCKED_CHOICE), key=waves)


_SMS: list[int] = []
# 16, 64, 128 or a name in BLOCKED_VARIANTS: every product and dense forward takes that kernel
# (bench/kernels.py times each this way); None: tile_for chooses.
FORCE_TILE: int | str | None = None


# The simulator has no multiprocessor count; it takes an H100's, so that a product takes the
# kernel it would take on that GPU (the tests call each kernel by its tile as well).
SIMULATED_MULTIPROCESSORS = 132


def _multiprocessors() -> int:
    """The current device's multiprocessor count, read once."""
    if not _SMS:
        _SMS.append(SIMULATED_MULTIPROCESSORS if cuda.config.ENABLE_CUDASIM
                    else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SMS[0]


def dense_forward(x, W, b, out, relu, *, stream=0):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    n, o = out.shape
    if x.shape[1] != W.shape[0] or (x.shape[0], W.shape[1]) != (n, o) or b.shape != (o,):
        raise ValueError(f"dense_forward: x {x.shape}, W {W.shape}, b {b.shape}, out {out.shape}")
    if n and o:
        dense_forward_tiled(x, W, b, out, relu, tile_for(n, o), stream=stream)


def dense_forward_tiled(x, W, b, out, relu, tile, *, stream=0):
    """dense_forward with a chosen kernel, as matmul_tiled; shapes already checked."""
    n, o = out.shape
    if tile == TILE:
        matmul_bias_relu[(_blocks(o, TILE), _blocks(n, TILE)), (TILE, TILE), stream](
            x, W, b, out, bool(relu))
    elif _gemm_name(tile):
        cuda_gemm.dense_forward(x, W, b, out, relu, _gemm_name(tile), stream=stream)
    else:
        side, _, dense = _blocked(tile)
        dense[(_blocks(o, side), _blocks(n, side)),
              (BLOCKED_THREADS, BLOCKED_THREADS), stream](x, W, b, out, bool(relu))


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


def softmax_xent(logits, y, dlogits, row_loss=None, *, stream=0):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n; each row's
    loss into the host array row_loss when given. Waits."""
    return _loss_now(softmax_xent_into, logits, y, dlogits, stream, row_loss)


def mse(pred, y, dpred, row_loss=None, *, stream=0):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n; each row's 0.5 * (pred - y)^2
    into the host array row_loss when given. Waits."""
    return _loss_now(mse_into, pred, y, dpred, stream, row_loss, row_scale=0.5)


def _loss_now(into, out, y, dout, stream, row_loss=None, row_scale=1.0) -> float:
    # The CPU kernels' contract (return the loss; the rows' losses into row_loss, a host array,
    # when given) costs scratch and a wait: fine for tests and one-off calls; the model keeps
    # its scratch and waits once per step instead. mse_rows holds (pred - y)^2: row_scale 0.5.
    rows = cuda.device_array(out.shape[0], np.float32, stream=stream)
    loss = cuda.device_array(1, np.float64, stream=stream)
    into(out, y, dout, rows, loss, stream=stream)
    host = loss.copy_to_host(stream=stream)
    each = None if row_loss is None else rows.copy_to_host(stream=stream)
    if stream:  # an async copy on a stream: wait for it (the default stream's copy already did)
        stream.synchronize()
    if row_loss is not None:
        row_loss[:] = each * row_scale
    return float(host[0])


@cuda.jit(device=True)
def _pool_scale(ids, weights, n, combiner):
    """1 / sample n's divisor (reference.py: 1, the sum of its weights or their root sum of
    squares), 0 where that is 0."""
    if combiner == reference.POOL_SUM:
        return 1.0
    d = 0.0
    for l in range(ids.shape[1]):
        if ids[n, l] >= 0:
            w = float64(weights[n, l])
            d += w if combiner == reference.POOL_MEAN else w * w
    if combiner == reference.POOL_SQRTN:
        d = math.sqrt(d)
    return 0.0 if d == 0 else 1.0 / d


@cuda.jit
def pooled_forward_kernel(ids, weights, table, combiner, out):
    i = cuda.grid(1)
    if i >= out.size:
        return
    n, d = i // out.shape[1], i % out.shape[1]
    acc = float64(0.0)
    for l in range(ids.shape[1]):
        row = ids[n, l]
        if row >= table.shape[0]:
            acc = math.nan
        elif row >= 0:
            acc += float64(weights[n, l]) * table[row, d]
    out[n, d] = acc * _pool_scale(ids, weights, n, combiner)


@cuda.jit
def pooled_backward_kernel(ids, weights, dy, combiner, dtable):
    """One thread per (n, l, d): atomic adds, as embedding_backward_kernel (repeated ids add)."""
    i = cuda.grid(1)
    per_sample = ids.shape[1] * dtable.shape[1]
    if i >= ids.shape[0] * per_sample:
        return
    n, r = i // per_sample, i % per_sample
    l, d = r // dtable.shape[1], r % dtable.shape[1]
    row = ids[n, l]
    if 0 <= row < dtable.shape[0]:
        f = float64(weights[n, l]) * _pool_scale(ids, weights, n, combiner)
        cuda.atomic.add(dtable, (row, d), float32(f * dy[n, d]))


# -- layer launchers: the CPU kernels' names and arguments, on device arrays ----------------

def _launch_elements(kernel, count, stream, *args):
    """kernel over a flat 1-D grid of `count` threads, ELEMENT_THREADS per block."""
    if count:
        kernel[_blocks(count, ELEMENT_THREADS), ELEMENT_THREADS, stream](*args)


def _check_image_shapes(name, x, out, channels_out):
    if len(x.shape) != 4 or len(out.shape) != 4 or out.shape[0] != x.shape[0] \
            or out.shape[3] != channels_out:
        raise ValueError(f"{name}: x {x.shape}, out {out.shape}")


# The convolutions' kernels: "igemm", implicit GEMM on the blocked product (cuda_gemm, its
# CONV_DEFAULT variant), or a variant of cuda_gemm.VARIANTS by name (bench/kernels.py times each
# this way); "direct", the kernels above with one thread per output element (one block per
# weight for dw): the fallback, 0.02x cuDNN at the reference CNN's shapes (bench/results/gpu).
CONV_KERNEL = "igemm"


def _conv_variant():
    return None if CONV_KERNEL == "igemm" else CONV_KERNEL


def conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu, *, stream=0):
    """out[:] = conv(x, w) + b, then ReLU if `relu`. x (N,H,W,C), w (KH,KW,C,F), out (N,OH,OW,F)."""
    _check_image_shapes("conv2d_forward", x, out, w.shape[3])
    if w.shape[2] != x.shape[3] or b.shape != (w.shape[3],):
        raise ValueError(f"conv2d_forward: x {x.shape}, w {w.shape}, b {b.shape}")
    if CONV_KERNEL != "direct":
        cuda_gemm.conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu,
                                 _conv_variant(), stream=stream)
        return
    # One thread per output element.
    _launch_elements(conv2d_forward_kernel, out.size, stream, x, w, b, out,
                     stride_h, stride_w, pad_top, pad_left, bool(relu))


def conv2d_backward(x, w, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, *, stream=0):
    """dw, db (and dx unless it is None) from dy = d loss / d pre-activation (N,OH,OW,F)."""
    _check_image_shapes("conv2d_backward", x, dy, w.shape[3])
    if dw.shape != w.shape or (dx is not None and dx.shape != x.shape) or db.shape != (w.shape[3],):
        raise ValueError(f"conv2d_backward: x {x.shape}, w {w.shape}, dw {dw.shape}, db {db.shape}")
    if CONV_KERNEL != "direct":
        cuda_gemm.conv2d_backward(x, w, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left,
                                  _conv_variant(), stream=stream)
        return
    if dw.size:
        # One block of REDUCE_THREADS per element of dw (see conv2d_dw_kernel).
        conv2d_dw_kernel[dw.size, REDUCE_THREADS, stream](x, dy, dw, stride_h, stride_w,
                                                          pad_top, pad_left)
    column_sum(dy.reshape(dy.size // dy.shape[3], dy.shape[3]), db, stream=stream)
    if dx is not None:
        # One thread per input element, gathering from the windows that read it.
        _launch_elements(conv2d_dx_kernel, dx.size, stream, w, dy, dx, stride_h, stride_w,
                         pad_top, pad_left)


def maxpool2d_forward(x, out, argmax, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left, *,
                      stream=0):
    """out[:] = each window's max; argmax[:] = its flat index h*W + w (int32)."""
    _check_image_shapes("maxpool2d_forward", x, out, x.shape[3])
    if argmax.shape != out.shape:
        raise ValueError(f"maxpool2d_forward: out {out.shape}, argmax {argmax.shape}")
    # One thread per output element.
    _launch_elements(maxpool2d_forward_kernel, out.size, stream, x, out, argmax,
                     pool_h, pool_w, stride_h, stride_w, pad_top, pad_left)


def maxpool2d_backward(dy, argmax, dx, *, stream=0):
    """dx[:] = 0, then each dy element added at its window's argmax (overlapping windows add)."""
    if argmax.shape != dy.shape or dx.shape[0] != dy.shape[0] or dx.shape[3] != dy.shape[3]:
        raise ValueError(f"maxpool2d_backward: dy {dy.shape}, argmax {argmax.shape}, dx {dx.shape}")
    # One thread per element: zero dx, then one per dy element to scatter it.
    _launch_elements(fill_kernel, dx.size, stream, _flat(dx), float32(0.0))
    _launch_elements(maxpool2d_backward_kernel, dy.size, stream, dy, argmax, dx)


def avgpool2d_forward(x, out, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left, *, stream=0):
    """out[:] = mean of each window's elements inside the image (padding not counted)."""
    _check_image_shapes("avgpool2d_forward", x, out, x.shape[3])
    # One thread per output element.
    _launch_elements(avgpool2d_forward_kernel, out.size, stream, x, out, pool_h, pool_w,
                     stride_h, stride_w, pad_top, pad_left)


def avgpool2d_backward(dy, dx, pool_h, pool_w, stride_h, stride_w, pad_top, pad_left, *, stream=0):
    """dx[:] = each window's dy / its count, spread over its elements inside the image."""
    _check_image_shapes("avgpool2d_backward", dx, dy, dx.shape[3])
    # One thread per input element, gathering from the windows that hold it.
    _launch_elements(avgpool2d_backward_kernel, dx.size, stream, dy, dx, pool_h, pool_w,
                     stride_h, stride_w, pad_top, pad_left)


def _activation_code(kind) -> int:
    if kind not in ACTIVATION_CODES:
        raise ValueError(f"activation: unknown kind {kind!r}; "
                         f"choose one of {', '.join(ACTIVATION_CODES)}")
    return ACTIVATION_CODES[kind]


def activation_forward(kind, x, out, *, stream=0):
    """out[:] = f(x) for f = relu | sigmoid | tanh | linear; any shape."""
    code = _activation_code(kind)
    # One thread per element of the flat views.
    _launch_elements(activation_forward_kernel, x.size, stream, code, _flat(x), _flat(out))


def activation_backward(kind, y, dy, dx, *, stream=0):
    """dx[:] = dy * f'(.), written in terms of the activation's output y."""
    code = _activation_code(kind)
    # One thread per element of the flat views.
    _launch_elements(activation_backward_kernel, y.size, stream, code, _flat(y), _flat(dy), _flat(dx))


def dropout_forward(x, out, mask, rate, seed, *, stream=0):
    """mask[:] = 0 or 1/(1 - rate) per element, the same mask as every backend's for this
    seed (see reference.dropout_forward); out = x * mask."""
    threshold = uint64(reference.dropout_threshold(rate, seed))
    # One thread per element of the flat views.
    _launch_elements(dropout_forward_kernel, x.size, stream, _flat(x), _flat(out), _flat(mask),
                     threshold, float32(1 / (1 - rate)), uint64(seed))


def dropout_backward(dy, mask, dx, *, stream=0):
    """dx[:] = dy * mask."""
    # One thread per element of the flat views.
    _launch_elements(multiply_kernel, dy.size, stream, _flat(dy), _flat(mask), _flat(dx))


def copy(x, out, *, stream=0):
    """out[:] = x, device to device, on the stream."""
    if x.shape != out.shape:
        raise ValueError(f"copy: x {x.shape}, out {out.shape}")
    out.copy_to_device(x, stream=stream)


def embedding_forward(ids, table, out, *, stream=0):
    """out[n, l] = table[ids[n, l]]. ids int (N, L), table (V, D), out (N, L, D).

    Ids are not checked here (that would need them on the host): -1 is padding (zeros), another
    id outside [0, V) reads nothing and gives a row of NaN, which the loss then shows.
    """
    if out.shape != (*ids.shape, table.shape[1]):
        raise ValueError(f"embedding_forward: ids {ids.shape}, table {table.shape}, out {out.shape}")
    # One thread per output element.
    _launch_elements(embedding_forward_kernel, out.size, stream, ids, table, out)


def embedding_backward(ids, dy, dtable, *, stream=0):
    """dtable[:] = 0, then dy[n, l] added to row ids[n, l] (repeated ids add; others skipped)."""
    if dy.shape != (*ids.shape, dtable.shape[1]):
        raise ValueError(f"embedding_backward: ids {ids.shape}, dy {dy.shape}, dtable {dtable.shape}")
    # One thread per element: zero the table, then one per dy element to scatter it.
    _launch_elements(fill_kernel, dtable.size, stream, _flat(dtable), float32(0.0))
    _launch_elements(embedding_backward_kernel, dy.size, stream, ids, dy, dtable)


def pooled_embedding_forward(ids, weights, table, combiner, out, *, stream=0):
    """out[n] = sum_l weights[n, l] table[ids[n, l]] / the combiner's divisor (reference.py says
    the semantics; ids < 0 are padding). An id >= V reads nothing and gives NaN, as
    embedding_forward's does."""
    if out.shape != (ids.shape[0], table.shape[1]) or weights.shape != ids.shape or len(ids.shape) != 2:
        raise ValueError(f"pooled_embedding_forward: ids {ids.shape}, weights {weights.shape}, "
                         f"table {table.shape}, out {out.shape}")
    # One thread per output element, each summing its sample's list (the divisor computed by each
    # of the sample's D threads: L reads, fewer than the row reads beside them).
    _launch_elements(pooled_forward_kernel, out.size, stream, ids, weights, table, combiner, out)


def pooled_embedding_backward(ids, weights, dy, combiner, dtable, *, stream=0):
    """dtable[:] = 0, then weights[n, l] / divisor[n] * dy[n] added to row ids[n, l] (padding and
    ids >= V skipped)."""
    if dy.shape != (ids.shape[0], dtable.shape[1]) or weights.shape != ids.shape or len(ids.shape) != 2:
        raise ValueError(f"pooled_embedding_backward: ids {ids.shape}, weights {weights.shape}, "
                         f"dy {dy.shape}, dtable {dtable.shape}")
    _launch_elements(fill_kernel, dtable.size, stream, _flat(dtable), float32(0.0))
    count = ids.shape[0] * ids.shape[1] * dtable.shape[1]
    _launch_elements(pooled_backward_kernel, count, stream, ids, weights, dy, combiner, dtable)


def sigmoid_bce_into(logits, y, dlogits, row_loss, loss, *, stream=0):
    """dlogits as `sigmoid_bce`; the mean loss goes to loss[0] on the device (no wait)."""
    n = logits.size
    if y.shape != (n,) or dlogits.shape != logits.shape or row_loss.shape != (n,) or n == 0 \
            or logits.shape not in ((n,), (n, 1)):
        raise ValueError(f"sigmoid_bce: logits {logits.shape}, y {y.shape}, "
                         f"dlogits {dlogits.shape}, row_loss {row_loss.shape}")
    # One thread per row, ROW_THREADS rows per block.
    sigmoid_bce_rows[_blocks(n, ROW_THREADS), ROW_THREADS, stream](_flat(logits), y, _flat(dlogits),
                                                                  row_loss)
    scaled_sum(row_loss, 1.0 / n, loss, stream=stream)


def sigmoid_bce(logits, y, dlogits, row_loss=None, *, stream=0):
    """Mean binary cross-entropy from logits; dlogits[:] = (sigmoid(logits) - y) / n; each
    row's term into the host array row_loss when given. Waits."""
    return _loss_now(sigmoid_bce_into, logits, y, dlogits, stream, row_loss)
