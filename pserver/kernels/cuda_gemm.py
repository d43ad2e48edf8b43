"""Register-blocked products whose operands are read where they lie: the convolutions as
implicit GEMM (no im2col matrix in global memory) and the plain product's newer variants.

One skeleton (`_gemm`) computes a bm x bn tile of C per block of 16 x 16 threads, each thread a
(bm / 16) x (bn / 16) block of it in registers, stepping along the reduction in strips bk deep
that sit in shared memory (as `pserver.kernels.cuda`'s blocked product). What differs between
the products is where an element of op(A) or op(B) comes from. An operand is a pair of device
functions, chosen per product:

    prep(info, X, geo, w0, k0, t)             once per block, k0 its first strip: what thread t
                                              can work out before the loop (the pixels its rows
                                              stand for), in `info`
    load(regs, X, info, geo, k0, kend, w0, t) thread t's share of the strip at k0 into `regs`:
                                              element s of it is e = t + 256 s of the strip,
                                              0 outside the operand or past kend; called once
                                              per strip, in order (it may move `info` along)

With `kfast` an operand's strip is walked along the reduction first (consecutive threads read
consecutive k: right when k is the contiguous index in memory, as a channel is in NHWC),
otherwise along its rows or columns. The convolutions are then three products on NHWC arrays
(x (N,H,W,C), w (KH,KW,C,F), y (N,OH,OW,F); a pixel p = (n, oh, ow); a tap k = (ki, kj, c)):

    forward       y[p, f]   = sum_k  x[n, oh*sh - pt + ki, ow*sw - pl + kj, c] * w[k, f]
    input grad    dx[q, c]  = sum_(ki,kj,f) dy[n, (h + pt - ki) / sh, (w + pl - kj) / sw, f]
                                * w[ki, kj, c, f]   (q = (n, h, w); terms whose division is
                                not exact, or that fall outside dy, are 0)
    weight grad   dw[k, f]  = sum_p  x[.. as forward ..] * dy[p, f], and db[f] = sum_p dy[p, f]
                              as one more row of A, all ones

The weight gradient reduces over every pixel of the batch (43,264 at batch 256 for 13 x 13
images) into a small matrix (289 x 64): its blocks split the pixels (`blockIdx.z`), each writes
its partial tile to a workspace, and a second kernel adds the slices in a fixed order (so the
sum's order, and its value, does not depend on scheduling: no atomics).

`geo` is one tuple of 12 int64 for all three: (H, W, C, OH, OW, F, KH, KW, sh, sw, pt, pl).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

THREADS = 16                  # threads along each side of a block
NT = THREADS * THREADS        # 256 threads per block


@cuda.jit(device=True)
def _divmod(a, b):
    """(a // b, a % b) for 0 <= a, 0 < b below 2**32: unsigned 32-bit division (div.u32; a
    64-bit or signed one is a longer subroutine, and these run in the loops' index arithmetic)."""
    a32, b32 = uint32(a), uint32(b)
    q = a32 // b32
    # Back to signed: callers subtract paddings from these (and the simulator, which runs this
    # as NumPy, would wrap a negative uint32 around).
    return int32(q), int32(a32 - q * b32)


STRIDED, CONTIG, WARP = 0, 1, 2     # where a thread's rows and columns of the tile lie


def _layout(kind: int, tm: int, tn: int):
    """(row, col): row(ty, tx, i) and col(ty, tx, j), thread (ty, tx)'s i-th row and j-th
    column of the tile. STRIDED: every 16th; CONTIG: runs of 4, 64 apart (the 16 threads' runs
    side by side, as pserver.kernels.cuda._owned); WARP: each warp (2 rows of the 16 x 16
    threads) owns a 4tm x 8tn block of the tile (32 x 64 for 128 x 128), its 32 lanes as 4 x 8
    threads with runs of 4, 16 (rows) and 32 (columns) apart: a 128-bit shared load of A then
    touches 4 runs and one of B 8 (one pass of the banks each), against 2 and 16 in CONTIG.
    (Worked out where used, from ty and tx: offsets kept from the start in 64-bit registers
    made g128k8cr2 spill 148 bytes instead of 20.)"""
    if kind == WARP:
        # Thread t = 16 ty + tx is lane (ty & 1) * 16 + tx of warp ty >> 1. In uint32: the
        # compiler then knows the offsets are not negative (no wraparound select per row,
        # which split the 128-bit shared loads: seen in the PTX).
        @cuda.jit(device=True)
        def row(ty, tx, i):
            y, x = uint32(ty), uint32(tx)
            return (y >> 2) * (4 * tm) + ((y & 1) * 2 + (x >> 3)) * 4 + (i // 4) * 16 + i % 4

        @cuda.jit(device=True)
        def col(ty, tx, j):
            y, x = uint32(ty), uint32(tx)
            return ((y >> 1) & 1) * (8 * tn) + (x & 7) * 4 + (j // 4) * 32 + j % 4
    elif kind == CONTIG:
        @cuda.jit(device=True)
        def row(ty, tx, i):
            return (i // 4) * (4 * THREADS) + ty * 4 + i % 4

        @cuda.jit(device=True)
        def col(ty, tx, j):
            return (j // 4) * (4 * THREADS) + tx * 4 + j % 4
    else:
        @cuda.jit(device=True)
        def row(ty, tx, i):
            return ty + i * THREADS

        @cuda.jit(device=True)
        def col(ty, tx, j):
            return tx + j * THREADS
    return row, col


def _pos(width: int, bk: int, kfast: bool):
    """pos(e) -> (k, w): where element e of a strip (`width` by bk) goes in shared memory."""

    @cuda.jit(device=True)
    def pos(e):
        return (e % bk, e // bk) if kfast else (e // width, e % width)

    return pos


@cuda.jit(device=True)
def _no_prep(info, X, geo, w0, k0, t):
    pass


# -- operands: the plain product -----------------------------------------------------------------

def plain_a(trans: bool):
    """op(A) = A (M x K, K contiguous: walked along k) or A.T (A stored K x M)."""

    def make(width, bk):
        loads = width * bk // NT

        @cuda.jit(device=True)
        def load(regs, A, info, geo, k0, kend, w0, t):
            for s in range(loads):
                e = t + s * NT
                if trans:
                    k, m = k0 + e // width, w0 + e % width
                    regs[s] = A[k, m] if k < kend and m < A.shape[1] else float32(0.0)
                else:
                    k, m = k0 + e % bk, w0 + e // bk
                    regs[s] = A[m, k] if k < kend and m < A.shape[0] else float32(0.0)

        return _no_prep, load, not trans

    return make


def plain_b(trans: bool):
    """op(B) = B (K x N, walked along n) or B.T (B stored N x K, walked along k)."""

    def make(width, bk):
        loads = width * bk // NT

        @cuda.jit(device=True)
        def load(regs, B, info, geo, k0, kend, w0, t):
            for s in range(loads):
                e = t + s * NT
                if trans:
                    k, n = k0 + e % bk, w0 + e // bk
                    regs[s] = B[n, k] if k < kend and n < B.shape[0] else float32(0.0)
                else:
                    k, n = k0 + e // width, w0 + e % width
                    regs[s] = B[k, n] if k < kend and n < B.shape[1] else float32(0.0)

        return _no_prep, load, trans

    return make


# -- operands: the convolutions ------------------------------------------------------------------

def conv_patches(width, bk):
    """A of the forward: row p (an output pixel), column k = (ki, kj, c), from x (N,H,W,C).
    Each thread's rows are fixed for the whole loop: their pixels are decoded once (prep)."""
    loads = width * bk // NT
    step = NT // bk

    @cuda.jit(device=True)
    def prep(info, x, geo, w0, k0, t):
        ohw, ow_n = geo[3] * geo[4], geo[4]
        for s in range(loads):
            m = w0 + t // bk + s * step
            info[s, 0] = -1
            if m < x.shape[0] * ohw:
                n, r = _divmod(m, ohw)
                oh, ow = _divmod(r, ow_n)
                info[s, 0] = n
                info[s, 1] = oh * geo[8] - geo[10]
                info[s, 2] = ow * geo[9] - geo[11]

    @cuda.jit(device=True)
    def load(regs, x, info, geo, k0, kend, w0, t):
        k = k0 + t % bk
        tap, c = _divmod(k, x.shape[3])
        ki, kj = _divmod(tap, geo[7])
        for s in range(loads):
            n, ih, iw = info[s, 0], info[s, 1] + ki, info[s, 2] + kj
            ok = k < kend and n >= 0 and 0 <= ih < x.shape[1] and 0 <= iw < x.shape[2]
            regs[s] = x[n, ih, iw, c] if ok else float32(0.0)

    return prep, load, True


def conv_windows(width, bk):
    """A of the input gradient: row q (an input pixel), column (ki, kj, f), from dy."""
    loads = width * bk // NT
    step = NT // bk

    @cuda.jit(device=True)
    def prep(info, dy, geo, w0, k0, t):
        hw, w_n = geo[0] * geo[1], geo[1]
        for s in range(loads):
            m = w0 + t // bk + s * step
            info[s, 0] = -1
            if m < dy.shape[0] * hw:
                n, r = _divmod(m, hw)
                h, w = _divmod(r, w_n)
                info[s, 0] = n
                info[s, 1] = h + geo[10]
                info[s, 2] = w + geo[11]

    @cuda.jit(device=True)
    def load(regs, dy, info, geo, k0, kend, w0, t):
        k = k0 + t % bk
        tap, f = _divmod(k, dy.shape[3])
        ki, kj = _divmod(tap, geo[7])
        sh, sw = geo[8], geo[9]
        for s in range(loads):
            n, a, b = info[s, 0], info[s, 1] - ki, info[s, 2] - kj
            ok = k < kend and n >= 0 and a >= 0 and b >= 0
            if sh != 1 or sw != 1:       # a window reads pixel q only where the stride lands
                ok = ok and a % sh == 0 and b % sw == 0
                a, b = a // sh, b // sw
            ok = ok and a < dy.shape[1] and b < dy.shape[2]
            regs[s] = dy[n, a, b, f] if ok else float32(0.0)

    return prep, load, True


def conv_filters_t(width, bk):
    """B of the input gradient: row (ki, kj, f), column c, from w viewed as (KH*KW, C, F)."""
    loads = width * bk // NT
    step = NT // bk

    @cuda.jit(device=True)
    def load(regs, w3, info, geo, k0, kend, w0, t):
        k = k0 + t % bk
        tap, f = _divmod(k, w3.shape[2])
        for s in range(loads):
            c = w0 + t // bk + s * step
            regs[s] = w3[tap, c, f] if k < kend and c < w3.shape[1] else float32(0.0)

    return _no_prep, load, True


def conv_patches_t(width, bk):
    """A of the weight gradient: row k = (ki, kj, c) (row KH*KW*C: all ones, for the bias),
    column p (an output pixel), from x. Each thread's row is fixed (decoded once, into the
    spare row of `info`); its pixels are decoded once too, then moved along by bk per strip
    with a carry instead of a division per element and strip (the reduction runs over
    pixels here: two divisions per element were as many instructions as the multiply-adds)."""
    loads = width * bk // NT
    step = NT // width

    @cuda.jit(device=True)
    def prep(info, x, geo, w0, k0, t):
        m = w0 + t % width
        taps = geo[6] * geo[7] * x.shape[3]
        info[loads, 0] = 0 if m < taps else (1 if m == taps else -1)
        tap, c = _divmod(min(m, taps - 1), x.shape[3])
        ki, kj = _divmod(tap, geo[7])
        info[loads, 1] = ki - geo[10]
        info[loads, 2] = kj - geo[11]
        info[loads, 3] = c
        for s in range(loads):
            n, r = _divmod(k0 + t // width + s * step, geo[3] * geo[4])
            oh, ow = _divmod(r, geo[4])
            info[s, 0], info[s, 1], info[s, 2] = n, oh, ow

    @cuda.jit(device=True)
    def load(regs, x, info, geo, k0, kend, w0, t):
        kind, di, dj, c = info[loads, 0], info[loads, 1], info[loads, 2], info[loads, 3]
        oh_n, ow_n = geo[3], geo[4]
        for s in range(loads):
            n, oh, ow = info[s, 0], info[s, 1], info[s, 2]
            v = float32(0.0)
            if k0 + t // width + s * step < kend:
                if kind == 1:
                    v = float32(1.0)
                elif kind == 0:
                    ih, iw = oh * geo[8] + di, ow * geo[9] + dj
                    if 0 <= ih < x.shape[1] and 0 <= iw < x.shape[2]:
                        v = x[n, ih, iw, c]
            regs[s] = v
            # This element's pixel in the next strip: bk further along (n, oh, ow).
            ow += bk
            while ow >= ow_n:
                ow -= ow_n
                oh += 1
            while oh >= oh_n:
                oh -= oh_n
                n += 1
            info[s, 0], info[s, 1], info[s, 2] = n, oh, ow

    return prep, load, False


# -- the skeleton --------------------------------------------------------------------------------

PLAIN, BIAS, SPLIT = 0, 1, 2      # epilogues: C[r, c] = acc; + bias, ReLU; C[z, r, c] = acc


def _gemm(bm, bn, bk, a_op, b_op, epilogue, dbuf=False, contig=False, bounds=None, warp=False):
    """A kernel (X, Y, C, bias, geo, relu, kred, kspan): C = op(A) @ op(B) over the reduction
    [z * kspan, min(kred, (z + 1) * kspan)) for block z of the grid's third axis.

    With `dbuf`, two shared strips: the next strip goes into the other one while this one is
    read, one barrier per strip instead of two. Either way each thread loads its share of the
    next strip into registers before it computes on the current one (the loads in flight
    during the multiply-adds). `contig`: runs of 4 rows and columns per thread, read with
    128-bit shared loads; `warp` (with contig): those runs placed per warp (_layout's WARP).
    `bounds`: (threads, blocks per multiprocessor) for the compiler's register budget."""
    tm, tn = bm // THREADS, bn // THREADS
    al, bl = bm * bk // NT, bn * bk // NT
    if min(al, bl) < 1 or NT % bk or (contig and (tm % 4 or tn % 4)):
        raise ValueError(f"no such blocked product: {bm} x {bn} x {bk}, contig={contig}")
    row_of, col_of = _layout((WARP if warp else CONTIG) if contig else STRIDED, tm, tn)
    a_prep, a_load, a_kfast = a_op(bm, bk)
    b_prep, b_load, b_kfast = b_op(bn, bk)
    a_pos, b_pos = _pos(bm, bk, a_kfast), _pos(bn, bk, b_kfast)
    nbuf = 2 if dbuf else 1
    a_info, b_info = al + 1, bl + 1     # a row per element of the strip, and a spare: conv_patches_t
    a_rows, b_rows = bm + 4, bn + 4     # +4: a warp's stores of a k-walked strip spread over banks

    @cuda.jit(device=True)
    def stash(sA, sB, buf, ra, rb, t):
        for s in range(al):
            k, m = a_pos(t + s * NT)
            sA[buf, k, m] = ra[s]
        for s in range(bl):
            k, n = b_pos(t + s * NT)
            sB[buf, k, n] = rb[s]

    @cuda.jit(device=True)
    def compute(sA, sB, buf, acc, a, b, ty, tx):
        for k in range(bk):
            for i in range(tm):
                a[i] = sA[buf, k, row_of(ty, tx, i)]
            for j in range(tn):
                b[j] = sB[buf, k, col_of(ty, tx, j)]
            for i in range(tm):
                for j in range(tn):
                    acc[i, j] += a[i] * b[j]

    # The epilogue is chosen here, not by a branch in the kernel: each form indexes C (and
    # bias) in a way that would not compile for the others' arrays.
    @cuda.jit(device=True)
    def put(C, v, bias, relu, row, col, z):
        C[row, col] = v

    @cuda.jit(device=True)
    def put_bias(C, v, bias, relu, row, col, z):
        v += bias[col]
        C[row, col] = float32(0.0) if relu and v < 0 else v      # `v < 0` keeps NaN

    @cuda.jit(device=True)
    def put_split(C, v, bias, relu, row, col, z):
        C[z, row, col] = v

    put_one = {PLAIN: put, BIAS: put_bias, SPLIT: put_split}[epilogue]

    @cuda.jit(device=True)
    def store(C, acc, bias, relu, r0, c0, z, ty, tx):
        rows, cols = C.shape[C.ndim - 2], C.shape[C.ndim - 1]
        for i in range(tm):
            row = r0 + row_of(ty, tx, i)
            if row < rows:
                for j in range(tn):
                    col = c0 + col_of(ty, tx, j)
                    if col < cols:
                        put_one(C, acc[i, j], bias, relu, row, col, z)

    @cuda.jit(device=True)
    def stage(X, Y, ia, ib, geo, sA, sB, buf, acc, a, b, ra, rb, k0, kend, r0, c0, t, ty, tx):
        """One strip of the double-buffered loop: read shared strip `buf` while the next strip
        comes in from global memory, then put that into the other one."""
        more = k0 + bk < kend
        if more:
            a_load(ra, X, ia, geo, k0 + bk, kend, r0, t)
            b_load(rb, Y, ib, geo, k0 + bk, kend, c0, t)
        compute(sA, sB, buf, acc, a, b, ty, tx)
        if more:
            # The other strip was last read before the previous barrier: free to fill.
            stash(sA, sB, 1 - buf, ra, rb, t)
        # This strip read by all, and the next one written, before either changes role.
        cuda.syncthreads()

    def kernel(X, Y, C, bias, geo, relu, kred, kspan):
        sA = cuda.shared.array((nbuf, bk, a_rows), float32, alignment=16)
        sB = cuda.shared.array((nbuf, bk, b_rows), float32, alignment=16)
        acc = cuda.local.array((tm, tn), float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        ra = cuda.local.array(al, float32)
        rb = cuda.local.array(bl, float32)
        ia = cuda.local.array((a_info, 4), int32)
        ib = cuda.local.array((b_info, 4), int32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        t = ty * THREADS + tx
        # Row tiles along x (up to 2**31 - 1 blocks: a large batch's pixels), columns along y.
        r0, c0, z = cuda.blockIdx.x * bm, cuda.blockIdx.y * bn, cuda.blockIdx.z
        kbeg = z * kspan
        kend = min(kred, kbeg + kspan)
        for i in range(tm):
            for j in range(tn):
                acc[i, j] = float32(0.0)
        a_prep(ia, X, geo, r0, kbeg, t)
        b_prep(ib, Y, geo, c0, kbeg, t)
        a_load(ra, X, ia, geo, kbeg, kend, r0, t)
        b_load(rb, Y, ib, geo, kbeg, kend, c0, t)
        if dbuf:
            stash(sA, sB, 0, ra, rb, t)
            # Strip 0 complete before any thread reads it.
            cuda.syncthreads()
            # Two strips per turn, so that each names its shared strip by a constant: with a
            # run-time index the compiler could not prove the 16-byte alignment of the
            # `contig` runs and split their 128-bit loads (seen in the PTX).
            for k0 in range(kbeg, kend, 2 * bk):
                stage(X, Y, ia, ib, geo, sA, sB, 0, acc, a, b, ra, rb, k0, kend, r0, c0, t, ty, tx)
                if k0 + bk < kend:
                    stage(X, Y, ia, ib, geo, sA, sB, 1, acc, a, b, ra, rb, k0 + bk, kend, r0, c0, t,
                          ty, tx)
        else:
            for k0 in range(kbeg, kend, bk):
                stash(sA, sB, 0, ra, rb, t)
                # The strip complete before any thread reads it.
                cuda.syncthreads()
                if k0 + bk < kend:
                    a_load(ra, X, ia, geo, k0 + bk, kend, r0, t)
                    b_load(rb, Y, ib, geo, k0 + bk, kend, c0, t)
                compute(sA, sB, 0, acc, a, b, ty, tx)
                # Every thread done reading before the next strip overwrites it.
                cuda.syncthreads()
        store(C, acc, bias, relu, r0, c0, z, ty, tx)

    if bounds and not cuda.config.ENABLE_CUDASIM:     # the simulator takes no launch bounds
        return cuda.jit(launch_bounds=bounds)(kernel)
    return cuda.jit(kernel)


@cuda.jit
def split_sum_kernel(ws, dw, db):
    """dw[r, c] (r < rows of dw) or db[c] (the last row) = ws[:, r, c] summed in slice order."""
    c, r = cuda.grid(2)
    if r >= ws.shape[1] or c >= ws.shape[2]:
        return
    acc = float32(0.0)
    for z in range(ws.shape[0]):
        acc += ws[z, r, c]
    if r < dw.shape[0]:
        dw[r, c] = acc
    else:
        db[c] = acc


@cuda.jit
def slice_sum_kernel(ws, C):
    """C[r, c] = ws[:, r, c] summed in slice order (the split-K product's second kernel)."""
    c, r = cuda.grid(2)
    if r >= C.shape[0] or c >= C.shape[1]:
        return
    acc = ws[0, r, c]
    for z in range(1, ws.shape[0]):
        acc += ws[z, r, c]
    C[r, c] = acc


# -- variants ------------------------------------------------------------------------------------

class Variant:
    """One shape of the skeleton (tile bm x bn, strips bk deep, options), compiled per product
    on first use. `bn` None: 32 where the product has at most 32 columns (the 32-filter layer,
    the input gradient of 32 channels), else 64. `warp`: runs of 4 placed per warp (with
    contig). `splitk` (plain products only): the reduction split over that many blocks per
    tile, each writing its slice to a workspace that a second kernel sums in order; "auto":
    as many slices (up to 4) as fill `per_sm` blocks per multiprocessor where the tiles do not."""

    def __init__(self, bm, bk, bn=None, dbuf=False, contig=False, bounds=None, warp=False, splitk=1,
                 per_sm=2):
        self.bm, self.bk, self.bn, self.dbuf, self.contig, self.bounds = bm, bk, bn, dbuf, contig, bounds
        self.warp, self.splitk, self.per_sm = warp, splitk, per_sm
        self._kernels: dict = {}

    def splits(self, tiles: int, k: int) -> int:
        """The product's slices of the reduction: splitk, or auto's choice; at least 8 strips each."""
        want = self.splitk
        if want == "auto":
            want = max(1, min(4, (_multiprocessors() * self.per_sm) // max(tiles, 1)))
        return max(1, min(int(want), k // (8 * self.bk)))

    def width(self, cols: int) -> int:
        return self.bn or (32 if cols <= 32 else 64)

    def kernel(self, a_op, b_op, epilogue, bn: int):
        key = (a_op, b_op, epilogue, bn)
        if key not in self._kernels:
            self._kernels[key] = _gemm(self.bm, bn, self.bk, a_op, b_op, epilogue, self.dbuf,
                                       self.contig and bn % 64 == 0, self.bounds,
                                       self.warp and self.contig and bn % 64 == 0)
        return self._kernels[key]


# Names: g<bm>[x<bn>]k<bk>, d: two shared strips, c: runs of 4 per thread, r2: at most 128
# registers (launch bounds of 256 threads, 2 blocks per multiprocessor).
VARIANTS = {
    "g64k16": Variant(64, 16),
    "g64k16d": Variant(64, 16, dbuf=True),
    "g64k8d": Variant(64, 8, dbuf=True),
    "g128k8d": Variant(128, 8, dbuf=True),
    "g64k16dc": Variant(64, 16, 64, dbuf=True, contig=True),
    "g128k8dc": Variant(128, 8, 128, dbuf=True, contig=True),
    "g128k16dc": Variant(128, 16, 128, dbuf=True, contig=True),
    "g128k8dcr2": Variant(128, 8, 128, dbuf=True, contig=True, bounds=(NT, 2)),
    "g128x64k16dc": Variant(128, 16, 64, dbuf=True, contig=True),
    "g128x64k8dc": Variant(128, 8, 64, dbuf=True, contig=True),
    # After run-7's first sweep: register caps for more blocks per multiprocessor (r2 won at
    # 4096), and single-buffered tiles (the 64 one won the convolutions) with runs of 4. ptxas
    # (sm_90) spills 4-24 bytes of the capped products, 24-208 of their convolutions; the caps
    # r2 on g128k16dc and r3 on g64k16 spilled 150-650 bytes and were not kept.
    "g128k8cr2": Variant(128, 8, 128, contig=True, bounds=(NT, 2)),
    "g128x64k8dcr3": Variant(128, 8, 64, dbuf=True, contig=True, bounds=(NT, 3)),
    "g64k16dcr3": Variant(64, 16, 64, dbuf=True, contig=True, bounds=(NT, 3)),
    "g64k16c": Variant(64, 16, 64, contig=True),
    "g128x64k8c": Variant(128, 8, 64, contig=True),
    # Issue 36's second round (run 8). w: runs of 4 placed per warp (each warp a 32 x 64 block
    # of the 128 x 128 tile, 32 x 32 of the 128 x 64 one); s<n>: split-K into n slices (sa: as
    # many as fill 2 blocks per multiprocessor, up to 4) for products whose tiles leave
    # multiprocessors idle (64 tiles of 128 at n = 1024 on 132); r2 on the 128 x 64 tile, whose
    # input gradient took 128-130 registers (1 block per multiprocessor) without it. ptxas
    # (sm_90, CUDA 13.0) spills 16-108 bytes of the capped 128 x 128 tiles (as g128k8cr2: 20-96),
    # none of the 128 x 64 k8 ones, 0-64 of g128x64k16cwr2. (w on the 64 x 64 tile lost its
    # 128-bit shared loads, and the 128 x 64 k16 tile without a cap took 140-174 registers: not kept.)
    "g128k8cwr2": Variant(128, 8, 128, contig=True, bounds=(NT, 2), warp=True),
    "g128k8dcwr2": Variant(128, 8, 128, dbuf=True, contig=True, bounds=(NT, 2), warp=True),
    "g128x64k8cw": Variant(128, 8, 64, contig=True, warp=True),
    "g128x64k8cr2": Variant(128, 8, 64, contig=True, bounds=(NT, 2)),
    "g128x64k8cwr2": Variant(128, 8, 64, contig=True, bounds=(NT, 2), warp=True),
    "g128x64k16cwr2": Variant(128, 16, 64, contig=True, bounds=(NT, 2), warp=True),
    "g128k8cr2s2": Variant(128, 8, 128, contig=True, bounds=(NT, 2), splitk=2),
    "g128k8cr2s4": Variant(128, 8, 128, contig=True, bounds=(NT, 2), splitk=4),
    "g128k8cr2sa": Variant(128, 8, 128, contig=True, bounds=(NT, 2), splitk="auto"),
    "g128k8cwr2s4": Variant(128, 8, 128, contig=True, bounds=(NT, 2), warp=True, splitk=4),
    "g128k8cwr2sa": Variant(128, 8, 128, contig=True, bounds=(NT, 2), warp=True, splitk="auto"),
    "g128x64k8cs2": Variant(128, 8, 64, contig=True, splitk=2),
    "g128x64k8cws2": Variant(128, 8, 64, contig=True, warp=True, splitk=2),
    "g64k16cs2": Variant(64, 16, 64, contig=True, splitk=2),
}
# The convolutions' variant when none is named (bench/results/gpu/run-7, H100: g128x64k8c, 0.43x
# and 0.26x cuDNN at the reference CNN's second-layer shape and at 3x3 64 -> 64). A weight
# gradient with at most 64 rows (KH*KW*C + 1: a few input channels, as the first layer's 10)
# takes WGRAD_SMALL instead, whose tile wastes fewer of them (0.189 against 0.251 ms there).
# Run 8 (H100): g128x64k16cwr2 for all three parts, 2.983 ms at 3x3 64 -> 64 against g128x64k8c's
# 3.278 (0.28x and 0.26x cuDNN: the weight gradient 1.115 against 1.369), 0.586 against 0.584 at
# conv2 (the same within 0.4%).
CONV_DEFAULT = "g128x64k16cwr2"
WGRAD_DEFAULT = "g128x64k16cwr2"
WGRAD_SMALL = "g64k16"

_PLAIN_A = {False: plain_a(False), True: plain_a(True)}
_PLAIN_B = {False: plain_b(False), True: plain_b(True)}
_NO_GEO = (0,) * 12


def _blocks(n: int, per: int) -> int:
    return (n + per - 1) // per


def _multiprocessors() -> int:
    """The current device's multiprocessor count (the simulator: an H100's 132), read once."""
    if not _SMS:
        _SMS.append(132 if cuda.config.ENABLE_CUDASIM
                    else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SMS[0]


_SMS: list[int] = []


def matmul(A, B, C, trans_a=False, trans_b=False, variant="g128k8dc", *, splits=None, stream=0):
    """C[:] = op(A) @ op(B) with a named variant; shapes as pserver.kernels.cuda.matmul.
    `splits`: slices of the reduction (default the variant's; the tests ask for ragged ones)."""
    M, K = (A.shape[1], A.shape[0]) if trans_a else A.shape
    K2, N = (B.shape[1], B.shape[0]) if trans_b else B.shape
    if K != K2 or C.shape != (M, N):
        raise ValueError(f"matmul: op(A) is {(M, K)}, op(B) is {(K2, N)}, C is {C.shape}")
    if not (M and N):
        return
    v = VARIANTS[variant]
    bn = v.width(N)
    ops = _PLAIN_A[bool(trans_a)], _PLAIN_B[bool(trans_b)]
    grid = (_blocks(M, v.bm), _blocks(N, bn))
    splits = splits or v.splits(grid[0] * grid[1], K)
    span = _blocks(_blocks(K, splits), v.bk) * v.bk       # whole strips per slice
    splits = max(1, _blocks(K, span)) if K else 1
    if splits == 1:
        v.kernel(*ops, PLAIN, bn)[(*grid, 1), (THREADS, THREADS), stream](
            A, B, C, C, _NO_GEO, False, K, max(K, 1))
        return
    ws = _workspace((splits, M, N), stream)
    v.kernel(*ops, SPLIT, bn)[(*grid, splits), (THREADS, THREADS), stream](
        A, B, ws, C, _NO_GEO, False, K, span)
    slice_sum_kernel[(_blocks(N, 32), _blocks(M, 8)), (32, 8), stream](ws, C)


def dense_forward(x, W, b, out, relu, variant, *, stream=0):
    """out[:] = x @ W + b, then ReLU if `relu`, with a named variant (shapes checked by the caller)."""
    v = VARIANTS[variant]
    (n, o), k = out.shape, x.shape[1]
    bn = v.width(o)
    kern = v.kernel(_PLAIN_A[False], _PLAIN_B[False], BIAS, bn)
    if n and o:
        kern[(_blocks(n, v.bm), _blocks(o, bn), 1), (THREADS, THREADS), stream](
            x, W, out, b, _NO_GEO, bool(relu), k, max(k, 1))


def _conv_variant(variant, part: str):
    """The variant a convolution's part takes: `variant` names one for all three, or "X+Y": X
    for the forward and input gradient, Y for the weight gradient; None: the defaults."""
    if variant and "+" in variant:
        main, wgrad = variant.split("+", 1)
        return wgrad if part == "wgrad" else main
    return variant


def geometry(x_shape, w_shape, y_shape, stride_h, stride_w, pad_top, pad_left) -> tuple:
    """The kernels' `geo`: (H, W, C, OH, OW, F, KH, KW, sh, sw, pt, pl), as Python ints."""
    _, h, w, c = x_shape
    kh, kw, _, f = w_shape
    return tuple(int(v) for v in (h, w, c, y_shape[1], y_shape[2], f, kh, kw, stride_h, stride_w,
                                  pad_top, pad_left))


def conv2d_forward(x, w, b, out, stride_h, stride_w, pad_top, pad_left, relu, variant=None, *,
                   stream=0):
    """out[:] = conv(x, w) + b, then ReLU if `relu` (shapes checked by the caller)."""
    v = VARIANTS[_conv_variant(variant, "forward") or CONV_DEFAULT]
    geo = geometry(x.shape, w.shape, out.shape, stride_h, stride_w, pad_top, pad_left)
    kh, kw, c, f = w.shape
    P, K = out.size // f, kh * kw * c
    if not (P and f):
        return
    bn = v.width(f)
    kern = v.kernel(conv_patches, _PLAIN_B[False], BIAS, bn)
    kern[(_blocks(P, v.bm), _blocks(f, bn), 1), (THREADS, THREADS), stream](
        x, w.reshape(K, f), out.reshape(P, f), b, geo, bool(relu), K, max(K, 1))


def conv2d_input_grad(w, dy, dx, stride_h, stride_w, pad_top, pad_left, variant=None, *, stream=0):
    """dx[:] = d loss / d x from dy (shapes checked by the caller)."""
    v = VARIANTS[_conv_variant(variant, "input") or CONV_DEFAULT]
    geo = geometry(dx.shape, w.shape, dy.shape, stride_h, stride_w, pad_top, pad_left)
    kh, kw, c, f = w.shape
    Q, K = dx.size // c if c else 0, kh * kw * f
    if not (Q and c):
        return
    bn = v.width(c)
    kern = v.kernel(conv_windows, conv_filters_t, PLAIN, bn)
    kern[(_blocks(Q, v.bm), _blocks(c, bn), 1), (THREADS, THREADS), stream](
        dy, w.reshape(kh * kw, c, f), dx.reshape(Q, c), dx, geo, False, K, max(K, 1))


# Blocks the weight gradient aims for: enough waves over 132 multiprocessors (H100, H200) to
# keep each busy, few enough that the slices' sum stays small next to the product.
WGRAD_BLOCKS = 4 * 132
_WORKSPACES: dict = {}


def splits_for(tiles: int, pixels: int, bk: int) -> int:
    """How many slices of the pixels the weight gradient's blocks take: WGRAD_BLOCKS over the
    tiles, at most one per 8 strips of pixels (so that each block has a loop to pipeline)."""
    return max(1, min(_blocks(WGRAD_BLOCKS, max(tiles, 1)), pixels // (8 * bk)))


def _workspace(shape, stream):
    """A float32 device array of `shape`, reused by the launches on this stream (the stream
    orders them, so a reuse never overlaps the last use); kept with its stream, with its views
    by shape (slicing a device array costs host time on every call)."""
    key = id(stream) if stream else 0
    have = _WORKSPACES.get(key)
    size = int(np.prod(shape))
    if have is None or have[1].size < size:
        have = (stream, cuda.device_array(max(size, 1), np.float32, stream=stream), {})
        _WORKSPACES[key] = have
    view = have[2].get(shape)
    if view is None:
        if len(have[2]) >= 64:        # a few shapes per worker; never an unbounded map
            have[2].clear()
        view = have[2][shape] = have[1][:size].reshape(shape)
    return view


def workspaces() -> list:
    """The device arrays _workspace holds now (a step graph keeps them: it holds their address
    after a larger one replaces them here)."""
    return [have[1] for have in _WORKSPACES.values()]


def conv2d_weight_grad(x, dy, dw, db, stride_h, stride_w, pad_top, pad_left, variant=None, *,
                       splits=None, stream=0):
    """dw[:] and db[:] from x and dy (shapes checked by the caller); `splits`: slices of the
    pixels (default splits_for's choice; the tests ask for ragged ones)."""
    kh, kw, c, f = dw.shape
    taps = kh * kw * c
    v = VARIANTS[_conv_variant(variant, "wgrad") or (WGRAD_SMALL if taps + 1 <= 64 else WGRAD_DEFAULT)]
    geo = geometry(x.shape, dw.shape, dy.shape, stride_h, stride_w, pad_top, pad_left)
    P = dy.size // f if f else 0
    if not f:
        return
    bn = v.width(f)
    tiles = _blocks(taps + 1, v.bm) * _blocks(f, bn)
    splits = splits or splits_for(tiles, P, v.bk)
    span = _blocks(_blocks(P, splits), v.bk) * v.bk      # a whole number of strips per slice
    splits = max(1, _blocks(P, span))
    ws = _workspace((splits, taps + 1, f), stream)
    kern = v.kernel(conv_patches_t, _PLAIN_B[False], SPLIT, bn)
    kern[(_blocks(taps + 1, v.bm), _blocks(f, bn), splits), (THREADS, THREADS), stream](
        x, dy.reshape(max(P, 1), f) if P else dy.reshape(0, f), ws, db, geo, False, P, max(span, 1))
    # One thread per element of dw and db: 32 columns by 8 rows per block.
    split_sum_kernel[(_blocks(f, 32), _blocks(taps + 1, 8)), (32, 8), stream](
        ws, dw.reshape(taps, f), db)


def conv2d_backward(x, w, dy, dx, dw, db, stride_h, stride_w, pad_top, pad_left, variant=None, *,
                    stream=0):
    """dw, db (and dx unless it is None) from dy: pserver.kernels.cuda.conv2d_backward's contract."""
    conv2d_weight_grad(x, dy, dw, db, stride_h, stride_w, pad_top, pad_left, variant, stream=stream)
    if dx is not None:
        conv2d_input_grad(w, dy, dx, stride_h, stride_w, pad_top, pad_left, variant, stream=stream)


__all__ = ["VARIANTS", "CONV_DEFAULT", "WGRAD_DEFAULT", "WGRAD_SMALL", "matmul", "dense_forward",
           "conv2d_forward", "conv2d_backward", "conv2d_input_grad", "conv2d_weight_grad", "geometry",
           "splits_for"]
