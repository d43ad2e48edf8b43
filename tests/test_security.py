"""The auth token, TLS and where shards bind, against live in-process shards.

A refused call must change nothing: these tests compare the shard's whole state
(parameters' bytes, version, layout, every counter, membership, pending gradients)
before and after. Refused calls never reach the shard, so no counter moves, not even
pushes_received.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from pserver import cli
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.config import ServerConfig
from pserver.errors import ConfigError, Unauthenticated, Unavailable
from pserver.wire import codec, frames
from pserver.wire.security import TOKEN_ENV, ClientSecurity, client_security
from pserver.worker import dataplane as worker_dataplane
from pserver.worker.client import PSClient
from tests.support.certs import make_certs
from tests.support.clients import LAYOUT, TOKEN
from tests.support.processes import missing

WRONG = "not-the-token"


def state(shard) -> tuple:
    """Everything a refused call must leave as it was."""
    s, p, m = shard.store, shard.policy, shard.members
    return (None if s.params is None else s.params.tobytes(), s.version, s.signature, s.total,
            s.counters.snapshot(), sorted(m.registered), sorted(m.left), sorted(m.dead),
            sorted(getattr(p, "pending", {})), m.num_workers)


def ready(address, token=TOKEN, plane="grpc", ca=None, init=True) -> PSClient:
    sec = ClientSecurity(token, ca.read_bytes() if ca else None)
    c = PSClient([address], rpc_deadline=10, data_plane=plane, security=sec)
    c.connect(5)
    c.register(LAYOUT)
    if init:
        c.init(np.arange(LAYOUT.total, dtype=np.float32))
    return c


def messages(header, arr, chunk_bytes=64) -> list:
    """A tensor stream as plain protobuf messages, as any gRPC client would send it."""
    return [pb.TensorChunk.FromString(codec.serialize_chunk(m))
            for m in codec.encode(header, arr, chunk_bytes)]


def every_rpc(stub, metadata, session: str = "") -> dict:
    """One well-formed call of each RPC: with the right token each would be accepted."""
    sig = LAYOUT.signature()
    spec = [pb.TensorSpec(name=t.name, shape=t.shape) for t in LAYOUT.tensors]
    kw = dict(metadata=metadata, timeout=5)
    return {
        "Register": lambda: stub.Register(pb.RegisterRequest(rank=0, num_workers=1, shard=0, num_shards=1,
                                                             layout=spec,
                                                             protocol_version=codec.PROTOCOL_VERSION), **kw),
        "Init": lambda: stub.Init(iter(messages(pb.TensorHeader(rank=0, shard=0, layout_signature=sig,
                                                                session=session),
                                                 np.full(33, 7, np.float32))), **kw),
        "Pull": lambda: list(stub.Pull(pb.PullRequest(rank=0, shard=0, seen_version=-1, session=session),
                                       **kw)),
        "Push": lambda: stub.Push(iter(messages(pb.TensorHeader(rank=0, shard=0, step=0, num_samples=4,
                                                                session=session),
                                                 np.ones(33, np.float32))), **kw),
        "Status": lambda: stub.Status(pb.StatusRequest(), **kw),
        "Leave": lambda: stub.Leave(pb.LeaveRequest(rank=0, session=session), **kw),
        "Checkpoint": lambda: stub.Checkpoint(pb.CheckpointRequest(rank=0, session=session), **kw),
    }


BAD_METADATA = {
    "missing": None,
    "wrong": [("authorization", f"Bearer {WRONG}")],
    "no scheme": [("authorization", TOKEN)],
    "prefix": [("authorization", f"Bearer {TOKEN[:-1]}")],
    "empty": [("authorization", "Bearer ")],
}


@pytest.mark.parametrize("how", BAD_METADATA)
def test_every_rpc_without_the_token_is_unauthenticated_and_changes_nothing(shard_server, how):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = ready(addr)
    before = state(shard)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    for name, call in every_rpc(stub, BAD_METADATA[how]).items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, e.value)
        details = e.value.details()
        assert "authorization" in details and TOKEN not in details and WRONG not in details
    assert state(shard) == before
    # The same calls with the token are accepted: the refusals above were about the token.
    good = every_rpc(stub, [("authorization", f"Bearer {TOKEN}")], c.shards[0].session)
    assert good["Push"]().outcome == pb.PushReply.AGGREGATED and shard.store.version == 1
    c.close()


def test_client_with_a_wrong_or_missing_token_gets_one_line_naming_the_shard(shard_server):
    addr, shard = shard_server(auth_token=TOKEN)
    before = state(shard)
    for token, words in ((WRONG, "does not match"), (None, "requires a token")):
        with pytest.raises(Unauthenticated) as e:
            ready(addr, token=token)
        msg = str(e.value)
        assert msg.startswith(f"shard 0 at {addr}: authorization:") and words in msg
        assert "\n" not in msg and TOKEN not in msg and WRONG not in msg
    assert state(shard) == before


@pytest.mark.parametrize("plane", ["grpc", "auto"])
def test_training_works_with_the_right_token(shard_server, plane):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = ready(addr, plane=plane)
    assert (c.shards[0].fast is not None) == (plane == "auto")
    w = np.empty(33, np.float32)
    for step in range(3):
        assert c.pull(w) == [step]
        assert c.push(np.ones(33, np.float32), 4) == [("aggregated", step + 1)]
    c.pull(w)
    np.testing.assert_array_equal(w, np.arange(33) - 3.0)
    st = c.status()[0].counters
    assert (st.pushes_received, st.pushes_aggregated, st.pushes_rejected) == (3, 3, 0)
    c.leave()
    c.close()


# --- the same-host data plane -----------------------------------------------------------
def raw_dataplane(shard) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(shard.dataplane.path)
    return s


def read_reply(sock) -> tuple[int, str]:
    code, _, _, _, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    return code, frames.recv_exact(sock, n).decode() if n else ""


def assert_closed(sock) -> None:
    assert sock.recv(1) == b"", "the shard must close a refused connection"


@pytest.mark.parametrize("token, words", [(None, "requires a token"), (WRONG, "does not match"),
                                          (TOKEN[:-1], "does not match")])
def test_data_plane_hello_needs_the_token(shard_server, token, words):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0)
    c = ready(addr, plane="auto")
    before = state(shard)
    with pytest.raises(Unauthenticated, match=words) as e:
        worker_dataplane.DataPlaneChannel(shard.dataplane.address, 0, 0, 33, "shard 0 (data plane)", token)
    assert TOKEN not in str(e.value)
    assert state(shard) == before
    c.pull(np.empty(33, np.float32))
    assert c.push(np.ones(33, np.float32), 1) == [("aggregated", 1)]   # the right token still works
    c.close()


def test_data_plane_refuses_requests_before_an_authenticated_hello(shard_server):
    addr, shard = shard_server(auth_token=TOKEN)
    c = ready(addr, plane="auto")
    before = state(shard)
    for op in (frames.PUSH, frames.PULL, frames.INIT):
        sock = raw_dataplane(shard)
        sock.sendall(frames.REQUEST.pack(frames.MAGIC, op, 0, 0, 0, 0, 33, 1, 1000))
        code, message = read_reply(sock)
        assert frames.CODES[code] == "UNAUTHENTICATED" and "HELLO" in message
        assert_closed(sock)
    # A HELLO that declares a huge token is refused before anything is read or allocated.
    sock = raw_dataplane(shard)
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.HELLO, 0, 0, 0, 0, 0, 0, 0)
                 + frames.TOKEN_LEN.pack(1 << 31))
    code, message = read_reply(sock)
    assert frames.CODES[code] == "UNAUTHENTICATED" and "longer than" in message
    assert_closed(sock)
    assert state(shard) == before
    c.close()


# --- TLS --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_with_the_ca_trains_and_without_it_cannot_connect(shard_server, certs):
    addr, shard = shard_server(auth_token=TOKEN, tls_cert=str(certs.cert), tls_key=str(certs.key),
                               optimizer="sgd", lr=1.0)
    c = ready(addr, ca=certs.ca)
    w = np.empty(33, np.float32)
    assert c.pull(w) == [0] and c.push(np.ones(33, np.float32), 1) == [("aggregated", 1)]
    for ca in (None, certs.other_ca):               # plain text, or a CA that did not sign it
        bad = PSClient([addr], rpc_deadline=1,
                       security=ClientSecurity(TOKEN, ca.read_bytes() if ca else None))
        with pytest.raises(Unavailable) as e:
            bad.connect(1.0)
        assert re.match(f"shard 0 at {addr}: no answer within [0-9.]+ s .*--tls-ca", str(e.value))
        assert "\n" not in str(e.value)
        with pytest.raises(Unavailable, match=f"shard 0 at {addr}: unavailable for 1 s despite retries"):
            bad.register(LAYOUT)
        bad.close()
    assert shard.store.version == 1
    c.close()


def test_a_connect_that_times_out_leaves_no_thread_polling_the_channel():
    """Catches the channel-ready future left subscribed after its timeout: gRPC's thread that
    polls the channel's connectivity then ran for the rest of the process, one per failed
    connect (one was alive in a test process that hung in .ci/run)."""
    with socket.socket() as s:                       # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    before = set(threading.enumerate())
    client = PSClient([addr], rpc_deadline=1)
    with pytest.raises(Unavailable, match="no answer within"):
        client.connect(0.3)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and set(threading.enumerate()) - before:
        time.sleep(0.05)
    assert not [t.name for t in set(threading.enumerate()) - before]
    client.close()


def test_unreadable_tls_files_are_one_line_config_errors(tmp_path, certs):
    missing = str(tmp_path / "nope.pem")
    cases = [(dict(tls_cert=missing, tls_key=str(certs.key)), f"--tls-cert: cannot read {missing}"),
             (dict(tls_cert=str(certs.cert), tls_key=missing), f"--tls-key: cannot read {missing}"),
             (dict(tls_cert=str(certs.cert)), "go together"),
             (dict(tls_cert=str(certs.key), tls_key=str(certs.key)), "not a PEM file holding a certificate")]
    for kw, words in cases:
        with pytest.raises(ConfigError, match=words):
            ServerConfig(port=0, **kw)
    with pytest.raises(ConfigError, match=f"--tls-ca: cannot read {missing}"):
        client_security(None, missing)


# --- flags, environment, and where shards bind -----------------------------------------
def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_token_from_flag_or_environment_and_bad_tokens_are_not_echoed(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert cli.server_config(parse("serve", "--port", "0")).auth_token is None
    assert cli.server_config(parse("serve", "--auth-token", TOKEN)).auth_token == TOKEN
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = cli.worker_config(parse("worker", "--ps", "127.0.0.1:2222"))
    assert cfg.auth_token == TOKEN and TOKEN not in repr(cfg)
    assert TOKEN not in repr(cli.server_config(parse("serve")))
    assert TOKEN not in repr(ClientSecurity(TOKEN))
    for bad in ("has space", "tab\there", "é-accent", "x" * 5000):
        with pytest.raises(ConfigError, match="--auth-token: a token must be") as e:
            cli.server_config(parse("serve", "--auth-token", bad))
        assert bad not in str(e.value)
    monkeypatch.setenv(TOKEN_ENV, "bad token")
    with pytest.raises(ConfigError, match=f"{TOKEN_ENV}: a token must be"):
        cli.worker_config(parse("worker", "--ps", "127.0.0.1:2222"))


def status_main(monkeypatch, capsys, addr, token) -> tuple[int, str, str]:
    if token is None:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(TOKEN_ENV, token)
    code = cli.main(["status", "--ps", addr, "--timeout", "5"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_needs_the_token_and_says_so_in_one_line(shard_server, monkeypatch, capsys):
    addr, shard = shard_server(auth_token=TOKEN)
    ready(addr).close()
    for token in (None, WRONG):
        code, out, err = status_main(monkeypatch, capsys, addr, token)
        assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
        assert "pserver status: error: shard 0" in err and "authorization" in err and TOKEN not in err
    code, out, err = status_main(monkeypatch, capsys, addr, TOKEN)
    assert code == 0 and "shard" in out and err == ""


def listening_hosts(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state_hex = line.split()[1], line.split()[3]
            host, _, p = local.partition(":")
            if int(p, 16) == port and state_hex == "0A":
                found.add(proc_address(host))
    return found


def proc_address(text: str) -> str:
    """/proc/net/tcp's hex (32-bit words in host order, little-endian here) -> dotted or v6 text;
    an IPv4-mapped v6 address (gRPC binds 127.0.0.1 on a dual-stack socket) as plain v4."""
    raw = b"".join(bytes.fromhex(text[i:i + 8])[::-1] for i in range(0, len(text), 8))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    v6 = socket.inet_ntop(socket.AF_INET6, raw)
    return v6.removeprefix("::ffff:")


def test_shards_bind_loopback_unless_told(shard_server, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert ServerConfig().host == "127.0.0.1"
    assert cli.server_config(parse("serve", "--port", "0")).host == "127.0.0.1"
    addr, _ = shard_server()
    port = int(addr.rpartition(":")[2])
    hosts = listening_hosts(port)
    if not hosts:
        missing("the loopback-binding test", "/proc/net/tcp is not readable here")
    assert hosts == {"127.0.0.1"}


# --- a push that streams while its rank is taken over (issue 46.2) ------------------------------
AUTH = [("authorization", f"Bearer {TOKEN}")]   # timeouts below: the first Init loads the kernels
TAKEOVER_PART = 8            # elements per data-plane part: 33 elements go in five parts


def raw_register(stub, rank: int, previous: str = "") -> str:
    """Register `rank` of 2 as a plain protobuf client; its session credential."""
    spec = [pb.TensorSpec(name=t.name, shape=t.shape) for t in LAYOUT.tensors]
    return stub.Register(pb.RegisterRequest(rank=rank, num_workers=2, shard=0, num_shards=1, layout=spec,
                                            protocol_version=codec.PROTOCOL_VERSION,
                                            previous_session=previous),
                         metadata=AUTH, timeout=60).session


def raw_push_of(stub, rank: int, session: str, g: np.ndarray):
    header = pb.TensorHeader(rank=rank, shard=0, step=0, num_samples=1, session=session)
    return stub.Push(iter(messages(header, g)), metadata=AUTH, timeout=60)


def grpc_push_paused(addr: str, shard, session: str, g: np.ndarray, takeover) -> tuple[str, str]:
    """Rank 1's push over gRPC on a channel of its own, paused after its header (the shard has
    authorized it and waits for the payload) while `takeover()` runs; (status code, details)."""
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    first, *rest = messages(pb.TensorHeader(rank=1, shard=0, step=0, num_samples=1, session=session), g)
    head = pb.TensorChunk(header=first.header)            # the header alone, the payload after
    data = [pb.TensorChunk(data=first.data), *rest]
    go = threading.Event()

    def stream():
        yield head
        go.wait(10)
        yield from data

    seen = shard.members.last_seen[1]
    answer = stub.Push.future(stream(), metadata=AUTH, timeout=20)
    deadline = time.monotonic() + 10
    while shard.members.last_seen[1] == seen and time.monotonic() < deadline:
        time.sleep(0.01)                                  # until the shard authorized the push
    assert shard.members.last_seen[1] != seen, "the shard never authorized the paused push"
    takeover()
    go.set()
    try:
        reply = answer.result()
        return "OK", f"{reply.outcome} {reply.message}"
    except grpc.RpcError as e:
        return e.code().name, e.details()


def dataplane_push_paused(shard, session: str, g: np.ndarray, takeover) -> tuple[str, str]:
    """Rank 1's push over the data plane, by hand: part 0 goes with the request; once the shard
    has copied it (FREE), so authorized the push, `takeover()` runs, then the other parts."""
    sock = raw_dataplane(shard)
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.HELLO, 1, 0, 0, 0, 0, 0, 0)
                 + b"".join(frames.TOKEN_LEN.pack(len(f)) + f for f in (TOKEN.encode(), session.encode())))
    msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
    assert frames.REPLY.unpack(msg)[0] == 0 and len(fds) == 2
    slots = np.frombuffer(mmap.mmap(fds[0], 2 * TAKEOVER_PART * 4), np.float32).reshape(2, TAKEOVER_PART)
    parts = [g[a:a + TAKEOVER_PART] for a in range(0, g.size, TAKEOVER_PART)]
    slots[0][:parts[0].size] = parts[0]
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PUSH, 1, 0, 0, 0, g.size, 1, 10_000))
    assert frames.recv_exact(sock, 1) == frames.FREE     # part 0 copied: the push was authorized
    takeover()
    for k, part in enumerate(parts[1:], 1):
        if k >= 3:                                        # slot k % 2 is free once part k - 2 is copied
            assert frames.recv_exact(sock, 1) == frames.FREE
        slots[k % 2][:part.size] = part
        sock.sendall(frames.READY)
    code, message = read_reply(sock)
    sock.close()
    for fd in fds:
        os.close(fd)
    return frames.CODES[code], message


@pytest.mark.parametrize("plane", ["grpc", "dataplane"])
def test_a_push_streaming_when_its_rank_is_taken_over_is_refused_and_changes_nothing(
        shard_server, monkeypatch, plane):
    """Issue 46.2: rank 1 (credential S1) starts a push of 100s for step 0; a restarted process takes
    rank 1 over (Register presenting S1: S2); then the first push's payload arrives. It is refused
    as taken over, its gradient in no step; the restarted process's push of 1s is taken in, and the
    step is (3 + 1) / 2 with rank 0's 3s. Fails if the policy holds a push without checking, under
    the take-over's lock, that its session is still the rank's: the step would be (3 + 100) / 2 and
    the restarted process's push refused as already pushed."""
    monkeypatch.setattr(frames, "PART_ELEMENTS", TAKEOVER_PART)
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync", num_workers=2,
                               step_timeout=60)
    start = np.arange(33, dtype=np.float32)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    s0 = raw_register(stub, 0)
    s1 = raw_register(stub, 1)
    stub.Init(iter(messages(pb.TensorHeader(rank=0, shard=0, layout_signature=LAYOUT.signature(), session=s0),
                            start)), metadata=AUTH, timeout=60)
    assert raw_push_of(stub, 0, s0, np.full(33, 3, np.float32)).outcome == pb.PushReply.AGGREGATED
    taken = {}

    def takeover():
        taken["s2"] = raw_register(stub, 1, previous=s1)

    old = np.full(33, 100, np.float32)
    if plane == "grpc":
        code, message = grpc_push_paused(addr, shard, s1, old, takeover)
    else:
        code, message = dataplane_push_paused(shard, s1, old, takeover)
    assert (code, "was taken over by a restarted process" in message) == ("UNAUTHENTICATED", True), \
        (code, message)
    assert shard.store.version == 0 and shard.policy.pending.keys() == {0}
    np.testing.assert_array_equal(shard.store.params, start)
    reply = raw_push_of(stub, 1, taken["s2"], np.ones(33, np.float32))   # the restarted process's
    assert (reply.outcome, reply.version) == (pb.PushReply.AGGREGATED, 1)
    np.testing.assert_array_equal(shard.store.params, start - 2)         # (3 + 1) / 2, lr 1
    counters = shard.store.counters.snapshot()
    assert (counters["pushes_aggregated"], counters["sessions_taken_over"]) == (2, 1)
