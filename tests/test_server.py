"""The shard over real gRPC: status codes, messages, streams, sizes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import FailedPrecondition, InvalidArgument, Unavailable
from pserver.models.layout import Layout
from pserver.wire import codec
from pserver.worker.client import PSClient
from tests.support.clients import LAYOUT, raw_push, ready_client


@pytest.fixture(params=["grpc", "auto"])
def plane(request):
    """Every client-level test runs over gRPC streams and over the shared-memory plane."""
    return request.param


def test_push_and_pull_round_trip(shard_server, plane):
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = ready_client(addr, plane=plane)
    w = np.empty(LAYOUT.total, np.float32)
    assert c.pull(w) == [0]
    np.testing.assert_array_equal(w, np.arange(33))
    assert c.push(np.ones(33, np.float32), num_samples=8) == [("aggregated", 1)]
    assert c.pull(w) == [1]
    np.testing.assert_array_equal(w, np.arange(33) - 1)
    st = c.status()[0]
    assert (st.version, st.mode, st.num_params, st.counters.pushes_aggregated,
            st.counters.samples_pushed) == (1, "sync", 33, 1, 8)


@pytest.mark.parametrize("mutate, code, field", [
    (lambda h, g: setattr(h, "num_elements", 32), "INVALID_ARGUMENT", "num_elements"),
    (lambda h, g: setattr(h, "dtype", "float64"), "INVALID_ARGUMENT", "dtype"),
    (lambda h, g: g.__setitem__(5, np.nan), "INVALID_ARGUMENT", "non-finite"),
    (lambda h, g: setattr(h, "step", 7), "FAILED_PRECONDITION", "step"),
    (lambda h, g: setattr(h, "rank", 4), "FAILED_PRECONDITION", "rank"),
    (lambda h, g: setattr(h, "shard", 2), "FAILED_PRECONDITION", "shard"),
    (lambda h, g: setattr(h, "num_samples", -1), "INVALID_ARGUMENT", "num_samples: -1 for a push; a grad"),
])
def test_bad_push_gets_its_status_code_and_names_the_field(shard_server, mutate, code, field):
    addr, shard = shard_server()
    c = ready_client(addr)
    before = shard.store.params.copy()
    g = np.ones(33, np.float32)
    h = pb.TensorHeader(rank=0, shard=0, step=0, num_samples=1, session=c.shards[0].session)
    msgs = list(codec.encode(h, g, 64))
    mutate(msgs[0].header, g)
    if np.isnan(g).any():
        msgs = list(codec.encode(h, g, 64))
    with pytest.raises(grpc.RpcError) as e:
        raw_push(addr, msgs)
    assert e.value.code().name == code
    assert field in e.value.details()
    np.testing.assert_array_equal(shard.store.params, before)
    assert shard.store.version == 0
    assert shard.status()["counters"]["pushes_rejected"] == 1


@pytest.mark.parametrize("chunks, words", [
    ([], "empty"),
    ([pb.TensorChunk(data=b"1234")], "no header"),
    ([pb.TensorChunk(header=pb.TensorHeader(num_elements=33, dtype="float32", num_samples=1)),
      pb.TensorChunk(data=b"\0" * 100)], "truncated"),
    ([pb.TensorChunk(header=pb.TensorHeader(num_elements=33, dtype="float32", num_samples=1)),
      pb.TensorChunk(data=b"\0" * 200)], "more than"),
])
def test_malformed_streams_are_invalid_argument(shard_server, chunks, words):
    addr, shard = shard_server()
    c = ready_client(addr)
    if chunks and chunks[0].HasField("header"):
        chunks[0].header.session = c.shards[0].session     # only the stream's shape is wrong
    with pytest.raises(grpc.RpcError) as e:
        raw_push(addr, chunks)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    assert shard.store.version == 0 and not shard.policy.pending


def test_client_translates_status_codes_and_state_is_unchanged(shard_server, plane):
    addr, shard = shard_server()
    c = ready_client(addr, plane=plane)
    before = shard.store.params.tobytes()
    with pytest.raises(FailedPrecondition, match="shard 0 at 127.0.0.1.*step"):
        c.push(np.ones(33, np.float32), 1, steps=[3])
    bad = np.ones(33, np.float32)
    bad[0] = np.inf
    with pytest.raises(InvalidArgument, match="non-finite"):
        c.push(bad, 1)
    with pytest.raises(FailedPrecondition, match="layout"):
        ready_client(addr, layout=Layout.of([("w", (4,))]), init=False, plane=plane)
    assert shard.store.params.tobytes() == before and shard.store.version == 0
    assert shard.status()["counters"]["pushes_rejected"] == 2


def test_data_plane_off_on_the_server_means_grpc(shard_server):
    addr, _ = shard_server(data_plane="grpc")
    c = PSClient([addr], data_plane="auto")
    c.connect(5)
    c.register(LAYOUT)
    assert c.shards[0].fast is None and "gRPC" in c.plane_description()


def test_lost_data_plane_falls_back_to_grpc(shard_server):
    addr, shard = shard_server()
    c = ready_client(addr, plane="auto")
    shard.dataplane.close()                        # shared memory goes; gRPC stays
    w = np.empty(33, np.float32)
    assert c.pull(w) == [0] and c.shards[0].fast is None
    np.testing.assert_array_equal(w, np.arange(33))


def test_a_shard_gone_for_good_fails_with_one_line_after_retries():
    from pserver.config import ServerConfig
    from pserver.server.app import create_server
    server, port, shard = create_server(ServerConfig(port=0))
    c = PSClient([f"127.0.0.1:{port}"], rpc_deadline=1.5, data_plane="auto")
    c.connect(5)
    c.register(LAYOUT)
    c.init(np.zeros(33, np.float32))
    shard.close()
    server.stop(0)
    with pytest.raises(Unavailable, match=r"shard 0 at 127.0.0.1:\d+: unavailable for 1.5 s despite retries"):
        c.pull(np.empty(33, np.float32))


def test_unreachable_shard_is_unavailable_with_the_address():
    c = PSClient(["127.0.0.1:1"])
    with pytest.raises(Unavailable, match="127.0.0.1:1"):
        c.connect(0.5)


def test_two_shards_split_the_vector_and_pull_in_parallel(shard_server, plane):
    a0, s0 = shard_server(shard=0, num_shards=2, optimizer="sgd", lr=0.5)
    a1, s1 = shard_server(shard=1, num_shards=2, optimizer="sgd", lr=0.5)
    c = PSClient([a0, a1], rpc_deadline=10, data_plane=plane)
    c.connect(5)
    infos = c.register(LAYOUT)
    assert [(i.range_start, i.range_end) for i in infos] == [(0, 17), (17, 33)]
    c.init(np.arange(33, dtype=np.float32))
    w = np.empty(33, np.float32)
    assert c.pull(w) == [0, 0]
    c.push(np.full(33, 2, np.float32), 1)
    assert c.pull(w) == [1, 1]
    np.testing.assert_array_equal(w, np.arange(33) - 1.0)


def test_hundred_million_parameters_fit_default_message_limits(shard_server):
    """400 MB each way, in 1 MiB chunks, through gRPC's default 4 MiB limit."""
    n = 100_000_000
    layout = Layout.of([("w", (n,))])
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = PSClient([addr], rpc_deadline=120, data_plane="grpc")
    c.connect(5)
    c.register(layout)
    w = np.ones(n, np.float32)
    c.init(w)
    assert c.pull(w) == [0]
    g = np.full(n, 0.5, np.float32)
    c.push(g, 1)
    w[:] = 0
    assert c.pull(w) == [1]
    assert w[0] == 0.5 and w[-1] == 0.5 and w[n // 2] == 0.5
    del w, g


def test_a_stalled_init_does_not_block_other_calls(shard_server):
    import threading
    import time as _time
    addr, shard = shard_server()
    c = PSClient([addr], rpc_deadline=10, data_plane="grpc")
    c.connect(5)
    c.register(LAYOUT)
    release = threading.Event()

    def stalled():
        msgs = list(codec.encode(pb.TensorHeader(rank=0, shard=0, layout_signature=LAYOUT.signature(),
                                                 session=c.shards[0].session),
                                 np.ones(33, np.float32), 64))
        yield msgs[0]
        yield msgs[1]
        release.wait(10)                      # the rest never comes until released
        yield from msgs[2:]

    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    t = threading.Thread(target=lambda: stub.Init(
        (pb.TensorChunk.FromString(codec.serialize_chunk(m)) for m in stalled()), timeout=10))
    t.start()
    _time.sleep(0.3)
    started = _time.monotonic()
    assert c.status()[0].version == -1          # answered while the Init is stalled
    assert _time.monotonic() - started < 1
    release.set()
    t.join(10)
    assert shard.store.version == 0


def test_a_push_of_one_message_and_one_of_several_do_the_same(shard_server):
    """A push that fits one message goes as a unary call, a longer one as a stream, and a
    plain protobuf client may still send the header alone first: the shard applies each."""
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = ready_client(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    assert c.push(np.ones(33, np.float32), num_samples=1) == [("aggregated", 1)]   # 132 bytes: one message
    c.pull(w)
    c.shards[0].chunk_bytes = 40                                                    # four messages
    assert c.push(np.full(33, 2, np.float32), num_samples=1) == [("aggregated", 2)]
    raw_push(addr, [pb.TensorChunk(header=pb.TensorHeader(rank=0, shard=0, step=2, num_samples=1,
                                                          num_elements=33, dtype="float32",
                                                          session=c.shards[0].session)),
                    pb.TensorChunk(data=np.full(33, 4, np.float32).tobytes())])
    c.pull(w)
    np.testing.assert_array_equal(w, np.arange(33) - 1 - 2 - 4)
    assert shard.status()["counters"]["pushes_aggregated"] == 3
