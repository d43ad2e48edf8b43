"""The same-host data plane against hostile clients and killed shards, with real
`pserver serve` processes: a client that resizes the shared memory it was given, a shard
killed with SIGKILL (its socket left behind), and a socket directory others can enter."""

from __future__ import annotations

import glob
import mmap
import os
import signal
import socket
import stat
import tempfile

import numpy as np
import pytest

from pserver.wire import frames
from pserver.worker.client import PSClient
from tests.support.clients import LAYOUT, START
from tests.support.processes import Proc, missing

NBYTES = LAYOUT.total * 4
SERVE = ["serve", "--port", "0", "--mode", "sync", "--optimizer", "sgd", "--lr", "1"]


@pytest.fixture
def tmpdir_env():
    """A TMPDIR of its own (short: a socket path must fit in 108 bytes), so that sockets
    of other tests on this machine are not in the way."""
    with tempfile.TemporaryDirectory(prefix="ps") as d:
        yield d, {"TMPDIR": d}


def sockets_under(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "**", "pserver-*.sock"), recursive=True))


def request(sock, op, step=0, seen=0) -> tuple[int, int, str]:
    """One data-plane call as rank 0: (status code, version, message)."""
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, op, 0, 0, step if op == frames.PUSH else seen,
                                        0, LAYOUT.total, 1, 10_000))
    code, _, _, _, n, version = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    return code, version, frames.recv_exact(sock, n).decode() if n else ""


def test_a_client_that_resizes_its_memfds_cannot_crash_the_shard(procs, tmpdir_env):
    _, env = tmpdir_env
    shard = procs(*SERVE, env=env)
    addr = shard.address()
    c = PSClient([addr], rpc_deadline=30)
    c.connect(30)
    c.register(LAYOUT)
    c.init(START)
    info = c.shards[0].info
    # A second connection for worker 0, spoken by hand, with its session where the shard has sessions.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(info.dataplane.removeprefix("unix:"))
    session = getattr(c.shards[0], "session", "").encode()
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.HELLO, 0, 0, 0, 0, 0, 0, 0)
                 + frames.TOKEN_LEN.pack(0) + frames.TOKEN_LEN.pack(len(session)) + session)
    _, (push_fd, params_fd), _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
    for fd in (push_fd, params_fd):            # the sizes the shard maps are sealed
        for size in (0, 4, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        assert os.fstat(fd).st_size == NBYTES
    # Then it pushes and pulls through the very buffers it tried to shrink.
    push = np.frombuffer(mmap.mmap(push_fd, NBYTES), np.float32)
    params = np.frombuffer(mmap.mmap(params_fd, NBYTES, prot=mmap.PROT_READ), np.float32)
    push[:] = 1
    assert request(sock, frames.PUSH, step=0)[:2] == (0, 1)
    assert request(sock, frames.PULL, seen=0)[:2] == (0, 1)
    np.testing.assert_array_equal(params, START - 1)
    assert shard.popen.poll() is None, shard.output
    status = c.status()[0]
    assert status.version == 1 and status.counters.pushes_rejected == 0
    sock.close()
    c.close()


def test_a_killed_shards_socket_is_removed_when_the_next_one_starts(procs, tmpdir_env):
    tmp, env = tmpdir_env
    first = procs(*SERVE, env=env)
    first.address()
    (stale,) = sockets_under(tmp)
    os.kill(first.popen.pid, signal.SIGKILL)
    first.popen.wait(30)
    assert os.path.exists(stale)               # SIGKILL leaves it behind
    # One more that refuses connections although its pid (ours) is alive: nothing listens.
    refusing = os.path.join(os.path.dirname(stale), f"pserver-{os.getpid()}-shard0-0123abcd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(refusing)
    second = procs(*SERVE, env=env)
    second.address()
    assert not os.path.exists(stale) and not os.path.exists(refusing)
    (live,) = sockets_under(tmp)
    directory = os.path.dirname(live)
    st = os.lstat(directory)
    assert directory == os.path.join(tmp, f"pserver-{os.getuid()}")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def with_mode(path: str, mode: int) -> str:
    os.mkdir(path)
    os.chmod(path, mode)
    return f"a directory owned by uid {os.getuid()} with mode {mode:04o}"


def elsewhere(path: str) -> str:
    """A symlink to a directory of ours with the right mode: someone could point it anywhere."""
    os.mkdir(path + ".real", 0o700)
    os.symlink(path + ".real", path)
    return "not a directory"


def other_owner(path: str) -> str:
    if os.getuid() != 0:
        missing("the other-owner case", "only root can give a directory to another user (CI runs as root)")
    os.mkdir(path, 0o700)
    os.chown(path, 65534, 65534)
    return "a directory owned by uid 65534 with mode 0700"


SETUPS = {"0755": lambda p: with_mode(p, 0o755), "1777": lambda p: with_mode(p, 0o1777), "symlink": elsewhere,
          "other owner": other_owner}


@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
def test_a_socket_directory_others_can_enter_is_refused(procs, tmpdir_env, setup):
    tmp, env = tmpdir_env
    directory = os.path.join(tmp, f"pserver-{os.getuid()}")
    found = setup(directory)
    shard: Proc = procs(*SERVE, env=env)
    shard.port_seen.wait(60)                   # set when it listens, or when its output ends
    assert shard.port is None, "the shard started with a socket directory others can enter"
    assert shard.wait(30) == 2
    out = shard.output
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1
    assert f"{directory} must be a directory owned by uid {os.getuid()} with mode 0700; it is {found}" in out
    assert not sockets_under(tmp)
