"""Consistency modes under stragglers: sync, backup, async and bounded staleness (ssp).

    .venv/bin/pip install -e ".[bench]"        # matplotlib, for the figures (or pass --no-plots)
    .venv/bin/python bench/modes.py --dataset mnist                              # the full grid
    .venv/bin/python bench/modes.py --quick --dataset mnist   # < 10 min on 2 cores
    .venv/bin/python bench/modes.py --quick --workers 1,2 --modes sync,async --profiles none   # a subset
    .venv/bin/python bench/modes.py --dataset mnist --workers 3 --modes async,backup --profiles slow4x \
        --assignments slices,leases --repeats 2 --epochs 2       # data leases against slices (~6 min)

Every run is a real cluster: one `python -m pserver launch` process (S shards and N workers,
each its own process) with a hard timeout, whose summary JSON (`--summary-json`) is the only
source of the figures. Grid: modes sync, backup (b = 1 and N/4), async, ssp (s = 1, 4);
N = 1, 2, 4, 8 workers; straggler profiles none, heavy (a heavy-tailed delay on every worker)
and slow4x (one worker whose step takes 4x the others'); data assignments (--assignments) slices
(each rank its own slice, the default) and leases (shard 0 leases chunks to whoever asks, so a
straggler's rest goes to the others; docs/guide/data-leases.md). Each configuration runs --repeats
times (seeds --seed, --seed+1, ...: the same seed for every configuration of a repeat) and is
reported as the median with min and max. The grid is run repeat by repeat, so a burst of load
from another process on the machine spreads over configurations rather than hitting one.

Out (--out DIR): results.json, results.csv, summary.md (read this first), accuracy.png,
scaling.png, staleness.png; runs/ (each launch's summary JSON) and logs/ (each launch's output).
Whether matplotlib imports is checked before anything runs, and results.json is written before
any figure is drawn, so `--replot` can always redraw a finished run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pserver.observe.progress import Bar

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util and _plots sit beside this file
from _util import machine, machine_lines, table  # noqa: E402

FULL = dict(workers="1,2,4,8", modes="sync,backup,async,ssp", backup="1,N/4", staleness="1,4",
            profiles="none,heavy,slow4x", repeats=3, epochs=3, timeout=300.0)
# --quick: about 5-8 minutes on 2 busy cores (18 runs of 5-45 s, each plus ~4 s of start-up).
QUICK = dict(workers="1,2,4", modes="sync,backup,async,ssp", backup="1", staleness="1",
             profiles="none,heavy", repeats=1, epochs=2, timeout=150.0)
PROFILES = ("none", "heavy", "slow4x")
STOP_GRACE = 20.0        # seconds launch gets to stop its cluster after SIGINT before SIGKILL
CAL_STEPS = (20, 300)    # calibration run lengths (steps per worker) for the slow4x delay

# Scalar figures per run, aggregated as median/min/max over the repeats (CSV column order).
METRICS = ("time_to_target_s", "samples_per_s", "applied_samples_per_s", "updates_per_s",
           "acc_at_budget", "acc_at_samples", "final_accuracy", "wall_seconds", "updates_applied",
           "staleness_mean", "staleness_max", "pushes_dropped_late", "pushes_rejected",
           "workers_marked_dead", "clock_gap_max", "idle_fraction_mean", "idle_fraction_max",
           "delay_share", "chief_eval_share", "slow_step_ratio", "launch_seconds", "samples_trained")

DEFINITIONS = """\
- **wall** (`wall_seconds`): the chief's clock from its first pull to the last worker's finish; process
  start-up and data loading are excluded (`launch_seconds` is the whole launch, start-up included).
- **updates/s** = `updates_applied / wall_seconds`; an update is one completed step (sync, backup) or one
  applied push (async, ssp).
- **samples/s** = pserver's `train_samples_per_second`: samples in every push the shard received (pushes
  dropped late included) / wall. It is the throughput the Amdahl fit uses.
- **applied samples/s** = `updates_applied x batch x k / wall`, the samples whose gradients reached the
  weights, with k the workers an update averages: N (sync), N-b (backup), 1 (async, ssp).
- **time to target**: the `seconds` of the first point of the chief's `eval_curve` (test accuracy every
  `--eval-every` s; the final evaluation, at `wall_seconds`, is the curve's last point) at or above
  `--target`; null if never reached. Medians over repeats count "never" as infinitely late.
  Its resolution is --eval-every; the chief's evaluations are inline, so their cost (`chief_eval_share`)
  is part of every time, and in sync/backup it pauses the whole cluster.
- **acc @ budget**: test accuracy of the last curve point at or before `--budget` s (a run that finished
  earlier keeps its final accuracy).
- **acc @ samples** (statistical efficiency, apart from speed): test accuracy after `--samples` applied
  samples, where the applied samples at a curve point are `steps x batch x k` (steps: the shard's
  version then; k as above), interpolated linearly between the two points around it; null if the run
  applied fewer.
- **staleness** (async, ssp): the shard's version when a push arrived minus the version its gradient
  was computed on; histogram buckets 0, 1, 2, ... with the last bucket holding the rest.
- **idle fraction**: per worker (push + pull seconds) / wall, the time spent waiting on the shards
  (transfer and consistency waits); the injected delay is not idle. Mean and max over workers.
- **delay share**: injected delay / (compute + delay), summed over workers: how much the stragglers'
  sleep dominates compute (a sleep uses no CPU, so with a high share N processes on a few cores behave
  more like N machines).
- **slow step ratio** (slow4x, async runs only, where nothing waits): rank 0's seconds per step over the
  median of the other workers'.
- **speed-up** = median samples/s at N / median samples/s of sync at N=1 with the same profile (slow4x has
  no N=1 run: its baseline is sync at N=1 with no stragglers, a worker at the others' speed). Amdahl's law
  speed-up = 1/(s + (1-s)/N) is fitted by least squares over N (s on a grid in [0, 1], so clipped there);
  it cannot express a slow-down (s = 1 is as low as it goes) and a super-linear speed-up gives s = 0."""


@dataclass(frozen=True)
class Scenario:
    mode: str          # pserver launch --mode
    workers: int       # N
    profile: str       # none | heavy | slow4x
    backup: int = 0    # b, backup mode
    staleness: int = 0  # s, ssp mode
    assignment: str = "slices"   # --data-assignment: slices | leases

    @property
    def label(self) -> str:
        mode = {"backup": f"backup-b{self.backup}", "ssp": f"ssp-s{self.staleness}"}.get(self.mode, self.mode)
        return mode if self.assignment == "slices" else f"{mode}+{self.assignment}"

    @property
    def name(self) -> str:
        return f"{self.label} N={self.workers} {self.profile}"

    @property
    def slug(self) -> str:
        return f"{self.label}-n{self.workers}-{self.profile}"

    @property
    def averaged(self) -> int:
        """k: how many workers' pushes one update averages."""
        return {"sync": self.workers, "backup": self.workers - self.backup}.get(self.mode, 1)

    def mode_flags(self) -> list[str]:
        if self.mode == "backup":
            return ["--backup-workers", str(self.backup)]
        if self.mode == "ssp":
            return ["--staleness", str(self.staleness)]
        return []


# ---------------------------------------------------------------------------- arguments and grid

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced grid for 2 cores in < 10 min: " +
                   ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    g = p.add_argument_group("grid (defaults: the full grid, or --quick's)")
    g.add_argument("--workers", help=f"worker counts N (full: {FULL['workers']})")
    g.add_argument("--modes",
                   help="mode families and/or labels, e.g. sync,backup,async,ssp or sync,backup-b1")
    g.add_argument("--backup", help="backup b values: integers or N/4 (full: 1,N/4); only 0 < b < N run")
    g.add_argument("--staleness", help="ssp s values (full: 1,4)")
    g.add_argument("--profiles", help="straggler profiles among none,heavy,slow4x")
    g.add_argument("--assignments", default="slices",
                   help="--data-assignment values: slices (default), leases, or both: slices,leases")
    g.add_argument("--repeats", type=int, help="runs per configuration (full: 3)")
    g.add_argument("--epochs", type=int, help="epochs per run (full: 3, quick: 2)")
    g.add_argument("--timeout", type=float, help="hard limit per launch in seconds (full: 300, quick: 150)")
    t = p.add_argument_group("training (the same in every run)")
    t.add_argument("--dataset", choices=("synthetic", "mnist"),
                   help="mnist, or pserver's synthetic MNIST-shaped data (default: mnist with --data-dir, "
                        "else synthetic)")
    t.add_argument("--data-dir", help="the MNIST IDX files (default: pserver's, in its cache directory)")
    t.add_argument("--hidden", default="128,128", help="mlp hidden widths (default 128,128: 784-128-128-10)")
    t.add_argument("--optimizer", default="adam")
    t.add_argument("--lr", type=float, default=0.001, help="the same for every N and mode (default 0.001)")
    t.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    t.add_argument("--ps", type=int, default=1, help="shards (default 1)")
    t.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (default 0)")
    t.add_argument("--eval-every", type=float, default=0.5, help="chief evaluates every SEC s (default 0.5)")
    s = p.add_argument_group("stragglers and figures")
    s.add_argument("--heavy", default="lognormal:0.02,1.0", help="heavy profile's delay on every worker")
    s.add_argument("--slow-factor", type=float, default=4.0, help="slow4x: rank 0's step / the others'")
    s.add_argument("--slow-delay", type=float, help="slow4x: rank 0's fixed delay in s (default: calibrated)")
    s.add_argument("--target", type=float, default=0.95, help="test accuracy for time to target")
    s.add_argument("--budget", type=float, default=10.0, help="wall-clock budget in s for acc @ budget")
    s.add_argument("--samples", type=int, default=50_000, help="applied samples for acc @ samples")
    s.add_argument("--ref-workers", type=int, default=4, help="reference scenario's N (else the largest)")
    s.add_argument("--ref-profile", default="heavy", help="reference scenario's profile")
    p.add_argument("--out", default="results/modes", help="output directory (default results/modes)")
    p.add_argument("--list", action="store_true",
                   help="print the configurations and what is skipped; run nothing")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="write results.json, results.csv and summary.md but no figures "
                        "(no matplotlib needed)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rewrite summary.md, results.csv and the PNGs from --out's results.json")
    p.add_argument("extra", nargs="*", help="more flags for every pserver launch (after --)")
    args = p.parse_args(argv)
    if args.dataset is None:
        args.dataset = "mnist" if args.data_dir else "synthetic"
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def backup_values(n: int, spec: str) -> list[int]:
    """b for each item of spec ('1', 'N/4', ...), deduplicated, in order."""
    out = []
    for item in spec.split(","):
        item = item.strip().upper()
        b = n // int(item[2:]) if item.startswith("N/") else int(item)
        if b not in out:
            out.append(b)
    return out


def variants(n: int, args) -> tuple[list[tuple], list[str]]:
    """(mode, b, s) to run at N workers, and a note for each one left out."""
    out, notes = [], []
    for fam in args.modes.split(","):
        fam, _, only = fam.strip().partition("-")     # 'backup-b1' -> family backup, only b1
        if fam == "sync":
            out.append(("sync", 0, 0))
        elif n == 1:
            notes.append(f"N=1: {fam} skipped (it needs more than one worker; with one it is sync)")
        elif fam == "backup":
            for b in backup_values(n, args.backup if not only else only[1:]):
                if 0 < b < n:
                    out.append(("backup", b, 0))
                else:
                    notes.append(f"N={n}: backup b={b} skipped (needs 0 < b < N)")
        elif fam in ("async", "ssp"):
            values = [0] if fam == "async" else [int(x) for x in
                                                 (only[1:] if only else args.staleness).split(",")]
            out += [(fam, 0, s) for s in values]
        else:
            raise SystemExit(f"--modes: unknown mode '{fam}'")
    return list(dict.fromkeys(out)), notes


def build_grid(args) -> tuple[list[Scenario], list[str]]:
    grid, notes = [], []
    for profile in args.profiles.split(","):
        profile = "slow4x" if profile == "slow" else profile
        if profile not in PROFILES:
            raise SystemExit(f"--profiles: unknown profile '{profile}' (choose from {', '.join(PROFILES)})")
        for n in (int(x) for x in args.workers.split(",")):
            if profile == "slow4x" and n == 1:
                notes.append("N=1: slow4x skipped (one worker has no others to be 4x slower than)")
                continue
            vs, vnotes = variants(n, args)
            notes += vnotes
            for a in args.assignments.split(","):
                if a not in ("slices", "leases"):
                    raise SystemExit(f"--assignments: unknown data assignment '{a}' (slices, leases)")
                grid += [Scenario(m, n, profile, b, s, a) for m, b, s in vs]
    return grid, list(dict.fromkeys(notes))


# ---------------------------------------------------------------------------- one launch

def launch_argv(sc: Scenario | None, n: int, args, seed: int, summary: str, delay: list[str],
                extra: list[str] = ()) -> list[str]:
    data = ["--dataset", args.dataset] + (["--data-dir", args.data_dir] if args.data_dir else [])
    mode = ["--mode", sc.mode, *sc.mode_flags()] if sc else ["--mode", "async"]
    if sc and sc.assignment != "slices":
        mode += ["--data-assignment", sc.assignment]
    return [sys.executable, "-m", "pserver", "launch", "--ps", str(args.ps), "--workers", str(n), *mode,
            *data, "--model", "mlp", "--hidden", args.hidden, "--optimizer", args.optimizer,
            "--lr", str(args.lr), "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
            "--seed", str(seed), "--eval-every", str(args.eval_every), "--summary-json", summary,
            *delay, *extra, *args.extra]


def run_launch(argv: list[str], log_path: Path, timeout: float) -> str | None:
    """Run one launch to completion; None if it succeeded, else what went wrong."""
    with open(log_path, "w") as log:
        # A session of its own: a Ctrl-C in the terminal reaches only us, and we stop it.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_cluster(proc)
            return f"timed out after {timeout:g} s; cluster killed"
        except BaseException:
            stop_cluster(proc)
            raise
    if code != 0:
        return f"pserver launch exited with code {code}: {last_line(log_path)}"
    return None


def stop_cluster(proc: subprocess.Popen) -> None:
    """Stop a launch and every process under it. launch starts each shard and worker in a
    session of its own, so signalling launch's process group alone would leave them running:
    they are listed first (while they are still launch's children) and killed by id."""
    tree = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGINT)        # launch's Ctrl-C path stops workers, then shards
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid, started in tree:
        if start_time(pid) == started:         # still the same process, not a reused id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def descendants(root: int) -> list[tuple[int, str | None]]:
    """(pid, start time) of every process below root, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat:
                children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append((pid, start_time(pid)))
            todo.append(pid)
    return out


def read_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name: [state, ppid, pgrp, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    stat = read_stat(pid)
    return stat[19] if stat else None


def last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "(no output)"


# ---------------------------------------------------------------------------- stragglers

def calibrate(n: int, args, out: Path) -> dict:
    """Seconds per step of one worker with no delay, N workers, async (nothing waits), from
    two runs of different lengths: the difference cancels the first step's one-time cost
    (numba loading its compiled kernels, ~0.3 s, which would inflate a short run's mean)."""
    walls = []
    for steps in CAL_STEPS:
        summary = out / "runs" / f"calibrate-n{n}-{steps}.json"
        argv = launch_argv(None, n, args, args.seed, str(summary), [], ["--max-steps", str(steps)])
        error = run_launch(argv, out / "logs" / f"calibrate-n{n}-{steps}.log", args.timeout)
        if error:
            return {"workers": n, "error": f"calibration: {error}"}
        workers = json.loads(summary.read_text())["workers"]
        walls.append(statistics.median(w["wall_seconds"] for w in workers))
    base = max((walls[1] - walls[0]) / (CAL_STEPS[1] - CAL_STEPS[0]), 1e-4)
    return {"workers": n, "base_step_s": round(base, 5), "delay_s": round((args.slow_factor - 1) * base, 5),
            "source": f"async, no delay, {CAL_STEPS[1]} - {CAL_STEPS[0]} steps per worker"}


def delay_flags(sc: Scenario, args, calibration: dict) -> list[str] | str:
    """The launch flags of sc's profile, or an error message when slow4x has no delay."""
    if sc.profile == "heavy":
        return ["--delay", args.heavy]
    if sc.profile == "slow4x":
        cal = calibration.get(sc.workers, {})
        if "error" in cal:
            return cal["error"]
        return ["--delay", f"fixed:{cal['delay_s']:.5f}", "--delay-ranks", "0"]
    return []


def slow_calibration(grid: list[Scenario], args, out: Path) -> dict[int, dict]:
    """The slow4x delay for every N that needs one: --slow-delay, or measured."""
    cal = {}
    for n in sorted({sc.workers for sc in grid if sc.profile == "slow4x"}):
        if args.slow_delay is not None:
            cal[n] = {"workers": n, "delay_s": args.slow_delay, "source": "--slow-delay"}
        else:
            cal[n] = calibrate(n, args, out)
        c = cal[n]
        print(f"  slow4x N={n}: " + (c["error"] if "error" in c else
              f"base step {c.get('base_step_s', float('nan')) * 1e3:.2f} ms -> rank 0 delay "
              f"fixed:{c['delay_s']:.4f} s ({c['source']})"), flush=True)
    return cal


# ---------------------------------------------------------------------------- figures of one run

def curve_points(s: dict, sc: Scenario) -> list[dict]:
    """The chief's eval curve plus the final evaluation, with applied samples at each point."""
    per_update = s["batch_size"] * sc.averaged
    points = [(p["seconds"], p["steps"], p["accuracy"]) for p in s.get("eval_curve", [])]
    points.append((s["wall_seconds"], s["steps"], s["test_accuracy"]))
    return [{"seconds": t, "steps": k, "samples": k * per_update, "accuracy": a} for t, k, a in points]


def time_to_target(curve: list[dict], target: float) -> float | None:
    return next((p["seconds"] for p in curve if p["accuracy"] >= target), None)


def acc_at_time(curve: list[dict], budget: float) -> float | None:
    before = [p for p in curve if p["seconds"] <= budget]
    return before[-1]["accuracy"] if before else None


def acc_at_samples(curve: list[dict], samples: float) -> float | None:
    for i, p in enumerate(curve):
        if p["samples"] >= samples:
            if i == 0 or p["samples"] == curve[i - 1]["samples"]:
                return p["accuracy"]
            q = curve[i - 1]
            frac = (samples - q["samples"]) / (p["samples"] - q["samples"])
            return q["accuracy"] + (p["accuracy"] - q["accuracy"]) * frac
    return None


def worker_figures(s: dict, sc: Scenario) -> dict:
    workers = s.get("workers", [])
    compute = sum(w["compute_seconds"] for w in workers)
    delay = sum(w["delay_seconds"] for w in workers)
    c = s["chief"]
    busy = sum(c.get(f"{k}_seconds", 0.0) for k in ("compute", "delay", "push", "pull", "push_pull"))
    out = {"idle_fraction_mean": s.get("idle_fraction_mean"),
           "idle_fraction_max": max((w["idle_fraction"] for w in workers), default=None),
           "delay_share": delay / (compute + delay) if compute + delay > 0 else None,
           # what the chief did besides training: mostly its inline evaluations
           "chief_eval_share": max(0.0, 1 - busy / c["wall_seconds"]) if c["wall_seconds"] > 0 else None,
           "slow_step_ratio": None}
    if sc.profile == "slow4x" and sc.mode == "async" and len(workers) > 1:
        per_step = [w["wall_seconds"] / max(w["steps"], 1) for w in workers]
        out["slow_step_ratio"] = per_step[0] / statistics.median(per_step[1:])
    return out


def run_figures(s: dict, sc: Scenario, args) -> dict:
    wall, curve = s["wall_seconds"], curve_points(s, sc)
    keep = ("steps", "updates_applied", "staleness_mean", "staleness_max", "pushes_dropped_late",
            "pushes_rejected", "workers_marked_dead", "clock_gap_max", "staleness_histogram",
            "samples_trained", "chunks_done", "batches_retrained", "batches_dropped")
    return {"wall_seconds": wall,
            "epoch_seconds": [e["epoch_seconds"] for e in s.get("per_epoch", [])],
            "updates_per_s": s["updates_applied"] / wall,
            "samples_per_s": s["train_samples_per_second"],
            "applied_samples_per_s": s["updates_applied"] * s["batch_size"] * sc.averaged / wall,
            "time_to_target_s": time_to_target(curve, args.target),
            "acc_at_budget": acc_at_time(curve, args.budget),
            "acc_at_samples": acc_at_samples(curve, args.samples),
            "final_accuracy": s["test_accuracy"],
            **{k: s.get(k) for k in keep}, **worker_figures(s, sc),
            "curve": curve,
            "workers": [{k: w[k] for k in ("rank", "steps", "wall_seconds", "compute_seconds",
                                           "delay_seconds", "push_seconds", "pull_seconds",
                                           "push_pull_seconds", "idle_fraction") if k in w}
                        for w in s.get("workers", [])]}


def run_one(sc: Scenario, repeat: int, args, calibration: dict, out: Path) -> dict:
    seed = args.seed + repeat
    tag = f"{sc.slug}-r{repeat + 1}"
    summary = out / "runs" / f"{tag}.json"
    record = {"config": sc.slug, "repeat": repeat + 1, "seed": seed, "log": f"logs/{tag}.log", "ok": False}
    delay = delay_flags(sc, args, calibration)
    if isinstance(delay, str):
        return {**record, "error": delay}
    argv = launch_argv(sc, sc.workers, args, seed, str(summary), delay)
    record["command"] = " ".join(shlex.quote(a) for a in argv[1:])
    started = time.monotonic()
    error = run_launch(argv, out / record["log"], args.timeout)
    record["launch_seconds"] = round(time.monotonic() - started, 2)
    if error is None and not summary.exists():
        error = "pserver launch succeeded but wrote no summary"
    if error:
        return {**record, "error": error}
    return {**record, "ok": True, **run_figures(json.loads(summary.read_text()), sc, args)}


def progress_line(i: int, total: int, sc: Scenario, rec: dict, args) -> str:
    head = f"[{i}/{total}] {sc.name} repeat {rec['repeat']}/{args.repeats}:"
    if not rec["ok"]:
        return f"{head} FAILED: {rec['error']} (log {rec['log']})"
    tt = rec["time_to_target_s"]
    return (f"{head} wall {rec['wall_seconds']:.1f} s, {rec['samples_per_s']:,.0f} samples/s, "
            f"{rec['updates_per_s']:,.0f} updates/s, acc {rec['final_accuracy']:.4f}, "
            f"{args.target:g} at {'never' if tt is None else f'{tt:.1f} s'}, "
            f"staleness mean {rec['staleness_mean']:.2f}, dropped {rec['pushes_dropped_late']}")


# ---------------------------------------------------------------------------- aggregation

def stat(values: list, late_is_never: bool = False) -> dict | None:
    """median/min/max over the repeats that have a value; for time to target, a repeat that
    never reached it counts as infinitely late (and an infinite statistic is written null)."""
    vals = ([math.inf if v is None else v for v in values] if late_is_never
            else [v for v in values if v is not None])
    if not vals:
        return None
    fin = lambda x: None if math.isinf(x) else x      # noqa: E731
    out = {"median": fin(statistics.median(vals)), "min": fin(min(vals)), "max": fin(max(vals)),
           "n": len(vals)}
    if late_is_never:
        out["reached"] = sum(1 for v in values if v is not None)
    return out


def aggregate(sc: Scenario, records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    metrics = {m: stat([r[m] for r in ok], m == "time_to_target_s") if ok else None for m in METRICS}
    return {"label": sc.label, "name": sc.name, **asdict(sc), "slug": sc.slug, "repeats": len(records),
            "ok": len(ok),
            "failures": [f"repeat {r['repeat']}: {r['error']} (log {r['log']})"
                         for r in records if not r["ok"]],
            "metrics": metrics, "runs": records}


def med(entry: dict | None, metric: str) -> float | None:
    s = entry and entry["metrics"].get(metric)
    return s["median"] if s else None


def amdahl_fit(ns: list[int], speedups: list[float]) -> float:
    """Serial fraction s in [0, 1] minimising sum (speedup - 1/(s + (1-s)/N))^2 (a grid of
    10,001 values: exact enough, and clipping is built in)."""
    s = np.linspace(0.0, 1.0, 10_001)[:, None]
    n, y = np.asarray(ns, float)[None, :], np.asarray(speedups, float)[None, :]
    err = ((y - 1.0 / (s + (1.0 - s) / n)) ** 2).sum(axis=1)
    return float(s[int(np.argmin(err)), 0])


def scaling(entries: list[dict]) -> list[dict]:
    """Per (profile, mode label): throughput and speed-up against N, and Amdahl's serial fraction."""
    find = {(e["label"], e["workers"], e["profile"]): e for e in entries}
    out = []
    for profile in dict.fromkeys(e["profile"] for e in entries):
        base_profile = "none" if profile == "slow4x" else profile
        base = med(find.get(("sync", 1, base_profile)), "samples_per_s")
        for label in dict.fromkeys(e["label"] for e in entries if e["profile"] == profile):
            pts = [e for e in entries if e["profile"] == profile and e["label"] == label
                   and med(e, "samples_per_s")]
            pts.sort(key=lambda e: e["workers"])
            row = {"profile": profile, "label": label, "baseline": f"sync N=1 {base_profile}",
                   "baseline_samples_per_s": base, "points": [], "serial_fraction": None}
            for e in pts:
                m = e["metrics"]["samples_per_s"]
                row["points"].append({"workers": e["workers"], "samples_per_s": m["median"],
                                      "min": m["min"], "max": m["max"],
                                      "speedup": m["median"] / base if base else None})
            if base and row["points"]:
                row["serial_fraction"] = amdahl_fit([p["workers"] for p in row["points"]],
                                                    [p["speedup"] for p in row["points"]])
            out.append(row)
    return out


def reference(entries: list[dict], args) -> tuple[int | None, str | None]:
    """The reference scenario: --ref-workers (else the largest N run) with --ref-profile (else the first)."""
    profiles = list(dict.fromkeys(e["profile"] for e in entries))
    if not profiles:
        return None, None
    profile = args.ref_profile if args.ref_profile in profiles else profiles[0]
    ns = sorted({e["workers"] for e in entries if e["profile"] == profile})
    return (args.ref_workers if args.ref_workers in ns else ns[-1]), profile


def modes_object(entries: list[dict], n: int, profile: str) -> dict:
    out = {}
    for e in entries:
        if e["workers"] == n and e["profile"] == profile:
            tt = e["metrics"]["time_to_target_s"]
            out[e["label"]] = {"workers": n, "profile": profile, "repeats_ok": e["ok"],
                               "time_to_target_s": med(e, "time_to_target_s"),
                               "samples_per_s": med(e, "samples_per_s"),
                               "final_accuracy": med(e, "final_accuracy"),
                               "target_reached_in": (f"{tt['reached']}/{e['repeats']}" if tt
                                                     else f"0/{e['repeats']}"),
                               "ranges": {m: e["metrics"][m] for m in
                                          ("time_to_target_s", "samples_per_s", "final_accuracy")}}
    return out


# ---------------------------------------------------------------------------- outputs

def fmt(s: dict | None, spec: str = ".3f", none: str = "-") -> str:
    """'median (min-max)', or the median alone when the repeats agree or there is one."""
    if not s:
        return none
    f = lambda x: none if x is None else format(x, spec)    # noqa: E731
    if s["median"] is None and "reached" in s:
        return f"never ({s['reached']}/{s['n']} reached)" if s["reached"] else "never"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f(s["median"])
    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def write_csv(path: Path, entries: list[dict]) -> None:
    head = ["label", "mode", "workers", "profile", "backup", "staleness", "assignment", "repeats", "ok"]
    cols = [c for m in METRICS for c in (m, f"{m}_min", f"{m}_max")]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head + cols + ["failures"])
        for e in entries:
            vals = []
            for m in METRICS:
                s = e["metrics"][m] or {}
                vals += [s.get("median"), s.get("min"), s.get("max")]
            cells = ["" if v is None else format(v, ".6g") for v in vals]
            w.writerow([e.get(h, "slices" if h == "assignment" else None) for h in head] + cells
                       + ["; ".join(e["failures"])])


def config_rows(entries: list[dict], target: float) -> tuple[list[str], list[list[str]]]:
    headers = ["N", "profile", "mode", "ok", "samples/s", "updates/s", f"time to {target:g} (s)",
               "acc @ budget", "acc @ samples", "final acc", "staleness mean/max", "dropped late",
               "idle mean", "delay share"]
    rows = []
    for e in entries:
        m = e["metrics"]
        rows.append([str(e["workers"]), e["profile"], e["label"], f"{e['ok']}/{e['repeats']}",
                     fmt(m["samples_per_s"], ",.0f"), fmt(m["updates_per_s"], ",.0f"),
                     fmt(m["time_to_target_s"], ".1f"), fmt(m["acc_at_budget"], ".4f"),
                     fmt(m["acc_at_samples"], ".4f"), fmt(m["final_accuracy"], ".4f"),
                     f"{fmt(m['staleness_mean'], '.2f')} / {fmt(m['staleness_max'], '.0f')}",
                     fmt(m["pushes_dropped_late"], ".0f"), fmt(m["idle_fraction_mean"], ".2f"),
                     fmt(m["delay_share"], ".2f")])
    return headers, rows


def assignment_rows(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Leases against slices, per configuration run with both: wall time, its ratio, what was trained."""
    headers = ["N", "profile", "mode", "wall slices (s)", "wall leases (s)", "leases / slices",
               "samples trained slices / leases", "final acc slices / leases"]
    by = {(e["workers"], e["profile"], e["mode"], e["backup"], e["staleness"],
           e.get("assignment", "slices")): e for e in entries}
    rows = []
    for key, lease in by.items():
        if key[-1] != "leases" or (*key[:-1], "slices") not in by:
            continue
        sl, ws, wl = by[(*key[:-1], "slices")], med(by[(*key[:-1], "slices")], "wall_seconds"), \
            med(lease, "wall_seconds")
        rows.append([str(key[0]), key[1], sl["label"], fmt(sl["metrics"]["wall_seconds"], ".2f"),
                     fmt(lease["metrics"]["wall_seconds"], ".2f"),
                     "-" if not ws or wl is None else f"{wl / ws:.2f}",
                     f"{fmt(sl['metrics']['samples_trained'], ',.0f')} / "
                     f"{fmt(lease['metrics']['samples_trained'], ',.0f')}",
                     f"{fmt(sl['metrics']['final_accuracy'], '.4f')} / "
                     f"{fmt(lease['metrics']['final_accuracy'], '.4f')}"])
    return headers, rows


def assignment_section(entries: list[dict]) -> list[str]:
    headers, rows = assignment_rows(entries)
    if not rows:
        return []
    return ["## Data leases against slices", "",
            "median (min-max) wall time over the repeats; the ratio is of the medians. With slices a run "
            "ends when its last rank finished its own slice; in backup the fast ranks' end can end it "
            "before a straggler trained its slice (fewer samples trained).", "",
            md_table(headers, rows), ""]


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def scaling_rows(scale: list[dict], ns: list[int]) -> tuple[list[str], list[list[str]]]:
    headers = ["profile", "mode", "serial fraction s", *[f"speed-up N={n}" for n in ns], "baseline"]
    rows = []
    for r in scale:
        by_n = {p["workers"]: p["speedup"] for p in r["points"]}
        s = r["serial_fraction"]
        rows.append([r["profile"], r["label"], "-" if s is None else f"{s:.3f}",
                     *["-" if by_n.get(n) is None else f"{by_n[n]:.2f}" for n in ns],
                     f"{r['baseline']}" + ("" if r["baseline_samples_per_s"] else " (not run)")])
    return headers, rows


def compare(a: dict | None, b: dict | None, name_a: str, name_b: str, target: float) -> str:
    """One sentence on whether a reached the target sooner than b, with the numbers."""
    ta, tb = (e and e["metrics"]["time_to_target_s"] for e in (a, b))
    if not a or not b:
        return (f"{name_a} against {name_b} was not measured (no {name_a if not a else name_b} run in "
                "this grid).")
    if not ta or not tb:
        return (f"{name_a} and {name_b} cannot be compared: every repeat of "
                f"{name_a if not ta else name_b} failed.")
    if ta["median"] is None and tb["median"] is None:
        return f"neither {name_a} nor {name_b} reached {target:g} (median of the repeats)."
    if ta["median"] is None or tb["median"] is None:
        win, lose, t = (name_b, name_a, tb) if ta["median"] is None else (name_a, name_b, ta)
        return f"{win} reached {target:g} in {fmt(t, '.1f')} s and {lose} did not (median of the repeats)."
    verdict = ("sooner than" if ta["median"] < tb["median"] else
               "later than" if ta["median"] > tb["median"] else "as fast as")
    overlap = (ta["n"] > 1 and tb["n"] > 1 and ta["min"] is not None and tb["min"] is not None
               and ta["max"] is not None and tb["max"] is not None
               and ta["min"] <= tb["max"] and tb["min"] <= ta["max"])
    noise = (" with one repeat, so the noise is unknown" if min(ta["n"], tb["n"]) == 1 else
             "; the min-max ranges overlap, so the difference is within the noise" if overlap else
             "; the min-max ranges do not overlap")
    return (f"{name_a} reached {target:g} {verdict} {name_b}: {fmt(ta, '.1f')} s against "
            f"{fmt(tb, '.1f')} s{noise}.")


def findings(entries: list[dict], scale: list[dict], n: int | None, profile: str | None, args) -> str:
    """The 'what this run shows' paragraph, written from the numbers, whatever they are."""
    if n is None:
        return "No configuration ran."
    ref = {e["label"]: e for e in entries if e["workers"] == n and e["profile"] == profile}
    heavy4 = {e["label"]: e for e in entries if e["workers"] == 4 and e["profile"] == "heavy"}
    parts = []
    for label in [k for k in heavy4 if k.startswith("backup")] or ["backup"]:
        parts.append("With heavy-tailed stragglers and 4 workers, " +
                     compare(heavy4.get(label), heavy4.get("sync"), label, "sync", args.target))
    done = {k: med(e, "time_to_target_s") for k, e in ref.items() if med(e, "time_to_target_s") is not None}
    if not done:
        parts.append(f"In the reference scenario (N={n}, {profile}) no mode reached {args.target:g} "
                     "(median of the repeats).")
    else:
        best = min(done, key=done.get)
        parts.append(f"In the reference scenario (N={n}, {profile}) {best} reached {args.target:g} first "
                     f"({done[best]:.1f} s); " + (", ".join(f"{k} never" for k in ref if k not in done) or
                                                   "every mode reached it") + ".")
    rates = {k: med(e, "samples_per_s") for k, e in ref.items() if med(e, "samples_per_s")}
    if rates and rates.get("sync"):
        fast = max(rates, key=rates.get)
        parts.append(f"Throughput there: {fast} {rates[fast]:,.0f} samples/s, "
                     f"{rates[fast] / rates['sync']:.2f}x sync's "
                     f"{rates['sync']:,.0f}.")
    eff = {k: med(e, "acc_at_samples") for k, e in ref.items() if med(e, "acc_at_samples") is not None}
    if eff:
        parts.append(f"Per applied sample (statistical efficiency, {args.samples:,} samples): " +
                     ", ".join(f"{k} {v:.4f}" for k, v in sorted(eff.items(), key=lambda kv: -kv[1])) + ".")
    fits = [f"{r['label']} {r['serial_fraction']:.2f}" for r in scale
            if r["profile"] == profile and r["serial_fraction"] is not None]
    if fits:
        parts.append(f"Amdahl serial fraction ({profile}): " + ", ".join(fits) + ".")
    failed = sum(e["repeats"] - e["ok"] for e in entries)
    parts.append(f"{failed} run(s) failed (listed below)." if failed else "No run failed.")
    return " ".join(parts)


def profile_notes(args, calibration: dict, entries: list[dict]) -> list[str]:
    ran = set(e["profile"] for e in entries)
    shares = [med(e, "delay_share") for e in entries if e["profile"] == "heavy" and med(e, "delay_share")]
    share = f" (delay share {min(shares):.2f}-{max(shares):.2f} in these runs)" if shares else ""
    notes = ["none: no injected delay."] if "none" in ran else []
    if "heavy" in ran:
        notes.append(f"heavy: `--delay {args.heavy}` on every worker: a seeded lognormal sleep per step "
                     "(mean in seconds, log-space sigma), heavy-tailed: some steps take several times the "
                     "mean. The mean is chosen well above a step's compute here, so the sleep, which uses no "
                     f"CPU, dominates compute{share} and N processes on few cores behave more like N "
                     "machines.")
    for n, c in sorted(calibration.items()):
        ratio = [med(e, "slow_step_ratio") for e in entries
                 if e["workers"] == n and e["profile"] == "slow4x" and e["mode"] == "async"]
        measured = (f"; measured in the async run: rank 0's step took {ratio[0]:.1f}x the others'"
                    if ratio and ratio[0] else "")
        notes.append(f"slow4x N={n}: " + (c["error"] if "error" in c else
                     f"`--delay fixed:{c['delay_s']:.4f} --delay-ranks 0`: rank 0 sleeps "
                     f"{args.slow_factor - 1:g}x the base step "
                     f"({c.get('base_step_s', float('nan')) * 1e3:.2f} ms, "
                     f"{c['source']}), so its step takes ~{args.slow_factor:g}x the others'{measured}. "
                     "launch gives one delay to the ranks in --delay-ranks, so a base delay on every worker "
                     "with 4x on one cannot be expressed: the others run at compute speed."))
    return notes


def context_notes(args, grid: list[Scenario], skipped: list[str]) -> list[str]:
    cores = os.cpu_count() or 1
    over = sorted({sc.workers for sc in grid if sc.workers > cores})
    notes = []
    if over:
        notes.append(f"compute is oversubscribed at N = {', '.join(map(str, over))}: N workers and {args.ps} "
                     f"shard(s) share {cores} cores, so without injected delays throughput cannot scale "
                     "with N there; speed-ups at those N measure the machine, not the modes.")
    notes.append(f"every process of a run (N workers + {args.ps} shard(s)) shares this machine's {cores} "
                 "cores; other processes on it (load average above) slow runs unevenly.")
    return notes + skipped


def write_summary(path: Path, ctx: dict, entries: list[dict], scale: list[dict], pngs: list[str],
                  args) -> None:
    n, profile = ctx["reference"]["workers"], ctx["reference"]["profile"]
    ref = [e for e in entries if e["workers"] == n and e["profile"] == profile]
    ns = sorted({e["workers"] for e in entries})
    lines = [f"# pserver consistency modes under stragglers{' (--quick)' if args.quick else ''}", "",
             *[f"- {ln}" for ln in ctx["machine_lines"]], f"- command: `{ctx['command']}`",
             f"- started {ctx['started']}, took {ctx['seconds'] / 60:.1f} min for {ctx['runs']} launches", "",
             f"- training: {ctx['training']}", "",
             "## What this run shows", "", ctx["findings"], "",
             f"## Reference scenario: N={n}, profile {profile}", "",
             md_table(*config_rows(ref, args.target)), "",
             "## Parallel scaling (Amdahl's law)", "", md_table(*scaling_rows(scale, ns)), "",
             "## Every configuration", "", "median (min-max) over the repeats that ran.", "",
             md_table(*config_rows(entries, args.target)), "",
             *assignment_section(entries),
             "## Straggler profiles", "", *[f"- {x}" for x in ctx["profiles"]], "",
             "## Notes", "", *[f"- {x}" for x in ctx["notes"]], "",
             "## Definitions", "", DEFINITIONS.replace("--budget", f"--budget ({args.budget:g})")
             .replace("--samples", f"--samples ({args.samples:,})")
             .replace("--target", f"--target ({args.target:g})"),
             "", "## Failed runs", ""]
    failures = [f"- {e['name']}: {f}" for e in entries for f in e["failures"]]
    lines += failures or ["none"]
    what = {"accuracy.png": f"test accuracy against wall time and against applied samples, N={n}",
            "scaling.png": "throughput against N with the Amdahl fit",
            "staleness.png": f"staleness histograms of async and ssp, N={n}"}
    lines += ["", "## Files", "", "- results.json, results.csv", *[f"- {f}: {what[f]}" for f in pngs],
              "- runs/: each launch's summary JSON; logs/: each launch's output", ""]
    path.write_text("\n".join(lines))


# ---------------------------------------------------------------------------- main

def run_grid(grid: list[Scenario], args, calibration: dict, out: Path) -> dict[Scenario, list[dict]]:
    """Repeat by repeat over the whole grid, a progress line per launch."""
    records: dict[Scenario, list[dict]] = {sc: [] for sc in grid}
    total, i = len(grid) * args.repeats, 0
    with Bar("launches", total) as bar:
        for repeat in range(args.repeats):
            for sc in grid:
                i += 1
                rec = run_one(sc, repeat, args, calibration, out)
                records[sc].append(rec)
                print(progress_line(i, total, sc, rec, args), flush=True)
                bar.update()
    return records


def header(args, grid: list[Scenario], skipped: list[str]) -> dict:
    m = machine(("grpcio", "numpy", "numba", "matplotlib"))
    data = ("synthetic MNIST-shaped data" if args.dataset == "synthetic"
            else f"MNIST from {args.data_dir or 'pserver cache directory'}")
    ctx = {"machine": m, "machine_lines": machine_lines(m),
           "command": " ".join(shlex.quote(a) for a in ["python", "bench/modes.py", *sys.argv[1:]]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "training": (f"{data}; mlp 784-{args.hidden.replace(',', '-')}-10, {args.optimizer} "
                        f"lr {args.lr:g}, batch {args.batch_size} per worker, {args.epochs} epoch(s) "
                        f"(each worker a 1/N slice), {args.ps} shard(s), chief evaluates every "
                        f"{args.eval_every:g} s; seeds {args.seed}.."
                        f"{args.seed + args.repeats - 1} (one per repeat); target {args.target:g}, budget "
                        f"{args.budget:g} s, {args.samples:,} samples; timeout {args.timeout:g} s "
                        "per launch"),
           "notes": context_notes(args, grid, skipped)}
    print(f"pserver consistency modes: {len(grid)} configurations x {args.repeats} repeat(s)")
    for line in ctx["machine_lines"] + [ctx["training"]] + ctx["notes"]:
        print(f"  {line}")
    return ctx


def load_plots(args):
    """bench/_plots.py (which imports matplotlib), or None with --no-plots. Called before any
    launch runs: a missing matplotlib must not cost a finished grid."""
    if not args.plots:
        return None
    try:
        import _plots
    except ImportError as e:
        raise SystemExit(f"bench/modes.py: the figures need matplotlib ({e}); install it with "
                         f"`.venv/bin/pip install -e \".[bench]\"`, or pass --no-plots") from None
    return _plots


def write_outputs(out: Path, ctx: dict, entries: list[dict], calibration: dict, args, plots) -> None:
    scale = scaling(entries)
    n, profile = reference(entries, args)
    ctx.update(reference={"workers": n, "profile": profile}, runs=sum(e["repeats"] for e in entries),
               findings=findings(entries, scale, n, profile, args),
               profiles=profile_notes(args, calibration, entries))
    result = {**{k: v for k, v in ctx.items() if k != "machine_lines"}, "settings": vars(args),
              "definitions": DEFINITIONS, "calibration": {str(k): v for k, v in calibration.items()},
              "modes": modes_object(entries, n, profile) if n else {}, "scaling": scale, "configs": entries}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_csv(out / "results.csv", entries)
    pngs = plots.draw_all(out, entries, scale, n, args) if plots else []
    write_summary(out / "summary.md", ctx, entries, scale, pngs, args)
    print(f"\n{ctx['findings']}\n")
    headers, rows = config_rows([e for e in entries if e["workers"] == n and e["profile"] == profile],
                                args.target)
    print(table(headers, rows, left=3))
    print(f"\nwrote {', '.join(str(out / f) for f in ['summary.md', 'results.json', 'results.csv', *pngs])}")


def replot(out: Path, plots) -> int:
    """Redraw from a finished run's results.json, with the settings it ran with."""
    if not (out / "results.json").is_file():
        raise SystemExit(f"bench/modes.py: --replot: {out / 'results.json'} does not exist (--out names "
                         "the directory of a finished run)")
    saved = json.loads((out / "results.json").read_text())
    args = argparse.Namespace(**{**saved["settings"], "out": str(out), "plots": plots is not None})
    ctx = {k: saved[k] for k in ("machine", "command", "started", "seconds", "training", "notes")}
    ctx["machine_lines"] = machine_lines(ctx["machine"])
    calibration = {int(k): v for k, v in saved["calibration"].items()}
    write_outputs(out, ctx, saved["configs"], calibration, args, plots)
    return 0


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    grid, skipped = build_grid(args)
    if args.list:
        total = f"{len(grid)} configurations x {args.repeats} repeat(s) = {len(grid) * args.repeats} launches"
        print("\n".join([sc.name for sc in grid] + skipped + [total]))
        return 0
    plots = load_plots(args)
    if args.replot:
        return replot(Path(args.out), plots)
    out = Path(args.out)
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the launch running now is stopped (run_launch's except).
    # SIGINT gets a handler even if we were started with it ignored (a background job): an
    # ignored signal stays ignored across exec, and launch must see our SIGINT to stop its cluster.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    ctx = header(args, grid, skipped)
    try:
        calibration = slow_calibration(grid, args, out)
        records = run_grid(grid, args, calibration, out)
    except KeyboardInterrupt:
        print("bench/modes.py: interrupted; the running cluster was stopped", file=sys.stderr)
        return 130
    ctx["seconds"] = time.monotonic() - started
    write_outputs(out, ctx, [aggregate(sc, recs) for sc, recs in records.items()], calibration, args, plots)
    print(f"took {ctx['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
