"""A worker's step as one exchange: PSClient.push_pull, and the data plane's THEN_PULL
(pserver/server/dataplane.py), against live in-process shards.

The pull that rides with a push must be exactly the pull the worker would have sent after
it: same wait, same version, same values. A refused push pulls nothing and leaves the shard
as it was; a pull part that fails leaves the push taken and the worker pulling on its own;
and a raw client cannot use the flag to desynchronise the connection.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from pserver.errors import FailedPrecondition, InvalidArgument
from pserver.wire import frames
from tests.support.clients import LAYOUT, START, TOKEN, raw_hello, worker
from tests.support.processes import wait_until
from tests.support.shards import counters

ONES = np.ones(LAYOUT.total, np.float32)


@pytest.mark.parametrize("plane", ["auto", "grpc"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_push_pull_lands_where_push_then_pull_does(shard_server, plane, mode):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=0.5, mode=mode)
    c = worker(addr, data_plane=plane)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    g = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)
    outcomes = c.push_pull(g, w, 8, clock=0)
    expected = START - np.float32(0.5) * g
    assert outcomes == ["aggregated" if mode == "sync" else "applied"]
    np.testing.assert_array_equal(w, expected)
    np.testing.assert_array_equal(shard.store.params, expected)
    assert c.versions == [1] == [shard.store.version]
    assert c.shards[0].last_flat is w                # what a restarted shard would be re-seeded with
    st = counters(shard)
    assert st["pushes_received"] == 1 and st["pulls_served"] == 2 and st["samples_pushed"] == 8
    c.push_pull(g, w, 8, clock=1)                   # the next step starts from what was pulled
    np.testing.assert_array_equal(w, START - 2 * (np.float32(0.5) * g))
    assert c.versions == [2]
    c.close()


def test_in_sync_the_riding_pull_waits_for_the_step(two_sync_workers):  # noqa: F811 (the fixture)
    """Worker 0's exchange returns only once worker 1 has pushed: the pull part waits for
    version 1, as the pull on its own would."""
    import threading
    import time
    shard, a, b = two_sync_workers()
    w0, w1 = np.empty(LAYOUT.total, np.float32), np.empty(LAYOUT.total, np.float32)
    a.pull(w0)
    b.pull(w1)
    done = []
    t = threading.Thread(target=lambda: done.append(a.push_pull(ONES, w0, 1, clock=0)))
    t.start()
    time.sleep(0.5)
    assert not done and shard.store.version == 0    # aggregated, the pull part waiting
    b.push(3 * ONES, 1)
    t.join(10)
    assert done == [["aggregated"]] and a.versions == [1]
    np.testing.assert_array_equal(w0, START - 2 * ONES)   # lr 1, mean of 1 and 3


def test_a_refused_push_pulls_nothing_and_changes_nothing(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    bad = ONES.copy()
    bad[7] = np.nan
    w[:] = -5
    with pytest.raises(InvalidArgument, match="non-finite"):
        c.push_pull(bad, w, 1, clock=0)
    assert (w == -5).all()                            # nothing pulled into it
    np.testing.assert_array_equal(shard.store.params, START)
    assert shard.store.version == 0 and counters(shard)["pushes_rejected"] == 1
    c.push_pull(ONES, w, 1, clock=0)                  # the connection is still framed
    np.testing.assert_array_equal(w, START - 1)
    assert c.shards[0].fast is not None


def test_the_worker_step_pushes_its_batch_size_and_pulls_at_the_next_clock(shard_server):
    """pserver.worker.run.push_pull, as the training loop calls it: the samples it trained on are
    counted, and in ssp its clock moves to the one its next step pulls for."""
    from pserver.worker.run import push_pull
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="ssp", staleness=5)
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    assert push_pull(c, ONES, w, 32, clock=3) == ["applied"]
    assert counters(shard)["samples_pushed"] == 32
    assert shard.store.clocks[0] == 4
    np.testing.assert_array_equal(w, START - 1)


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_stale_push_in_a_worker_still_pulls(shard_server, mode):
    """pserver.worker.run.push_pull: a push refused for its step is survivable; the pull that
    it could not carry is made on its own, for the clock after the push's, so the worker
    goes on from the current version."""
    from pserver.worker.run import push_pull
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode=mode, staleness=5)
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    c.push_pull(ONES, w, 1, clock=0)
    c.versions = [0] if mode == "sync" else [7]       # a step it missed / a version it never saw
    w[:] = 0
    assert push_pull(c, ONES, w, 1, clock=6) == ["rejected"]
    np.testing.assert_array_equal(w, START - 1)      # pulled: the shard's current values
    assert c.versions == [1] and shard.store.version == 1
    if mode == "ssp":
        assert shard.store.clocks[0] == 7             # the pull was for clock 6 + 1


def test_a_failed_pull_part_leaves_the_push_taken_and_pulls_on_its_own(shard_server):
    """A pull part refused (here: a seen_version the shard never reached) comes back as an
    error reply after the push's; the channel reports no pull, stays framed, and the client
    then pulls the usual way."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    fast = c.shards[0].fast
    dest = np.full(LAYOUT.total, -5, np.float32)
    outcome, version, finished, pulled = fast.push(ONES, 0, 1, 0, 5, then_pull=(dest, 99, 1))
    assert pulled is None and (dest == -5).all()
    assert version == 1 == shard.store.version       # the push was applied
    np.testing.assert_array_equal(shard.store.params, START - 1)
    assert fast.pull_into(dest, 1, 1, 5) == (1, False)     # still framed
    np.testing.assert_array_equal(dest, START - 1)
    # Through the client: the seen_version the shard refuses is retried as "none seen".
    c.shards[0].reset_seen = False
    w[:] = 0
    c.versions = [99]
    with pytest.raises(FailedPrecondition):
        c.shards[0].push(ONES, 0, 99, 1, 1, 5)       # a push for a version it never had
    assert c.shards[0].push_pull(ONES, w, 0, 1, 1, 1, 99, 2, 5)[:2] == ("applied", 2)
    np.testing.assert_array_equal(w, START - 2)


def test_a_data_lease_on_anything_but_a_push_is_refused_and_cut(shard_server):
    """WITH_LEASE (a push's data lease progress in its frame) on a pull: refused in one line and
    the connection cut (what follows cannot be framed); catches a server that reads the lease
    fields of any operation or ignores the flag."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr)
    sock, fds = raw_hello(shard, c)
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PULL | frames.WITH_LEASE, 0, 0, -1, 0,
                                        LAYOUT.total, 0, 1000) + frames.LEASE_AT.pack(0, 0, 0, 0.0, 0.0))
    code, _, _, _, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    assert frames.CODES[code] == "INVALID_ARGUMENT"
    said = frames.recv_exact(sock, n).decode()
    assert f"only a push can carry a data lease, not operation {frames.PULL}" in said
    assert sock.recv(1) == b""
    sock.close()
    assert counters(shard)["pulls_served"] == 0
    c.close()


def test_then_pull_on_anything_but_a_push_is_refused_and_cut(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = worker(addr)
    sock, fds = raw_hello(shard, c)
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PULL | frames.THEN_PULL, 0, 0, -1, 0,
                                        LAYOUT.total, 0, 1000) + frames.PULL_AFTER.pack(-1, 0))
    code, _, _, _, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    assert frames.CODES[code] == "INVALID_ARGUMENT"
    assert f"only a push can carry a pull, not operation {frames.PULL}" in frames.recv_exact(sock, n).decode()
    assert sock.recv(1) == b""                        # the connection is closed
    sock.close()
    assert counters(shard)["pulls_served"] == 0
    c.close()


def test_a_raw_push_with_then_pull_gets_both_replies_in_one_message(shard_server):
    """On the wire: the push's reply and the pull's, back to back, with the pull's version."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr)
    sock, (push_fd, params_fd) = raw_hello(shard, c)
    import mmap
    import os
    buf = mmap.mmap(push_fd, os.fstat(push_fd).st_size)
    np.frombuffer(buf, np.float32)[:LAYOUT.total] = 2
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PUSH | frames.THEN_PULL, 0, 0, 0, 0,
                                        LAYOUT.total, 4, 1000) + frames.PULL_AFTER.pack(0, 1))
    size = frames.REPLY.size
    push_reply = frames.REPLY.unpack(frames.recv_exact(sock, size))
    pull_reply = frames.REPLY.unpack(frames.recv_exact(sock, size))
    assert push_reply == (0, 1, False, 0, 0, 1)       # OK, applied, no error kind, version 1
    assert pull_reply == (0, 0, False, 0, 0, 1)       # OK, version 1
    np.testing.assert_array_equal(shard.store.params, START - 2)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    del buf
    for fd in (push_fd, params_fd):
        os.close(fd)
    c.close()


@pytest.mark.parametrize("plane", ["auto", "grpc"])
def test_a_second_worker_exchanges_as_itself(shard_server, plane):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    a = worker(addr, rank=0, num_workers=2, data_plane=plane)
    b = worker(addr, rank=1, num_workers=2, init=False, data_plane=plane)
    w = np.empty(LAYOUT.total, np.float32)
    b.pull(w)
    assert b.push_pull(ONES, w, 1, clock=0) == ["applied"]
    assert shard.store.clocks.get(1) == 1 and shard.store.clocks.get(0, 0) == 0
    np.testing.assert_array_equal(w, START - 1)
    a.close()
    b.close()


def test_over_the_data_plane_a_step_is_one_request(shard_server):
    """The point of push_pull: one request per shard and step, the push flagged THEN_PULL;
    after a rejoin (reset_seen) it does not ride, since the pull must not assume a version."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    fast = c.shards[0].fast
    sent, send = [], fast._send
    fast._send = lambda op, *a, **k: (sent.append(op), send(op, *a, **k))[1]
    c.push_pull(ONES, w, 1, clock=0)
    assert sent == [frames.PUSH | frames.THEN_PULL]
    c.shards[0].reset_seen = True
    sent.clear()
    c.push_pull(ONES, w, 1, clock=1)
    assert sent == [frames.PUSH, frames.PULL]
    np.testing.assert_array_equal(w, START - 2)
    c.close()


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "backup"])
def test_the_chief_evaluates_on_every_core_only_when_no_other_worker_trains_meanwhile(shard_server, mode):
    """pserver.worker.loop.eval_threads, from the mode a real shard answered at Register: at an
    epoch's end only sync makes the other workers wait for the chief (its push completes their
    step); in async, ssp and backup they keep training, so it evaluates on one thread. At the
    run's end every worker is done: every core. (A mode check inverted, or one that reads the
    worker's own settings instead of the shard's, fails here.)"""
    import os

    from pserver.worker.loop import eval_threads
    options = {"staleness": 2} if mode == "ssp" else {"backup_workers": 1} if mode == "backup" else {}
    addr, _ = shard_server(auth_token=TOKEN, mode=mode, num_workers=2, **options)
    c = worker(addr, num_workers=2)
    cores = min(len(os.sched_getaffinity(0)), 16)
    assert eval_threads(c, others_wait=False) == (cores if mode == "sync" else 1)
    assert eval_threads(c, others_wait=True) == cores


def two_shard_workers(shard_server, workers: int = 1) -> tuple[list, list]:
    """Two live sync shards (SGD, lr 0.5) and `workers` clients on both, over the data plane;
    worker 0 initialized them with START."""
    from pserver.wire.security import ClientSecurity
    from pserver.worker.client import PSClient

    served = [shard_server(auth_token=TOKEN, optimizer="sgd", lr=0.5, mode="sync", shard=j, num_shards=2)
              for j in range(2)]
    clients = []
    for rank in range(workers):
        c = PSClient([a for a, _ in served], rank=rank, num_workers=workers, rpc_deadline=30,
                     data_plane="auto", security=ClientSecurity(TOKEN))
        c.connect(5)
        c.register(LAYOUT)
        if rank == 0:
            c.init(START)
        assert all(s.fast is not None for s in c.shards), "both shards must be on the data plane"
        clients.append(c)
    return clients, [shard for _, shard in served]


def test_a_step_on_two_shards_sends_to_both_before_it_waits_on_either(shard_server):
    """PSClient.push_pull sends its push to every shard, then takes each one's replies, in one thread
    (ShardClient.push_pull_sent). Worker 0's step waits in shard 0's reply for worker 1, which has
    pushed to shard 1 only: shard 1 completes the step while worker 0 still waits, so worker 0's
    push to it was sent before that wait. Then what lands is what push then pull give, on both.
    Catches an exchange that waits on each shard before it sends to the next (shard 1's step would
    wait for worker 0, and worker 0 for worker 1's push to shard 0: the join times out)."""
    import threading

    (a, b), shards = two_shard_workers(shard_server, workers=2)
    w, wb = np.empty(LAYOUT.total, np.float32), np.empty(LAYOUT.total, np.float32)
    a.pull(w)
    b.pull(wb)
    ga = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)
    gb = np.full(LAYOUT.total, 0.25, np.float32)
    got = {}
    step = threading.Thread(target=lambda: got.update(outcomes=a.push_pull(ga, w, 8, clock=0)))
    step.start()
    b.shards[1].push(gb, 1, 0, 8, 0, 30.0)              # worker 1 on shard 1 alone, for now
    assert wait_until(lambda: shards[1].store.version == 1, 10), "worker 0's push never reached shard 1"
    assert step.is_alive() and shards[0].store.version == 0   # worker 0 still waits on shard 0
    b.shards[0].push(gb, 1, 0, 8, 0, 30.0)
    step.join(30)
    assert not step.is_alive() and got["outcomes"] == ["aggregated", "aggregated"]
    expected = START - np.float32(0.5) * (ga + gb) / np.float32(2)
    np.testing.assert_array_equal(w, expected)
    for s, shard in zip(a.shards, shards):
        np.testing.assert_array_equal(s.own(w), shard.store.params)
    assert a.versions == [1, 1]


def test_a_push_refused_by_one_shard_leaves_the_others_exchange_whole(shard_server):
    """One worker, two shards: shard 0 refuses the step's push (a stale step), shard 1 takes it.
    The refusal is raised, after shard 1's replies were taken: shard 1 applied the push, and its
    connection still frames (the next step lands exactly on both). Catches an error raised before
    the later shard's replies are read (the next exchange would read the old ones)."""
    from pserver.errors import StaleStep

    (c,), shards = two_shard_workers(shard_server)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    g1, g2 = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32), np.full(LAYOUT.total, 2.0, np.float32)
    c.versions = [7, 0]                                 # shard 0 is at version 0: refused
    with pytest.raises(StaleStep):
        c.push_pull(g1, w, 8, clock=0)
    assert [s.store.version for s in shards] == [0, 1]
    c.pull(w, 1)
    assert c.versions == [0, 1]
    assert c.push_pull(g2, w, 8, clock=1) == ["aggregated", "aggregated"]
    once, twice = START - np.float32(0.5) * g2, START - np.float32(0.5) * g1 - np.float32(0.5) * g2
    for s, shard, want in zip(c.shards, shards, (once, twice)):
        np.testing.assert_array_equal(s.own(w), s.own(want))
        np.testing.assert_array_equal(shard.store.params, s.own(want))
    assert c.versions == [1, 2]

