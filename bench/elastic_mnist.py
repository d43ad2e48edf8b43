"""The whole elastic scenario on real MNIST against a job that ran 4 workers from the start.

    PSERVER_MNIST_DIR=DIR .venv/bin/python bench/elastic_mnist.py --repeats 2 \\
        --out bench/results/elastic/elastic_mnist.json

Grown (what tests/e2e/test_elastic_mnist.py runs): an MLP on MNIST, --data-assignment leases,
--step-timeout 5; 2 workers start, 2 more join with `--rank auto` in epoch 1, one of them is
SIGKILLed in epoch 2. Reference: the same shard, model, seed and epochs with 4 workers from the start.
Both in sync and in async, interleaved (grown, reference, grown, ...). Prints the machine and its load
first, then each run's test accuracy and shard 0's data counters; writes the JSON. The test keeps an
accuracy floor: the reference is measured here, since running it in CI would double the test's time.
"""

from __future__ import annotations

import argparse
import json
import math
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
from pserver.data.mnist import mnist_dir  # noqa: E402

EPOCHS, BATCH, CHUNK, SAMPLES = 2, 128, 8, 60000
BATCHES = math.ceil(SAMPLES / BATCH)                       # 469 a epoch, the last of 96 samples
CHUNKS = math.ceil(BATCHES / CHUNK)                        # 59 a epoch
STEP_TIMEOUT = 5
SERVE = ["--step-timeout", str(STEP_TIMEOUT), "--optimizer", "adam", "--lr", "0.002"]
# --delay stretches epoch 1 of the 2 first workers (234 steps) past the joiners' start.
TRAIN = ["--dataset", "mnist", "--model", "mlp", "--hidden", "64,64", "--batch-size", str(BATCH),
         "--epochs", str(EPOCHS), "--seed", "3", "--delay", "fixed:0.03", "--data-assignment", "leases",
         "--chunk-batches", str(CHUNK), "--log-every", "0.2"]


def wait_for(proc, pattern: str, timeout: float = 120) -> re.Match:
    """The first line of proc's output that matches `pattern` (proc: .lines, .popen, .output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ln in list(proc.lines):
            m = re.search(pattern, ln)
            if m:
                return m
        if proc.popen.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in:\n{proc.output}")


def grown(start, mode: str, summary: Path) -> dict:
    """2 workers, 2 joiners (--rank auto) in epoch 1, one SIGKILLed in epoch 2. `start(*args)`
    starts a pserver process. Returns the chief's summary with what the run saw: the joiners'
    ranks, whether both joined before epoch 1 ended, the shard's output."""
    shard = start("serve", "--port", "0", "--num-workers", "2", "--max-workers", "4", "--mode", mode, *SERVE)
    addr = "127.0.0.1:" + wait_for(shard, r"listening on [\w.]+:(\d+)").group(1)
    first = [start("worker", "--ps", addr, "--rank", str(r), "--num-workers", "2", *TRAIN,
                   *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(2)]
    for w in first:                                     # both registered: ranks 0 and 1 are taken
        wait_for(w, r"worker rank \d+/2 device")
    joiners = [start("worker", "--ps", addr, "--rank", "auto", "--num-workers", "4", *TRAIN)
               for _ in range(2)]
    ranks = [int(wait_for(j, r"shard 0 assigned rank (\d+)").group(1)) for j in joiners]
    first_push = [float(wait_for(j, r"first push after joining taken in ([\d.]+) s").group(1))
                  for j in joiners]
    joined_in_epoch_1 = not any(f"epoch 1/{EPOCHS} done" in ln for ln in first[0].lines)
    wait_for(first[0], rf"epoch 2/{EPOCHS} step")
    joiners[0].popen.send_signal(signal.SIGKILL)
    codes = [first[0].wait(), first[1].wait(), joiners[1].wait()]
    if codes != [0, 0, 0]:
        raise AssertionError(f"exit codes {codes}:\n" + "\n".join(p.output for p in (*first, joiners[1])))
    with open(summary) as f:
        s = json.load(f)
    return {**s, "joiner_ranks": ranks, "joined_in_epoch_1": joined_in_epoch_1,
            "joiner_first_push_s": first_push, "shard_output": shard.output,
            "chief_output": first[0].output, "joiner_outputs": [j.output for j in joiners]}


def from_start(start, mode: str, summary: Path) -> dict:
    """The reference: 4 workers from the start, the same shard, model, seed and epochs."""
    shard = start("serve", "--port", "0", "--num-workers", "4", "--max-workers", "4", "--mode", mode, *SERVE)
    addr = "127.0.0.1:" + wait_for(shard, r"listening on [\w.]+:(\d+)").group(1)
    workers = [start("worker", "--ps", addr, "--rank", str(r), "--num-workers", "4", *TRAIN,
                     *(["--summary-json", str(summary)] if r == 0 else [])) for r in range(4)]
    codes = [w.wait() for w in workers]
    if codes != [0] * 4:
        raise AssertionError(f"exit codes {codes}:\n{workers[0].output}")
    with open(summary) as f:
        return json.load(f)


class Proc:
    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "pserver", *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env=os.environ | {"PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 300) -> int:
        code = self.popen.wait(timeout)
        self.reader.join(5)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def once(kind, mode: str, tmp: Path) -> dict:
    started: list[Proc] = []

    def start(*args: str) -> Proc:
        started.append(Proc(*args))
        return started[-1]

    t0 = time.monotonic()
    try:
        s = kind(start, mode, tmp / f"{kind.__name__}-{mode}.json")
    finally:
        for p in reversed(started):
            p.stop()
    keys = ("test_accuracy", "chunks_done", "chunks_released", "batches_retrained", "batches_dropped",
            "joiner_ranks", "joined_in_epoch_1", "joiner_first_push_s")
    return {"seconds": round(time.monotonic() - t0, 1), "load_avg_1m": round(os.getloadavg()[0], 2),
            **{k: s[k] for k in keys if k in s}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="interleaved (grown, from start) pairs per mode")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--out", default=None, help="JSON path (default results/elastic/elastic_mnist.json)")
    args = p.parse_args(argv)
    where, named = mnist_dir()          # where every worker finds MNIST (no --data-dir)
    if not os.path.isdir(where):
        p.error(f"no MNIST in {where} ({named}): set PSERVER_MNIST_DIR to a directory with the IDX files")
    m = machine()
    print(json.dumps(m), flush=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"elastic_mnist.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    result = {"machine": m, "what": " ".join(["serve", *SERVE, "| worker", *TRAIN]), "modes": {}}
    for mode in args.modes.split(","):
        runs = {"grown": [], "from_start": []}
        for i in range(args.repeats):
            for name, kind in (("grown", grown), ("from_start", from_start)):
                r = once(kind, mode, tmp)
                runs[name].append(r)
                print(f"{mode} {name} #{i + 1}: {json.dumps(r)}", flush=True)
        med = {k: statistics.median(r["test_accuracy"] for r in v) for k, v in runs.items()}
        result["modes"][mode] = {**runs, "median_accuracy": med,
                                 "difference_points": round(100 * (med["grown"] - med["from_start"]), 2)}
        print(f"{mode}: median test accuracy grown {med['grown']:.4f}, 4 from the start "
              f"{med['from_start']:.4f}: {result['modes'][mode]['difference_points']:+.2f} points "
              f"(target within 0.5)", flush=True)
    path = result_path(args.out, "elastic/elastic_mnist.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
