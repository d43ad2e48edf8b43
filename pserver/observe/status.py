"""`pserver status`: each shard's version, mode, size and counters, as a table or JSON."""

from __future__ import annotations

import json

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from pserver.observe.metrics import combine_counters, describe_data, describe_version

# The words of metrics.describe_updates: updates are optimizer steps; pushes are gradients,
# averaged into a step, applied on arrival, dropped late or rejected.
COLUMNS = [("shard", "shard"), ("version", "version"), ("mode", "mode"), ("params", "num_params"),
           ("workers", "num_workers"), ("live", "live"), ("updates", "updates_applied"),
           ("pushes", "pushes_received"), ("averaged", "pushes_aggregated"),
           ("on_arrival", "pushes_applied"), ("late", "pushes_dropped_late"),
           ("rejected", "pushes_rejected"), ("dead", "workers_marked_dead"),
           ("stale_mean", "staleness_mean"), ("stale_max", "staleness_max"), ("memory_mib", "memory")]
MiB = 1 << 20
INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
         FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def rows(statuses) -> list[dict]:
    out = []
    for s in statuses:
        c = s.counters
        out.append({"shard": s.shard, "version": describe_version(s.version), "mode": s.mode,
                    "num_params": s.num_params,
                    "num_workers": s.num_workers, "live": ",".join(map(str, s.live_workers)) or "-",
                    **{k: getattr(c, k) for k in ("updates_applied", "pushes_received", "pushes_applied",
                                                  "pushes_aggregated", "pushes_dropped_late",
                                                  "pushes_rejected", "workers_marked_dead", "staleness_max")},
                    "staleness_mean": round(c.staleness_mean, 3),
                    "memory": f"{s.memory.used / MiB:,.0f}/{s.memory.budget / MiB:,.0f}"})
    return out


def as_dict(msg) -> dict:
    """A message as a dict for JSON, every field present, int64 fields as numbers (protobuf's
    JSON mapping writes them as strings)."""
    out = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for f in msg.DESCRIPTOR.fields:
        if f.message_type is not None and f.name in out and isinstance(out[f.name], dict):
            out[f.name] = as_dict(getattr(msg, f.name))
        elif f.type in INT64:
            out[f.name] = [int(v) for v in out[f.name]] if isinstance(out[f.name], list) else int(out[f.name])
    return out


def settings_of(msg) -> dict:
    """A TrainingSettings message as {setting: value}, every field (defaults included)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def differing_settings(settings: list[dict]) -> dict:
    """{setting: [each shard's value]} for the training settings on which the shards differ
    (`settings`: each shard's, as settings_of gives them), in the message's field order. The
    worker refuses such a cluster (worker/client.py); `pserver status` shows it."""
    return {n: [s[n] for s in settings] for n in (settings[0] if settings else ())
            if len({s[n] for s in settings}) > 1}


def show_status(statuses, as_json: bool = False) -> int:
    """Print the shards' Status replies (PSClient.status) as a table, or as JSON. Training
    settings on which the shards differ (a misconfigured job) are shown per shard."""
    differ = differing_settings([settings_of(s.settings) for s in statuses])
    if as_json:
        shards = [as_dict(s) for s in statuses]
        print(json.dumps({"shards": shards, "cluster": combine_counters(statuses),
                          "settings_differ": differ}, indent=2))
        return 0
    table = rows(statuses)
    widths = [max(len(h), *(len(str(r[k])) for r in table)) for h, k in COLUMNS]
    print("  ".join(h.rjust(w) for (h, _), w in zip(COLUMNS, widths)))
    for r in table:
        print("  ".join(str(r[k]).rjust(w) for (_, k), w in zip(COLUMNS, widths)))
    total = combine_counters(statuses)
    hist = total["staleness_histogram"]
    last = max((i for i, n in enumerate(hist) if n), default=-1)
    for name, values in differ.items():
        print(f"settings differ: --{name.replace('_', '-')}: "
              + ", ".join(f"shard {s.shard} {v!r}" for s, v in zip(statuses, values))
              + " (workers refuse shards that disagree)")
    optimizer = ("differs by shard" if {"optimizer", "lr"} & differ.keys()
                 else f"{statuses[0].optimizer} lr {statuses[0].lr:g}")
    # Before the chief's Init (or a restore) every shard holds version -1: no step, not "-1 steps".
    done = (f"{total['steps']} steps, {total['samples_trained']:,} samples" if total["steps"] >= 0 else
            "not started (the shards wait for the chief's initial weights)")
    print(f"cluster: {done}; optimizer "
          f"{optimizer}; staleness histogram "
          f"{hist[:last + 1] if last >= 0 else '(no async pushes)'}; clock gap max {total['clock_gap_max']}")
    if describe_data(total):
        print(describe_data(total))
    for st in statuses:
        c = st.counters
        if c.rows_evicted_for_memory or c.pushes_refused_for_memory:
            print(f"memory: shard {st.shard} holds {st.memory.used / MiB:,.1f} of its "
                  f"{st.memory.budget / MiB:,.1f} MiB (--max-memory-mb); it evicted "
                  f"{c.rows_evicted_for_memory:,} rows and refused {c.pushes_refused_for_memory:,} "
                  f"pushes to stay within it")
    print_tables(statuses)
    return 0


TABLE_COLUMNS = ("table", "shard", "dim", "optimizer", "rows", "bytes", "pending_ids", "admissions",
                 "creations", "evictions")


def print_tables(statuses) -> None:
    """One line per sparse table per shard: its rows and what admission and eviction did."""
    table = [{"table": t.name, "shard": s.shard, **{k: getattr(t, k) for k in TABLE_COLUMNS[2:]}}
             for s in statuses for t in s.tables]
    if not table:
        return
    widths = [max(len(h), *(len(str(r[h])) for r in table)) for h in TABLE_COLUMNS]
    print("sparse tables:")
    print("  ".join(h.rjust(w) for h, w in zip(TABLE_COLUMNS, widths)))
    for r in table:
        print("  ".join(str(r[h]).rjust(w) for h, w in zip(TABLE_COLUMNS, widths)))
