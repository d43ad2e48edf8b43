"""ndarray <-> streamed gRPC chunks (the shared-memory data plane's layout is wire.frames, a
compressed push's wire.compress).

A tensor travels as a stream of `TensorChunk` messages: the first carries the header
(sizes, dtype, step...) and the first chunk of raw little-endian float32 bytes, the rest
carry the following bytes, at most `chunk_bytes` each. A payload of one chunk (1 MiB by
default) is therefore one message each way, not two: a message costs a wake-up of a
thread on each side, which is what small round trips pay for. Receiving writes each
chunk straight into a preallocated array, so a 100M-parameter model never needs one
400 MB message or one 400 MB bytes object.

Payload chunks are encoded and parsed here by hand rather than through protobuf
objects: the bytes on the wire are exactly the `TensorChunk` of protos/pserver.proto
(field 2, length-delimited), but sending costs one copy from the array into the message
and receiving none before the copy into the destination, instead of three each way
(tobytes, the message object, its serialization). Any protobuf client still interoperates.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver.errors import ConfigError, InvalidArgument

DTYPE = np.dtype("<f4")
DTYPE_NAME = "float32"
# The wire protocol's version: Register refuses a peer that speaks another (2: sessions;
# 3: the header message carries the first payload chunk; 4: a push's data lease carries what
# its batch's step measured, in the data plane's frame too).
PROTOCOL_VERSION = 4
CHUNK_BYTES = 1 << 20          # 1 MiB: well under gRPC's 4 MiB default message limit
MAX_CHUNK_BYTES = 4 << 20      # largest chunk a sender may use (gRPC's default limit)


def check_chunk_bytes(chunk_bytes: int) -> int:
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES - 1024:  # leave room for framing
        raise InvalidArgument(f"chunk_bytes: {chunk_bytes} is outside (0, {MAX_CHUNK_BYTES - 1024}]")
    return chunk_bytes


DATA_TAG = b"\x12"            # TensorChunk.data: field 2, wire type 2 (length-delimited)
HEADER_FIELD, DATA_FIELD = 1, 2


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class RawChunk:
    """A received TensorChunk, parsed without copying its payload: `data` is a memoryview.

    Parsing never raises (a deserializer that raises becomes INTERNAL in gRPC): a
    malformed message carries `error`, which read_header / receive_into report as
    INVALID_ARGUMENT.
    """

    __slots__ = ("header", "data", "error")

    def __init__(self, header=None, data=memoryview(b""), error: str = "") -> None:
        self.header, self.data, self.error = header, data, error

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's spelling
        return name == "header" and self.header is not None


def parse_chunk(raw: bytes) -> RawChunk:
    """The wire bytes of one TensorChunk -> RawChunk (unknown fields are skipped)."""
    view, pos, chunk = memoryview(raw), 0, RawChunk()
    try:
        while pos < len(view):
            key, pos = read_varint(view, pos)
            field, wire = key >> 3, key & 7
            if wire == 2:
                n, pos = read_varint(view, pos)
                if pos + n > len(view):
                    raise ValueError("a field runs past the end of the message")
                value, pos = view[pos:pos + n], pos + n
                if field == HEADER_FIELD:
                    chunk.header = pb.TensorHeader.FromString(bytes(value))
                elif field == DATA_FIELD:
                    chunk.data = value
            elif wire == 0:
                _, pos = read_varint(view, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire} is not valid here")
    except Exception as e:   # DecodeError, ValueError, IndexError: all mean malformed
        return RawChunk(error=f"message: not a TensorChunk ({e})")
    return chunk


def read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


class HeadChunk:
    """The first message of a stream: the header and the first payload bytes. It becomes
    bytes only as it is sent (one copy, as every payload chunk), so until then the header
    is still an ordinary message that its sender may fill in."""

    __slots__ = ("header", "pieces")

    def __init__(self, header: pb.TensorHeader, pieces: list) -> None:
        self.header, self.pieces = header, pieces

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's spelling
        return name == "header"

    def to_bytes(self) -> bytes:
        head = pb.TensorChunk(header=self.header).SerializeToString()
        if not self.pieces:
            return head
        return b"".join((head, DATA_TAG, varint(sum(len(p) for p in self.pieces)), *self.pieces))


def serialize_chunk(msg) -> bytes:
    """gRPC serializer for TensorChunk streams: payload chunks come pre-encoded as bytes."""
    if isinstance(msg, bytes):
        return msg
    return msg.to_bytes() if isinstance(msg, HeadChunk) else msg.SerializeToString()


def as_chunk(msg):
    """Whatever a stream yields (pre-encoded bytes, a HeadChunk, a RawChunk, a TensorChunk) as a chunk."""
    if isinstance(msg, HeadChunk):
        msg = msg.to_bytes()
    return parse_chunk(msg) if isinstance(msg, (bytes, bytearray)) else msg


def encode(header: pb.TensorHeader, arr: np.ndarray,
           chunk_bytes: int = CHUNK_BYTES) -> Iterator:
    """Yield `arr`'s bytes as encoded TensorChunks of at most `chunk_bytes` payload each,
    the first with the header (one copy: from the array into the message bytes)."""
    return encode_parts(header, [np.ascontiguousarray(arr, dtype=DTYPE).reshape(-1)], chunk_bytes)


def read_header(chunks: Iterator[pb.TensorChunk]) -> tuple[pb.TensorHeader, Iterator]:
    """Take the first message of a stream, which must carry the header (and may carry the
    first payload bytes); returns (header, the payload chunks: those bytes, then the rest)."""
    first = next(chunks, None)
    if first is None:
        raise InvalidArgument("header: the stream is empty; its first message must carry a header")
    first = as_chunk(first)
    if getattr(first, "error", ""):
        raise InvalidArgument(first.error)
    if not first.HasField("header"):
        raise InvalidArgument("header: the first message of the stream carries no header")
    if not first.data:
        return first.header, chunks
    return first.header, itertools.chain((RawChunk(data=memoryview(first.data)),), chunks)


def check_header(header: pb.TensorHeader, expected_elements: int) -> None:
    """A payload must be float32 and exactly as long as the receiver's range."""
    if header.dtype != DTYPE_NAME:
        raise InvalidArgument(f"dtype: '{header.dtype}' is not supported; send '{DTYPE_NAME}'")
    if header.num_elements != expected_elements:
        raise InvalidArgument(f"num_elements: {header.num_elements} does not match this "
                              f"shard's range of {expected_elements} elements")


def receive_into(dest: np.ndarray, chunks: Iterable[pb.TensorChunk], *more: np.ndarray) -> None:
    """Fill `dest`, then each of `more` (contiguous arrays), from the data chunks that follow
    a header: the bytes run on from one array into the next, as a push's dense slice and
    then its sparse ids and rows do.

    Raises InvalidArgument if the stream carries too many or too few bytes, or a second
    header; the arrays may then be partly written, so callers receive into scratch buffers.
    """
    dests = [a.reshape(-1).view(np.uint8) for a in (dest, *more)]
    size = sum(d.size for d in dests)
    which, pos, total = 0, 0, 0         # the array being filled, the position in it, bytes so far
    for chunk in chunks:
        chunk = as_chunk(chunk)
        if getattr(chunk, "error", ""):
            raise InvalidArgument(chunk.error)
        if chunk.HasField("header"):
            raise InvalidArgument("header: a second header arrived in the middle of the stream")
        data = np.frombuffer(chunk.data, dtype=np.uint8)
        if total + data.size > size:
            raise InvalidArgument(f"data: the stream carries more than the {size} bytes "
                                  f"its header declared")
        total += data.size
        while data.size:
            while dests[which].size == pos:
                which, pos = which + 1, 0
            n = min(data.size, dests[which].size - pos)
            dests[which][pos:pos + n] = data[:n]
            data, pos = data[n:], pos + n
    if total != size:
        raise InvalidArgument(f"data: the stream ended after {total} of {size} bytes (truncated)")


def tensor_spec(t) -> pb.TensorSpec:
    """A dense tensor (pserver.models.layout.TensorSpec) as Register carries it: momentum only for
    a moving statistic (unset, it is an ordinary tensor, as from a worker that predates it)."""
    stats = {} if t.momentum is None else {"momentum": t.momentum}
    return pb.TensorSpec(name=t.name, shape=t.shape, frozen=t.frozen, **stats)


def table_spec(t) -> pb.SparseTableSpec:
    """A pserver.sparse.TableConfig as Register carries it."""
    d = t.to_dict()
    return pb.SparseTableSpec(**{k: v for k, v in d.items() if k != "params"}, params=dict(d["params"]))


def table_config(spec: pb.SparseTableSpec):
    """The TableConfig a Register carries; InvalidArgument for one no table can run with."""
    from pserver.sparse import TableConfig
    try:
        return TableConfig.from_dict(dict(name=spec.name, dim=spec.dim, optimizer=spec.optimizer,
                                          lr=spec.lr, init_scale=spec.init_scale, seed=spec.seed,
                                          min_count=spec.min_count, max_rows=spec.max_rows,
                                          ttl_steps=spec.ttl_steps, params=dict(spec.params),
                                          row_dtype=spec.row_dtype or "float32",
                                          state_dtype=spec.state_dtype or "float32"))
    except ConfigError as e:
        raise InvalidArgument(f"tables: {e}") from None


class Position(NamedTuple):
    """Where a worker stands in its data (pb.TrainingPosition): the shard records it per rank,
    checkpoints it, and hands it back when the rank registers again."""
    clock: int              # steps of the rank taken in; the next one is this
    data_seed: int          # the seed of the data order those steps followed
    steps_per_epoch: int    # the epoch length they were counted in

    @property
    def epoch(self) -> int:
        return self.clock // max(self.steps_per_epoch, 1)

    @property
    def step(self) -> int:
        return self.clock % max(self.steps_per_epoch, 1)

    @staticmethod
    def of(reply) -> Position | None:
        return Position(reply.position.clock, reply.position.data_seed,
                        reply.position.steps_per_epoch) if reply.HasField("position") else None


def encode_parts(header: pb.TensorHeader, arrays: Iterable[np.ndarray],
                 chunk_bytes: int = CHUNK_BYTES, num_elements: int | None = None) -> Iterator:
    """As `encode`, for a payload made of several arrays back to back (a push's dense slice,
    then its sparse ids and rows); header.num_elements counts the first array's elements,
    or is `num_elements` (a compressed slice: the elements it decodes to). The first message
    (a HeadChunk) carries the header and the first chunk's bytes."""
    check_chunk_bytes(chunk_bytes)
    header.num_elements = arrays[0].size if num_elements is None else num_elements
    header.dtype = DTYPE_NAME
    # made as they are sent: `arrays` may be an iterator that makes each one (a bf16 pull)
    views = (memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in arrays)
    first, pending, held = True, [], 0
    for raw in views:
        start = 0
        while start < len(raw):
            piece = raw[start:start + chunk_bytes - held]
            pending.append(piece)
            held += len(piece)
            start += len(piece)
            if held == chunk_bytes:
                yield HeadChunk(header, pending) if first else b"".join((DATA_TAG, varint(held), *pending))
                first, pending, held = False, [], 0
    if first:
        yield HeadChunk(header, pending)
    elif held:
        yield b"".join((DATA_TAG, varint(held), *pending))


def decode(chunks: Iterable[pb.TensorChunk],
           dest_for: Callable[[pb.TensorHeader], np.ndarray]) -> tuple[pb.TensorHeader, np.ndarray]:
    """Read a whole stream: header, then payload into the array `dest_for(header)` gives."""
    header, rest = read_header(iter(chunks))
    dest = dest_for(header)
    receive_into(dest, rest)
    return header, dest


def to_array(chunks: Iterable[pb.TensorChunk]) -> tuple[pb.TensorHeader, np.ndarray]:
    """Decode a stream into a new array sized by its header (for tests and tools)."""
    return decode(chunks, lambda h: np.empty(h.num_elements, dtype=DTYPE))
