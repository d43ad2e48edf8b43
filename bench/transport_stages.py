"""Where a shared-memory round trip spends its time: bench/transport.py's pserver "fast" row
(one shard, one worker, sync, SGD; `PSClient.push_pull` over the data plane) taken apart with
time.perf_counter around its stages, on both sides, and the page faults of both processes.

    .venv/bin/python bench/transport_stages.py --json bench/results/transport/stages.json

The shard runs as `python -m pserver serve` does, started through this script, which first
wraps (in that process only; the product is unchanged) the shard's stages with timers:
  server request    DataPlaneServer._request: from a request's header read to its reply sent
  server take       Parts._take: waiting for the client's READY of a part (payloads in parts)
  server check-copy ShardStore.copy_finite / store.copy_finite: the validating copy
  server apply      ShardStore.apply: the SGD step (mean of the pushes, then w -= lr g)
  server pull       Shard.pull: the pull that rides with the push (the sync wait)
and on the client (this process):
  client round trip PSClient.push_pull
  client send       DataPlaneChannel._send_values: copy the gradient into the shared slot(s),
                    the header and READYs, waiting for FREEs
  client wait       DataPlaneChannel._reply: waiting for the shard's replies
  client rest       round trip - send - wait: the pull's copy out of the shard's pages, Python
wake-up = client wait - server request: the request's and reply's trips through the Unix
socket and the scheduler waking each side (it includes any time the other process is not
running because the 2 cores are busy). Each stage's wall time comes with the CPU time of the
thread that ran it (time.thread_time): on a loaded machine the difference is the time it waited
for a core; and each round trip with the CPU time of both processes (getrusage, /proc/PID/stat).
Page faults: the client's from getrusage, the shard's from /proc/PID/stat (minor faults).
The sizes' repeats are interleaved (A, B, A, B ...).

Beside them, this CPU's floors in one thread (CPU time, which a loaded machine does not inflate):
np.copyto between warm arrays (a memcpy), copy_finite between warm arrays, the same copy into
freshly allocated memory (first touch: page faults); and a 1-byte ping-pong between two processes
over a Unix socket pair, with the answering side idle and with it spending 1 ms of CPU first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, positive_ints, result_path  # noqa: E402
from transport import ServerProcess, pserver_loop, shard_argv  # noqa: E402

SERVER_STAGES = ("request", "take", "check-copy", "apply", "pull")
CLIENT_STAGES = ("round trip", "send", "wait")


def timed(owner, name: str, totals: dict, key: str, static: bool = False) -> None:
    """Replace owner.name by a wrapper adding its calls' seconds (wall, then the calling
    thread's CPU: the difference is time blocked or waiting for a core) to totals[key]."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key][0] += time.perf_counter() - t
            totals[key][1] += time.thread_time() - c
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def serve_instrumented(stats: str, argv: list[str]) -> int:
    """The shard's process: its stages timed, their totals written to `stats` every 0.1 s."""
    from pserver.cli import main
    from pserver.server import dataplane, shard, store
    totals: dict = defaultdict(lambda: [0.0, 0.0])
    timed(dataplane.DataPlaneServer, "_request", totals, "request")
    timed(dataplane.Parts, "_take", totals, "take")
    timed(store.ShardStore, "copy_finite", totals, "check-copy", static=True)
    timed(store, "copy_finite", totals, "check-copy")           # copy_gradient's (one slot)
    timed(store.ShardStore, "apply", totals, "apply")
    timed(shard.Shard, "pull", totals, "pull")

    def write() -> None:
        while True:
            Path(stats + ".tmp").write_text(json.dumps(dict(totals)))
            os.replace(stats + ".tmp", stats)
            time.sleep(0.1)
    threading.Thread(target=write, daemon=True).start()
    return main(argv)


def proc_stat(pid: int) -> tuple[int, float]:
    """(minor page faults, CPU seconds) of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Side:
    """One size's shard (instrumented) and client, ready for timed repeats."""

    def __init__(self, params: int, stats: str) -> None:
        from pserver.worker.client import PSClient
        self.params, self.stats = params, stats
        argv = shard_argv(0, 1, 1 << 20)[3:]             # the serve command's arguments
        self.proc = ServerProcess(f"shard {params}",
                                  [sys.executable, __file__, "--serve", stats, "--", *argv])
        self.client = PSClient([self.proc.address()], rank=0, num_workers=1, data_plane="auto")
        self.round_trip, self.check = pserver_loop(self.client, params)
        if self.client.shards[0].fast is None:
            raise SystemExit("the client did not take the shared-memory data plane")
        self.n = max(20, min(2000, round(1.5e8 / (params * 4))))   # about 0.2 s of copies per repeat
        self.repeats: list[dict] = []

    def server_totals(self) -> dict:
        time.sleep(0.3)                                          # the shard writes them every 0.1 s
        return json.loads(Path(self.stats).read_text())

    def repeat(self, client_totals: dict) -> None:
        before_s, before_c = self.server_totals(), {k: list(v) for k, v in client_totals.items()}
        pid = self.proc.proc.pid
        stat_s, ru = proc_stat(pid), resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        for _ in range(self.n):
            self.round_trip()
        wall = time.perf_counter() - t
        ru_after, stat_after = resource.getrusage(resource.RUSAGE_SELF), proc_stat(pid)
        after_s = self.server_totals()
        per = {"wall": wall / self.n, "client faults": (ru_after.ru_minflt - ru.ru_minflt) / self.n,
               "server faults": (stat_after[0] - stat_s[0]) / self.n,
               "client process cpu": (ru_after.ru_utime + ru_after.ru_stime
                                      - ru.ru_utime - ru.ru_stime) / self.n,
               "server process cpu": (stat_after[1] - stat_s[1]) / self.n}
        for side, keys, now, before in (("client", CLIENT_STAGES, client_totals, before_c),
                                        ("server", SERVER_STAGES, after_s, before_s)):
            for k in keys:
                wall_cpu = [a - b for a, b in zip(now.get(k, [0, 0]), before.get(k, [0, 0]))]
                per[f"{side} {k}"], per[f"{side} {k} cpu"] = (x / self.n for x in wall_cpu)
        per["client rest"] = per["client round trip"] - per["client send"] - per["client wait"]
        per["client rest cpu"] = (per["client round trip cpu"] - per["client send cpu"]
                                  - per["client wait cpu"])
        # One part only: the shard's request then starts after the client's send (with parts,
        # it overlaps the client's writing of the later ones, and this difference means nothing)
        per["wake-up"] = per["client wait"] - per["server request"] if per["server take"] == 0 else None
        self.repeats.append(per)

    def close(self) -> None:
        self.check()
        self.client.close()
        self.proc.stop()
        self.proc.wait()
        for leftover in (self.stats, self.stats + ".tmp"):
            Path(leftover).unlink(missing_ok=True)


def floors(params: int, tries: int = 7) -> dict:
    """This CPU's single-thread floors for P float32: the median CPU seconds (thread_time) of
    each, which waiting for a core on a loaded machine does not inflate."""
    from pserver.server.store import copy_finite
    src = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    dst = np.zeros(params, np.float32)

    def best(fn) -> float:
        times = []
        for _ in range(tries):
            t = time.thread_time()
            fn()
            times.append(time.thread_time() - t)
        return statistics.median(times)
    copy_finite(src, dst)                                      # compiled before it is timed
    fresh = best(lambda: np.copyto(np.empty(params, np.float32), src))
    return {"memcpy warm": best(lambda: np.copyto(dst, src)),
            "copy_finite warm": best(lambda: copy_finite(src, dst)),
            "memcpy into fresh memory": fresh, "page faults of fresh memory": params * 4 / 4096}


def ping_pong(work: float, n: int) -> float:
    """Median seconds of a 1-byte round trip between two processes over a Unix socket pair, the
    answering side first spending `work` seconds of CPU (as a shard handles a request): whether
    a process that computes between its sleeps is woken later than an idle one."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while b.recv(1):
            t = time.thread_time()
            while time.thread_time() - t < work:
                pass
            b.sendall(b"x")
        os._exit(0)
    b.close()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        a.sendall(b"x")
        a.recv(1)
        times.append(time.perf_counter() - t)
    a.close()
    os.waitpid(pid, 0)
    return statistics.median(times)


def client_timers() -> dict:
    from pserver.worker import dataplane
    from pserver.worker.client import PSClient
    totals: dict = defaultdict(lambda: [0.0, 0.0])
    timed(PSClient, "push_pull", totals, "round trip")
    timed(dataplane.DataPlaneChannel, "_send_values", totals, "send")
    timed(dataplane.DataPlaneChannel, "_reply", totals, "wait")
    return totals


def report(sides: list[Side], floor: dict, pp: dict) -> list[str]:
    keys = ["wall", *(f"client {k}" for k in ("send", "wait", "rest")),
            *(f"server {k}" for k in SERVER_STAGES)]
    lines = ["per round trip, median of the repeats, ms of wall time (/ ms of the thread's CPU time); "
             "page faults per round trip"]
    for s in sides:
        med = {k: statistics.median(r[k] for r in s.repeats) for k in s.repeats[0] if k != "wake-up"}
        if s.repeats[0]["wake-up"] is not None:
            keys_here = [*keys, "wake-up"]
            med["wake-up"] = statistics.median(r["wake-up"] for r in s.repeats)
        else:
            keys_here = keys
        mb = s.params * 4 / 1e6
        lines.append(f"{s.params:,} float32 ({mb:.1f} MB), {len(s.repeats)} repeats of {s.n}: "
                     + ", ".join(f"{k} {med[k] * 1e3:.3f}"
                                 + (f" / {med[k + ' cpu'] * 1e3:.3f}" if k + " cpu" in med else "")
                                 for k in keys_here)
                     + f"; CPU of the processes: client {med['client process cpu'] * 1e3:.3f}, "
                     + f"shard {med['server process cpu'] * 1e3:.3f}"
                     + f"; faults client {med['client faults']:.1f}, shard {med['server faults']:.1f}"
                     + f"; {mb / (med['wall'] / 2):,.0f} MB/s per direction, "
                     + f"{1 / med['wall']:,.0f} round trips/s")
        f = floor[s.params]
        lines.append(f"  floors, one thread's CPU: memcpy {f['memcpy warm'] * 1e3:.3f} ms, copy_finite "
                     f"{f['copy_finite warm'] * 1e3:.3f} ms, memcpy into fresh memory "
                     f"{f['memcpy into fresh memory'] * 1e3:.3f} ms "
                     f"({f['page faults of fresh memory']:.0f} pages)")
    lines.append("1-byte ping-pong between two processes over a Unix socket pair, median: "
                 + ", ".join(f"{pp[w] * 1e6:,.0f} us with {w * 1e3:g} ms of CPU on the answering side"
                             for w in pp))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=positive_ints, default=[10_000_000, 262_144], help="parameter counts")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="where to write the result (default results/transport-stages.json)")
    ap.add_argument("--serve", metavar="STATS", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.serve:
        return serve_instrumented(args.serve, rest[1:] if rest[:1] == ["--"] else rest)
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    totals = client_timers()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"transport-stages-{os.getpid()}"
    sides = [Side(p, f"{tmp}-{p}.json") for p in args.sizes]
    try:
        for s in sides:                              # warm-up: kernels, first touches, sizing
            for _ in range(max(5, s.n // 5)):
                s.round_trip()
        for _ in range(args.repeats):
            for s in sides:
                s.repeat(totals)
    finally:
        for s in sides:
            s.close()
    floor = {p: floors(p) for p in args.sizes}
    pp = {0.0: ping_pong(0.0, 1000), 0.001: ping_pong(0.001, 300)}
    lines = report(sides, floor, pp)
    print("\n".join(lines))
    out = {"what": __doc__.split("\n\n")[0], "machine": m,
           "load_avg_end": [round(v, 2) for v in os.getloadavg()],
           "sizes": {str(s.params): {"round_trips_per_repeat": s.n, "repeats": s.repeats} for s in sides},
           "floors": {str(p): v for p, v in floor.items()},
           "unix_ping_pong_seconds_by_work": {str(w): v for w, v in pp.items()}, "report": lines}
    path = result_path(args.json, "transport-stages.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
