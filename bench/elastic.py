"""Elastic workers: how long a joining worker takes to its first push taken in, and the job's
throughput after growing from 2 to 4 workers against a job started with 4; with --release, how
soon a SIGKILLed worker's data lease is released (and so leased again).

    .venv/bin/python bench/elastic.py --pairs 3 --out results/elastic/elastic.json
    .venv/bin/python bench/elastic.py --pairs 0 --release --out results/elastic/release.json

Each pair runs, one after the other on this machine: (grown) a sync shard with --num-workers 2
--max-workers 4, two workers, then two `pserver worker --rank auto` once the first two train;
(started with 4) the same shard and model with 4 workers from the start. Throughput is the
shard's steps per second over --window seconds once all 4 push (the shard's version read with
Status), times 4 batches a step. The joiner's figure is what it prints: "first push after
joining taken in X s after this process started" (kernels cached: the first workers compiled
them). Prints the machine and its load first; writes the JSON.

--release: a real shard and 3 workers with --data-assignment leases in async, --step-timeout 3;
one is SIGKILLed mid-epoch; the figure is the time from the kill until shard 0 counts its lease
released (chunks_released, polled every 20 ms), which the next ask then gets: the step timeout
after the worker's last call, since the shard's reaper wakes when a session falls due. The
straggler comparison of leases and slices is bench/modes.py's (--assignments slices,leases).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import machine, result_path  # noqa: E402

MODEL = ["--model", "mlp", "--hidden", "64", "--samples", "25600", "--features", "64", "--batch-size", "32",
         "--epochs", "100", "--log-every", "0.5"]
PSERVER = [sys.executable, "-m", "pserver"]


class Proc:
    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen([*PSERVER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                m = re.search(pattern, ln)
                if m:
                    return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r} in:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def version(addr: str) -> int:
    import grpc

    from pserver._proto import pserver_pb2 as pb
    from pserver._proto import pserver_pb2_grpc as pb_grpc
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.ParameterServerStub(ch).Status(pb.StatusRequest(), timeout=10).version


def steps_per_second(addr: str, window: float) -> float:
    v0, t0 = version(addr), time.monotonic()
    time.sleep(window)
    return (version(addr) - v0) / (time.monotonic() - t0)


def run(grown: bool, window: float) -> dict:
    n0 = 2 if grown else 4
    procs = [Proc("serve", "--port", "0", "--num-workers", str(n0), "--max-workers", "4", "--mode", "sync",
                  "--step-timeout", "30", "--optimizer", "sgd", "--lr", "0.05")]
    try:
        addr = "127.0.0.1:" + procs[0].wait_for(r"listening on [\w.]+:(\d+)").group(1)
        workers = [Proc("worker", "--ps", addr, "--rank", str(r), "--num-workers", str(n0), *MODEL)
                   for r in range(n0)]
        procs += workers
        workers[0].wait_for(r"epoch 1/\d+ step")
        out: dict = {"started_with": n0}
        if grown:
            joiners = [Proc("worker", "--ps", addr, "--rank", "auto", "--num-workers", "4", *MODEL)
                       for _ in range(2)]
            procs += joiners
            out["joiner_first_push_s"] = [
                float(j.wait_for(r"first push after joining taken in ([\d.]+) s").group(1)) for j in joiners]
        else:
            for w in workers:
                w.wait_for(r"epoch 1/\d+ step")
        time.sleep(1.0)
        out["steps_per_s"] = steps_per_second(addr, window)
        out["samples_per_s"] = out["steps_per_s"] * 4 * 32
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def release_run(step_timeout: float = 3.0, workers: int = 3) -> dict:
    """Kill one leased worker mid-epoch; seconds until shard 0 counts its lease released."""
    from pserver.worker.client import PSClient
    shard = Proc("serve", "--port", "0", "--num-workers", str(workers), "--mode", "async",
                 "--step-timeout", str(step_timeout), "--optimizer", "sgd", "--lr", "0.1")
    procs = [shard]
    try:
        addr = "127.0.0.1:" + shard.wait_for(r"listening on [\w.]+:(\d+)").group(1)
        flags = ["--model", "logreg", "--samples", "9600", "--features", "20", "--batch-size", "32",
                 "--epochs", "3", "--chunk-batches", "8", "--data-assignment", "leases",
                 "--delay", "fixed:0.005"]
        procs += [Proc("worker", "--ps", addr, "--rank", str(r), "--num-workers", str(workers), *flags)
                  for r in range(workers)]
        status = PSClient([addr], rpc_deadline=5)
        status.connect(30)
        try:
            deadline = time.monotonic() + 120
            while status.status()[0].counters.chunks_done < 3:
                if time.monotonic() > deadline or any(p.popen.poll() is not None for p in procs):
                    raise RuntimeError("the leased workers did not get going:\n" + "\n".join(procs[-1].lines))
                time.sleep(0.05)
            procs[-1].popen.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            while status.status()[0].counters.chunks_released < 1:
                if time.monotonic() - killed > 60:
                    raise RuntimeError("the lease was not released within 60 s")
                time.sleep(0.02)
            return {"step_timeout": step_timeout, "release_seconds": round(time.monotonic() - killed, 3)}
        finally:
            status.close()
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--window", type=float, default=6.0, help="seconds throughput is measured over")
    p.add_argument("--release", action="store_true",
                   help="measure the re-lease of a killed worker's chunk too")
    p.add_argument("--out", default=None, help="JSON path (default results/elastic/elastic.json)")
    args = p.parse_args(argv)
    m = machine()
    print(json.dumps(m), flush=True)
    pairs = []
    for i in range(args.pairs):
        g, b = run(True, args.window), run(False, args.window)
        pairs.append({"grown": g, "started_with_4": b, "ratio": g["steps_per_s"] / b["steps_per_s"],
                      "load_avg_1m": round(os.getloadavg()[0], 2)})
        print(f"pair {i + 1}: grown 2->4 {g['steps_per_s']:.1f} steps/s, started with 4 "
              f"{b['steps_per_s']:.1f} steps/s, ratio {pairs[-1]['ratio']:.3f}; joiners' first push "
              f"{', '.join(f'{x:.1f}' for x in g['joiner_first_push_s'])} s after their start; "
              f"load {pairs[-1]['load_avg_1m']}", flush=True)
    result: dict = {"machine": m}
    if pairs:
        firsts = [x for pr in pairs for x in pr["grown"]["joiner_first_push_s"]]
        result.update(what="sync, 1 shard, mlp hidden 64 on synthetic 64 features, batch 32 per worker",
                      pairs=pairs, median_ratio=statistics.median(pr["ratio"] for pr in pairs),
                      joiner_first_push_s_median=statistics.median(firsts),
                      joiner_first_push_s_max=max(firsts))
        print(f"median throughput ratio grown/started-with-4: {result['median_ratio']:.3f} (target >= 0.95); "
              f"joiner start to first push taken in: median {result['joiner_first_push_s_median']:.1f} s, "
              f"max {result['joiner_first_push_s_max']:.1f} s (target < 5 s)", flush=True)
    if args.release:
        result["release"] = release_run()
        result["release"]["load_avg_1m"] = round(os.getloadavg()[0], 2)
        r = result["release"]
        print(f"re-lease: a killed worker's lease released {r['release_seconds']:.2f} s after SIGKILL "
              f"(--step-timeout {r['step_timeout']:g}; 3 leased workers, async)", flush=True)
    path = result_path(args.out, "elastic/elastic.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
