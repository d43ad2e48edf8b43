import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pserver._proto import pserver_pb2 as pb
from pserver.errors import InvalidArgument
from pserver.wire import codec


def wire(msgs):
    """What the receiver sees: each message serialized as gRPC would, then parsed."""
    return [codec.parse_chunk(codec.serialize_chunk(m)) for m in msgs]


floats32 = arrays(np.float32, st.integers(0, 5000),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True))


@settings(max_examples=200, deadline=None)
@given(arr=floats32, chunk_bytes=st.integers(1, 9000))
def test_round_trip_any_float32_array_any_chunk_size(arr, chunk_bytes):
    msgs = wire(codec.encode(pb.TensorHeader(step=7), arr, chunk_bytes))
    assert all(len(m.data) <= chunk_bytes for m in msgs)
    header, out = codec.to_array(msgs)
    assert header.step == 7 and header.num_elements == arr.size and header.dtype == "float32"
    assert out.tobytes() == arr.tobytes()          # bit-exact, NaN payloads included


def test_large_payload_chunks_fit_grpc_default_limit():
    arr = np.arange(3_000_000, dtype=np.float32)    # 12 MB: three times the 4 MiB limit
    raw = [codec.serialize_chunk(m) for m in codec.encode(pb.TensorHeader(), arr)]
    assert max(len(r) for r in raw) < 4 * 1024 * 1024
    assert np.array_equal(codec.to_array(raw)[1], arr)


@settings(max_examples=100, deadline=None)
@given(arr=floats32, chunk_bytes=st.integers(1, 3000))
def test_hand_encoded_chunks_are_the_proto_wire_format(arr, chunk_bytes):
    """protobuf itself parses what the codec writes, and the codec parses what protobuf
    writes: a client generated from protos/pserver.proto interoperates."""
    payload = b"".join(pb.TensorChunk.FromString(codec.serialize_chunk(m)).data
                       for m in codec.encode(pb.TensorHeader(), arr, chunk_bytes))
    assert payload == arr.tobytes()
    msg = pb.TensorChunk(header=pb.TensorHeader(step=3, num_elements=2), data=b"\x01\x02")
    parsed = codec.parse_chunk(msg.SerializeToString())
    assert parsed.header.step == 3 and bytes(parsed.data) == b"\x01\x02"


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_parsing_random_bytes_never_raises(raw):
    chunk = codec.parse_chunk(raw)
    assert chunk.error or chunk.header is not None or isinstance(chunk.data, memoryview)


def _stream(arr, **header):
    return wire(codec.encode(pb.TensorHeader(**header), arr, 64))


def test_truncated_stream_is_rejected():
    msgs = _stream(np.ones(100, np.float32))
    with pytest.raises(InvalidArgument, match="truncated"):
        codec.to_array(msgs[:-1])


def test_overlong_stream_is_rejected():
    msgs = _stream(np.ones(100, np.float32))
    msgs.append(codec.parse_chunk(pb.TensorChunk(data=b"\0" * 8).SerializeToString()))
    with pytest.raises(InvalidArgument, match="more than"):
        codec.to_array(msgs)


def test_missing_header_second_header_and_empty_stream():
    msgs = _stream(np.ones(40, np.float32))        # 160 bytes: three messages
    with pytest.raises(InvalidArgument, match="no header"):
        codec.to_array(msgs[1:])
    with pytest.raises(InvalidArgument, match="second header"):
        codec.to_array(msgs + [pb.TensorChunk(header=pb.TensorHeader())])
    with pytest.raises(InvalidArgument, match="empty"):
        codec.to_array([])


def test_check_header_names_the_field():
    with pytest.raises(InvalidArgument, match="dtype"):
        codec.check_header(pb.TensorHeader(dtype="float64", num_elements=3), 3)
    with pytest.raises(InvalidArgument, match="num_elements"):
        codec.check_header(pb.TensorHeader(dtype="float32", num_elements=4), 3)


def test_bad_chunk_size():
    with pytest.raises(InvalidArgument, match="chunk_bytes"):
        list(codec.encode(pb.TensorHeader(), np.ones(3, np.float32), 0))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 700), chunk_bytes=st.integers(1, 1000))
def test_the_first_message_carries_the_header_and_the_first_chunk(n, chunk_bytes):
    """A payload of k chunks is k messages (one when empty), not k + 1: the header rides
    with the first chunk, and no other message carries a header."""
    arr = np.arange(n, dtype=np.float32)
    msgs = wire(codec.encode(pb.TensorHeader(step=5), arr, chunk_bytes))
    assert len(msgs) == max(1, -(-arr.nbytes // chunk_bytes))
    assert msgs[0].header.step == 5 and len(msgs[0].data) == min(arr.nbytes, chunk_bytes)
    assert not any(m.HasField("header") for m in msgs[1:])


def test_a_header_alone_then_the_data_is_still_read():
    """The form a client of protocol 2 sends: the header message without payload bytes."""
    arr = np.arange(7, dtype=np.float32)
    msgs = [pb.TensorChunk(header=pb.TensorHeader(num_elements=7, dtype="float32")),
            pb.TensorChunk(data=arr.tobytes())]
    assert np.array_equal(codec.to_array(msgs)[1], arr)
