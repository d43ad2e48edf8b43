"""Hostile and malformed requests against a live in-process shard.

Every request gets a proper status code (never INTERNAL or UNKNOWN, which mean a bug),
a rejected request changes nothing, and the shard keeps serving with bounded memory.
"Changes nothing" is checked on the whole state; the one documented exception: a push
whose header was read counts in pushes_received and pushes_rejected (docs/semantics.md: every
push is accounted for), so those two counters may both move by one.

Messages over gRPC's 4 MiB receive limit get RESOURCE_EXHAUSTED from gRPC itself,
before any pserver code runs.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver._proto import pserver_pb2 as pb
from pserver.errors import FailedPrecondition
from pserver.wire import codec, frames
from pserver.worker import dataplane as worker_dataplane
from pserver.worker.client import PSClient
from tests.support.clients import LAYOUT

SIG = LAYOUT.signature()
SERVICE = "/pserver.v1.ParameterServer/"
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
PUSH_COUNTERS = {"pushes_received", "pushes_rejected"}


def state(shard) -> dict:
    s, p, m = shard.store, shard.policy, shard.members
    return dict(params=None if s.params is None else s.params.tobytes(), version=s.version,
                signature=s.signature, total=s.total, counters=s.counters.snapshot(),
                registered=sorted(m.registered), left=sorted(m.left), dead=sorted(m.dead),
                pending=sorted(getattr(p, "pending", {})), num_workers=m.num_workers,
                sessions=dict(m.sessions))


def settled(shard, timeout: float = 2.0) -> dict:
    """The state once every push has an outcome: a call that gRPC ended (deadline, size
    limit) is answered to the client a moment before its handler finishes."""
    deadline = time.monotonic() + timeout
    while True:
        st = state(shard)
        c = st["counters"]
        done = c["pushes_applied"] + c["pushes_aggregated"] + c["pushes_dropped_late"] + c["pushes_rejected"]
        if done == c["pushes_received"] or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def assert_unchanged(before: dict, after: dict, push: bool = False) -> None:
    """Equal, but for a push: received and rejected may both have moved by one."""
    b, a = dict(before), dict(after)
    cb, ca = b.pop("counters"), a.pop("counters")
    assert a == b
    moved = {k for k in cb if cb[k] != ca[k]}
    if push and moved:
        assert moved == PUSH_COUNTERS and all(ca[k] - cb[k] == 1 for k in moved), (cb, ca)
    else:
        assert not moved, (cb, ca)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Raw:
    """Calls any method with raw bytes: no client-side serialization, no checks."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)])

    def call(self, method: str, payload, timeout: float = 2.0) -> grpc.StatusCode:
        kind = {"Init": "su", "Push": "su", "Pull": "us"}.get(method, "uu")
        path = SERVICE + method
        try:
            if kind == "su":
                self.channel.stream_unary(path)(iter(payload), timeout=timeout)
            elif kind == "us":
                list(self.channel.unary_stream(path)(payload, timeout=timeout))
            else:
                self.channel.unary_unary(path)(payload, timeout=timeout)
        except grpc.RpcError as e:
            assert e.code() not in BUGS, (method, e.code(), e.details())
            assert e.details(), (method, e.code())
            return e.code()
        return grpc.StatusCode.OK


def wire(header: pb.TensorHeader | None = None, data: bytes | None = None) -> bytes:
    return pb.TensorChunk(header=header).SerializeToString() if header is not None \
        else pb.TensorChunk(data=data).SerializeToString()


def tensor(values, **header) -> list[bytes]:
    """A well-formed stream (header, then 64-byte chunks), as bytes."""
    h = pb.TensorHeader(**header)
    return [codec.serialize_chunk(m) for m in codec.encode(h, np.asarray(values, np.float32), 64)]


@pytest.fixture
def live(shard_server):
    """A registered, initialized shard (2 workers, so one push never completes a step)."""
    addr, shard = shard_server(optimizer="sgd", lr=1.0, num_workers=2)
    clients = []
    for rank in (0, 1):
        c = PSClient([addr], rank=rank, num_workers=2, rpc_deadline=10, data_plane="grpc")
        c.connect(5)
        c.register(LAYOUT)
        clients.append(c)
    clients[0].init(np.arange(33, dtype=np.float32))
    raw = Raw(addr)
    raw.clients = clients                         # the two workers, whose sessions stay live
    raw.session = clients[0].shards[0].session    # rank 0's credential, for well-formed requests
    yield addr, shard, raw
    for c in clients:
        c.close()


def still_serves(raw) -> None:
    """Both workers (their sessions untouched by the hostile calls) push and pull: one step
    completes."""
    cs = raw.clients
    w = np.empty(33, np.float32)
    for c in cs:
        c.pull(w, seen=[-1])
    v = cs[0].versions[0]
    for c in cs:
        try:
            c.push(np.zeros(33, np.float32), 1)
        except FailedPrecondition as e:     # a fuzzed push was accepted for this step already
            assert "already pushed" in str(e)
    assert cs[0].pull(w) == [v + 1]


# --- named hostile inputs ----------------------------------------------------------
ONES = np.ones(33)


def cases(session: str) -> dict:
    """Each hostile request, well-formed but for its one fault (rank 0's session inside)."""
    GOOD = dict(rank=0, shard=0, step=0, num_samples=1, session=session)  # noqa: N806
    return {
        "second header": ("Push", tensor(ONES, **GOOD)[:2] + [wire(pb.TensorHeader(rank=0))],
                          "INVALID_ARGUMENT"),
        "data before header": ("Push", [wire(data=b"\0" * 8)] + tensor(ONES, **GOOD), "INVALID_ARGUMENT"),
        "no header": ("Push", [wire(data=b"\0" * 132)], "INVALID_ARGUMENT"),
        "empty stream": ("Push", [], "INVALID_ARGUMENT"),
        "truncated": ("Push", tensor(ONES, **GOOD)[:2], "INVALID_ARGUMENT"),
        "too long": ("Push", tensor(ONES, **GOOD) + [wire(data=b"\0" * 4)], "INVALID_ARGUMENT"),
        "not a message": ("Push", [b"\xff\xff\xff"], "INVALID_ARGUMENT"),
        "negative rank": ("Push", tensor(ONES, **GOOD | dict(rank=-1)), "FAILED_PRECONDITION"),
        "step far ahead": ("Push", tensor(ONES, **GOOD | dict(step=1 << 62)), "FAILED_PRECONDITION"),
        "negative step": ("Push", tensor(ONES, **GOOD | dict(step=-5)), "FAILED_PRECONDITION"),
        "unknown shard": ("Push", tensor(ONES, **GOOD | dict(shard=7)), "FAILED_PRECONDITION"),
        "huge declared size": ("Push", [wire(pb.TensorHeader(**GOOD, num_elements=1 << 40, dtype="float32"))],
                               "INVALID_ARGUMENT"),
        "negative declared size": ("Push", [wire(pb.TensorHeader(**GOOD, num_elements=-1, dtype="float32"))],
                                   "INVALID_ARGUMENT"),
        "float64": ("Push", [wire(pb.TensorHeader(**GOOD, num_elements=33, dtype="float64"))],
                    "INVALID_ARGUMENT"),
        "NaN": ("Push", tensor(np.full(33, np.nan), **GOOD), "INVALID_ARGUMENT"),
        "chunk over 4 MiB": ("Push", [wire(pb.TensorHeader(**GOOD, num_elements=33, dtype="float32")),
                                      wire(data=b"\0" * (5 << 20))], "RESOURCE_EXHAUSTED"),
        "init: huge size": ("Init", [wire(pb.TensorHeader(rank=0, layout_signature=SIG, num_elements=1 << 40,
                                                          session=session, dtype="float32"))],
                            "INVALID_ARGUMENT"),
        "init: wrong layout": ("Init", tensor(ONES, rank=0, layout_signature="0" * 16, session=session),
                               "FAILED_PRECONDITION"),
        "init: negative rank": ("Init", tensor(ONES, rank=-3, layout_signature=SIG, session=session),
                                "FAILED_PRECONDITION"),
        "pull: negative rank": ("Pull", pb.PullRequest(rank=-1).SerializeToString(), "FAILED_PRECONDITION"),
        "pull: version far ahead": ("Pull", pb.PullRequest(rank=0, seen_version=1 << 62, session=session)
                                    .SerializeToString(), "FAILED_PRECONDITION"),
        "pull: unknown shard": ("Pull", pb.PullRequest(rank=0, shard=9, session=session).SerializeToString(),
                                "FAILED_PRECONDITION"),
        "pull: not a message": ("Pull", b"\x08", "INVALID_ARGUMENT"),
        "register: negative rank": ("Register", pb.RegisterRequest(
            rank=-1, num_workers=2, num_shards=1, protocol_version=codec.PROTOCOL_VERSION,
            layout=[pb.TensorSpec(name="w", shape=[10, 3]), pb.TensorSpec(name="b", shape=[3])])
            .SerializeToString(), "FAILED_PRECONDITION"),
        "register: unknown shard": ("Register", pb.RegisterRequest(
            rank=0, num_workers=2, shard=3, num_shards=4, protocol_version=codec.PROTOCOL_VERSION)
            .SerializeToString(), "FAILED_PRECONDITION"),
        # sessions (docs/semantics.md, "Security"): a token holder cannot act for another worker,
        # nor take a live rank
        "register: a live rank": ("Register", pb.RegisterRequest(
            rank=1, num_workers=2, num_shards=1, protocol_version=codec.PROTOCOL_VERSION,
            layout=[pb.TensorSpec(name="w", shape=[10, 3]), pb.TensorSpec(name="b", shape=[3])])
            .SerializeToString(), "ALREADY_EXISTS"),
        "register: another protocol": ("Register", pb.RegisterRequest(
            rank=1, num_workers=2, num_shards=1, protocol_version=1,
            layout=[pb.TensorSpec(name="w", shape=[10, 3]), pb.TensorSpec(name="b", shape=[3])])
            .SerializeToString(), "FAILED_PRECONDITION"),
        "push: no session": ("Push", tensor(ONES, **GOOD | dict(session="")), "UNAUTHENTICATED"),
        "push: rank 0's session for rank 1": ("Push", tensor(ONES, **GOOD | dict(rank=1)), "UNAUTHENTICATED"),
        "pull: rank 0's session for rank 1": ("Pull", pb.PullRequest(rank=1, seen_version=-1, session=session)
                                              .SerializeToString(), "UNAUTHENTICATED"),
        "leave: rank 0's session for rank 1": ("Leave", pb.LeaveRequest(rank=1, session=session)
                                               .SerializeToString(), "UNAUTHENTICATED"),
        "leave: no session": ("Leave", pb.LeaveRequest(rank=0).SerializeToString(), "UNAUTHENTICATED"),
        "checkpoint: no session": ("Checkpoint", pb.CheckpointRequest(rank=0).SerializeToString(),
                                   "UNAUTHENTICATED"),
        "heartbeat: no session": ("Heartbeat", pb.HeartbeatRequest(rank=1).SerializeToString(),
                                  "UNAUTHENTICATED"),
        "register: over 4 MiB": ("Register", pb.RegisterRequest(
            layout=[pb.TensorSpec(name="x" * 1024, shape=[1])] * 5000).SerializeToString(),
            "RESOURCE_EXHAUSTED"),
        "leave: negative rank": ("Leave", pb.LeaveRequest(rank=-1).SerializeToString(),
                                 "FAILED_PRECONDITION"),
        "unknown method": ("Destroy", b"", "UNIMPLEMENTED"),
    }


CASES = list(cases(""))


@pytest.mark.parametrize("name", CASES)
def test_hostile_request_gets_its_code_and_changes_nothing(live, name):
    addr, shard, raw = live
    method, payload, code = cases(raw.session)[name]
    before = state(shard)
    assert raw.call(method, payload).name == code
    assert_unchanged(before, settled(shard), push=method == "Push")
    still_serves(raw)


LAYOUTS = {
    "int64 overflow": [[1 << 62, 4]],
    "wraps to a small size": [[(1 << 32) + 1, 1 << 32]],
    "over the limit": [[1 << 20, 1 << 20]],
    "negative": [[-1, 5]],
    "two negatives": [[-4, -4]],
    "empty": [[0]],
    "no tensors": [],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_register_checks_declared_sizes_before_it_allocates(shard_server, name):
    """On a fresh shard: a bad layout is INVALID_ARGUMENT and leaves it unconfigured."""
    addr, shard = shard_server()
    layout = [pb.TensorSpec(name=f"t{i}", shape=s) for i, s in enumerate(LAYOUTS[name])]
    req = pb.RegisterRequest(rank=0, num_workers=1, num_shards=1, layout=layout,
                             protocol_version=codec.PROTOCOL_VERSION)
    before = state(shard)
    assert Raw(addr).call("Register", req.SerializeToString()).name == "INVALID_ARGUMENT"
    assert_unchanged(before, state(shard))


@pytest.mark.parametrize("rank, num_workers, code", [(-1, 2, "FAILED_PRECONDITION"),
                                                     (2, 2, "FAILED_PRECONDITION"),
                                                     (0, 3, "FAILED_PRECONDITION"),
                                                     (0, 0, "INVALID_ARGUMENT")])
def test_a_refused_register_leaves_a_fresh_shard_unconfigured(shard_server, rank, num_workers, code):
    addr, shard = shard_server(num_workers=2)
    spec = [pb.TensorSpec(name=t.name, shape=t.shape) for t in LAYOUT.tensors]
    req = pb.RegisterRequest(rank=rank, num_workers=num_workers, num_shards=1, layout=spec,
                             protocol_version=codec.PROTOCOL_VERSION)
    before = state(shard)
    assert Raw(addr).call("Register", req.SerializeToString()).name == code
    assert_unchanged(before, state(shard))


# --- random requests (hypothesis) ----------------------------------------------------
small = st.integers(-2, 3)
i32 = st.one_of(small, st.integers(-(1 << 31), (1 << 31) - 1))
i64 = st.one_of(small, st.integers(-(1 << 63), (1 << 63) - 1))
LIVE_SESSION = [""]   # rank 0's credential, set by the test: well-formed requests reach the checks
sessions = st.one_of(st.just(""), st.text(max_size=8), st.builds(lambda: LIVE_SESSION[0]))
headers = st.builds(pb.TensorHeader, rank=i32, shard=i32, step=i64, clock=i64, num_samples=i32,
                    session=sessions,
                    num_elements=st.one_of(st.just(33), i64),
                    dtype=st.one_of(st.sampled_from(["float32", "float64", ""]), st.text(max_size=6)),
                    layout_signature=st.one_of(st.just(SIG), st.text(max_size=20)), finished=st.booleans())
finite = st.lists(st.floats(-1e3, 1e3, width=32), min_size=33, max_size=33).map(
    lambda xs: np.asarray(xs, np.float32).tobytes())
chunks = st.one_of(headers.map(lambda h: wire(h)),
                   st.one_of(st.binary(max_size=300), finite).map(lambda d: wire(data=d)),
                   st.binary(max_size=64))                     # bytes that may not parse at all
streams = st.one_of(st.lists(chunks, max_size=6),
                    st.tuples(headers, finite).map(lambda t: [wire(t[0]), wire(data=t[1])]))
specs = st.builds(pb.TensorSpec, name=st.text(max_size=8), shape=st.lists(i64, max_size=4))
registers = st.builds(pb.RegisterRequest, rank=i32, num_workers=st.one_of(st.just(2), i32),
                      protocol_version=st.one_of(st.just(codec.PROTOCOL_VERSION), i32),
                      shard=st.one_of(st.just(0), i32), num_shards=st.one_of(st.just(1), i32),
                      batch_size=i32, layout=st.one_of(st.lists(specs, max_size=4),
                                                       st.just([pb.TensorSpec(name="w", shape=[10, 3]),
                                                                pb.TensorSpec(name="b", shape=[3])])))
pulls = st.builds(pb.PullRequest, rank=i32, shard=i32, seen_version=i64, clock=i64, session=sessions)
unary = st.one_of(registers.map(lambda m: ("Register", m.SerializeToString())),
                  pulls.map(lambda m: ("Pull", m.SerializeToString())),
                  i32.map(lambda r: ("Leave", pb.LeaveRequest(rank=r).SerializeToString())),
                  i32.map(lambda r: ("Checkpoint", pb.CheckpointRequest(rank=r).SerializeToString())),
                  st.tuples(st.sampled_from(["Register", "Pull", "Status", "Leave", "Checkpoint", "Nope"]),
                            st.binary(max_size=200)))
FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_fuzz_live_server(live):
    addr, shard, raw = live
    LIVE_SESSION[0] = raw.session
    seen: dict[str, set] = {}
    rss_start = None

    def check(method, payload, timeout=2.0):
        before = state(shard)
        code = raw.call(method, payload, timeout)
        seen.setdefault(method, set()).add(code.name)
        if code != grpc.StatusCode.OK:
            assert_unchanged(before, settled(shard), push=method == "Push")

    @FUZZ
    @given(method=st.sampled_from(["Push", "Init"]), stream=streams)
    def fuzz_streams(method, stream):
        check(method, stream)

    @FUZZ
    @given(call=unary)
    def fuzz_unary(call):
        method, payload = call
        check(method, payload, timeout=0.15 if method == "Pull" else 2.0)   # a sync pull may wait

    fuzz_streams()                          # warm-up: the first calls size gRPC's own pools
    rss_start = rss_mb()
    started = time.monotonic()
    fuzz_unary()
    fuzz_streams()
    grown = rss_mb() - rss_start
    assert grown < 40, f"RSS grew by {grown:.1f} MB"
    assert "INVALID_ARGUMENT" in seen["Push"] and "FAILED_PRECONDITION" in seen["Push"], seen
    print(f"fuzz: {time.monotonic() - started:.1f} s, RSS +{grown:.1f} MB, codes {seen}")
    still_serves(raw)


# --- the same-host data plane -------------------------------------------------------
planes = st.tuples(st.sampled_from([frames.PUSH, frames.PULL, frames.INIT, 0, 9]), i32, i32, i64, i64,
                   st.one_of(st.just(33), i64), i32, st.integers(0, 50),
                   st.one_of(st.binary(min_size=132, max_size=132), finite))


def test_fuzz_data_plane(live):
    """Random requests after a HELLO: each gets a status in the reply, none INTERNAL."""
    addr, shard, raw = live
    chan = worker_dataplane.DataPlaneChannel(shard.dataplane.address, 0, 0, 33, "shard 0",
                                             session=raw.session)
    seen = set()

    @FUZZ
    @given(req=planes)
    def fuzz(req):
        op, rank, sh, step, clock, n, samples, timeout_ms, payload = req
        chan.push_buf[:] = np.frombuffer(payload, np.float32)
        before = state(shard)
        tail = frames.SIGNATURE.pack(SIG.encode()) if op == frames.INIT else b""
        chan.sock.sendall(frames.REQUEST.pack(frames.MAGIC, op, rank, sh, step, clock, n, samples,
                                                 timeout_ms) + tail)
        code, _, _, _, size, _ = frames.REPLY.unpack(frames.recv_exact(chan.sock, frames.REPLY.size))
        message = frames.recv_exact(chan.sock, size).decode() if size else ""
        assert frames.CODES[code] != "INTERNAL", message
        seen.add(frames.CODES[code])
        if code:
            assert message
            assert_unchanged(before, settled(shard), push=op == frames.PUSH)

    fuzz()
    chan.close()
    assert {"INVALID_ARGUMENT", "FAILED_PRECONDITION"} <= seen, seen
    still_serves(raw)
