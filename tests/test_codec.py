import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from pserver import codec
from pserver._proto import pserver_pb2 as pb
from pserver.errors import InvalidArgument

floats32 = arrays(np.float32, st.integers(0, 5000),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True))


@settings(max_examples=200, deadline=None)
@given(arr=floats32, chunk_bytes=st.integers(1, 9000))
def test_round_trip_any_float32_array_any_chunk_size(arr, chunk_bytes):
    msgs = list(codec.encode(pb.TensorHeader(step=7), arr, chunk_bytes))
    assert all(len(m.data) <= chunk_bytes for m in msgs)
    header, out = codec.to_array(msgs)
    assert header.step == 7 and header.num_elements == arr.size and header.dtype == "float32"
    assert out.tobytes() == arr.tobytes()          # bit-exact, NaN payloads included


def test_large_payload_chunks_fit_grpc_default_limit():
    arr = np.arange(3_000_000, dtype=np.float32)    # 12 MB: three times the 4 MiB limit
    msgs = list(codec.encode(pb.TensorHeader(), arr))
    assert max(m.ByteSize() for m in msgs) < 4 * 1024 * 1024
    assert np.array_equal(codec.to_array(msgs)[1], arr)


def _stream(arr, **header):
    return list(codec.encode(pb.TensorHeader(**header), arr, 64))


def test_truncated_stream_is_rejected():
    msgs = _stream(np.ones(100, np.float32))
    with pytest.raises(InvalidArgument, match="truncated"):
        codec.to_array(msgs[:-1])


def test_overlong_stream_is_rejected():
    msgs = _stream(np.ones(100, np.float32))
    msgs.append(pb.TensorChunk(data=b"\0" * 8))
    with pytest.raises(InvalidArgument, match="more than"):
        codec.to_array(msgs)


def test_missing_header_second_header_and_empty_stream():
    msgs = _stream(np.ones(10, np.float32))
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
