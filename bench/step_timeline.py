"""Where a sync step of keras-rs's DCN example goes under `pserver run --ps 2 --workers 2`: the
worker's compute between its exchanges, its exchange (PSClient.push_pull), and each shard's side
of it (Shard.push), from timestamps taken in every process of one run.

A `sitecustomize` this script writes into a temporary directory (on PYTHONPATH for the run) wraps
those two calls in each worker and shard process and writes their start and end
(time.perf_counter: one clock for every process of the machine) when the process exits. Loading it
imports pserver's worker and shard modules at each process's start, so the fit this run prints is
not a speed figure (bench/keras_io/compare.py measures that); what it prints is where the time of
a step goes:

    PSERVER_MOVIELENS_DIR=DIR .venv/bin/python bench/step_timeline.py --seed 1 [--[no-]bind-cores] \\
        --out step_timeline.json

- between exchanges: each worker's time from one exchange's end to the next one's start (the
  gradient, the next batch, the step's bookkeeping);
- not running: of that time, what the worker's main thread did not spend on a core (its wall
  time less its thread CPU time): the share of its compute that other processes took;
- exchange: each worker's push_pull;
- gap: at each shard and step, from the earlier worker's push to the later one's;
- later worker done: from the later worker's push reaching a shard to that worker's push_pull
  returning (it has the replies of both shards then);
- shard push: the later push's Shard.push at each shard (its copy, then the mean and the
  optimizer step of the two pushes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _util import machine, machine_lines

HERE = Path(__file__).resolve().parent
FIT = re.compile(r"Fit: ([0-9.]+) s")

# Written as the run's sitecustomize: it records in workers (the script) and shards only.
HOOK = '''
import atexit, json, os, sys, time
OUT = os.environ["PSERVER_TIMELINE_DIR"]
EVENTS = []

def _timed(cls, name, key):
    inner = getattr(cls, name)
    def wrapper(self, *a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        at = key(self, *a, **k)
        try:
            return inner(self, *a, **k)
        finally:
            EVENTS.append((name, *at, t0, time.perf_counter(), c0, time.thread_time()))
    setattr(cls, name, wrapper)

def _write(role):
    with open(os.path.join(OUT, f"{role}-{os.getpid()}.json"), "w") as f:
        json.dump(EVENTS, f)

if "pserver.launch.child" in sys.orig_argv and "serve" in sys.orig_argv:
    from pserver.server.shard import Shard
    _timed(Shard, "push", lambda self, req: (req.rank, self.store.version))
    atexit.register(_write, "shard")
elif os.environ.get("PSERVER_RUN_RANK") is not None and "pserver" not in sys.orig_argv[1:3]:
    from pserver.worker.client import PSClient
    _timed(PSClient, "push_pull", lambda self, *a, **k: (self.rank, self.versions[0]))
    atexit.register(_write, "worker")
'''


def stats(values) -> dict:
    a = np.asarray(values, np.float64) * 1e3
    return {"n": int(a.size), "median_ms": round(float(np.median(a)), 3),
            "mean_ms": round(float(a.mean()), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3)}


def analyse(directory: Path) -> dict:
    """The figures the docstring names, from the run's event files."""
    exchanges: dict[tuple[int, int], tuple[float, float]] = {}
    between: dict[int, list[float]] = {}
    away: dict[int, list[float]] = {}
    for f in sorted(directory.glob("worker-*.json")):
        events = sorted(json.loads(f.read_text()), key=lambda e: e[3])
        for _, rank, step, t0, t1, _, _ in events:
            exchanges[(rank, step)] = (t0, t1)
        between[events[0][1]] = [b[3] - a[4] for a, b in zip(events, events[1:])]
        # wall less the main thread's CPU between two exchanges: its time off the core
        away[events[0][1]] = [(b[3] - a[4]) - (b[5] - a[6]) for a, b in zip(events, events[1:])]
    out = {"between_exchanges": {f"worker {r}": stats(v) for r, v in sorted(between.items())},
           "not_running_between_exchanges": {f"worker {r}": {**stats(v), "sum_s": round(float(np.sum(v)), 3)}
                                             for r, v in sorted(away.items())},
           "exchange": {f"worker {r}": stats([t1 - t0 for (rr, _), (t0, t1) in exchanges.items() if rr == r])
                        for r in sorted(between)}}
    for j, f in enumerate(sorted(directory.glob("shard-*.json"))):
        pushes: dict[int, dict[int, tuple[float, float]]] = {}
        for name, rank, step, t0, t1, _, _ in json.loads(f.read_text()):
            if name == "push":
                pushes.setdefault(step, {})[rank] = (t0, t1)
        gaps, done, work = [], [], []
        for step, by_rank in pushes.items():
            if len(by_rank) != 2 or not all((r, step) in exchanges for r in by_rank):
                continue
            late = max(by_rank, key=lambda r: by_rank[r][0])
            early = min(by_rank, key=lambda r: by_rank[r][0])
            gaps.append(by_rank[late][0] - by_rank[early][0])
            work.append(by_rank[late][1] - by_rank[late][0])
            done.append(exchanges[(late, step)][1] - by_rank[late][0])
        out[f"shard process {j + 1}"] = {"gap": stats(gaps), "later_worker_done": stats(done),
                                         "shard_push": stats(work),
                                         "steps_with_gap_over_2ms": int(np.sum(np.asarray(gaps) > 2e-3))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bind-cores", action=argparse.BooleanOptionalAction, default=None,
                    help="pserver run --bind-cores or --no-bind-cores (default: neither)")
    ap.add_argument("--run-flags", default="", metavar="FLAGS",
                    help="more pserver run flags, e.g. '--sched normal' (recorded in the command)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)))
    sys.path.insert(0, str(HERE / "keras_io"))
    import compare
    tmp = Path(tempfile.mkdtemp(prefix="step-timeline-"))
    script, env = compare.dcn_pserver_run(args.seed, tmp)
    hook, events = tmp / "hook", tmp / "events"
    hook.mkdir()
    events.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env |= {"PSERVER_TIMELINE_DIR": str(events),
            "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "pserver", "run", "--ps", "2", "--workers", "2", "--seed", str(args.seed),
           *compare.bind_flag(args.bind_cores), *args.run_flags.split(), "--", sys.executable, str(script)]
    load = round(os.getloadavg()[0], 2)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
    fit = FIT.findall(run.stdout)
    if run.returncode != 0 or not fit:
        raise SystemExit(f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    result = {"what": "where a sync step of the DCN example goes (bench/step_timeline.py)", "machine": m,
              "command": " ".join(["python", *cmd[1:]]), "load_avg_1m_start": load,
              "fit_seconds_with_the_hooks": float(fit[-1]), **analyse(events)}
    for k, v in result.items():
        if isinstance(v, dict) and k != "machine":
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk}: {vv}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
