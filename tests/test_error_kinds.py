"""Error kinds (pserver.errors.KINDS) across the wire: the servicer's trailing metadata, the
data plane's kind byte, the client's translation, and the callers that branch on the class.
No code in pserver/ may branch on an error's text: the last tests grep for it."""

from __future__ import annotations

import pathlib
import re
import signal
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from pserver import errors
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.config import ServerConfig
from pserver.errors import (
    KIND_METADATA,
    AlreadyPushed,
    FailedPrecondition,
    NotRegistered,
    SeenVersionAhead,
    StaleStep,
    TakenOver,
    Unauthenticated,
    rpc_error_for,
)
from pserver.server.app import create_server
from pserver.wire import frames
from pserver.wire.security import ClientSecurity
from pserver.worker.client import PSClient, ShardClient
from pserver.worker.run import push_pull
from tests.support.clients import LAYOUT, START, TOKEN, raw_hello, worker
from tests.support.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONES = np.ones(LAYOUT.total, np.float32)


# --- the table --------------------------------------------------------------------------
def test_every_kind_has_a_unique_wire_name_and_a_status_codes_class_above_it():
    assert list(errors.KINDS) == ["stale_step", "already_pushed", "not_registered", "seen_version_ahead",
                                  "taken_over", "over_budget", "join_step_open", "lease_gone"]
    # append only: the data plane sends positions
    for kind, cls in errors.KINDS.items():
        assert cls.kind == kind and cls.code_name in errors.RPC_ERRORS
        assert issubclass(cls, errors.RPC_ERRORS[cls.code_name])
    assert frames.KINDS == ["", *errors.KINDS]
    assert all(cls.kind == "" for cls in errors.RPC_ERRORS.values())


@pytest.mark.parametrize("code, kind, expected", [
    ("FAILED_PRECONDITION", "stale_step", StaleStep),
    ("FAILED_PRECONDITION", "already_pushed", AlreadyPushed),
    ("FAILED_PRECONDITION", "not_registered", NotRegistered),
    ("FAILED_PRECONDITION", "seen_version_ahead", SeenVersionAhead),
    ("UNAUTHENTICATED", "taken_over", TakenOver),
    ("FAILED_PRECONDITION", "", FailedPrecondition),                 # an older shard: no kind
    ("FAILED_PRECONDITION", "a_kind_from_a_newer_release", FailedPrecondition),
    ("UNAUTHENTICATED", "stale_step", Unauthenticated),              # a kind of another status code
    ("INVALID_ARGUMENT", "not_registered", errors.InvalidArgument),
])
def test_the_kind_picks_the_class_and_the_status_code_is_the_fallback(code, kind, expected):
    e = rpc_error_for(code, "shard 0: the message", kind)
    assert type(e) is expected and str(e) == "shard 0: the message" and e.code_name == code


def test_an_unknown_status_code_stays_a_plain_rpc_error_with_its_name():
    e = rpc_error_for("DATA_LOSS", "lost", "stale_step")
    assert type(e) is errors.RpcError and e.code_name == "DATA_LOSS" and str(e) == "lost"


# --- gRPC: trailing metadata --------------------------------------------------------------
def trailing_kind(e: grpc.RpcError) -> str | None:
    return dict(e.trailing_metadata() or ()).get(KIND_METADATA)


def test_a_raw_grpc_client_reads_the_kind_in_the_trailing_metadata(shard_server):
    """The stubs generated from protos/pserver.proto (tests/test_proto.py keeps them current),
    as any other language's client: status and message as before, the kind beside them."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")
    meta = [("authorization", f"Bearer {TOKEN}")]
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))

    def pull(**fields) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Pull(pb.PullRequest(**fields), timeout=5, metadata=meta))
        return e.value

    e = pull(rank=0, shard=0)                       # nobody has registered yet
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and trailing_kind(e) == "not_registered"
    assert e.details() == "layout: no worker has registered with this shard yet"
    c = worker(addr, data_plane="grpc")
    e = pull(rank=0, shard=0, seen_version=99, session=c.shards[0].session)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and trailing_kind(e) == "seen_version_ahead"
    assert e.details().startswith("seen_version: 99 is ahead of shard 0's version 0")
    e = pull(rank=0, shard=3, session=c.shards[0].session)    # a refusal of no kind: no metadata
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and trailing_kind(e) is None
    e = pull(rank=0, shard=0, session="not-the-session")
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and trailing_kind(e) is None
    c.close()


# --- the data plane: the kind byte ------------------------------------------------------------
def raw_reply(sock) -> tuple[int, int, str]:
    code, _, _, kind, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    return code, kind, frames.recv_exact(sock, n).decode() if n else ""


def test_the_data_plane_carries_the_kind_in_the_byte_that_was_padding(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")
    c = worker(addr)
    sock, _ = raw_hello(shard, c)
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PULL, 0, 0, 99, 0, LAYOUT.total, 0, 1000))
    reply = frames.recv_exact(sock, frames.REPLY.size)
    code, _, _, kind, n, _ = frames.REPLY.unpack(reply)
    assert (frames.CODES[code], frames.KINDS[kind]) == ("FAILED_PRECONDITION", "seen_version_ahead")
    message = frames.recv_exact(sock, n).decode()
    assert message.startswith("seen_version: 99 is ahead of shard 0's version 0")
    # An older client reads the same header with a pad byte where the kind is: same answer.
    assert struct.unpack("<BBBxIq", reply)[0] == code and struct.unpack("<BBBxIq", reply)[3] == n
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.PULL, 0, 3, -1, 0, LAYOUT.total, 0, 1000))
    code, kind, message = raw_reply(sock)               # a refusal of no kind: byte 0
    assert (frames.CODES[code], kind) == ("FAILED_PRECONDITION", 0) and message.startswith("shard: ")
    sock.close()
    c.close()


def test_a_reply_decodes_to_the_kind_or_falls_back_on_the_status_code():
    fp = frames.CODES.index("FAILED_PRECONDITION")
    assert type(frames.reply_error(fp, frames.KINDS.index("stale_step"), "m")) is StaleStep
    assert type(frames.reply_error(fp, 0, "m")) is FailedPrecondition          # an older shard
    assert type(frames.reply_error(fp, len(frames.KINDS), "m")) is FailedPrecondition   # a newer one
    assert type(frames.reply_error(len(frames.CODES), 1, "m")).__name__ == "RpcError"
    assert frames.reply_error(len(frames.CODES), 1, "m").code_name == "INTERNAL"
    assert frames.error_codes(StaleStep("m")) == (fp, frames.KINDS.index("stale_step"))
    assert frames.error_codes(TakenOver("m")) == (frames.CODES.index("UNAUTHENTICATED"),
                                                  frames.KINDS.index("taken_over"))
    assert frames.error_codes(FailedPrecondition("m")) == (fp, 0)
    assert frames.error_codes(errors.DeadlineExceeded("m")) == (frames.CODES.index("DEADLINE_EXCEEDED"), 0)
    odd = errors.RpcError("m")
    odd.code_name = "DATA_LOSS"
    assert frames.error_codes(odd) == (frames.CODES.index("INTERNAL"), 0)


# --- the client: the class a user sees ----------------------------------------------------------
@pytest.mark.parametrize("plane", ["auto", "grpc"])
def test_the_client_raises_the_kind_over_either_plane(shard_server, plane):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync")
    c = worker(addr, num_workers=2, data_plane=plane)
    s = c.shards[0]
    with pytest.raises(StaleStep, match="^shard 0 at .*: step: push for step 99 but shard 0 is at version 0"):
        s.push(ONES, 0, 99, 1, 0, 5)
    with pytest.raises(SeenVersionAhead, match="seen_version: 99 is ahead"):
        s._pull_once(np.empty(LAYOUT.total, np.float32), 0, 99, 0, 5)
    other = PSClient([addr], rank=1, num_workers=2, rpc_deadline=5, security=ClientSecurity(TOKEN))
    with pytest.raises(NotRegistered, match="rank: worker 1 has not registered with shard 0"):
        other.shards[0]._pull_once(np.empty(LAYOUT.total, np.float32), 1, -1, 0, 5)
    other.close()
    c.close()


def test_a_taken_over_session_is_told_apart_from_a_wrong_one(shard_server, tmp_path):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr, data_plane="grpc")
    old = c.shards[0].session
    c.shards[0].previous = old
    c.shards[0]._register_once(0, 1, 1, LAYOUT, 0, 5, previous=old)     # a restarted process
    c.shards[0].session = old
    with pytest.raises(TakenOver, match="was taken over by a restarted process"):
        c.shards[0].heartbeat(0, 5)
    c.shards[0].session = "0" * 32
    with pytest.raises(Unauthenticated, match="does not carry that worker's session") as e:
        c.shards[0].heartbeat(0, 5)
    assert type(e.value) is Unauthenticated
    c.close()


def test_a_shard_that_forgot_the_worker_is_joined_again(shard_server, capsys):
    """NotRegistered (the shard restarted and lost its members) makes the client register
    again and repeat the call; any other refusal goes to the caller."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr, data_plane="grpc")
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    with shard.store.cond:                     # as a restart would: rank 0 unknown
        shard.members.registered.discard(0)
        shard.members.sessions.pop(0)
    before = c.shards[0].session
    assert c.pull(w) == [0]
    assert c.shards[0].session != before and shard.members.registered == {0}
    c.shards[0]._joined = None                 # nothing to join again with: the error goes up
    with shard.store.cond:
        shard.members.registered.discard(0)
        shard.members.sessions.pop(0)
    with pytest.raises(NotRegistered):
        c.pull(w)
    c.close()


def test_a_shard_that_keeps_forgetting_is_joined_three_times_then_reported(shard_server, monkeypatch):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr, data_plane="grpc")
    s = c.shards[0]
    joins = []
    real = s._rejoin
    monkeypatch.setattr(s, "_rejoin", lambda quiet: (joins.append(quiet), real(quiet))[1])
    calls = []

    def forgetful():
        calls.append(1)
        raise NotRegistered("rank: worker 0 has not registered with shard 0; call Register first")

    with pytest.raises(NotRegistered):
        s.resilient(forgetful, 5)
    assert joins == [False, False, False] and len(calls) == 4
    with pytest.raises(StaleStep):             # not a forgotten worker: no rejoin
        s.resilient(lambda: (_ for _ in ()).throw(StaleStep("step: x")), 5)
    assert len(joins) == 3
    c.close()


def test_the_seen_version_a_shard_refuses_is_pulled_again_as_none_seen(shard_server):
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr, data_plane="grpc")
    w = np.zeros(LAYOUT.total, np.float32)
    assert c.pull(w, seen=[99]) == [0]
    np.testing.assert_array_equal(w, START)
    c.close()


# --- the client's retries: what a user sees when they run out -------------------------------
def free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def ran_out(s: ShardClient, what: str, seconds: str) -> str:
    return (f"^{re.escape(s.label)}: {what} for {seconds} s despite retries \\(--rpc-deadline\\); "
            f"last error: ")


def test_an_unreachable_shard_is_retried_for_retry_for_then_named_with_the_time():
    """Retried for retry_for (not the extra `waits`, which is for DEADLINE_EXCEEDED alone),
    then one Unavailable naming the shard, what failed, for how long and the last error."""
    s = ShardClient(0, free_address(), data_plane="grpc")
    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match=ran_out(s, "unavailable", "0.3") + re.escape(s.label)):
        s.resilient(lambda: s.status(timeout=0.2), 0.3, waits=5)
    assert 0.1 < time.monotonic() - started < 10
    s.close()


def test_a_stopping_worker_does_not_wait_for_a_shard_to_come_back(monkeypatch):
    """Catches a retry loop that ignores a stop signal: under a killed launcher every child gets
    SIGTERM at once, the shards go, and a worker's pool thread retried them for --rpc-deadline
    while its exit waited for that thread (a child outlived its launcher by 30 s in CI)."""
    from pserver import signals
    s = ShardClient(0, free_address(), data_plane="grpc")
    monkeypatch.setattr(signals, "_stopping", [int(signal.SIGTERM)])
    started = time.monotonic()
    with pytest.raises(errors.Unavailable):
        s.resilient(lambda: s.status(timeout=0.2), 30)
    assert time.monotonic() - started < 5
    s.close()


def test_a_wait_that_ran_out_is_retried_only_in_a_call_that_waits():
    """DEADLINE_EXCEEDED: retried for retry_for + waits in a call that waits (a pull), never
    in one that does not (the default: a push goes to the caller at once, unchanged)."""
    s = ShardClient(0, free_address(), data_plane="grpc")
    calls = []

    def wait_ran_out():
        calls.append(time.monotonic())
        raise errors.DeadlineExceeded("shard 0: the pull's wait ran out")

    with pytest.raises(errors.DeadlineExceeded, match="^shard 0: the pull's wait ran out$"):
        s.resilient(wait_ran_out, 5)
    assert len(calls) == 1
    with pytest.raises(errors.DeadlineExceeded, match=ran_out(s, "deadline exceeded", "0.7") + "shard 0"):
        s.resilient(wait_ran_out, 0.1, waits=0.6)
    assert len(calls) > 3 and calls[-1] - calls[1] > 0.3
    s.close()


def test_a_worker_whose_shard_went_away_rejoins_quietly_until_the_retries_run_out():
    """A registered worker retries an unreachable shard by registering again, quietly: the
    user sees the one Unavailable after retry_for, not the first failed Register's."""
    server, port, shard = create_server(ServerConfig(port=0, auth_token=TOKEN, mode="async"))
    c = worker(f"127.0.0.1:{port}", data_plane="grpc")
    s = c.shards[0]
    shard.close()
    server.stop(0).wait()
    with pytest.raises(errors.Unavailable, match=ran_out(s, "unavailable", "0.5")):
        s.resilient(lambda: s.status(timeout=0.2), 0.5)
    c.close()


@pytest.mark.parametrize("call", ["lease_data", "set_lr", "checkpoint"])
def test_a_call_retried_on_a_restarted_shard_carries_the_new_sessions_credential(call, tmp_path):
    """The shard restarts on its port and forgets the worker: the call is refused (not registered),
    the worker registers again, and the call tried again carries the new credential. Catches a
    request built once, before the retries: the retry carried the old session's credential and
    the worker died on 'does not carry that worker's session credential' (a clean-clone CI run
    lost a worker so when shard 0 was SIGKILLed and restored while a lease ask was out)."""
    cfg = dict(auth_token=TOKEN, mode="async", optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path))
    server, port, shard = create_server(ServerConfig(port=0, **cfg))
    c = worker(f"127.0.0.1:{port}", data_plane="grpc")
    c.pull(np.empty(LAYOUT.total, np.float32))              # what the restarted shard is seeded with
    old = c.shards[0].session
    shard.close()
    server.stop(0).wait()
    server, _, shard = create_server(ServerConfig(port=port, **cfg))
    try:
        if call == "lease_data":
            assert c.lease_data(12, 4, 3, "fp").has_lease
        elif call == "set_lr":
            c.set_lr(0.5)
            assert shard.status()["lr"] == 0.5
        else:
            assert pathlib.Path(c.checkpoint()[0][0]).exists()
        assert c.shards[0].session not in ("", old)
    finally:
        c.close()
        shard.close()
        server.stop(0)


@pytest.mark.parametrize("a_client_of_a_gone_shard_was_there", [False, True])
def test_a_call_to_a_shard_that_never_answers_ends_at_its_deadline(a_client_of_a_gone_shard_was_there):
    """The timeout reaches gRPC: a Status the server holds for 3 s ends at its 0.3 s deadline.
    Also catches channels sharing connections: a client still trying a shard gone from this port
    (a test's never closed, or a worker's) made a new client of the server started there fail at
    once with the old "Connection refused" (a clean-clone CI run failed so)."""
    from concurrent import futures
    held = threading.Event()
    port = free_port()
    if a_client_of_a_gone_shard_was_there:
        gone = ShardClient(0, f"127.0.0.1:{port}", data_plane="grpc")
        with pytest.raises(errors.Unavailable):
            gone.status(timeout=0.5)

    def hold(request, context):
        held.wait(3)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pserver.v1.ParameterServer", {"Status": grpc.unary_unary_rpc_method_handler(hold)})])
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    s = ShardClient(0, f"127.0.0.1:{port}", data_plane="grpc")
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded, match=f"^{re.escape(s.label)}: "):
        s.status(timeout=0.3)
    assert time.monotonic() - started < 2.5   # the server holds it 3 s
    held.set()
    s.close()
    if a_client_of_a_gone_shard_was_there:
        gone.close()
    server.stop(0)


def test_a_pull_whose_wait_ran_out_on_the_shard_is_tried_again(shard_server, monkeypatch):
    """pull_into gives DEADLINE_EXCEEDED up to twice the session timeout on top of its own:
    what the pull waits for (a slow worker's push, or its removal) may still come."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    c = worker(addr, data_plane="grpc")
    s = c.shards[0]
    real, tries = s._pull_once, []

    def ran_out_once(*args):
        tries.append(args)
        if len(tries) == 1:
            raise errors.DeadlineExceeded("shard 0: the pull's wait ran out")
        return real(*args)

    monkeypatch.setattr(s, "_pull_once", ran_out_once)
    w = np.zeros(LAYOUT.total, np.float32)
    assert s.pull_into(w, 0, -1, 0, 0.01) == (0, False) and len(tries) == 2
    np.testing.assert_array_equal(w, START)
    c.close()


def test_the_pull_again_after_a_refused_seen_version_is_the_same_workers(shard_server):
    """Rank 1's pull after SeenVersionAhead goes as rank 1 (with rank 1's session)."""
    addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="async")
    a = worker(addr, rank=0, num_workers=2, data_plane="grpc")
    b = worker(addr, rank=1, num_workers=2, init=False, data_plane="grpc")
    w = np.zeros(LAYOUT.total, np.float32)
    assert b.pull(w, seen=[99]) == [0]
    np.testing.assert_array_equal(w, START)
    a.close()
    b.close()


class CodeLess(grpc.RpcError):
    """An RpcError that never reached a shard: no status code, no trailing metadata."""

    def code(self):
        return None

    def details(self):
        return "the channel closed"


def test_an_rpc_error_without_a_status_code_is_a_plain_rpc_error_named_unknown():
    s = ShardClient(3, free_address(), data_plane="grpc")

    def fails():
        raise CodeLess()

    with pytest.raises(errors.RpcError) as e:
        s.call(fails)
    assert type(e.value) is errors.RpcError and e.value.code_name == "UNKNOWN"
    assert str(e.value) == f"{s.label}: the channel closed"
    s.close()


def test_the_data_plane_sends_no_kind_for_one_it_does_not_know():
    e = errors.FailedPrecondition("step: x")
    e.kind = "a_kind_from_a_newer_release"
    assert frames.error_codes(e) == (frames.CODES.index("FAILED_PRECONDITION"), 0)


# --- the worker: survives a stale step, nothing else ---------------------------------------------
class Refusing:
    """A PSClient whose push_pull raises `error`; records the pulls made after it."""

    def __init__(self, error: Exception) -> None:
        self.error, self.pulls = error, []

    def push_pull(self, *args, **kwargs):
        raise self.error

    def pull(self, w, clock=0):
        self.pulls.append(clock)


@pytest.mark.parametrize("error", [StaleStep("step: push for step 3 but shard 0 is at version 4"),
                                   AlreadyPushed("rank: worker 0 already pushed for step 4")])
def test_the_worker_pulls_again_after_a_stale_step(error):
    client = Refusing(error)
    assert push_pull(client, ONES, ONES.copy(), 4, 6) == ["rejected"] and client.pulls == [7]


@pytest.mark.parametrize("error", [
    FailedPrecondition("step: a message that names the step but is no kind (an older shard)"),
    FailedPrecondition("rank: worker 0 was marked dead after --step-timeout"),
    NotRegistered("rank: worker 0 has not registered with shard 0; call Register first"),
    SeenVersionAhead("seen_version: 9 is ahead of shard 0's version 4 (step)"),
])
def test_the_worker_stops_on_any_other_refusal_whatever_its_text(error):
    client = Refusing(error)
    with pytest.raises(type(error)) as e:
        push_pull(client, ONES, ONES.copy(), 4, 6)
    assert e.value is error and client.pulls == []


# --- nothing branches on an error's text --------------------------------------------------------
ERR = r"(?:e|ex|exc|err|error|failure|\w+_err|\w+_error)"          # what an error is called
TEXT_BRANCHES = [
    re.compile(rf"\bin\s+str\(\s*{ERR}\s*\)"),                            # "x" in str(e)
    re.compile(rf"\bstr\(\s*{ERR}\s*\)\s*(==|!=|\.(startswith|endswith|find|index|count)\b)"),
    re.compile(r"\.details\(\)\s*(==|!=|\.(startswith|endswith|find|index|count)\b)"),
    re.compile(r"\bin\s+\w+(\.\w+)*\.details\(\)"),                       # "x" in e.details()
    re.compile(rf"(==|!=|\bin)\s+{ERR}\.args\b|\b{ERR}\.args\s*(==|!=|\[)"),  # e.args compared
    re.compile(rf"\bre\.\w+\([^)]*(\bstr\({ERR}\)|\.details\(\))"),      # re.search(.., str(e))
]


def text_branches(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines()
            if any(p.search(line) for p in TEXT_BRANCHES)]


@pytest.mark.parametrize("line", [
    'forgot = "has not registered" in str(e)',
    'if "step" not in str(err):',
    'if str(e).startswith("seen_version"):',
    'if e.details() == "gone":',
    'if "deadline" in e.details():',
    'if "x" in e.args[0]:',
    'if err.args == ("gone",):',
    'if re.search("step", exc.details()):',
    'if re.search("step", str(e)):',
])
def test_the_grep_finds_a_branch_on_text(line):
    assert text_branches(line) == [line]


def test_no_code_in_pserver_branches_on_an_errors_text():
    found = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "pserver").rglob("*.py"))
             if "_proto" not in p.parts and (hits := text_branches(p.read_text()))}
    assert found == {}, "branch on the error's class (pserver.errors.KINDS), not on its text"
