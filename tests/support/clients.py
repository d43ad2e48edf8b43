"""Real clients of a live shard (the shard_server fixture): PSClient over gRPC or the data
plane, the generated stub, and the data plane's HELLO by hand."""

from __future__ import annotations

import socket

import grpc
import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.models.layout import Layout
from pserver.wire import codec, frames
from pserver.wire.security import ClientSecurity
from pserver.worker.client import PSClient

TOKEN = "s3cret-Token_for.tests"
LAYOUT = Layout.of([("w", (10, 3)), ("b", (3,))])   # 33 elements
START = np.arange(LAYOUT.total, dtype=np.float32)


def ready_client(address, num_workers=1, rank=0, layout=LAYOUT, init=True, plane="grpc"):
    """A registered client (without a token) on gRPC, or on shared memory with plane="auto"."""
    c = PSClient([address], rank=rank, num_workers=num_workers, rpc_deadline=10, data_plane=plane)
    c.connect(5)
    c.register(layout)
    assert (c.shards[0].fast is not None) == (plane == "auto"), "auto must use shared memory here"
    if init:
        c.init(np.arange(layout.total, dtype=np.float32))
    return c


def raw_push(address, chunks):
    """A push through the generated stub: a plain protobuf client, as any language has."""
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
    msgs = [m if isinstance(m, pb.TensorChunk) else pb.TensorChunk.FromString(codec.serialize_chunk(m))
            for m in chunks]
    return stub.Push(iter(msgs), timeout=5)


def worker(addr: str, rank: int = 0, num_workers: int = 1, init: bool = True,
           data_plane: str = "auto") -> PSClient:
    """A real client on the data plane, or on gRPC alone with data_plane="grpc" (sync pulls
    may wait up to 120 s), of a shard started with auth_token=TOKEN."""
    c = PSClient([addr], rank=rank, num_workers=num_workers, rpc_deadline=120, data_plane=data_plane,
                 security=ClientSecurity(TOKEN))
    c.connect(5)
    c.register(LAYOUT)
    if init:
        c.init(START)
    assert (c.shards[0].fast is not None) == (data_plane == "auto"), f"the worker must use {data_plane}"
    return c


def session_of(c: PSClient) -> str:
    """The worker's credential from Register ("" from a shard without sessions)."""
    return getattr(c.shards[0], "session", "")


def raw_hello(shard, c: PSClient) -> tuple[socket.socket, list[int]]:
    """HELLO by hand as worker c (token, then its session, each length-prefixed): (socket,
    its two fds)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(shard.dataplane.path)
    sock.sendall(hello_bytes(c.rank, session_of(c)))
    msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
    assert frames.REPLY.unpack(msg)[0] == 0 and len(fds) == 2
    return sock, fds


def hello_bytes(rank: int, session: str) -> bytes:
    fields = [TOKEN.encode(), session.encode()]
    return (frames.REQUEST.pack(frames.MAGIC, frames.HELLO, rank, 0, 0, 0, 0, 0, 0)
            + b"".join(frames.TOKEN_LEN.pack(len(f)) + f for f in fields))
