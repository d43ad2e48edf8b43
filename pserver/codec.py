"""ndarray <-> streamed chunks: the one place where tensors become bytes and back.

A tensor travels as a stream of `TensorChunk` messages: the first carries only the
header (sizes, dtype, step...), the rest carry raw little-endian float32 bytes, at most
`chunk_bytes` each. Receiving writes each chunk straight into a preallocated array, so
a 100M-parameter model never needs one 400 MB message or one 400 MB bytes object.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver.errors import InvalidArgument

DTYPE = np.dtype("<f4")
DTYPE_NAME = "float32"
CHUNK_BYTES = 1 << 20          # 1 MiB: well under gRPC's 4 MiB default message limit
MAX_CHUNK_BYTES = 4 << 20      # largest chunk a sender may use (gRPC's default limit)


def check_chunk_bytes(chunk_bytes: int) -> int:
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES - 1024:  # leave room for framing
        raise InvalidArgument(f"chunk_bytes: {chunk_bytes} is outside (0, {MAX_CHUNK_BYTES - 1024}]")
    return chunk_bytes


def encode(header: pb.TensorHeader, arr: np.ndarray,
           chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Yield the header message, then `arr`'s bytes in chunks of at most `chunk_bytes`."""
    check_chunk_bytes(chunk_bytes)
    flat = np.ascontiguousarray(arr, dtype=DTYPE).reshape(-1)
    header.num_elements = flat.size
    header.dtype = DTYPE_NAME
    yield pb.TensorChunk(header=header)
    raw = flat.view(np.uint8)
    for start in range(0, raw.size, chunk_bytes):
        # tobytes() of a slice is the one copy protobuf needs (it takes no memoryview).
        yield pb.TensorChunk(data=raw[start:start + chunk_bytes].tobytes())


def read_header(chunks: Iterator[pb.TensorChunk]) -> pb.TensorHeader:
    """Take the first message of a stream, which must carry the header and no data."""
    first = next(chunks, None)
    if first is None:
        raise InvalidArgument("header: the stream is empty; its first message must carry a header")
    if not first.HasField("header"):
        raise InvalidArgument("header: the first message of the stream carries no header")
    if first.data:
        raise InvalidArgument("data: the header message must not carry payload bytes")
    return first.header


def check_header(header: pb.TensorHeader, expected_elements: int) -> None:
    """A payload must be float32 and exactly as long as the receiver's range."""
    if header.dtype != DTYPE_NAME:
        raise InvalidArgument(f"dtype: '{header.dtype}' is not supported; send '{DTYPE_NAME}'")
    if header.num_elements != expected_elements:
        raise InvalidArgument(f"num_elements: {header.num_elements} does not match this "
                              f"shard's range of {expected_elements} elements")


def receive_into(dest: np.ndarray, chunks: Iterable[pb.TensorChunk]) -> None:
    """Fill `dest` (1-D, contiguous) from the data chunks that follow a header.

    Raises InvalidArgument if the stream carries too many or too few bytes, or a second
    header; `dest` may then be partly written, so callers receive into a scratch buffer.
    """
    raw = dest.view(np.uint8)
    pos = 0
    for chunk in chunks:
        if chunk.HasField("header"):
            raise InvalidArgument("header: a second header arrived in the middle of the stream")
        n = len(chunk.data)
        if pos + n > raw.size:
            raise InvalidArgument(f"data: the stream carries more than the {raw.size} bytes "
                                  f"its header declared")
        raw[pos:pos + n] = np.frombuffer(chunk.data, dtype=np.uint8)
        pos += n
    if pos != raw.size:
        raise InvalidArgument(f"data: the stream ended after {pos} of {raw.size} bytes (truncated)")


def decode(chunks: Iterable[pb.TensorChunk],
           dest_for: Callable[[pb.TensorHeader], np.ndarray]) -> tuple[pb.TensorHeader, np.ndarray]:
    """Read a whole stream: header, then payload into the array `dest_for(header)` gives."""
    it = iter(chunks)
    header = read_header(it)
    dest = dest_for(header)
    receive_into(dest, it)
    return header, dest


def to_array(chunks: Iterable[pb.TensorChunk]) -> tuple[pb.TensorHeader, np.ndarray]:
    """Decode a stream into a new array sized by its header (for tests and tools)."""
    return decode(chunks, lambda h: np.empty(h.num_elements, dtype=DTYPE))
