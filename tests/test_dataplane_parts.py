"""Dense payloads larger than one part on the same-host data plane (pserver/server/dataplane.py):
they travel through a push buffer of two slots, part by part, with every value checked as
the shard copies it, against live in-process shards. The part size is made small here, so
that a 33-element model takes five parts (the last one short)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.wire import frames
from tests.support.clients import LAYOUT, START, TOKEN, raw_hello, worker
from tests.support.shards import counters

PART = 8


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(frames, "PART_ELEMENTS", PART)


@pytest.fixture
def sgd_shard(shard_server, small_parts):
    """(address, shard): sync, SGD with lr 1, so a step from START lands on START - g."""
    return shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")


def step(c, g: np.ndarray) -> np.ndarray:
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    c.push(g, 1)
    c.pull(w)
    return w


def test_the_push_buffer_holds_two_parts_not_the_range(sgd_shard):
    addr, shard = sgd_shard
    c = worker(addr)
    assert c.shards[0].fast.push_buf.size == 2 * PART < LAYOUT.total
    g = np.arange(LAYOUT.total, dtype=np.float32) / 4          # a different value in every element
    np.testing.assert_array_equal(step(c, g), START - g)
    np.testing.assert_array_equal(shard.store.params, START - g)
    c.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.integers(0, (1 << 32) - 1), min_size=LAYOUT.total, max_size=LAYOUT.total))
def test_parts_deliver_every_bit_or_refuse_the_first_non_finite_value(zero_lr_worker, words):
    """Any float32 bit patterns: a finite gradient lands exactly (each part in its place);
    one with NaN or Inf is refused naming its first such element, and the next push works."""
    shard, c = zero_lr_worker
    g = np.array(words, dtype=np.uint32).view(np.float32)
    bad = np.flatnonzero(~np.isfinite(g))
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    if bad.size:
        rejected = counters(shard)["pushes_rejected"]
        with pytest.raises(InvalidArgument, match=f"at element {bad[0]} of the flat vector"):
            c.push(g, 1)
        assert counters(shard)["pushes_rejected"] == rejected + 1
        g = np.where(np.isfinite(g), g, np.float32(1))
    c.push(g, 1)                        # the stream stayed framed: the next push is whole
    grad = shard.store.pool.acquire()   # the buffer the step just applied, given back
    assert grad.tobytes() == g.tobytes()
    shard.store.pool.release(grad)


@pytest.fixture
def zero_lr_worker(shard_server, small_parts):
    """(shard, worker): one sync worker; lr 1e-30 keeps the parameters finite whatever it pushes."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1e-30, mode="sync")
    c = worker(addr)
    yield shard, c
    c.close()


def test_a_push_refused_before_its_parts_are_copied_keeps_the_stream_framed(sgd_shard):
    addr, shard = sgd_shard
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    with pytest.raises(FailedPrecondition, match="step"):
        c.push(np.ones(LAYOUT.total, np.float32), 1, steps=[7])    # a step the shard is not at
    with pytest.raises(InvalidArgument, match="num_samples: -1 for a push; a gradient is the mean"):
        c.push(np.ones(LAYOUT.total, np.float32), -1)               # the data plane checks it too
    c.push(np.full(LAYOUT.total, 2, np.float32), 1)       # the next push is read whole
    c.pull(w)
    np.testing.assert_array_equal(w, START - 2)
    assert counters(shard)["pushes_rejected"] == 2
    c.close()


def test_a_client_that_stops_between_parts_is_cut_and_others_go_on(sgd_shard):
    addr, shard = sgd_shard
    c = worker(addr)
    sock, fds = raw_hello(shard, c)
    # Part 0 announced with the header, then silence: no READY for part 1.
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PUSH, 0, 0, 0, 0, LAYOUT.total, 1, 100))
    sock.settimeout(30)
    started = time.monotonic()
    said = b""
    while chunk := sock.recv(64):                                 # until the shard hangs up
        said += chunk
    assert said == frames.FREE                                 # part 0 copied, no reply
    assert time.monotonic() - started < 20
    np.testing.assert_array_equal(step(c, np.ones(LAYOUT.total, np.float32)), START - 1)
    sock.close()
    for fd in fds:
        socket.close(fd)
    c.close()


def test_closing_a_shard_ends_its_data_plane_threads(sgd_shard):
    """Closing the listening socket alone left the accept thread blocked in accept() for good:
    one leaked thread per shard ever closed in a process (a long pytest run had over 100)."""
    addr, shard = sgd_shard
    c = worker(addr)
    plane = shard.dataplane
    assert plane.accepter.is_alive()
    shard.close()
    plane.accepter.join(5)
    assert not plane.accepter.is_alive()
    c.close()
