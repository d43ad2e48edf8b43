"""Compact rows: a table's rows (and, optionally, its optimizer slots) stored as float16 or bfloat16.

A table with row_dtype float16 or bfloat16 keeps each entry's values as 16-bit words in one
uint16 matrix `data`: the row first (dim words), then each optimizer slot (dim words in the
state type when state_dtype is "row", or 2 dim words holding float32 values, low half first,
when it is "float32"). The optimizer runs in float32 as it does on float32 tables: a push widens
the rows it touches into a float32 scratch matrix (`widen`), steps them there with the row
rule's own kernel, and narrows them back (`narrow`), rounding each value to its column's type
*stochastically*: up with probability (x - lo) / (hi - lo) between its two neighbours lo < x < hi,
so that the stored value is x on average. Round-to-nearest would drop every update smaller than
half a unit in the last place (2**-9 of a bfloat16 row's value): a hot row's late small steps
would all be lost (tests/test_compact_rows.py shows it).

The draw for value c of the row of id `id_` pushed at `step` in the table with key `key`
(hashing.table_key(seed, table)) is splitmix64 of (key, id, step, c): a run repeats bit for bit,
and the NumPy twins (`*_numpy`) give the same bits as the numba kernels. A value above the type's
largest finite one is stored as that (float16: 65504); one below its smallest subnormal rounds
to 0 or to it. Initial rows are rounded to nearest (no step yet): a lookup of an id that is
not stored returns the same value as its row once created.

bfloat16 has no NumPy dtype: its values are uint16 words, the high half of a float32
(`state()` arrays hold them so); float16 values are NumPy float16.

Second moments in float16 are stored as their square roots. A slot that sums or averages squared
gradients (RowRule.second_moments: adagrad's accumulator, adam's v, ftrl's n) is about g^2, 1e-6
for a gradient of 1e-3: below float16's smallest normal value (6.1e-5), where its subnormals keep
a few bits at most (1M criteo-synthetic samples: test AUC 0.0057 below float32's). Its square
root, 1e-3, is well inside float16's normal range and keeps 11 bits. So with state type float16
such a slot holds s = sqrt(G): widen squares it (exactly: 11 bits squared fit float32's 24),
the row rule steps G in float32 as ever, and narrow rounds sqrt(G) stochastically (its rounding
is unbiased in s; s^2 is then biased by the variance, under 2**-20 of G). bfloat16 has float32's
range, and its 8 bits would give G only 7 as a square: its slots stay G. `state()` names such a
slot slot_<name>.sqrt (a checkpoint's columns record it so), and SparseTable.load converts a
slot from either form and any state type into the table's (`convert_slot`): an older checkpoint
(G in float16) loads, and a float32-state table restores G from s^2.

The kernels move values between types as bits and round in float64 (every step exact); the
twins use NumPy's own conversions and array arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from pserver.kernels import reference
from pserver.kernels.cpu import splitmix64 as _draw
from pserver.registry import Registry
from pserver.sparse import index
from pserver.sparse.hashing import initial_row

# Formats: (mantissa bits, smallest normal exponent, exponent bias, 16-bit words per value)
F32, BF16, F16 = 0, 1, 2
ROW_DTYPES = Registry("row type", "--row-dtype")
ROW_DTYPES.add("float32", "4 bytes a value (default)", F32)
ROW_DTYPES.add("float16", "2 bytes: 11 significant bits, values within +-65504 (subnormals below 6e-5)", F16)
ROW_DTYPES.add("bfloat16", "2 bytes: float32's range with 8 significant bits (the high half of a float32)",
               BF16)
STATE_DTYPES = Registry("state type", "--state-dtype")
STATE_DTYPES.add("float32", "the optimizer slots stay float32 (default)")
STATE_DTYPES.add("row", "the optimizer slots in the row's type, rounded stochastically as the rows are "
                 "(float16 keeps those of squared gradients as their square roots)")
FORMATS = np.array([[23, -126, 127, 2], [7, -126, 127, 1], [10, -14, 15, 1]], np.int64)
MAX_FINITE = np.array([float(np.finfo(np.float32).max), 3.3895313892515355e38, 65504.0])
CODE = {"float32": F32, "bfloat16": BF16, "float16": F16}
STORAGE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16)}
ROUND_SALT = np.uint64(0x5EED0F5713C0DE5)   # separates the rounding draws from initial_row's
_ZERO = np.uint64(0)
_TWO_M53 = 2.0 ** -53


def check_dtypes(what: str, row_dtype, state_dtype) -> None:
    """ConfigError, in one line, for a row or state type a table cannot store."""
    ROW_DTYPES.get(row_dtype, f"{what}: row_dtype")
    STATE_DTYPES.get(state_dtype, f"{what}: state_dtype")


class Layout:
    """Where each column (the row, then each slot) of a compact table's entry lies in its words."""

    def __init__(self, dim: int, row_dtype: str, state_dtype: str, slots: int, second_moments=()):
        """`second_moments`: the positions (0-based) of the slots that hold sums or averages of
        squared gradients: stored as square roots in float16 (the module docstring)."""
        self.dim, self.slots = dim, slots
        self.row_dtype = row_dtype
        self.state_dtype = row_dtype if state_dtype == "row" else "float32"
        self.row_fmt, self.state_fmt = CODE[self.row_dtype], CODE[self.state_dtype]
        self.compact = row_dtype != "float32"
        self.row_words = dim * int(FORMATS[self.row_fmt, 3])
        self.state_words = dim * int(FORMATS[self.state_fmt, 3])
        self.words = self.row_words + slots * self.state_words
        self.roots = np.array([self.state_fmt == F16 and s in second_moments for s in range(slots)],
                              np.bool_)   # slot s holds sqrt(G)

    def bytes_per_row(self) -> int:
        """Bytes of one entry's values (the row and its slots)."""
        return 2 * self.words if self.compact else 4 * self.dim * (1 + self.slots)

    def unpack(self, words: np.ndarray) -> list[np.ndarray]:
        """An (n, words) uint16 matrix as its columns, each a contiguous copy in its storage type."""
        out = [np.ascontiguousarray(words[:, :self.row_words]).view(STORAGE[self.row_dtype])]
        for s in range(self.slots):
            at = self.row_words + s * self.state_words
            block = np.ascontiguousarray(words[:, at:at + self.state_words])
            out.append(block.view(STORAGE[self.state_dtype]))
        return out


def pack(columns: list[np.ndarray]) -> np.ndarray:
    """Columns (each (n, dim) in its storage type) side by side as one (n, words) uint16 matrix."""
    n = columns[0].shape[0]
    return np.concatenate([np.ascontiguousarray(c).view(np.uint16).reshape(n, -1) for c in columns], axis=1)


# -- scalar codecs (numba) -----------------------------------------------------------------------
# Values cross between types as bits (work arrays are read and written through uint32 views):
# every conversion here is exact; only _round chooses, in float64, where exact too (powers of two
# from POW2 scale without rounding).

_F16_SCALE = np.float32(2.0 ** 112)
POW2_OFFSET = 256
POW2 = np.ldexp(1.0, np.arange(-POW2_OFFSET, POW2_OFFSET + 1))


@njit(cache=True, nogil=True, inline="always")
def _round(x, xbits, fmt, u, stochastic):
    """x (float32, its bits xbits) rounded to format fmt, as a float64: stochastically with the
    uniform draw u in [0, 1), else to nearest (ties to even); clipped to the largest finite value."""
    a = abs(np.float64(x))
    if a == 0.0 or fmt == F32:
        return np.float64(x)
    m, emin = FORMATS[fmt, 0], FORMATS[fmt, 1]
    field = np.int64((xbits >> np.uint32(23)) & np.uint32(0xFF))
    e = field - 127 if field else math.frexp(a)[1] - 1   # a float32 subnormal: frexp
    if e < emin:
        e = emin
    q = e - m                       # the exponent of one unit in the last place at a
    y = a * POW2[POW2_OFFSET - q]
    f = math.floor(y)
    frac = y - f
    if stochastic:
        if u < frac:
            f += 1.0
    elif frac > 0.5 or (frac == 0.5 and f % 2.0 == 1.0):
        f += 1.0
    r = f * POW2[POW2_OFFSET + q]
    if r > MAX_FINITE[fmt]:
        r = MAX_FINITE[fmt]
    return -r if x < 0 else r


@njit(cache=True, nogil=True, inline="always")
def _half_to_float_bits(b):
    s = np.uint32(b & 0x8000) << np.uint32(16)
    e5 = (np.int64(b) >> 10) & 0x1F
    m = np.int64(b) & 0x3FF
    if e5 == 0:
        if m == 0:
            return s
        p = 9
        while (m >> p) == 0:
            p -= 1
        return s | np.uint32((p - 24 + 127) << 23) | np.uint32((m << (23 - p)) & 0x7FFFFF)
    if e5 == 31:
        return s | np.uint32(0x7F800000) | np.uint32(m << 13)
    return s | np.uint32((e5 + 112) << 23) | np.uint32(m << 13)


@njit(cache=True, nogil=True, inline="always")
def _get(data, r, at, fmt):
    """The float32 bits of the value at data[r, at] (one word, or two: float32, low half first)."""
    if fmt == BF16:
        return np.uint32(data[r, at]) << np.uint32(16)
    if fmt == F16:
        return _half_to_float_bits(data[r, at])
    return np.uint32(data[r, at]) | (np.uint32(data[r, at + 1]) << np.uint32(16))


@njit(cache=True, nogil=True, inline="always")
def _narrow_bits(x, xbits, fmt, draw, stochastic):
    """The bits (uint64) of x (float32, bits xbits) rounded to fmt (bfloat16 or float16) with
    the draw `draw`: what _round does with u = the draw's top 53 bits / 2**53, in integers where
    the result keeps float32's low bits (bfloat16 always, float16 in its normal range): there
    u < frac is the draw's top k bits < the k bits dropped. Scalars only: no array to count."""
    x64 = np.uint64(xbits)
    if fmt == BF16:
        low = x64 & np.uint64(0xFFFF)
        if stochastic:
            up = (draw >> np.uint64(48)) < low
        else:
            odd = ((x64 >> np.uint64(16)) & np.uint64(1)) == np.uint64(1)
            up = low > np.uint64(0x8000) or (low == np.uint64(0x8000) and odd)
        b = (x64 >> np.uint64(16)) + np.uint64(up)
        if (b & np.uint64(0x7F80)) == np.uint64(0x7F80):     # past the largest finite value
            b = (b & np.uint64(0x8000)) | np.uint64(0x7F7F)
        return b
    sign = (x64 >> np.uint64(16)) & np.uint64(0x8000)
    field = (x64 >> np.uint64(23)) & np.uint64(0xFF)
    if field >= np.uint64(143):                               # 65536 and above: the largest
        return sign | np.uint64(0x7BFF)
    if field >= np.uint64(113):                               # float16's normal range
        a = x64 & np.uint64(0x7FFFFFFF)
        low = a & np.uint64(0x1FFF)
        if stochastic:
            up = (draw >> np.uint64(51)) < low
        else:
            odd = ((a >> np.uint64(13)) & np.uint64(1)) == np.uint64(1)
            up = low > np.uint64(0x1000) or (low == np.uint64(0x1000) and odd)
        b = (a >> np.uint64(13)) - np.uint64(112 << 10) + np.uint64(up)
        if b >= np.uint64(0x7C00):
            b = np.uint64(0x7BFF)
        return sign | b
    # Below: float16's subnormals, multiples of 2**-24 (1024 of them is its smallest normal, whose
    # bits are 0x400 too).
    r = _round(x, xbits, fmt, np.float64(draw >> np.uint64(11)) * _TWO_M53, stochastic)
    return sign | np.uint64(abs(r) * 16777216.0)


@njit(cache=True, nogil=True, inline="always")
def _row_key(key, id_, step):
    return _draw(_draw(key ^ id_, _ZERO) ^ ROUND_SALT, np.uint64(step))


@njit(cache=True, nogil=True, inline="always")
def _uniform(row_key, c):
    return np.float64(_draw(row_key, np.uint64(c)) >> np.uint64(11)) * _TWO_M53


# -- kernels and their twins -------------------------------------------------------------------

@njit(cache=True, nogil=True)
def widen(data, idx, dim, row_fmt, state_fmt, slots, roots, work):
    """work[i] = the row and slots of entry idx[i] as float32, for idx[i] >= 0 (a slot s with
    roots[s] holds sqrt(G): G = its square)."""
    rw, sw = dim * FORMATS[row_fmt, 3], dim * FORMATS[state_fmt, 3]
    bits = work.view(np.uint32)
    for i in range(idx.shape[0]):
        index.prefetch_ahead(data, idx, i)
        r = idx[i]
        if r < 0:
            continue
        for c in range(slots + 1):
            fmt = row_fmt if c == 0 else state_fmt
            base, o = (0 if c == 0 else rw + (c - 1) * sw), c * dim
            # One loop per format, free of branches the compiler cannot make selects of, so that
            # it vectorizes them (as _get does, value by value).
            if fmt == BF16:
                for j in range(dim):
                    bits[i, o + j] = np.uint32(data[r, base + j]) << np.uint32(16)
            elif fmt == F16:
                # float16's magnitude bits placed as a float32's, times 2**112, is its value
                # exactly, subnormals too (the float32 is then one, m 2**-149, and m 2**-24
                # the product); the sign is put back, and infinities and NaNs as _get has them.
                for j in range(dim):
                    bits[i, o + j] = (np.uint32(data[r, base + j]) & np.uint32(0x7FFF)) << np.uint32(13)
                for j in range(dim):
                    work[i, o + j] = work[i, o + j] * _F16_SCALE
                for j in range(dim):
                    h = np.uint32(data[r, base + j])
                    sign = (h & np.uint32(0x8000)) << np.uint32(16)
                    special = sign | np.uint32(0x7F800000) | ((h & np.uint32(0x3FF)) << np.uint32(13))
                    bits[i, o + j] = special if (h & np.uint32(0x7C00)) == np.uint32(0x7C00) \
                        else bits[i, o + j] | sign
            else:
                for j in range(dim):
                    bits[i, o + j] = np.uint32(data[r, base + 2 * j]) | (
                        np.uint32(data[r, base + 2 * j + 1]) << np.uint32(16))
            if c > 0 and roots[c - 1]:
                for j in range(dim):
                    work[i, o + j] = work[i, o + j] * work[i, o + j]


@njit(cache=True, nogil=True)
def narrow(data, idx, ids, key, step, dim, row_fmt, state_fmt, slots, roots, work, stochastic):
    """Entry idx[i] = work[i] rounded to its columns' formats (widen's inverse), for idx[i] >= 0:
    value c of the row of ids[i] draws splitmix64(key, id, step, c). A slot s with roots[s] stores
    sqrt(G) (float32's, left in work in G's place)."""
    rw, sw = dim * FORMATS[row_fmt, 3], dim * FORMATS[state_fmt, 3]
    bits = work.view(np.uint32)
    for i in range(idx.shape[0]):
        r = idx[i]
        if r < 0:
            continue
        rk = _row_key(key, ids[i], step)
        for c in range(slots + 1):
            fmt = row_fmt if c == 0 else state_fmt
            base, o = (0 if c == 0 else rw + (c - 1) * sw), c * dim
            if c > 0 and roots[c - 1]:
                for j in range(dim):
                    work[i, o + j] = np.sqrt(work[i, o + j])
            # One loop per format. float16's: _narrow_bits's integer path for its normal range
            # written out, which the compiler vectorizes, the draws too (1.2-2x faster, same
            # bits: bench/compact_push.py --baseline); the values below that range go through
            # _narrow_bits itself afterwards. (bfloat16's written out so was 10% slower.)
            if fmt == F32:
                for j in range(dim):
                    data[r, base + 2 * j] = np.uint16(bits[i, o + j] & np.uint32(0xFFFF))
                    data[r, base + 2 * j + 1] = np.uint16(bits[i, o + j] >> np.uint32(16))
            elif fmt == BF16:
                for j in range(dim):
                    draw = _draw(rk, np.uint64(o + j)) if stochastic else _ZERO
                    data[r, base + j] = np.uint16(_narrow_bits(work[i, o + j], bits[i, o + j], fmt, draw,
                                                               stochastic))
            else:
                low_range = False
                for j in range(dim):
                    x64 = np.uint64(bits[i, o + j])
                    sign = (x64 >> np.uint64(16)) & np.uint64(0x8000)
                    a = x64 & np.uint64(0x7FFFFFFF)
                    low = a & np.uint64(0x1FFF)
                    if stochastic:
                        up = (_draw(rk, np.uint64(o + j)) >> np.uint64(51)) < low
                    else:
                        odd = ((a >> np.uint64(13)) & np.uint64(1)) == np.uint64(1)
                        up = low > np.uint64(0x1000) or (low == np.uint64(0x1000) and odd)
                    # (below the normal range this wraps: the value is redone below)
                    b = min((a >> np.uint64(13)) - np.uint64(112 << 10) + np.uint64(up), np.uint64(0x7BFF))
                    data[r, base + j] = np.uint16(sign | b)
                    low_range |= a < np.uint64(113 << 23)
                if low_range:
                    for j in range(dim):
                        if np.uint64(bits[i, o + j] & np.uint32(0x7FFFFFFF)) < np.uint64(113 << 23):
                            draw = _draw(rk, np.uint64(o + j)) if stochastic else _ZERO
                            data[r, base + j] = np.uint16(_narrow_bits(work[i, o + j], bits[i, o + j], fmt,
                                                                       draw, stochastic))


@njit(cache=True, nogil=True)
def lookup(slots, keys, bits, data, ids, key, scale, row_fmt, out):
    """out[i] = the stored row of ids[i] as float32, else its initial value rounded to nearest."""
    d = out.shape[1]
    w = FORMATS[row_fmt, 3]
    out_bits = out.view(np.uint32)
    idx = np.empty(ids.shape[0], np.int64)
    index.find_many(slots, keys, ids, bits, idx)
    for i in range(ids.shape[0]):
        index.prefetch_ahead(data, idx, i)
        e = idx[i]
        if e == index.EMPTY:
            initial_row(key, ids[i], scale, out[i])
            for j in range(d):
                out[i, j] = np.float32(_round(out[i, j], out_bits[i, j], row_fmt, 0.0, False))
        else:
            for j in range(d):
                out_bits[i, j] = _get(data, e, j * w, row_fmt)


@njit(cache=True, nogil=True)
def round_many(x, fmt, key, step, ids, stochastic, out):
    """out[i, j] = x[i, j] rounded to fmt with the draws narrow uses for id ids[i] (tests, bench)."""
    x_bits = x.view(np.uint32)
    for i in range(x.shape[0]):
        rk = _row_key(key, ids[i], step)
        for j in range(x.shape[1]):
            out[i, j] = np.float32(_round(x[i, j], x_bits[i, j], fmt, _uniform(rk, j), stochastic))


def _uniform_numpy(key, ids, step, n):
    """The draws (float64 (len(ids), n)) narrow uses for values 0..n-1 of each id's row."""
    key = np.uint64(key)
    with np.errstate(over="ignore"):
        first = reference.splitmix64(key ^ np.asarray(ids, np.uint64), np.zeros(len(ids), np.uint64))
        rk = reference.splitmix64(first ^ ROUND_SALT, np.full(len(ids), step, np.uint64))
    draws = reference.splitmix64(rk[:, None], np.arange(n, dtype=np.uint64)[None, :])
    return (draws >> np.uint64(11)).astype(np.float64) * _TWO_M53


def round_numpy(x, fmt, u, stochastic):
    """NumPy twin of _round over arrays: x float32, u float64 draws like x; float32 results."""
    x = np.asarray(x, np.float64)
    if fmt == F32:
        return x.astype(np.float32)
    m, emin = int(FORMATS[fmt, 0]), int(FORMATS[fmt, 1])
    a = np.abs(x)
    e = np.maximum(np.frexp(a)[1] - 1, emin)
    q = e - m
    y = np.ldexp(a, -q)
    f = np.floor(y)
    frac = y - f
    if stochastic:
        f = f + (u < frac)
    else:
        f = f + ((frac > 0.5) | ((frac == 0.5) & (f % 2.0 == 1.0)))
    r = np.minimum(np.ldexp(f, q), MAX_FINITE[fmt])
    return np.where(a == 0, x, np.where(x < 0, -r, r)).astype(np.float32)


def round_many_numpy(x, fmt, key, step, ids, stochastic, out):
    out[:] = round_numpy(x, fmt, _uniform_numpy(key, ids, step, x.shape[1]), stochastic)


_FORMAT_OF = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.uint16): BF16}


def slot_key(name: str, root: bool) -> str:
    """A slot's name in state() and in a checkpoint's columns: slot_<name>, or slot_<name>.sqrt
    when it holds sqrt(G)."""
    return f"slot_{name}.sqrt" if root else f"slot_{name}"


def convert_slot(values: np.ndarray, root: bool, lay: Layout, s: int) -> np.ndarray:
    """A slot's state() array, in any state type (float32, float16, bfloat16 words) and either
    form (root: it holds sqrt(G)), in the form and type of slot s of `lay`: itself when they are
    the same, else converted in float32 and rounded to nearest."""
    fmt = _FORMAT_OF[values.dtype]
    if fmt == lay.state_fmt and root == bool(lay.roots[s]):
        return values
    x = _from_storage(values, fmt).astype(np.float32)
    if root:
        x = x * x
    if lay.roots[s]:
        x = np.sqrt(x)
    return np.ascontiguousarray(_to_storage(round_numpy(x, lay.state_fmt, None, False), lay.state_fmt))


def to_float32(rows: np.ndarray, row_dtype: str) -> np.ndarray:
    """A table's stored rows (state().rows, in their storage type) as their float32 values."""
    rows = np.asarray(rows)
    if row_dtype == "bfloat16" and rows.dtype == np.uint16:
        return _from_storage(rows, BF16)
    return rows.astype(np.float32, copy=False)


def _to_storage(values: np.ndarray, fmt: int) -> np.ndarray:
    """float32 values exactly representable in fmt, as their storage type (NumPy's conversions)."""
    if fmt == F16:
        return values.astype(np.float16)
    if fmt == BF16:
        return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return values


def _from_storage(stored: np.ndarray, fmt: int) -> np.ndarray:
    if fmt == F16:
        return stored.astype(np.float32)
    if fmt == BF16:
        return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return stored


def widen_numpy(data, idx, dim, row_fmt, state_fmt, slots, roots, work):
    """NumPy twin of widen."""
    keep = idx >= 0
    lay = _layout_of(dim, row_fmt, state_fmt, slots)
    cols = [_from_storage(c, row_fmt if k == 0 else state_fmt)
            for k, c in enumerate(lay.unpack(data[idx[keep]]))]
    work[keep] = np.concatenate([c * c if k > 0 and roots[k - 1] else c for k, c in enumerate(cols)],
                                axis=1)


def narrow_numpy(data, idx, ids, key, step, dim, row_fmt, state_fmt, slots, roots, work, stochastic):
    """NumPy twin of narrow."""
    keep = idx >= 0
    u = _uniform_numpy(key, ids[keep], step, dim * (slots + 1))
    vals = work[keep]
    cols = []
    for c in range(slots + 1):
        fmt = row_fmt if c == 0 else state_fmt
        part = slice(c * dim, (c + 1) * dim)
        x = np.sqrt(vals[:, part]) if c > 0 and roots[c - 1] else vals[:, part]
        cols.append(_to_storage(round_numpy(x, fmt, u[:, part], stochastic), fmt))
    data[idx[keep]] = pack(cols)


_NAMES = {F32: "float32", BF16: "bfloat16", F16: "float16"}


def _layout_of(dim, row_fmt, state_fmt, slots) -> Layout:
    return Layout(dim, _NAMES[row_fmt], "row" if state_fmt == row_fmt else "float32", slots)


def step_rows(opt, data, steps, idx, ids, grads, scale, key, version, lay: Layout, fast: bool) -> None:
    """One push's row update on a compact table: widen the touched entries to float32, run the
    row rule `opt` (a RowOptimizer) there, narrow them back stochastically (draws of `version`,
    the push's step). `fast`: the numba kernels, else their twins (same bits)."""
    n = idx.shape[0]
    keep = idx >= 0
    work = np.empty((n, lay.dim * (1 + lay.slots)), np.float32)
    (widen if fast else widen_numpy)(data, idx, lay.dim, lay.row_fmt, lay.state_fmt, lay.slots, lay.roots,
                                     work)
    local = np.where(keep, np.arange(n), -1)
    own = steps
    if opt.counts_steps:
        own = np.zeros(n, np.int64)
        own[keep] = steps[idx[keep]]
    opt.step(work, own, local, grads, scale)
    if opt.counts_steps:
        steps[idx[keep]] = own[keep]
    (narrow if fast else narrow_numpy)(data, idx, ids, key, version, lay.dim, lay.row_fmt, lay.state_fmt,
                                       lay.slots, lay.roots, work, True)


def store_initial(data, first, fresh, lay: Layout, fast: bool) -> None:
    """Entries first.. = fresh (float32 initial rows and slots), rounded to nearest."""
    n = fresh.shape[0]
    idx = np.arange(first, first + n, dtype=np.int64)
    ids = np.zeros(n, np.uint64)
    (narrow if fast else narrow_numpy)(data, idx, ids, np.uint64(0), 0, lay.dim, lay.row_fmt,
                                       lay.state_fmt, lay.slots, lay.roots, fresh, False)
