"""Gradient compression for pushes (`--compress`): the worker's encoders with error feedback,
and the shard's decoders, numba kernels that validate as they decode. And the one codec for
pulls (`--pull-compress bf16`): the shard encodes its range as it streams it, the worker
decodes into its float32 weights.

A compressed push carries its dense slice in one of these layouts (all little-endian), named by
TensorHeader.compression; its sparse rows follow uncompressed, as in any push:

- `bf16`: uint16 per element, the top half of the float32 rounded to nearest even.
- `fp16`: IEEE half per element, of the gradient times TensorHeader.scale. The worker picks that
  scale per push, a power of two that puts the largest |g| just under 2^15: nothing overflows
  (so no step is ever skipped, unlike loss scaling that backs off after an overflow), small
  values keep 11 significant bits down to 2^-9 of the largest, and scaling back is exact.
- `topk`: TensorHeader.num_values uint32 indices (strictly ascending), then as many float32
  values: the ceil(RATIO * block) largest |g| of every block of BLOCK elements.
- `sign`: one bit per element (1: +, bit order little), then one float32 scale per block of BLOCK
  elements, the block's mean |g|; an element decodes to +-scale.

The lossy codecs lose what they round away only for one step: the worker keeps it as a residual
and adds it to its next gradient (error feedback: Seide et al. 2014, 1-bit SGD; Lin et al. 2018,
Deep Gradient Compression), so the sum of what the shards receive tracks the sum of the true
gradients. A bf16 pull needs no residual: the shard keeps the float32 weights and applies every
update to them; only the worker's copy, which it computes with, is rounded (as mixed-precision
training computes with bf16 weights and keeps float32 masters). Every kernel has a NumPy twin
(`*_ref`, or the encoder `bf16_bits`) that the tests compare it with.

This module is the format that both ends share; the worker's side (error feedback, a pulled
range decoded) is pserver.worker.compress, the shard's (a push's gradient filled from its
stream, a pull encoded as it streams) pserver.server.compress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from pserver.errors import ConfigError, InvalidArgument
from pserver.registry import Registry

BLOCK = 4096          # elements per top-k selection and per sign scale: one scale costs 1/1024 bit each
FP16_TOP = 15         # the fp16 scale puts max|g| just under 2**15 (fp16's largest finite is 65504)
# TensorHeader.compression names one of these; "none" sends float32 as it is.
CODECS = Registry("codec", "--compress")
CODECS.add("none", "float32 as it is (the default)")
CODECS.add("bf16", "half the bytes, rounded to nearest even")
CODECS.add("fp16", "half the bytes, scaled per push so that nothing overflows")
CODECS.add("topk", f"the largest RATIO of |g| per {BLOCK} elements, as index+value pairs",
           form="topk:RATIO")
CODECS.add("sign", f"1 bit per element, one scale per {BLOCK}")
PULL_CODECS = Registry("pull codec", "--pull-compress")
PULL_CODECS.add("none", "float32 as it is (the default)")
PULL_CODECS.add("bf16", "half the bytes; the shard keeps and updates float32 weights")


@dataclass(frozen=True)
class Spec:
    """A parsed --compress value: the codec and, for topk, the fraction of elements kept."""
    name: str = "none"
    ratio: float = 1.0

    def __str__(self) -> str:
        return f"topk:{self.ratio:g}" if self.name == "topk" else self.name


def parse(text: str) -> Spec:
    """A form in CODECS: 'none', 'bf16', 'fp16', 'sign' or 'topk:RATIO' (0 < RATIO <= 1)."""
    name, _, arg = (text or "none").partition(":")
    if name not in CODECS or bool(arg) != (name == "topk"):
        raise ConfigError(f"--compress: '{text}' is not one of {', '.join(CODECS.forms())}")
    if name != "topk":
        return Spec(name)
    try:
        ratio = float(arg)
    except ValueError:
        ratio = math.nan
    if not 0 < ratio <= 1:
        raise ConfigError(f"--compress: topk ratio '{arg}' must be a number in (0, 1], e.g. topk:0.01")
    return Spec(name, ratio)


def parse_pull(text: str) -> str:
    """--pull-compress: 'none' or 'bf16'."""
    if (text or "none") not in PULL_CODECS:
        raise ConfigError(f"--pull-compress: '{text}' is not one of {', '.join(PULL_CODECS)}")
    return text or "none"


@dataclass
class Packed:
    """One shard's compressed slice: what its push header says and the arrays sent after it."""
    compression: str
    num_elements: int
    arrays: list[np.ndarray]
    num_values: int = 0
    scale: float = 0.0


# ---- encoders (NumPy; the worker pushes with them) ----

def bf16_bits(g: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (ties to the even upper half)."""
    u = g.view(np.uint32)
    return ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)


def fp16_scale(g: np.ndarray) -> float:
    top = float(np.max(np.abs(g))) if g.size else 0.0
    if not top > 0 or not math.isfinite(top):
        return 1.0
    _, e = math.frexp(top)                  # top < 2**e
    return math.ldexp(1.0, min(max(FP16_TOP - e, -126), 127))


def topk_indices(g: np.ndarray, ratio: float) -> np.ndarray:
    """Ascending indices of the ceil(ratio * len) largest |g| of every BLOCK-element block."""
    parts = []
    for start in range(0, g.size, BLOCK):
        a = np.abs(g[start:start + BLOCK])
        k = min(a.size, max(1, math.ceil(ratio * a.size)))
        parts.append(np.argpartition(a, a.size - k)[a.size - k:] + start)
    return np.sort(np.concatenate(parts)).astype(np.uint32) if parts else np.zeros(0, np.uint32)


def block_means(g: np.ndarray) -> np.ndarray:
    n = g.size
    full = n // BLOCK * BLOCK
    means = [np.abs(g[:full], dtype=np.float64).reshape(-1, BLOCK).mean(axis=1)] if full else []
    if full < n:
        means.append([np.abs(g[full:], dtype=np.float64).mean()])
    return np.concatenate(means).astype(np.float32) if means else np.zeros(0, np.float32)


def encode(spec: Spec, g: np.ndarray) -> Packed:
    """Compress one float32 slice for a push."""
    n = g.size
    if spec.name == "bf16":
        return Packed("bf16", n, [bf16_bits(g)])
    if spec.name == "fp16":
        scale = fp16_scale(g)
        return Packed("fp16", n, [(g * np.float32(scale)).astype("<f2").view(np.uint16)], scale=scale)
    if spec.name == "topk":
        if n >= 1 << 32:
            raise ConfigError("--compress: topk indexes a shard's slice with uint32; "
                              f"{n} elements is too many")
        idx = topk_indices(g, spec.ratio)
        return Packed("topk", n, [idx, g[idx]], num_values=idx.size)
    if spec.name == "sign":
        return Packed("sign", n, [np.packbits(g >= 0, bitorder="little"), block_means(g)])
    raise ValueError(f"no encoder for codec '{spec.name}'")


# ---- pulls: the bf16 encoder (twin: bf16_bits) ----

@njit(cache=True, nogil=True)
def bf16_encode(values, out):
    """float32 -> bfloat16 bits rounded to nearest even, as bf16_bits (the shard's weights are
    always finite, so NaN needs no care)."""
    u = values.view(np.uint32)
    for i in range(out.size):
        x = u[i]
        out[i] = (x + (((x >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16)


# ---- decoders: numba kernels that validate as they decode, and their NumPy twins ----

@njit(cache=True, nogil=True)
def bf16_decode(bits, out):
    for i in range(out.size):
        out[i] = np.uint32(bits[i]) << np.uint32(16)


@njit(cache=True, nogil=True)
def fp16_decode(halves, scale, out):
    """IEEE half bits -> float32, divided by the push's scale (a power of two: exact)."""
    for i in range(out.size):
        h = np.int64(halves[i])
        exponent, mantissa = (h >> 10) & 0x1F, h & 0x3FF
        if exponent == 0:
            v = math.ldexp(float(mantissa), -24)
        elif exponent == 31:
            v = np.inf if mantissa == 0 else np.nan
        else:
            v = math.ldexp(float(1024 + mantissa), exponent - 25)
        out[i] = np.float32(-v if h & 0x8000 else v) / scale


@njit(cache=True, nogil=True)
def topk_decode(idx, values, out):
    """out = 0 except out[idx[i]] = values[i]; returns the first i whose index is out of range or
    not above the one before (a repeat), or -1."""
    out[:] = 0
    for i in range(idx.size):
        j = idx[i]
        if j >= out.size or (i > 0 and j <= idx[i - 1]):
            return i
        out[j] = values[i]
    return -1


@njit(cache=True, nogil=True)
def sign_decode(bits, scales, block, out):
    """out[i] = +-scales[i // block]; returns the first block whose scale is negative, NaN or
    infinite, or -1."""
    for b in range(scales.size):
        s = scales[b]
        if not (s >= 0 and s < np.inf):
            return b
    for b in range(scales.size):
        s = scales[b]
        for i in range(b * block, min(out.size, (b + 1) * block)):
            out[i] = s if (bits[i >> 3] >> (i & 7)) & 1 else -s
    return -1


def bf16_decode_ref(bits, out):
    out.view(np.uint32)[:] = bits.astype(np.uint32) << 16


def fp16_decode_ref(halves, scale, out):
    out[:] = halves.view("<f2").astype(np.float32) / np.float32(scale)


def topk_decode_ref(idx, values, out):
    bad = np.flatnonzero((idx >= out.size) | np.r_[False, idx[1:] <= idx[:-1]])
    out[:] = 0
    if bad.size:
        return int(bad[0])
    out[idx] = values
    return -1


def sign_decode_ref(bits, scales, block, out):
    bad = np.flatnonzero(~((scales >= 0) & (scales < np.inf)))
    if bad.size:
        return int(bad[0])
    signs = np.unpackbits(bits, count=out.size, bitorder="little").astype(bool)
    s = np.repeat(scales, block)[:out.size]
    out[:] = np.where(signs, s, -s)
    return -1


def decode_ref(packed: Packed, out: np.ndarray) -> None:
    """What the shard decodes from `packed` (the worker's view, for its residual)."""
    a = packed.arrays
    if packed.compression == "bf16":
        bf16_decode_ref(a[0], out)
    elif packed.compression == "fp16":
        fp16_decode_ref(a[0], packed.scale, out)
    elif packed.compression == "topk":
        topk_decode_ref(a[0], a[1], out)
    else:
        sign_decode_ref(a[0], a[1], BLOCK, out)


def buffers(header, n: int) -> list[np.ndarray]:
    """The arrays a compressed dense slice of n elements arrives in, checked against its header."""
    name = header.compression
    if name in ("bf16", "fp16"):
        if name == "fp16" and not (header.scale > 0 and math.isfinite(header.scale)):
            raise InvalidArgument(f"scale: fp16 needs a finite scale > 0, got {header.scale}")
        return [np.empty(n, np.uint16)]
    if name == "topk":
        if not 0 <= header.num_values <= n:
            raise InvalidArgument(f"num_values: topk sent {header.num_values} values for {n} elements")
        return [np.empty(header.num_values, "<u4"), np.empty(header.num_values, "<f4")]
    if name == "sign":
        return [np.empty((n + 7) // 8, np.uint8), np.empty(-(-n // BLOCK), "<f4")]
    raise InvalidArgument(f"compression: '{name}' is not one of {', '.join(CODECS.names()[1:])}")


def decode(header, parts: list[np.ndarray], out: np.ndarray) -> None:
    """Decode a received compressed slice into `out` (the shard's scratch gradient)."""
    name = header.compression
    if name == "bf16":
        bf16_decode(parts[0], out.view(np.uint32))
    elif name == "fp16":
        fp16_decode(parts[0], np.float32(header.scale), out)
    elif name == "topk":
        bad = topk_decode(parts[0], parts[1], out)
        if bad >= 0:
            raise InvalidArgument(f"topk: index {int(parts[0][bad])} at position {bad} is out of range "
                                  f"[0, {out.size}) or not above the one before it (repeated or unsorted)")
    else:
        bad = sign_decode(parts[0], parts[1], BLOCK, out)
        if bad >= 0:
            raise InvalidArgument(f"sign: block {bad}'s scale {float(parts[1][bad])} is not finite and >= 0")

