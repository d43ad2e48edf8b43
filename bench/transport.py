"""Round trips through pserver's real client and shard processes, against raw gRPC and TCP.

A round trip is what a worker does every step: push P float32 (the gradient), then pull
P float32 (the weights), through PSClient.push_pull as the worker calls it (over the
data plane the pull rides with the push: one exchange). pserver runs as a user runs it:
S `python -m pserver serve` processes in sync mode with one worker (so every push completes
a step and the shard applies SGD), and a PSClient in this process. The baselines move the
same bytes between this process and one server process started by this script:

  raw_grpc  gRPC with generic handlers and no protobuf: push streams 1 MiB chunks of raw
            bytes into a preallocated buffer, pull streams them back out of it;
            run with glibc malloc's defaults and with malloc tuned (env of the server).
  tcp       plain loopback sockets, preallocated buffers on both sides, TCP_NODELAY.

Then the shard's memory: for each pserver variant, a shard in sync mode with 4 worker
threads (a PSClient each) running 20 steps at the largest size; its idle RSS (started, its
kernels loaded, before any worker), its peak RSS under that load (VmHWM, reset after the
idle reading), and the bound idle + 1.2 x (parameters + optimizer state + the 4 gradients a
sync step holds), each term printed (--memory-workers 0: none).

    .venv/bin/python bench/transport.py                  # 10M and 262,144 params, 1/2/4 shards
    .venv/bin/python bench/transport.py --quick          # small sizes, 1 shard, 3 repeats
    .venv/bin/python bench/transport.py --json out.json  # the rows as JSON (default results/transport.json)
    # the gRPC path only
    .venv/bin/python bench/transport.py --systems raw_grpc,pserver --pserver-variants grpc
    # also 40 MB across a 10 Gbit/s veth pair, beside iperf3
    sudo .venv/bin/python bench/transport.py --two-hosts
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import itertools
import json
import os
import queue
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, positive_ints, result_path, summary, table  # noqa: E402

DEFINITIONS = """\
round trip: push P float32 (the gradient), then pull P float32 (the weights), sequentially, one client
mb_per_s_per_direction = (P * 4 bytes / 1e6) / (round-trip seconds / 2)
round_trips_per_s = 1 / round-trip seconds
each figure: median of the repeats (min, max beside it); a repeat times n round trips after
warm-up round trips that are not timed; every configuration of one payload size runs at once, its
repeats interleaved with theirs (repeat r of each before repeat r + 1 of any); a ratio divides \
a row's median by the baseline's
median on the same payload (the same for both metrics); tcp runs one server process; raw_grpc runs one
server process per shard, each holding its shard's range, the client calling them in parallel as
pserver's does, and a pserver row's raw_grpc ratios use raw_grpc with the same number of shards"""

SYSTEMS = ("pserver", "raw_grpc", "tcp")
PSERVER_VARIANTS = ("grpc", "fast")
METRICS = {"mb_per_s_per_direction": "MB/s", "round_trips_per_s": "1/s"}
# Server-side env of the raw_grpc malloc-tuned variant: no mmap for large blocks and no
# trimming, so the 1 MiB chunks reuse heap memory instead of mmap/munmap (page faults) each time.
MALLOC_TUNED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4000000000",
                "MALLOC_TOP_PAD_": "268435456"}
REFERENCE = ("raw_grpc", "malloc-tuned")          # the baseline the first ratio column uses
LISTENING = re.compile(r"listening on (\S+):(\d+)")
RAW_SERVICE = "bench.Raw"
REPEAT_SECONDS = 0.5      # a repeat runs enough round trips to take about this long
MIN_ROUND_TRIPS = 3       # ... and never fewer (a 40 MB round trip can take longer than that)
WARMUP_SECONDS = 0.3      # untimed round trips first: connections, buffers, numba, caches
MIN_WARMUP = 2
START_TIMEOUT = 120.0     # seconds a server process may take to print its port (2 busy cores)
PUSH, PULL, ACK = b"P", b"L", b"K"   # the TCP baseline's one-byte framing


@dataclass
class Measurement:
    system: str
    variant: str
    params: int
    shards: int
    seconds: list[float]              # seconds per round trip, one figure per repeat
    round_trips: int                  # round trips in each repeat
    path: str = ""                    # how the payloads travelled, where the client says

    def values(self, metric: str) -> list[float]:
        if metric == "round_trips_per_s":
            return [1.0 / s for s in self.seconds]
        return [(self.params * 4 / 1e6) / (s / 2) for s in self.seconds]


# ---------------------------------------------------------------------------- timing

@dataclass
class Running:
    """A configuration with its processes up: one round trip, and the check that the
    round trips did what they should (run once timing is over)."""
    system: str
    variant: str
    params: int
    shards: int
    round_trip: Callable[[], None]
    check: Callable[[], None]
    path: Callable[[], str]
    n: int = 0
    seconds: list[float] = field(default_factory=list)


def time_interleaved(configs: list[Running], repeats: int) -> list[Measurement]:
    """Warm every configuration up, then time repeat r of each in turn before repeat r + 1
    of any, so that a change in the machine's load falls on every configuration alike."""
    for c in configs:
        _, c.n, _ = time_round_trips(c.round_trip, 0)
    for _ in range(repeats):
        for c in configs:
            t = time.perf_counter()
            for _ in range(c.n):
                c.round_trip()
            c.seconds.append((time.perf_counter() - t) / c.n)
    for c in configs:
        c.check()
    return [Measurement(c.system, c.variant, c.params, c.shards, c.seconds, c.n, c.path()) for c in configs]


def time_round_trips(round_trip, repeats: int) -> tuple[list[float], int, int]:
    """(seconds per round trip of each repeat, round trips per repeat, round trips run in all)."""
    start, warm = time.perf_counter(), []
    while len(warm) < MIN_WARMUP or time.perf_counter() - start < WARMUP_SECONDS:
        t = time.perf_counter()
        round_trip()
        warm.append(time.perf_counter() - t)
    # Sized on the warm-up's median without its first round trip, which carries one-time costs.
    n = max(MIN_ROUND_TRIPS, round(REPEAT_SECONDS / max(summary(warm[1:])[0], 1e-6)))
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            round_trip()
        seconds.append((time.perf_counter() - t) / n)
    return seconds, n, len(warm) + n * repeats


def payloads(params: int) -> tuple[np.ndarray, np.ndarray]:
    """(gradient, weights): random, finite float32, allocated once."""
    rng = np.random.default_rng(0)
    return rng.standard_normal(params, dtype=np.float32), rng.standard_normal(params, dtype=np.float32)


# ---------------------------------------------------------------------------- server processes

class ServerProcess:
    """A child that prints `listening on HOST:PORT`. A thread drains its output, so a full
    pipe never blocks it, and keeps the last lines for the error message if it dies."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.name = name
        # A session of its own, so a Ctrl-C in the terminal reaches only this script, which
        # then stops the servers itself (rather than racing them down and reporting a dead
        # shard); and a parent-death signal, so even a killed bench leaves no orphans (set
        # by the child itself: pserver's main and this script's servers call follow_parent).
        from pserver.signals import with_parent_death
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True,
                                     env=with_parent_death(os.environ if env is None else env),
                                     start_new_session=True)
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._address: queue.Queue[str | None] = queue.Queue()
        self._seen: str | None = None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            m = LISTENING.search(line)
            if m:
                self._address.put(f"{m.group(1)}:{m.group(2)}")
        self._address.put(None)    # end of output: the process has gone

    def address(self) -> str:
        if self._seen is not None:
            return self._seen
        try:
            addr = self._address.get(timeout=START_TIMEOUT)
        except queue.Empty:
            addr = None
        if addr is None:
            raise RuntimeError(f"{self.name} did not print its port (exit code {self.proc.poll()}); "
                               f"its last output:\n  " + "\n  ".join(self.tail))
        self._seen = addr
        return addr

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def started(named_argvs: list[tuple[str, list[str]]], env: dict | None = None):
    """Start the processes together, yield them once each printed its address; SIGTERM them
    all however we leave."""
    procs: list[ServerProcess] = []
    try:
        for name, argv in named_argvs:
            procs.append(ServerProcess(name, argv, env))
        for p in procs:
            p.address()
        yield procs
    finally:
        for p in procs:
            p.stop()
        for p in procs:
            p.wait()


@contextlib.contextmanager
def running(named_argvs: list[tuple[str, list[str]]], env: dict | None = None):
    """Start the processes together, yield their addresses."""
    with started(named_argvs, env) as procs:
        yield [p.address() for p in procs]


def this_script(mode: str, params: int, chunk_bytes: int, value: str = "0") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), mode, value,
            "--params", str(params), "--chunk-bytes", str(chunk_bytes)]


# ---------------------------------------------------------------------------- pserver

def data_plane_keyword() -> bool:
    """Whether PSClient takes `data_plane` yet (the faster same-host plane is in the works)."""
    from pserver.worker.client import PSClient
    try:
        inspect.signature(PSClient).bind_partial(data_plane="grpc")
        return True
    except TypeError:
        return False


def shard_argv(j: int, shards: int, chunk_bytes: int, workers: int = 1) -> list[str]:
    argv = [sys.executable, "-m", "pserver", "serve", "--port", "0", "--shard", str(j),
            "--num-shards", str(shards), "--num-workers", str(workers), "--optimizer", "sgd", "--lr", "1e-9"]
    from pserver.wire.codec import CHUNK_BYTES
    return argv if chunk_bytes == CHUNK_BYTES else argv + ["--chunk-bytes", str(chunk_bytes)]


def start_pserver(stack: contextlib.ExitStack, addresses: list[str], params: int, shards: int, variant: str,
                  chunk_bytes: int, has_keyword: bool) -> Running:
    from pserver.worker.client import PSClient
    kw = {"data_plane": "auto" if variant == "fast" else "grpc"} if has_keyword else {}
    client = PSClient(addresses, rank=0, num_workers=1, chunk_bytes=chunk_bytes, **kw)
    stack.callback(client.close)
    round_trip, check = pserver_loop(client, params)
    return Running("pserver", variant, params, shards, round_trip, check, lambda: plane_description(client))


def plane_description(client) -> str:
    """What the client says carried the payloads: "auto" may fall back to gRPC, and a figure
    for "fast" must say which path it measured."""
    describe = getattr(client, "plane_description", None)
    return describe() if describe is not None else "payloads over gRPC streams"


def pserver_loop(client, params: int):
    """(round trip, check) for a client of fresh shards."""
    from pserver.models.layout import Layout
    client.connect(60.0)
    client.register(Layout.of([("w", (params,))]))
    g, w = payloads(params)
    client.init(w)
    start = list(client.pull(w))
    total = [0]

    # What a worker does every step: one exchange over the data plane (the pull rides with
    # the push), a push and then a pull over gRPC.
    clock = itertools.count()

    def round_trip():
        client.push_pull(g, w, num_samples=1, clock=next(clock))
        total[0] += 1

    def check():
        # Each round trip must have been one SGD step on every shard, not a no-op.
        if [v - s for v, s in zip(client.versions, start)] != [total[0]] * len(start):
            raise RuntimeError(f"pserver: versions went {start} -> {client.versions} "
                               f"in {total[0]} round trips")
    return round_trip, check


# ---------------------------------------------------------------------------- shard memory

@dataclass
class MemoryUse:
    """One shard's resident memory in sync mode with `workers` workers pushing P float32."""
    variant: str
    params: int
    workers: int
    steps: int
    idle: int                 # bytes: VmRSS once started (kernels compiled), before any worker
    peak: int                 # bytes: VmHWM over the load, the peak reset after `idle` was read

    def terms(self) -> dict[str, int]:
        """What sync mode must hold, in bytes: parameters, SGD's state (none), and one
        pending gradient per worker (a step applies the rank-ordered mean of them all)."""
        return {"parameters": self.params * 4, "optimizer_state": 0,
                f"gradient_buffers ({self.workers})": self.workers * self.params * 4}

    @property
    def bound(self) -> float:
        return self.idle + 1.2 * sum(self.terms().values())


def proc_status(pid: int, field: str) -> int:
    """Bytes of a /proc/PID/status memory field (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak(pid: int) -> None:
    """Make VmHWM start again from the current RSS (Linux >= 4.0: clear_refs value 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def measure_memory(params: int, variant: str, workers: int, steps: int, chunk_bytes: int) -> MemoryUse:
    """Peak shard RSS while `workers` worker threads (a PSClient each) run `steps` sync steps."""
    argv = shard_argv(0, 1, chunk_bytes, workers)
    with started([("pserver shard 0", argv)]) as [shard]:
        time.sleep(1.0)                        # let start-up's garbage go before the idle reading
        pid = shard.proc.pid
        idle = proc_status(pid, "VmRSS")
        reset_peak(pid)
        clients = [memory_client(shard.address(), rank, workers, chunk_bytes, variant)
                   for rank in range(workers)]
        try:
            with futures.ThreadPoolExecutor(workers) as pool:
                for f in [pool.submit(worker_steps, c, params, steps) for c in clients]:
                    f.result()
            peak = proc_status(pid, "VmHWM")
        finally:
            for c in clients:
                c.close()
    return MemoryUse(variant, params, workers, steps, idle, peak)


def memory_client(address: str, rank: int, workers: int, chunk_bytes: int, variant: str):
    from pserver.worker.client import PSClient
    return PSClient([address], rank=rank, num_workers=workers, chunk_bytes=chunk_bytes,
                    data_plane="auto" if variant == "fast" else "grpc")


def worker_steps(client, params: int, steps: int) -> None:
    """Register, pull (the chief inits first), then push and pull `steps` times, as a worker."""
    from pserver.models.layout import Layout
    client.connect(60.0)
    client.register(Layout.of([("w", (params,))]))
    g, w = payloads(params)
    if client.rank == 0:
        client.init(w)
    client.pull(w)
    for clock in range(steps):
        client.push_pull(g, w, num_samples=1, clock=clock)


def memory_report(m: MemoryUse) -> str:
    mib = 1 << 20
    terms = " + ".join(f"{k} {v / mib:,.0f}" for k, v in m.terms().items())
    verdict = "within" if m.peak <= m.bound else f"over by {(m.peak - m.bound) / mib:,.0f} MiB"
    return (f"shard memory, pserver {m.variant}, sync, {m.workers} workers x {m.steps} steps, "
            f"P={m.params:,}: peak {m.peak / mib:,.0f} MiB, bound {m.bound / mib:,.0f} MiB = idle "
            f"{m.idle / mib:,.0f} + 1.2 x ({terms}) MiB: {verdict}")


def memory_rows(m: MemoryUse, host: dict) -> list[dict]:
    mib = 1 << 20
    return [dict(system="pserver", variant=m.variant, params=m.params, shards=1, metric="shard_peak_rss",
                 value=m.peak / mib, unit="MiB", bound=m.bound / mib, idle=m.idle / mib,
                 terms={k: v / mib for k, v in m.terms().items()}, bound_factor=1.2, workers=m.workers,
                 steps=m.steps, mode="sync", within_bound=m.peak <= m.bound, host=host)]


# ---------------------------------------------------------------------------- raw gRPC baseline

def serve_raw_grpc(port: int, params: int, chunk_bytes: int) -> None:
    """Push fills a preallocated buffer from 1 MiB chunks; pull streams that buffer back."""
    import grpc
    buf = np.zeros(params * 4, dtype=np.uint8)
    mv = memoryview(buf)

    def push(chunks, context):
        pos = 0
        for chunk in chunks:
            buf[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            pos += len(chunk)
        return pos.to_bytes(8, "little")

    def pull(request, context):
        for a in range(0, buf.size, chunk_bytes):
            yield bytes(mv[a:a + chunk_bytes])     # the one copy gRPC needs: it takes bytes

    # No serializers anywhere: requests and replies are bytes as they are.
    handler = grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push),
        "Pull": grpc.unary_stream_rpc_method_handler(pull)})
    # The options pserver's shard uses (4 MiB is also gRPC's default receive limit).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 4 << 20), ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"raw grpc server: {params} params listening on 127.0.0.1:{bound}", flush=True)
    server.wait_for_termination()


def parts(params: int, shards: int) -> list[int]:
    """Elements of each shard's range, as pserver splits P (pserver.wire.sharding)."""
    from pserver.wire.sharding import shard_range
    return [b - a for a, b in (shard_range(params, shards, j) for j in range(shards))]


def start_raw_grpc(stack: contextlib.ExitStack, addresses: list[str], params: int, variant: str,
                   chunk_bytes: int) -> Running:
    """One channel per server; a round trip calls them all at once, the last in this thread
    (as PSClient does: gRPC releases the GIL while it waits)."""
    import grpc
    loops = []
    for address, part in zip(addresses, parts(params, len(addresses))):
        channel = grpc.insecure_channel(address)
        stack.callback(channel.close)
        grpc.channel_ready_future(channel).result(timeout=60)
        loops.append(raw_grpc_loop(channel, part, chunk_bytes))
    pool = stack.enter_context(futures.ThreadPoolExecutor(len(loops) - 1)) if len(loops) > 1 else None

    def round_trip():
        pending = [pool.submit(rt) for rt, _ in loops[:-1]]
        loops[-1][0]()
        for f in pending:
            f.result()

    def check():
        for _, ok in loops:
            ok()

    path = "raw bytes over gRPC streams" + (f", {len(loops)} servers" if len(loops) > 1 else "")
    return Running("raw_grpc", variant, params, len(loops), round_trip, check, lambda: path)


def raw_grpc_loop(channel, params: int, chunk_bytes: int):
    """(round trip, check): the same bytes as pserver moves, with nothing else done to them."""
    push = channel.stream_unary(f"/{RAW_SERVICE}/Push")   # no serializers: raw bytes
    pull = channel.unary_stream(f"/{RAW_SERVICE}/Pull")
    g, w = payloads(params)
    graw, wraw = g.view(np.uint8), w.view(np.uint8)

    def round_trip():
        push(graw[a:a + chunk_bytes].tobytes() for a in range(0, graw.size, chunk_bytes))
        pos = 0
        for chunk in pull(b""):
            wraw[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            pos += len(chunk)
        if pos != wraw.size:
            raise RuntimeError(f"raw_grpc: pulled {pos} of {wraw.size} bytes")

    return round_trip, lambda: check_echo(g, w, "raw_grpc")


def check_echo(g: np.ndarray, w: np.ndarray, system: str) -> None:
    """The baselines' pull returns what the push stored: the bytes really went both ways."""
    if not np.array_equal(g, w):
        raise RuntimeError(f"{system}: the pulled bytes differ from the pushed ones")


# ---------------------------------------------------------------------------- TCP baseline

def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean end of stream before its first byte."""
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            if pos == 0:
                return False
            raise ConnectionError(f"tcp: stream ended after {pos} of {len(view)} bytes")
        pos += n
    return True


def serve_tcp(port: int, params: int, chunk_bytes: int) -> None:
    """One connection at a time: 'P' + payload -> 'K'; 'L' -> payload."""
    mv = memoryview(np.zeros(params * 4, dtype=np.uint8)).cast("B")
    with socket.create_server(("127.0.0.1", port)) as listener:
        print(f"tcp server: {params} params listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                serve_tcp_connection(conn, mv)


def serve_tcp_connection(conn: socket.socket, mv: memoryview) -> None:
    op = bytearray(1)
    while recv_exactly(conn, memoryview(op)):
        if op == PUSH:
            recv_exactly(conn, mv)
            conn.sendall(ACK)
        elif op == PULL:
            conn.sendall(mv)
        else:
            raise ConnectionError(f"tcp: unknown op {bytes(op)!r}")


def start_tcp(stack: contextlib.ExitStack, address: str, params: int, variant: str,
              chunk_bytes: int) -> Running:
    host, _, port = address.rpartition(":")
    sock = stack.enter_context(socket.create_connection((host, int(port)), timeout=60))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    round_trip, check = tcp_loop(sock, params)
    return Running("tcp", variant, params, 1, round_trip, check, lambda: "loopback TCP socket")


def tcp_loop(sock: socket.socket, params: int):
    """(round trip, check) over a connected socket."""
    g, w = payloads(params)
    gmv, wmv = memoryview(g).cast("B"), memoryview(w).cast("B")
    ack = memoryview(bytearray(1))

    def round_trip():
        sock.sendall(PUSH)
        sock.sendall(gmv)
        recv_exactly(sock, ack)      # the push is done when the server has every byte
        sock.sendall(PULL)
        recv_exactly(sock, wmv)

    return round_trip, lambda: check_echo(g, w, "tcp")


# ---------------------------------------------------------------------------- two hosts

# Two network namespaces joined by a veth pair (as tests/e2e/test_netns.py sets up), each end
# limited to LINK_RATE by a token bucket: the shard in one, the client in the other.
LINK_RATE = "10gbit"
TWO_HOSTS_IPS = ("10.78.0.1", "10.78.0.2")          # shard side, client side
IPERF_SECONDS = 2
TWO_HOSTS_PARAMS = 10_000_000                        # 40 MB


def sh(*argv: str, timeout: float = 60) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"--two-hosts: `{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def namespaces() -> tuple[str, str]:
    """(shard namespace, client namespace) of this process's --two-hosts row: named by its pid,
    so that two runs on one machine never share (or remove) each other's."""
    tag = os.getpid() % 100000
    return f"pst-ps-{tag}", f"pst-w-{tag}"


@contextlib.contextmanager
def veth_pair():
    """(shard namespace, client namespace), joined by a rate-limited veth pair; always removed."""
    tag = os.getpid() % 100000
    names, devs = namespaces(), (f"pst{tag}a", f"pst{tag}b")
    made = []
    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        for ns, dev, ip in zip(names, devs, TWO_HOSTS_IPS):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # burst: at least rate / timer tick (1.25 MB at 10 Gbit/s and 1 ms), or tbf falls short of
            # the rate
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", LINK_RATE, "burst", "4mb", "latency", "20ms")
        yield names
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)   # takes the veth pair with it


def iperf3_mb_per_s(server_ns: str, client_ns: str) -> float:
    """The link rate iperf3 measures from the client's namespace to the shard's, in MB/s."""
    server = subprocess.Popen(["ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "--forceflush",
                               "-B", TWO_HOSTS_IPS[0]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:          # the client may start once the server listens
            if "listening" in line:
                break
        out = sh("ip", "netns", "exec", client_ns, "iperf3", "-c", TWO_HOSTS_IPS[0], "-J", "-t",
                 str(IPERF_SECONDS))
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e6
    finally:
        server.kill()
        server.wait()


def two_hosts_missing() -> str:
    """Why --two-hosts cannot run here, or ""."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "iperf3") if shutil.which(tool) is None]
    return f"install {', '.join(missing)} (apt install iproute2 iperf3)" if missing else ""


def measure_two_hosts(params: int, repeats: int, chunk_bytes: int) -> tuple[Measurement, list[float]]:
    """The pserver gRPC path across the veth pair and iperf3 on it, a repeat of each in turn:
    the client runs in the other namespace (this script again, --two-hosts-client) and times
    one repeat each time it reads a line."""
    with veth_pair() as (ps_ns, w_ns):
        argv = ["ip", "netns", "exec", ps_ns, *shard_argv(0, 1, chunk_bytes), "--host", TWO_HOSTS_IPS[0]]
        with running([("pserver shard (two hosts)", argv)]) as [address]:
            client = subprocess.Popen(["ip", "netns", "exec", w_ns,
                                       *this_script("--two-hosts-client", params, chunk_bytes, address)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                seconds, link = [], []
                for _ in range(repeats):
                    link.append(iperf3_mb_per_s(ps_ns, w_ns))
                    client.stdin.write("go\n")
                    client.stdin.flush()
                    seconds.append(read_number(client.stdout))
                client.stdin.close()
                n = int(read_number(client.stdout))
            finally:
                client.kill()
                client.wait()
    path = f"payloads over gRPC across a veth pair limited to {LINK_RATE}/s"
    return Measurement("pserver", "two-hosts", params, 1, seconds, n, path), link


def read_number(lines) -> float:
    """The next number the client prints; what else it prints (a shard that stopped
    answering for a while, and that it rode out) is passed on."""
    for line in lines:
        try:
            return float(line)
        except ValueError:
            print(f"two-hosts client: {line.rstrip()}", flush=True)
    raise RuntimeError("--two-hosts: the client in the other namespace ended early")


def two_hosts_client(address: str, params: int) -> None:
    """In the client's namespace: warm up, print the round trips per repeat, then time one
    repeat per line read from stdin, printing its seconds per round trip."""
    from pserver.models.layout import Layout
    from pserver.worker.client import PSClient
    client = PSClient([address], rank=0, num_workers=1, data_plane="grpc")
    client.connect(60.0)
    client.register(Layout.of([("w", (params,))]))
    g, w = payloads(params)
    client.init(w)
    client.pull(w)

    def round_trip():
        client.push(g, num_samples=1)
        client.pull(w)

    _, n, _ = time_round_trips(round_trip, 0)
    for _ in sys.stdin:
        t = time.perf_counter()
        for _ in range(n):
            round_trip()
        print((time.perf_counter() - t) / n, flush=True)
    print(n, flush=True)
    client.close()


def two_hosts_report(m: Measurement, link: list[float]) -> tuple[str, list[dict]]:
    mbps = summary(m.values("mb_per_s_per_direction"))
    rate = summary(link)
    text = (f"two hosts ({m.path}): pserver gRPC {m.params * 4 / 1e6:.0f} MB push+pull "
            f"{mbps[0]:,.1f} MB/s per direction (min {mbps[1]:,.1f}, max {mbps[2]:,.1f}); iperf3 on the "
            f"same veth {rate[0]:,.1f} MB/s (min {rate[1]:,.1f}, max {rate[2]:,.1f}); "
            f"ratio {mbps[0] / rate[0]:.2f}x the link rate ({len(link)} interleaved repeats each)")
    row = dict(system="pserver", variant="two-hosts", params=m.params, shards=1,
               metric="mb_per_s_per_direction", value=mbps[0], unit="MB/s", min=mbps[1], max=mbps[2],
               repeats=len(m.seconds), round_trips_per_repeat=m.round_trips, path=m.path, link_rate=LINK_RATE,
               iperf3_mb_per_s=rate[0], iperf3_min=rate[1], iperf3_max=rate[2],
               x_link_rate=mbps[0] / rate[0], namespaces=list(namespaces()))
    return text, [row]


# ---------------------------------------------------------------------------- the run

def configurations(args, has_keyword: bool):
    """(system, variant, params, shards) in the order they run: baselines first per size;
    the configurations of one size are timed together, interleaved."""
    variants = {"raw_grpc": ["default", "malloc-tuned"], "tcp": ["default"],
                "pserver": [v for v in args.pserver_variants if has_keyword or v == "grpc"]}
    for params in args.sizes:
        for system in ("tcp", "raw_grpc", "pserver"):
            if system not in args.systems:
                continue
            for variant in variants[system]:
                for shards in (args.shards if system != "tcp" else [1]):
                    yield system, variant, params, shards


def server_processes(system, variant, params, shards,
                     chunk_bytes) -> tuple[list[tuple[str, list[str]]], dict | None]:
    """(named argvs, env) of a configuration's server processes."""
    if system == "pserver":
        return [(f"pserver shard {j}", shard_argv(j, shards, chunk_bytes)) for j in range(shards)], None
    if system == "raw_grpc":
        env = {**os.environ, **MALLOC_TUNED} if variant == "malloc-tuned" else None
        return [(f"raw_grpc server {j} ({variant})", this_script("--serve-raw-grpc", part, chunk_bytes))
                for j, part in enumerate(parts(params, shards))], env
    return [("tcp server", this_script("--serve-tcp", params, chunk_bytes))], None


def start_all(stack: contextlib.ExitStack, configs: list[tuple], args, has_keyword: bool) -> list[Running]:
    """Every configuration's servers first, then its client: a process started while this one
    has gRPC channels open can inherit gRPC's threads' state half-copied (fork without exec
    handlers) and abort."""
    addresses = [stack.enter_context(running(*server_processes(*c, args.chunk_bytes))) for c in configs]
    out = []
    for (system, variant, params, shards), where in zip(configs, addresses):
        if system == "pserver":
            out.append(start_pserver(stack, where, params, shards, variant, args.chunk_bytes, has_keyword))
        elif system == "raw_grpc":
            out.append(start_raw_grpc(stack, where, params, variant, args.chunk_bytes))
        else:
            out.append(start_tcp(stack, where[0], params, variant, args.chunk_bytes))
    return out


def progress(m: Measurement) -> str:
    ms = summary(m.seconds)[0] * 1e3
    mbps = summary(m.values("mb_per_s_per_direction"))[0]
    rtps = summary(m.values("round_trips_per_s"))[0]
    return (f"{m.system:8s} {m.variant:12s} P={m.params:>10,} S={m.shards}: {len(m.seconds)} x "
            f"{m.round_trips:3d} round trips, median {ms:8.2f} ms/round trip, "
            f"{mbps:7.1f} MB/s/dir, {rtps:7.1f} rt/s ({m.path})")


def primary_metric(params: int) -> str:
    """The table shows MB/s for payloads of 4 MB and more, round trips/s below (--json has both)."""
    return "mb_per_s_per_direction" if params * 4 >= 4e6 else "round_trips_per_s"


def baseline(results: list[Measurement], system: str, variant: str, params: int, shards: int, metric: str):
    for m in results:
        if (m.system, m.variant, m.params, m.shards) == (system, variant, params, shards):
            return summary(m.values(metric))[0]
    return None


def ratio_cells(results, m: Measurement, metric: str) -> list[str]:
    med = summary(m.values(metric))[0]
    out = []
    for system, variant in (REFERENCE, ("raw_grpc", "default"), ("tcp", "default")):
        ref = baseline(results, system, variant, m.params, 1 if system == "tcp" else m.shards, metric)
        out.append("-" if ref is None else f"{med / ref:.2f}")
    return out


def result_table(results: list[Measurement]) -> str:
    headers = ["system", "variant", "params", "shards", "metric", "median", "min", "max",
               "x raw_grpc tuned", "x raw_grpc default", "x tcp"]
    rows = []
    for m in results:
        metric = primary_metric(m.params)
        med, lo, hi = summary(m.values(metric))
        rows.append([m.system, m.variant, f"{m.params:,}", str(m.shards), metric,
                     f"{med:,.1f}", f"{lo:,.1f}", f"{hi:,.1f}", *ratio_cells(results, m, metric)])
    return table(headers, rows, left=2)


def json_rows(results: list[Measurement], host: dict, chunk_bytes: int) -> list[dict]:
    rows = []
    for m in results:
        for metric, unit in METRICS.items():
            med, lo, hi = summary(m.values(metric))
            rows.append(dict(system=m.system, params=m.params, shards=m.shards, metric=metric,
                             value=med, unit=unit, variant=m.variant, min=lo, max=hi,
                             repeats=len(m.seconds), round_trips_per_repeat=m.round_trips,
                             chunk_bytes=chunk_bytes, path=m.path, host=host))
    return rows


def header_lines(args, has_keyword: bool, host: dict) -> list[str]:
    env = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in MALLOC_TUNED)
    lines = ["bench/transport.py: " + " ".join(sys.argv[1:]), *machine_lines(host), DEFINITIONS,
             f"sizes {args.sizes}, shards {args.shards}, {args.repeats} repeats, "
             f"chunks of {args.chunk_bytes} bytes, systems {','.join(args.systems)}",
             f"raw_grpc malloc-tuned: server env {' '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())}; "
             f"this (client) process runs with {env}"]
    if "pserver" in args.systems:
        lines.append(f"pserver variants: {', '.join(args.pserver_variants)} (grpc: data_plane='grpc'; "
                     f"fast: data_plane='auto')" if has_keyword
                     else "pserver variants: grpc only "
                          "(PSClient has no data_plane keyword yet, so no fast variant)")
    if args.repeats < 5:
        lines.append(f"note: {args.repeats} repeats (< 5): a functional check, not a measurement")
    return lines


def path_lines(results: list[Measurement]) -> str:
    """What carried each variant's payloads, as its client said (auto may fall back to gRPC)."""
    paths = {}
    for m in results:
        paths.setdefault(f"{m.system} {m.variant}", set()).add(m.path)
    return "paths: " + "; ".join(f"{k}: {' / '.join(sorted(v))}" for k, v in paths.items())


def memory_line() -> str:
    # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN is the largest server process waited for.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return f"peak RSS: this process {own:,.0f} MiB, largest server process {child:,.0f} MiB"


def run(args) -> int:
    has_keyword = "pserver" in args.systems and data_plane_keyword()
    host = machine()
    print("\n".join(header_lines(args, has_keyword, host)), flush=True)
    results = []
    for _, configs in itertools.groupby(configurations(args, has_keyword), key=lambda c: c[2]):
        with contextlib.ExitStack() as stack:
            measured = time_interleaved(start_all(stack, list(configs), args, has_keyword), args.repeats)
        for m in measured:
            results.append(m)
            print(progress(m), flush=True)
    print("\ntable: MB/s per direction for payloads of 4 MB and more, round trips/s below; "
          "--json has both metrics for every row")
    print(result_table(results))
    print(path_lines(results))
    rows = json_rows(results, host, args.chunk_bytes)
    if args.two_hosts:
        text, more = two_hosts_report(*measure_two_hosts(TWO_HOSTS_PARAMS, args.repeats, args.chunk_bytes))
        print(text)
        rows += [dict(r, chunk_bytes=args.chunk_bytes, host=host) for r in more]
    memory = "pserver" in args.systems and args.memory_workers
    for variant in (("grpc", "fast") if has_keyword else ("grpc",)) if memory else ():
        use = measure_memory(max(args.sizes), variant, args.memory_workers, args.memory_steps,
                             args.chunk_bytes)
        print(memory_report(use), flush=True)
        rows += memory_rows(use, host)
    print(memory_line())
    path = result_path(args.json, "transport.json")
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- command line

def choices(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `allowed`."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"'{text}': choose from {','.join(allowed)}")
        return names
    return parse


system_list, variant_list = choices(SYSTEMS), choices(PSERVER_VARIANTS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=positive_ints, help="parameter counts P (default 10000000,262144)")
    p.add_argument("--shards", type=positive_ints, help="pserver shard counts (default 1,2,4)")
    p.add_argument("--repeats", type=int, help="timed repeats per configuration (default 5)")
    p.add_argument("--systems", type=system_list, default=list(SYSTEMS),
                   help="which of pserver,raw_grpc,tcp to run (default all)")
    p.add_argument("--pserver-variants", type=variant_list, default=list(PSERVER_VARIANTS),
                   help="which pserver rows to run: grpc (data_plane='grpc', every multi-host user's path), "
                        "fast (data_plane='auto'); default both")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per streamed message "
                                                                    "(default 1 MiB)")
    p.add_argument("--json", metavar="PATH", help="write the rows {system, params, shards, metric, value, "
                                                  "unit, ...} here (default results/transport.json)")
    p.add_argument("--memory-workers", type=int, default=4,
                   help="worker threads for the shard memory rows, at the largest size (default 4; 0: none)")
    p.add_argument("--memory-steps", type=int, default=20, help="sync steps each of them runs (default 20)")
    p.add_argument("--quick", action="store_true",
                   help="functional check: sizes 1000000,262144, 1 shard, 3 repeats (flags given win)")
    p.add_argument("--two-hosts", action="store_true",
                   help=f"also the two-host row: a shard and this client in two network namespaces joined "
                        f"by a veth pair limited to {LINK_RATE}/s, 40 MB push+pull over gRPC against the "
                        f"rate iperf3 measures on it (needs root, ip, tc and iperf3)")
    p.add_argument("--two-hosts-client", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--serve-raw-grpc", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--serve-tcp", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = dict(sizes=[1_000_000, 262_144], shards=[1], repeats=3)
    full = dict(sizes=[10_000_000, 262_144], shards=[1, 2, 4], repeats=5)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1:
        p.error("--repeats: give at least 1")
    if args.two_hosts and two_hosts_missing():
        p.error(f"--two-hosts: {two_hosts_missing()}")
    if args.memory_workers < 0 or args.memory_steps < 1:
        p.error(f"--memory-workers {args.memory_workers} / --memory-steps {args.memory_steps}: "
                f"give >= 0 workers and >= 1 step")
    if not 0 < args.chunk_bytes <= (4 << 20) - 1024:   # gRPC's 4 MiB limit, less framing
        p.error(f"--chunk-bytes: {args.chunk_bytes} is outside (0, {(4 << 20) - 1024}]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.two_hosts_client:
        two_hosts_client(args.two_hosts_client, args.params)
        return 0
    if args.serve_raw_grpc is not None or args.serve_tcp is not None:
        # A baseline server: SIGTERM's default action ends it; Ctrl-C in the terminal too, quietly.
        from pserver.signals import follow_parent
        follow_parent()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if args.serve_raw_grpc is not None:
            serve_raw_grpc(args.serve_raw_grpc, args.params, args.chunk_bytes)
        else:
            serve_tcp(args.serve_tcp, args.params, args.chunk_bytes)
        return 0
    # SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop every server process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return run(args)
    except KeyboardInterrupt:
        print("bench/transport.py: interrupted; server processes stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
