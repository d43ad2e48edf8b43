"""Hostile clients of the same-host data plane (pserver/server/dataplane.py), against live
in-process shards.

A process that completed HELLO holds the shard's memfds and speaks the socket protocol
by hand. Whatever it does with them, the shard's memory stays the shard's: it cannot
write the parameters, cannot resize anything the shard maps, cannot change a gradient
after the shard checked it, cannot act for another rank, and cannot make the shard hold
threads or connections without bound.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver.errors import InvalidArgument, RpcError, Unauthenticated, Unavailable
from pserver.server import store
from pserver.wire import frames
from pserver.worker import dataplane as worker_dataplane
from pserver.worker.client import PSClient
from tests.support.clients import LAYOUT, START, TOKEN, hello_bytes, raw_hello, session_of, worker
from tests.support.shards import counters

NBYTES = LAYOUT.total * 4


def train_one_step(c: PSClient, expected: np.ndarray) -> None:
    """A single-worker sync step with gradient 1 and lr 1 lands exactly on `expected`."""
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    c.push(np.ones(LAYOUT.total, np.float32), 1)
    c.pull(w)
    np.testing.assert_array_equal(w, expected)


# Any float32 bit pattern: every NaN payload, both infinities, subnormals, -0.0.
bit_patterns = st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=300).map(
    lambda words: np.array(words, dtype=np.uint32).view(np.float32))


@settings(max_examples=300, deadline=None)
@given(values=bit_patterns)
def test_the_fused_copy_and_check_agrees_with_numpy(values):
    expected = int(np.flatnonzero(~np.isfinite(values))[0]) if not np.isfinite(values).all() else -1
    assert store.first_nonfinite(values) == expected
    dst = np.full(values.size, 7, np.float32)
    assert store.copy_finite(values, dst) == expected
    assert dst.tobytes() == values.tobytes()                # every bit, NaN payloads included


def test_a_client_can_map_the_parameters_only_read_only(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr)
    sock, (push_fd, params_fd) = raw_hello(shard, c)
    poison = np.full(LAYOUT.total, np.nan, np.float32).tobytes()
    with pytest.raises(PermissionError):
        mmap.mmap(params_fd, NBYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.pwrite(params_fd, poison, 0)
    with pytest.raises(PermissionError):
        os.write(params_fd, poison)
    for size in (0, NBYTES // 2, 2 * NBYTES):      # nor resize it, nor its own push buffer
        for fd in (params_fd, push_fd):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    # A private (copy-on-write) mapping may be scribbled on: the shard never sees it.
    private = mmap.mmap(params_fd, NBYTES, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    private[:] = poison
    readonly = np.frombuffer(mmap.mmap(params_fd, NBYTES, prot=mmap.PROT_READ), np.float32)
    np.testing.assert_array_equal(readonly, START)
    np.testing.assert_array_equal(shard.store.params, START)
    train_one_step(c, START - 1)
    np.testing.assert_array_equal(readonly, START - 1)     # the read-only view follows the shard
    for fd in (push_fd, params_fd):
        os.close(fd)
    sock.close()
    c.close()


def test_what_the_shard_validated_is_what_it_applies(two_sync_workers):
    """Sync, 2 workers: worker 0 pushes, then writes NaN into its shared buffer before the
    step completes. The step applies the gradient as it was pushed."""
    shard, a, b = two_sync_workers()
    w = np.empty(LAYOUT.total, np.float32)
    assert a.pull(w) == [0] and b.pull(w) == [0]
    assert a.push(np.ones(LAYOUT.total, np.float32), 4) == [("aggregated", 0)]
    a.shards[0].fast.push_buf[:] = np.nan             # the step is still waiting for worker 1
    assert b.push(np.full(LAYOUT.total, 3, np.float32), 4) == [("aggregated", 1)]
    assert a.pull(w) == [1]
    np.testing.assert_array_equal(w, START - 2)        # lr 1 x the mean of 1 and 3
    assert np.isfinite(shard.store.params).all()
    assert counters(shard)["pushes_rejected"] == 0
    # NaN in the buffer when the push is sent (the last element) is refused and counted.
    b.pull(w)
    bad = np.ones(LAYOUT.total, np.float32)
    bad[-1] = np.nan
    with pytest.raises(InvalidArgument, match=f"non-finite value \\(nan\\) at element {LAYOUT.total - 1}"):
        a.push(bad, 4)
    assert counters(shard)["pushes_rejected"] == 1
    np.testing.assert_array_equal(shard.store.params, START - 2)


def test_init_through_shared_memory_is_checked_as_it_is_copied(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr, init=False)
    bad = START.copy()
    bad[LAYOUT.total - 1] = np.inf
    with pytest.raises(InvalidArgument, match=f"non-finite value \\(inf\\) at element {LAYOUT.total - 1}"):
        c.init(bad)
    assert shard.store.version == -1 and not shard.store.params.any()   # zeroed, not initialized
    c.init(START)
    train_one_step(c, START - 1)
    c.close()


def test_a_connection_acts_only_for_the_rank_it_said_hello_as(two_sync_workers):
    shard, a, b = two_sync_workers()
    w = np.empty(LAYOUT.total, np.float32)
    a.pull(w)
    fast = a.shards[0].fast
    fast.rank = 1                              # worker 0's connection pushes as worker 1
    with pytest.raises(Unauthenticated, match="HELLO as worker 0; it cannot act for worker 1"):
        fast.push(np.ones(LAYOUT.total, np.float32), 0, 4, 0, 5)
    assert counters(shard)["pushes_received"] == 0 and shard.store.version == 0
    fast.rank = 0
    b.pull(w)
    assert a.push(np.ones(LAYOUT.total, np.float32), 4) == [("aggregated", 0)]
    assert b.push(np.ones(LAYOUT.total, np.float32), 4) == [("aggregated", 1)]


def test_a_hello_without_the_ranks_session_gets_no_memory(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr)
    for rank, session, words in ((0, "", "session"), (0, "f" * 32, "session"), (1, session_of(c), "rank")):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(shard.dataplane.path)
        sock.sendall(hello_bytes(rank, session))
        msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
        code, _, _, _, n, _ = frames.REPLY.unpack(msg)
        assert fds == [] and code != 0
        assert words in frames.recv_exact(sock, n).decode()
        assert sock.recv(1) == b"", "the shard must close a refused connection"
        sock.close()
    train_one_step(c, START - 1)
    c.close()


def conn_threads() -> int:
    return sum(t.name == "dataplane-conn" for t in threading.enumerate())


def wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_pull_whose_client_hung_up_frees_its_thread(two_sync_workers):
    """Worker 0 pulls for a step that worker 1 never completes, then its connection goes
    (as when its process is killed): the shard's thread stops waiting within a tick or
    two, not at the pull's deadline (120 s here)."""
    shard, a, b = two_sync_workers(step_timeout=600)
    w = np.empty(LAYOUT.total, np.float32)
    a.pull(w)
    b.pull(w)
    a.push(np.ones(LAYOUT.total, np.float32), 4)
    fast = a.shards[0].fast
    errors = []

    def parked_pull():
        try:
            fast.pull_into(w, 0, 0, 120)
        except Unavailable as e:
            errors.append(e)

    t = threading.Thread(target=parked_pull)
    t.start()
    assert wait_until(lambda: counters(shard)["pulls_served"] == 2 and conn_threads() == 2)
    time.sleep(0.5)                            # the pull is parked in the shard's wait
    assert t.is_alive()
    fast.sock.shutdown(socket.SHUT_RDWR)       # the worker's end goes away
    t.join(10)
    assert errors and not t.is_alive()
    assert wait_until(lambda: conn_threads() == 1, 10), "the parked pull's thread is still waiting"
    # The step still completes for the others.
    assert b.push(np.ones(LAYOUT.total, np.float32), 4) == [("aggregated", 1)]


def test_connections_are_bounded_and_the_extra_one_is_told_why(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr)
    held, refused = [], None
    for _ in range(100):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(shard.dataplane.path)
        with contextlib.suppress(BrokenPipeError):          # refused at once: the reply waits
            sock.sendall(hello_bytes(0, session_of(c)))
        msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
        for fd in fds:
            os.close(fd)
        code, _, _, _, n, _ = frames.REPLY.unpack(msg)
        if code:
            refused = (frames.CODES[code], frames.recv_exact(sock, n).decode())
            sock.close()
            break
        held.append(sock)
    assert refused is not None, "100 connections were all accepted"
    serving = 1 + len(held)                                # the worker's own, then ours
    assert refused[0] == "RESOURCE_EXHAUSTED" and f"already serves {serving} connections" in refused[1]
    assert serving == frames.connection_limit(1) == 20
    with pytest.raises(RpcError, match="its limit") as e:   # the client library says the same
        worker_dataplane.DataPlaneChannel(shard.dataplane.address, 0, 0, LAYOUT.total, "shard 0", TOKEN,
                                   session_of(c))
    assert e.value.code_name == "RESOURCE_EXHAUSTED"
    train_one_step(c, START - 1)                           # the connected worker is unaffected
    for sock in held:
        sock.close()
    assert wait_until(lambda: conn_threads() == 1)
    sock, fds = raw_hello(shard, c)                        # room again: a new connection gets in
    for fd in fds:
        os.close(fd)
    sock.close()
    c.close()


def lease_request(rank: int, **fields):
    from pserver._proto import pserver_pb2 as pb
    return pb.LeaseDataRequest(rank=rank, num_batches=10, chunk_batches=3, seed=1, fingerprint="f", epochs=2,
                               **fields)


def test_a_lease_over_the_data_plane_is_the_lease_over_grpc(shard_server):
    """LeaseData on a shard the worker shares a host with goes over the data plane (one LEASE
    request, no gRPC call) and answers what gRPC answers: two shards alike, one worker on each
    transport, the same asks (a first lease, the next with the first reported finished), the same
    replies but for the coordinator's random ident. Catches a LEASE answer that differs from
    LeaseData's, or a data-plane client that still asks over gRPC."""
    replies = {}
    for plane in ("auto", "grpc"):
        addr, _ = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")
        c = worker(addr, data_plane=plane)
        shard = c.shards[0]
        sent, grpc_calls = [], []
        if plane == "auto":
            send = shard.fast._send
            shard.fast._send = lambda op, *a, **k: (sent.append(op), send(op, *a, **k))[1]
        call = shard.call
        shard.call = lambda fn, *a, **k: (grpc_calls.append(fn), call(fn, *a, **k))[1]
        first = c.lease_data(10, 3, 1, "f", 2)
        second = c.lease_data(10, 3, 1, "f", 2, finished=(first.epoch, first.chunk))
        assert (sent, len(grpc_calls)) == (([frames.LEASE] * 2, 0) if plane == "auto" else ([], 2))
        for r in (first, second):
            r.coordinator_id = ""
        replies[plane] = [first, second]
        c.close()
    assert replies["auto"] == replies["grpc"]
    assert replies["auto"][0].has_lease and replies["auto"][1].has_lease
    assert replies["auto"][0].chunk != replies["auto"][1].chunk


def test_a_raw_lease_request_is_checked_and_a_bad_one_changes_nothing(shard_server):
    """A raw client on the data plane, after HELLO as worker 0: a payload that is no LeaseDataRequest
    is INVALID_ARGUMENT and the connection still frames; a request for another rank (in the header
    or in the message) is UNAUTHENTICATED; the message's session is not used, the connection's is
    (a request naming none is still worker 0's); a length over MAX_MESSAGE is refused and the
    connection cut. None of them leases anything."""
    from pserver._proto import pserver_pb2 as pb

    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")
    c = worker(addr)
    sock, fds = raw_hello(shard, c)
    for fd in fds:
        os.close(fd)

    def ask(payload: bytes, rank: int = 0, length: int | None = None):
        size = len(payload) if length is None else length
        sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.LEASE, rank, 0, 0, 0, size, 0, 1000) + payload)
        code, _, _, kind, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
        return frames.CODES[code], frames.recv_exact(sock, n) if n else b""

    code, message = ask(b"\xff\xff\xff not a message")
    assert code == "INVALID_ARGUMENT" and b"not a LeaseDataRequest" in message
    assert ask(lease_request(1).SerializeToString())[0] == "UNAUTHENTICATED"
    assert ask(lease_request(0).SerializeToString(), rank=1)[0] == "UNAUTHENTICATED"
    assert shard.leases.coordinator.plan is None or not shard.leases.coordinator.holds(0, session_of(c), 0, 0)
    code, data = ask(lease_request(0, session="not-the-session").SerializeToString())
    reply = pb.LeaseDataReply.FromString(data)
    assert code == "OK" and reply.has_lease and shard.leases.coordinator.holds(0, session_of(c), reply.epoch,
                                                                               reply.chunk)
    code, message = ask(b"", length=frames.MAX_MESSAGE + 1)
    assert code == "INVALID_ARGUMENT" and b"at most" in message
    assert sock.recv(1) == b""                          # cut: what followed could not be framed
    sock.close()
    c.close()
