"""The shard's side of compression (pserver.wire.compress has the formats and the
kernels): a push's gradient filled from its codec, and a pull streamed as bf16."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from pserver.errors import InvalidArgument
from pserver.wire import codec
from pserver.wire.compress import bf16_encode, buffers, decode


def check_pull(compression: str) -> None:
    """A PullRequest's codec, checked before its pull waits."""
    if compression not in ("", "bf16"):
        raise InvalidArgument(f"compression: a pull may ask for '' (float32) or 'bf16', not '{compression}'")


def pull_payload(params: np.ndarray, compression: str, chunk_bytes: int) -> Iterable[np.ndarray]:
    """What a pull streams after its header (codec checked by check_pull): the float32 range,
    or its bf16 bits made one chunk at a time as the stream is sent (so a pull holds a
    chunk, not half its range)."""
    return _bf16_blocks(params, max(1, chunk_bytes // 2)) if compression else [params]


def _bf16_blocks(params: np.ndarray, step: int) -> Iterator[np.ndarray]:
    for a in range(0, params.size, step):
        block = params[a:a + step]
        out = np.empty(block.size, np.uint16)
        bf16_encode(block, out)
        yield out


def fill_for(header, chunks: Iterator, more: list[np.ndarray]) -> Callable[[np.ndarray], None]:
    """How the shard fills a push's gradient from its stream: raw float32, or decoded from the
    codec its header names; the sparse arrays `more` follow either way."""
    if not header.compression:
        return lambda dest: codec.receive_into(dest, chunks, *more)

    def fill(dest: np.ndarray) -> None:
        parts = buffers(header, dest.size)
        codec.receive_into(parts[0], chunks, *parts[1:], *more)
        decode(header, parts, dest)
    return fill
