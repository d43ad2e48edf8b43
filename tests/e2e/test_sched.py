"""--sched: a shard process's threads under Linux's SCHED_BATCH unless told otherwise
(pserver.server.app.schedule), so that a worker's push wakes the shard without the shard taking
the worker's core before the worker has sent to the other shards. The policies are read from
/proc of a real `pserver serve`."""

from __future__ import annotations

import os
import subprocess

import pytest

from pserver.api import serve
from pserver.config import ServerConfig
from pserver.errors import ConfigError
from tests.support.processes import pserver_cmd, with_a_second_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                                reason="SCHED_BATCH and /proc/PID/task are Linux's")


def policies(pid: int) -> dict[int, int]:
    """Each thread of process `pid`: its scheduling policy."""
    return {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_of_a_shard_is_sched_batch_by_default_and_other_under_sched_normal(procs):
    batch = procs("serve", "--port", "0", "--num-workers", "1")
    normal = procs("serve", "--port", "0", "--num-workers", "1", "--sched", "normal")
    batch.address(), normal.address()                # both serve: their threads are all started
    got = policies(batch.popen.pid)
    assert len(got) > 4, got                         # the gRPC pool, the data plane, ...
    assert set(got.values()) == {os.SCHED_BATCH}, got
    assert set(policies(normal.popen.pid).values()) == {os.SCHED_OTHER}


def test_threads_started_before_the_policy_is_set_take_it_too():
    # A prestarted shard (pserver run) may have threads before serve: each is set, not only the caller.
    out = with_a_second_thread("from pserver.server.app import schedule\n"
                               "assert schedule('batch')\n"
                               "tids = os.listdir('/proc/self/task')\n"
                               "print(sorted({os.sched_getscheduler(int(i)) for i in tids}))\n"
                               "assert not schedule('normal')\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{os.SCHED_BATCH}]"]


def test_an_in_process_shard_leaves_its_callers_policy_alone():
    before = policies(os.getpid())
    with serve(num_workers=1):
        assert set(policies(os.getpid()).values()) == set(before.values())


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ConfigError, match="--sched: 'fifo' is not one of batch, normal"):
        ServerConfig(sched="fifo")
    out = subprocess.run(pserver_cmd("serve", "--port", "0", "--sched", "fifo"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--sched" in out.stderr and "invalid choice: 'fifo'" in out.stderr
