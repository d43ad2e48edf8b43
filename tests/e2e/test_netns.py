"""Several hosts for real: a shard and workers in separate network namespaces.

Two namespaces joined by a veth pair (10.77.0.1/24 and 10.77.0.2/24); traffic flows
only between them. The shard binds its veth address; the workers reach it through
`--ps 10.77.0.1:PORT`. Needs root and the `ip` command; skipped with the reason (a failure in CI)
otherwise. The namespaces (and with them the veth pair) are deleted in every case.

Which plane carries the payloads: rank 0 uses `--data-plane grpc`, so its tensors
really cross the veth. Rank 1 keeps `auto`: namespaces share the hostname, the boot id
and the filesystem, so the shard's Unix socket is reachable and the worker uses shared
memory - correctly, since it *is* the same machine. Register, Status and Leave cross
the veth for both.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

from pserver.wire.security import TOKEN_ENV
from tests.support.processes import LOGREG, env_with, missing, read_json

pytestmark = pytest.mark.e2e
PS_IP, WORKER_IP = "10.77.0.1", "10.77.0.2"
TOKEN = "netns-token-0123456789"


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    """(shard namespace, worker namespace), joined by a veth pair; always removed."""
    if os.geteuid() != 0:
        missing("the network-namespace test", "network namespaces need root")
    if shutil.which("ip") is None:
        missing("the network-namespace test", "the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    ps_ns, w_ns = f"pserver-ps-{tag}", f"pserver-w-{tag}"
    made = []
    try:
        for ns in (ps_ns, w_ns):
            r = sh("ip", "netns", "add", ns)
            if r.returncode != 0:
                missing("the network-namespace test",
                        f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [("ip", "link", "add", f"psv{tag}a", "type", "veth", "peer", "name", f"psv{tag}b"),
                 ("ip", "link", "set", f"psv{tag}a", "netns", ps_ns),
                 ("ip", "link", "set", f"psv{tag}b", "netns", w_ns)]
        for ns, dev, ip in ((ps_ns, f"psv{tag}a", PS_IP), (w_ns, f"psv{tag}b", WORKER_IP)):
            steps += [("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev),
                      ("ip", "-n", ns, "link", "set", dev, "up"),
                      ("ip", "-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = sh(*step)
            if r.returncode != 0:
                missing("the network-namespace test",
                        f"cannot set up the veth pair ({' '.join(step)}): {r.stderr.strip()}")
        yield ps_ns, w_ns
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns)      # takes the veth pair with it


class InNamespace:
    """A pserver process inside a namespace, its output collected in the background."""

    def __init__(self, ns: str, *args: str) -> None:
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "pserver", *args]
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env_with({TOKEN_ENV: TOKEN}), start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.popen.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def port(self, timeout: float = 60) -> int:
        for _ in range(int(timeout * 10)):
            m = re.search(r"listening on \S+:(\d+)", self.output)
            if m:
                return int(m.group(1))
            if self.popen.poll() is not None:
                break
            threading.Event().wait(0.1)
        raise AssertionError(f"the shard did not start: {self.output}")

    def wait(self, timeout: float = 240) -> int:
        code = self.popen.wait(timeout)
        self.reader.join(5)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def test_shard_and_workers_in_separate_network_namespaces(namespaces, tmp_path):
    ps_ns, w_ns = namespaces
    started = []
    try:
        shard = InNamespace(ps_ns, "serve", "--host", PS_IP, "--port", "0", "--num-workers", "2",
                            "--optimizer", "sgd", "--lr", "0.1")
        started.append(shard)
        addr = f"{PS_IP}:{shard.port()}"
        summary = tmp_path / "summary.json"
        chief = InNamespace(w_ns, "worker", "--ps", addr, "--rank", "0", "--num-workers", "2", *LOGREG,
                            "--data-plane", "grpc", "--summary-json", str(summary))
        other = InNamespace(w_ns, "worker", "--ps", addr, "--rank", "1", "--num-workers", "2", *LOGREG)
        started += [chief, other]
        assert chief.wait() == 0, chief.output
        assert other.wait() == 0, other.output
        s = read_json(summary)
        assert s["test_accuracy"] >= 0.9 and s["pushes_rejected"] == 0, s
        assert "payloads over gRPC streams" in chief.output
        plane = "shared memory" if "payloads through shared memory" in other.output else "gRPC streams"
        print(f"netns: rank 0 over gRPC across the veth, rank 1 over {plane}; "
              f"accuracy {s['test_accuracy']:.4f}")
        # The shard listens on its veth address only, not even on its own namespace's loopback.
        r = sh("ip", "netns", "exec", ps_ns, sys.executable, "-c",
               f"import socket; socket.create_connection(('127.0.0.1', {addr.rpartition(':')[2]}), 2)")
        assert r.returncode != 0 and "refused" in r.stderr.lower()
    finally:
        for p in reversed(started):
            p.stop()
