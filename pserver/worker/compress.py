"""The worker's side of compression (pserver.wire.compress has the formats and the
kernels): error feedback for compressed pushes, and decoding a bf16 pull into float32."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from pserver.errors import InvalidArgument
from pserver.wire import codec
from pserver.wire.compress import Packed, Spec, bf16_decode, decode_ref, encode


class ErrorFeedback:
    """The worker's residuals: what compression dropped from each element, added back next push."""

    def __init__(self, spec: Spec, size: int) -> None:
        self.spec = spec
        self.residual = np.zeros(size, np.float32)

    def pack(self, grad: np.ndarray, start: int, end: int) -> Packed:
        """Compress grad[start:end] plus its residual, and keep what the shard will not get.
        Shards own disjoint ranges, so their pushes may call this from parallel threads."""
        corrected = grad[start:end] + self.residual[start:end]
        packed = encode(self.spec, corrected)
        decoded = np.empty_like(corrected)
        decode_ref(packed, decoded)
        np.subtract(corrected, decoded, out=self.residual[start:end])
        return packed


def receive_pull(header, chunks: Iterator, dest: np.ndarray, scratch: Callable[[int], np.ndarray]) -> None:
    """A pulled range into dest (float32), as its header says it was sent; `scratch(n)` gives
    a reusable uint16 array of n elements for a bf16 range."""
    if header.num_elements != dest.size:
        raise InvalidArgument(f"num_elements: shard sent {header.num_elements}, expected {dest.size}")
    if not header.compression:
        codec.receive_into(dest, chunks)
    elif header.compression == "bf16":
        bits = scratch(dest.size)
        codec.receive_into(bits, chunks)
        bf16_decode(bits, dest.view(np.uint32))
    else:
        raise InvalidArgument(f"compression: the shard sent a pull as '{header.compression}'")
