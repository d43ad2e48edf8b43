"""Where a worker's time goes, the cluster's counters, and the run summary (printed, and written as
JSON); the progress while training is pserver.observe.progress's."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Callable, Sequence


class StepTimer:
    """Where a worker's time goes: compute, injected delay, push, pull (waiting included),
    and push_pull: a step's push and the pull after it, which over the data plane are one
    exchange and cannot be told apart (pull alone: a batch's sparse rows, the first pull)."""

    def __init__(self) -> None:
        self.seconds = {"compute": 0.0, "delay": 0.0, "push": 0.0, "pull": 0.0, "push_pull": 0.0}

    @contextmanager
    def __call__(self, what: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - t

    def summary(self, wall: float, **extra) -> dict:
        comm = self.seconds["push"] + self.seconds["pull"] + self.seconds["push_pull"]
        return {**extra, "wall_seconds": round(wall, 3),
                **{f"{k}_seconds": round(v, 3) for k, v in self.seconds.items()},
                # idle: waiting on the shards (transfer and consistency waits), not computing
                "idle_fraction": round(comm / wall, 4) if wall > 0 else 0.0}


class EvalCurve:
    """The chief's test accuracy against wall time, every `every` seconds (0 = off)."""

    def __init__(self, every: float) -> None:
        self.every, self.next, self.points = every, every, []

    def maybe(self, evaluate: Callable[[], dict], elapsed: float, client, clock: int) -> None:
        if self.every <= 0 or elapsed < self.next:
            return
        ev = evaluate()
        steps = max(client.versions)
        self.points.append({"seconds": round(elapsed, 3), "steps": steps, "clock": clock, **ev})
        self.next = elapsed + self.every


DATA_COUNTERS = ("chunks_done", "chunks_released", "batches_retrained", "batches_dropped")


def describe_data(s: dict) -> str:
    """The data coordinator's line (summary, pserver status); "" when no chunk was leased."""
    if not any(s.get(k) for k in DATA_COUNTERS):
        return ""
    return (f"data leases: {s['chunks_done']:,} chunk(s) done, {s['chunks_released']:,} released by their "
            f"worker's end and leased again; {s['batches_retrained']:,} batch(es) trained twice, "
            f"{s['batches_dropped']:,} dropped late")


def combine_counters(statuses: Sequence, since: Sequence | None = None) -> dict:
    """Cluster-wide counters from every shard's StatusReply; with `since` (the statuses at
    a run's start), that run's part only (see run_part).

    Each worker push reaches every shard, so push counters are summed over shards (they
    count push messages), as are checkpoints written and failed; updates_applied and
    workers_marked_dead are the largest any shard saw (every shard applies the same steps);
    staleness is pooled.
    """
    if since is not None:
        statuses = [run_part(now, then) for now, then in zip(statuses, since)]
    cs = [s.counters for s in statuses]
    out = {k: sum(getattr(c, k) for c in cs) for k in
           ("pushes_received", "pushes_applied", "pushes_aggregated", "pushes_dropped_late",
            "pushes_rejected", "pulls_served", "checkpoints_written", "checkpoints_failed")}
    out["updates_applied"] = max(c.updates_applied for c in cs)
    out["workers_marked_dead"] = max(c.workers_marked_dead for c in cs)
    out["clock_gap_max"] = max(c.clock_gap_max for c in cs)
    hist = [sum(col) for col in zip(*(c.staleness_histogram for c in cs))]
    n = sum(hist)
    out["staleness_mean"] = sum(c.staleness_mean * sum(c.staleness_histogram) for c in cs) / n if n else 0.0
    out["staleness_max"] = max(c.staleness_max for c in cs)
    out["staleness_histogram"] = hist
    out["samples_trained"] = statuses[0].counters.samples_pushed   # shard 0 sees every push
    for k in DATA_COUNTERS:             # shard 0's data coordinator (--data-assignment leases)
        out[k] = getattr(statuses[0].counters, k)
    out["steps"] = max(s.version for s in statuses)
    return out


TABLE_FIELDS = ("rows", "bytes", "pending_ids", "admissions", "creations", "evictions")


def sparse_summary(statuses: Sequence) -> dict:
    """The sparse tables summed over shards (each holds its own rows), with the rows moved:
    {"sparse_tables": {name: {rows, bytes, ...}}, "rows_pulled", "rows_pushed"}; {} for a
    dense model."""
    tables: dict[str, dict] = {}
    for st in statuses:
        for t in st.tables:
            agg = tables.setdefault(t.name,
                                    dict.fromkeys(TABLE_FIELDS, 0) | {"dim": t.dim, "optimizer": t.optimizer})
            for k in TABLE_FIELDS:
                agg[k] += getattr(t, k)
    if not tables:
        return {}
    return {"sparse_tables": tables, "rows_pulled": sum(st.counters.rows_pulled for st in statuses),
            "rows_pushed": sum(st.counters.rows_pushed for st in statuses)}


def shard_restarts(statuses: Sequence, since: Sequence | None, seen: Sequence[int]) -> list[dict]:
    """The shards that restarted during the run: `seen[j]`, how many restarts of shard j the chief
    rode out (each a rejoin), or else a new process since `since` (the statuses at the run's
    start). A lower bound: two restarts while the chief was away from the shard (evaluating,
    backing off) are one rejoin. Each: its restarts, the checkpoint it restored from ("" when it
    came back empty and a worker re-seeded it) and how many updates it holds fewer than the shard
    furthest on. Every shard applies every step (sync, backup) or every push (async, ssp), so
    that is what its restart lost: retrained for shard 0, whose data coordinator restored with
    it; lost for the others (docs/semantics.md, "What survives what")."""
    newest = max(st.version for st in statuses)
    out = []
    for j, st in enumerate(statuses):
        moved = since is not None and since[j].instance != st.instance
        count = max(seen[j], int(moved))
        if count:
            out.append({"shard": j, "restarts": count, "restored_from": st.restored_from,
                        "version": st.version, "updates_behind": max(newest - st.version, 0)})
    return out


def describe_restart(r: dict) -> str:
    """A summary line for one entry of shard_restarts."""
    source = (f"restored from {os.path.basename(r['restored_from'])}" if r["restored_from"]
              else "back empty, re-seeded from a worker's weights")
    behind = f"it holds {r['updates_behind']:,} update(s) fewer than the others"
    then = ("; their data was leased and trained again (the batches trained twice above)" if r["shard"] == 0
            else "; those updates since its checkpoint are lost on that shard only")
    return (f"shard {r['shard']} restarted at least {r['restarts']} time(s) during the run ({source}): "
            f"{behind}{then if r['updates_behind'] else ''}")


# Highest values seen, not sums: a run's part of them cannot be told apart.
PEAKS = ("staleness_max", "clock_gap_max")


def run_part(now, start):
    """A shard's StatusReply less what it held at `start`: the counters and version of the
    run in between. A shard that restarted since (another instance) counts from its restart;
    its version goes on from the start's only when it resumed from a checkpoint."""
    out = type(now)()
    out.CopyFrom(now)
    same = now.instance == start.instance
    base = max(start.version, 0) if same or now.restored_from else 0
    out.version = max(now.version - base, 0)
    if not same:
        return out
    c, c0 = out.counters, start.counters
    for f in c.DESCRIPTOR.fields:
        value, before = getattr(c, f.name), getattr(c0, f.name)
        if f.name in PEAKS or isinstance(value, float):
            continue
        if isinstance(value, int):
            setattr(c, f.name, value - before)
        else:                                   # the staleness histogram, bucket by bucket
            buckets = [a - b for a, b in zip(value, before)]
            del value[:]
            value.extend(buckets)
    n, n0 = sum(now.counters.staleness_histogram), sum(c0.staleness_histogram)
    total = now.counters.staleness_mean * n - c0.staleness_mean * n0
    c.staleness_mean = total / (n - n0) if n > n0 else 0.0
    return out


def describe_updates(c: dict) -> str:
    """The one vocabulary of the summary, the status table and the shard's log: an update is
    one optimizer step on the parameters; a push is one gradient a worker sent, which is
    averaged into a step's update (sync, backup), applied on arrival as an update of its own
    (async, ssp), dropped late (backup) or rejected. Push counts are summed over shards."""
    return (f"{c['updates_applied']} updates from {c['pushes_received']} pushes: "
            f"{c['pushes_aggregated']} averaged into a step, {c['pushes_applied']} applied on arrival, "
            f"{c['pushes_dropped_late']} dropped late, {c['pushes_rejected']} rejected")


def describe_version(version: int) -> str:
    """A shard's version as a user reads it: the shards hold -1 until the chief's Init (or a
    restore) gives them values, which is "not initialized", not a version."""
    return str(version) if version >= 0 else "not initialized"


def format_summary(s: dict) -> str:
    acc, on = s.get("test_accuracy"), s.get("evaluated_on", "test")     # a Keras fit's: validation
    r2 = s.get("test_r2")
    # A model with several outputs has neither: its loss alone (each output's are in its logs)
    metric = (f"{on} accuracy {acc:.4f}, " if acc is not None else
              f"{on} r2 {r2:.4f}, " if r2 is not None else "")
    if on is None:
        metric = "no validation set (fit's History holds the training loss and metrics)"
    elif s.get("test_loss") is None:
        metric = f"no {on} set"      # a Stream from Python without one
    else:
        metric += f"{on} loss {s['test_loss']:.4f}"
    if s.get("test_auc") is not None:
        metric += f", {on} AUC {s['test_auc']:.4f}"
        if s.get("best_auc") is not None:
            metric += f" (the planted model's: {s['best_auc']:.4f})"
    # The workers that trained (an elastic job's joiners too), not the chief's --num-workers
    trained = len(s.get("workers_registered") or ()) or s["num_workers"]
    started = f" ({s['num_workers']} at the start)" if trained != s["num_workers"] else ""
    lines = [
        f"== pserver run summary: {s['mode']}, {s['num_shards']} shard(s), {trained} worker(s){started} ==",
        f"model {s['model']} ({s['num_params']:,} params), dataset {s['dataset']}, "
        f"optimizer {s['optimizer']} lr {s['lr']:g}, batch {s['batch_size']}/worker, {s['epochs']} epoch(s)",
        metric,
        f"{s['steps']} steps in {s['wall_seconds']:.1f} s: "
        f"{s['train_samples_per_second']:,.0f} train samples/s",
        f"{describe_updates(s)}; {s['workers_marked_dead']} worker(s) marked dead",
        f"staleness mean {s['staleness_mean']:.2f} max {s['staleness_max']}; "
        f"clock gap max {s['clock_gap_max']}",
    ]
    lines += [line for line in [describe_data(s)] if line]
    lines += [describe_restart(r) for r in s.get("shard_restarts", ())]
    lines += [f"sparse table {name}: {t['rows']:,} rows x {t['dim']} ({t['bytes'] / 2**20:,.1f} MiB, "
              f"{t['optimizer']}), {t['creations']:,} created, {t['admissions']:,} admitted, "
              f"{t['evictions']:,} evicted" for name, t in s.get("sparse_tables", {}).items()]
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    """Write atomically, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
