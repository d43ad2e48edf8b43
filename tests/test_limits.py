"""What a client can make a shard hold is bounded, and Status answers under every load.

Real gRPC servers in this process, real clients on their own channels. Each test starts a
load that held a shard's threads or memory before the bounds of server/limits.py existed.
Latencies are printed (pytest -s shows them) and asserted only against generous deadlines.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver.models.layout import Layout
from pserver.wire import codec
from pserver.worker.client import PSClient
from tests.support.clients import session_of

LAYOUT = Layout.of([("w", (64,))])
SERVICE = "/pserver.v1.ParameterServer/"


def status_latency(address: str, deadline: float = 20.0) -> float:
    """Seconds one Status call took on a fresh channel (raises if it missed the deadline)."""
    channel = grpc.insecure_channel(address)
    started = time.monotonic()
    channel.unary_unary(SERVICE + "Status")(pb.StatusRequest().SerializeToString(), timeout=deadline)
    took = time.monotonic() - started
    channel.close()
    return took


def waiting_in_shard(kind: str = "wait_for") -> int:
    """Threads of this process currently blocked in the shard's `kind` function."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == kind and "pserver" in frame.f_code.co_filename:
                count += 1
                break
            frame = frame.f_back
    return count


def client(address, rank, num_workers, deadline=60.0):
    c = PSClient([address], rank=rank, num_workers=num_workers, rpc_deadline=deadline, data_plane="grpc")
    c.connect(5)
    c.register(LAYOUT)
    return c


def test_more_sync_workers_than_threads_all_train_and_none_is_marked_dead(shard_server):
    """40 sync workers against a 16-thread shard, half of them a second late to each step.
    The early half's parked pulls used to take every thread, so the late pushes never ran
    until the step timed out and live workers were marked dead."""
    n, steps = 40, 3
    addr, shard = shard_server(threads=16, optimizer="sgd", lr=0.1, step_timeout=10)
    clients = [client(addr, r, n) for r in range(n)]
    clients[0].init(np.zeros(LAYOUT.total, np.float32))
    errors: list = []

    def train(c):
        w = np.empty(LAYOUT.total, np.float32)
        try:
            c.pull(w)
            for _ in range(steps):
                if c.rank >= n // 2:
                    time.sleep(1.0)
                c.push(np.ones(LAYOUT.total, np.float32), 1)
                c.pull(w)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(c,)) for c in clients]
    started = time.monotonic()
    for t in threads:
        t.start()
    latencies = []
    while any(t.is_alive() for t in threads) and time.monotonic() - started < 120:
        latencies.append(status_latency(addr))
        time.sleep(0.2)
    for t in threads:
        t.join(1)
    st = shard.status()
    print(f"40 sync workers, 16 threads: {time.monotonic() - started:.1f} s, Status latency max "
          f"{max(latencies):.3f} s (median {sorted(latencies)[len(latencies) // 2]:.3f}), "
          f"{st['counters'].get('requests_refused_busy')} calls refused busy and retried")
    assert not errors, errors[:3]
    assert st["version"] == steps and st["counters"]["workers_marked_dead"] == 0
    for c in clients:
        c.close()


def stalled_push(address, session, rank, release: threading.Event, out: dict) -> threading.Thread:
    """A push stream that sends its header and one chunk, then nothing until released."""
    with_session = {"session": session} if session else {}
    msgs = list(codec.encode(pb.TensorHeader(rank=rank, shard=0, step=0, num_samples=1, **with_session),
                             np.ones(LAYOUT.total, np.float32), 64))

    def stream():
        yield msgs[0]
        yield msgs[1]
        release.wait(60)

    def run():
        channel = grpc.insecure_channel(address)
        call = channel.stream_unary(SERVICE + "Push", request_serializer=codec.serialize_chunk)
        try:
            call(stream(), timeout=60)
            out[rank] = "OK"
        except grpc.RpcError as e:
            out[rank] = e.code().name
        channel.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_stalled_push_streams_neither_block_status_nor_hold_threads(shard_server):
    """30 authenticated workers each open a push and stall mid-stream on a 16-thread shard.
    They used to hold every thread: Status timed out. Now streams past their share are
    refused at once, and a stream silent for --step-timeout is cancelled."""
    n = 30
    addr, shard = shard_server(threads=16, optimizer="sgd", lr=0.1, step_timeout=2.0)
    clients = [client(addr, r, n) for r in range(n)]
    clients[0].init(np.zeros(LAYOUT.total, np.float32))
    release, out = threading.Event(), {}
    stalls = [stalled_push(addr, session_of(c), c.rank, release, out) for c in clients]
    time.sleep(0.5)
    took = status_latency(addr, deadline=10)
    print(f"Status under {n} stalled push streams: {took:.3f} s")
    assert took < 10
    for t in stalls:
        t.join(10)                        # refused at once, or cancelled after --step-timeout
    release.set()
    assert set(out.values()) <= {"RESOURCE_EXHAUSTED", "CANCELLED"}, out
    assert "RESOURCE_EXHAUSTED" in out.values() and len(out) == n
    assert shard.store.version == 0 and not shard.policy.pending     # nothing half-received applied
    for c in clients:
        c.close()


# A process that opens a sync pull for each (rank, session) given, says so, and waits to be killed.
PULLER = """
import sys, time, grpc
from pserver._proto import pserver_pb2 as pb
address, calls = sys.argv[1], []
pull = grpc.insecure_channel(address).unary_stream("/pserver.v1.ParameterServer/Pull")
for arg in sys.argv[2:]:
    rank, session = arg.split(":", 1)
    req = pb.PullRequest(rank=int(rank), seen_version=0, **({"session": session} if session else {}))
    calls.append(pull(req.SerializeToString(), timeout=120))
print("open", flush=True)
time.sleep(300)
"""


def test_pulls_whose_client_went_away_stop_waiting(shard_server):
    """A sync pull parks until the next step; when its client disconnects it used to keep
    its thread until its own deadline. The client is a process killed with SIGKILL (its
    connection cut by the kernel, as a crashed worker's is): cancelling and closing an
    in-process channel instead hung this test once in CI, inside gRPC's client."""
    addr, shard = shard_server(threads=32, optimizer="sgd", lr=0.1)
    clients = [client(addr, r, 2) for r in range(2)]
    clients[0].init(np.zeros(LAYOUT.total, np.float32))
    puller = subprocess.Popen([sys.executable, "-c", PULLER, addr,
                               *(f"{c.rank}:{session_of(c)}" for c in clients)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert puller.stdout.readline().strip() == "open"
        deadline = time.monotonic() + 10             # waits for version 1, which never comes
        while waiting_in_shard() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting_in_shard() == 2
    finally:
        puller.kill()
        puller.wait(10)
    deadline = time.monotonic() + 5
    while waiting_in_shard() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting_in_shard() == 0, "a pull kept waiting after its client went away"
    for c in clients:
        c.close()


def test_a_layout_too_big_for_memory_is_refused_before_anything_is_allocated(shard_server):
    """2^33 float32 elements (within the documented bound of a layout) need 64 GiB with
    SGD on one shard: RESOURCE_EXHAUSTED naming the size and the limit, nothing changed."""
    addr, shard = shard_server()
    version = {"protocol_version": codec.PROTOCOL_VERSION} if hasattr(codec, "PROTOCOL_VERSION") else {}
    req = pb.RegisterRequest(rank=0, num_workers=1, num_shards=1,
                             layout=[pb.TensorSpec(name="w", shape=[1 << 33])], **version)
    channel = grpc.insecure_channel(addr)
    try:
        channel.unary_unary(SERVICE + "Register")(req.SerializeToString(), timeout=30)
        code, details = "OK", ""
    except grpc.RpcError as e:
        code, details = e.code().name, e.details()
    assert code == "RESOURCE_EXHAUSTED", (code, details)
    assert "8589934592 elements" in details and "MiB" in details and "limit" in details
    st = shard.status()
    assert st["total_params"] == 0 and st["layout_signature"] == "" and shard.store.params is None
    c = st["counters"]
    assert c["pushes_received"] == c["pushes_rejected"] == 0
    client(addr, 0, 1)                           # a model that fits still registers
    assert shard.status()["total_params"] == LAYOUT.total


def test_limits_refuse_past_each_share_and_give_slots_back():
    """The arithmetic of server/limits.py, alone: shares of a 24-thread pool, the per-worker
    bound, the bytes bound, the Checkpoint-call bound; a refused call is counted."""
    from pserver.errors import ResourceExhausted
    from pserver.server.limits import CHECKPOINT_CALLS, PER_RANK, RESERVED, Limits, pool_threads
    from pserver.server.store import Counters

    counters = Counters()
    lim = Limits(24, 10 << 20, 1.0, counters)
    assert (lim.max_pulls, lim.max_streams) == (9, 7) and 24 - RESERVED == 16
    assert lim.stream_slots(4 << 20) == 2 and lim.stream_slots(1) == 7      # bytes, then threads
    assert pool_threads(64, 100) == 2 * 100 + RESERVED + 4 and pool_threads(64, 2) == 64
    with lim.waiting(0, lambda: True) as a, lim.waiting(0, lambda: True) as b:
        a.park()
        b.park()
        with lim.waiting(0, lambda: True) as c:
            try:
                c.park()
                raise AssertionError(f"a third waiting pull of one worker was admitted ({PER_RANK} max)")
            except ResourceExhausted as e:
                assert "2 per worker" in str(e)
    assert lim.parked_pulls() == 0
    held = [lim.checkpoint_call() for _ in range(CHECKPOINT_CALLS)]
    for h in held:
        h.__enter__()
    try:
        with lim.checkpoint_call():
            raise AssertionError("a fifth Checkpoint call was admitted")
    except ResourceExhausted as e:
        assert "Checkpoint calls" in str(e)
    for h in held:
        h.__exit__(None, None, None)
    with lim.checkpoint_call():
        pass
    assert counters.snapshot()["requests_refused_busy"] == 2


def test_max_memory_mb_bounds_the_layout_a_shard_accepts(shard_server):
    """--max-memory-mb 1: a 1M-element layout (4 MiB of parameters) is refused by name."""
    addr, shard = shard_server(max_memory_mb=1)
    big = PSClient([addr], rpc_deadline=5, data_plane="grpc")
    big.connect(5)
    try:
        big.register(Layout.of([("w", (1 << 20,))]))
        raise AssertionError("a layout over --max-memory-mb was accepted")
    except Exception as e:  # noqa: BLE001 - the message is the point
        assert type(e).__name__ == "ResourceExhausted" and "--max-memory-mb" in str(e), e
    assert shard.store.params is None
    client(addr, 0, 1)                               # 64 elements fit
