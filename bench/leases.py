"""Data in leases (--data-assignment leases) against fixed slices, with a straggler; and how soon a
dead worker's chunk is leased again.

    .venv/bin/python bench/leases.py                 # ~3 min on 2 busy cores
    .venv/bin/python bench/leases.py --repeats 3                 # writes results/leases/results.json

1. Stragglers: `pserver launch` of N workers, one of them (rank 1) slowed by --slow-delay per step,
   the others by --delay; async and backup (b = 1) modes, slices and leases, interleaved repeat by
   repeat (the same seed for both in a repeat). Figure: the run's wall time from its summary
   (until the last worker finished) and its per-epoch times; the ratio leases / slices per mode.
   Sync cannot gain: its every step waits for the slowest worker either way.
2. Re-lease: a real shard and N leased workers in async with --step-timeout T; one is SIGKILLed
   mid-epoch; the figure is the time from the kill until shard 0 counts its lease released
   (chunks_released, polled every 20 ms), which the next ask then gets: at most T plus the
   shard's reaper tick (min(1, T/4)).

Out: results.json (every run), printed table; the machine's load average is printed first.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines  # noqa: E402

PSERVER = [sys.executable, "-m", "pserver"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=9600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-batches", type=int, default=8)
    p.add_argument("--delay", default="fixed:0.005", help="every worker's delay per step")
    p.add_argument("--slow-delay", default="fixed:0.04", help="rank 1's delay per step (the straggler)")
    p.add_argument("--step-timeout", type=float, default=3.0, help="for the re-lease figure")
    p.add_argument("--modes", default="async,backup")
    p.add_argument("--out", default="results/leases")
    return p.parse_args(argv)


def train_flags(args) -> list[str]:
    return ["--model", "logreg", "--dataset", "synthetic", "--samples", str(args.samples), "--features", "20",
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
            "--chunk-batches", str(args.chunk_batches)]


def straggler_run(args, mode: str, assignment: str, seed: int, work: Path) -> dict:
    """One launch with a slow rank 1; its summary's figures."""
    summary = work / f"{mode}-{assignment}-{seed}.json"
    mode_flags = ["--mode", mode] + (["--backup-workers", "1"] if mode == "backup" else [])
    argv = PSERVER + ["launch", "--ps", "1", "--workers", str(args.workers), *mode_flags, *train_flags(args),
                      "--optimizer", "sgd", "--lr", "0.1",
                      "--seed", str(seed), "--data-assignment", assignment, "--delay", args.delay,
                      "--delay-for", f"1={args.slow_delay}", "--summary-json", str(summary)]
    started = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"launch failed ({out.returncode}): {' '.join(argv)}\n"
                         f"{out.stdout[-3000:]}{out.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    return {"mode": mode, "assignment": assignment, "seed": seed, "wall_seconds": s["wall_seconds"],
            "launch_seconds": round(time.monotonic() - started, 3),
            "epoch_seconds": [e["epoch_seconds"] for e in s["per_epoch"]],
            "test_accuracy": s["test_accuracy"], "pushes_dropped_late": s["pushes_dropped_late"],
            **{k: s.get(k, 0) for k in ("chunks_done", "chunks_released", "batches_retrained",
                                        "batches_dropped")}}


def wait_line(proc_lines: list[str], needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(needle in ln for ln in proc_lines):
            return
        time.sleep(0.02)
    raise SystemExit(f"no line with {needle!r} in {timeout} s")


def release_run(args, work: Path) -> dict:
    """Kill one leased worker mid-epoch; seconds until shard 0 counts its lease released."""
    import threading

    from pserver.worker.client import PSClient
    serve = ["serve", "--port", "0", "--num-workers", str(args.workers), "--mode", "async",
             "--step-timeout", str(args.step_timeout), "--optimizer", "sgd", "--lr", "0.1"]
    shard = subprocess.Popen(PSERVER + serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(ln) for ln in shard.stdout], daemon=True).start()
    wait_line(lines, "listening", 60)
    said = next(ln for ln in lines if "listening" in ln)
    port = said.split("listening on ")[1].split()[0].rsplit(":", 1)[1]
    addr = f"127.0.0.1:{port}"
    flags = [*train_flags(args), "--data-assignment", "leases", "--delay", args.delay, "--epochs", "3"]
    log = open(work / "release-workers.log", "w")
    workers = [subprocess.Popen(PSERVER + ["worker", "--ps", addr, "--rank", str(r), "--num-workers",
                                           str(args.workers), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
               for r in range(args.workers)]
    status = PSClient([addr], rpc_deadline=5)
    status.connect(30)
    try:
        while status.status()[0].counters.chunks_done < 3:
            if any(p.poll() is not None for p in workers):
                raise SystemExit(f"a worker exited: {(work / 'release-workers.log').read_text()[-2000:]}")
            time.sleep(0.05)
        victim = workers[-1]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while status.status()[0].counters.chunks_released < 1:
            if time.monotonic() - killed > 60:
                raise SystemExit("the lease was not released within 60 s")
            time.sleep(0.02)
        return {"step_timeout": args.step_timeout, "release_seconds": round(time.monotonic() - killed, 3)}
    finally:
        status.close()
        for p in workers + [shard]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workers + [shard]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv=None) -> int:
    args = parse_args(argv)
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in args.modes.split(","):
                for assignment in ("slices", "leases"):          # interleaved: load hits both alike
                    rec = straggler_run(args, mode, assignment, r, Path(tmp))
                    runs.append(rec)
                    print(f"  {mode:7} {assignment:7} seed {r}: {rec['wall_seconds']:.2f} s, epochs "
                          f"{rec['epoch_seconds']}, accuracy {rec['test_accuracy']:.4f}", flush=True)
        release = release_run(args, Path(tmp))
    rows = []
    for mode in args.modes.split(","):
        of = {a: [x for x in runs if x["mode"] == mode and x["assignment"] == a]
              for a in ("slices", "leases")}
        med = {a: statistics.median(x["wall_seconds"] for x in xs) for a, xs in of.items()}
        acc = {a: statistics.median(x["test_accuracy"] for x in xs) for a, xs in of.items()}
        rows.append({"mode": mode, "slices_s": med["slices"], "leases_s": med["leases"],
                     "ratio": round(med["leases"] / med["slices"], 3), "slices_acc": acc["slices"],
                     "leases_acc": acc["leases"]})
    print(f"\n{args.workers} workers, rank 1 slowed by {args.slow_delay} per step, {args.epochs} epochs, "
          f"median of {args.repeats}; wall seconds (until the last worker finished):")
    for row in rows:
        print(f"  {row['mode']:7} slices {row['slices_s']:6.2f} s  leases {row['leases_s']:6.2f} s  "
              f"leases/slices {row['ratio']:.2f}  accuracy {row['slices_acc']:.4f} / {row['leases_acc']:.4f}")
    print(f"re-lease: a killed worker's lease released {release['release_seconds']:.2f} s after SIGKILL "
          f"(--step-timeout {release['step_timeout']:g})")
    result = {"machine": m, "args": vars(args), "runs": runs, "rows": rows, "release": release}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
