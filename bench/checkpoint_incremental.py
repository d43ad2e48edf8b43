"""Incremental checkpoints: what a delta holds, what a chain costs to restore, and
the memory a write takes beside the state.

    .venv/bin/python bench/checkpoint_incremental.py --secs 5 --run-samples 120000 --rows 3_000_000

(a) f and r on a real run: `pserver launch --model wide_deep --dataset criteo-synthetic` with
    --checkpoint-dir D --checkpoint-secs SECS (30 s is the target interval; a shorter one keeps
    the run short here: say which). Every file is hard-linked aside as it appears (pruning
    keeps only the newest), then read: per delta, f = rows in its rows.<T>.entries / rows in
    the tables at its version (also by bytes), r = its bytes / its base's bytes, checked
    against r <= 1.1 f + dense bytes / full bytes + 1%.
(b) restore: checkpoint.load of a base alone vs of the newest delta of the longest chain the
    rules allow (--full-every 10: 9 deltas of 3.5% of the rows each, 31.5% of the base in all;
    and 2 deltas of 16%), the same table size: REPS rounds, each loading the base and both chains
    (interleaved, the order rotating), so both ratios divide by one base series; the ratio's
    target is at most 1.6.
(c) extra RSS during a write: one ShardStore, one table of ROWS x 16 (adagrad), one thread
    pushing PUSH ids (uniform over the table: every row it changes before the writer reads it
    is copied aside) every PERIOD seconds for the whole part (WARMUP s before the first window),
    as a server's RPC threads push before, during and after a write; VmRSS sampled every 2 ms;
    glibc malloc tuned as `pserver serve` tunes it (pserver/launch/allocator.py). REPS times,
    interleaved: pushes without a write (the baseline: what the pushes alone add), a base
    written under pushes, a base written with pushes paused (the floor). Extra = peak during
    the window - RSS at its start; compared with the state's bytes (what the full copy before
    it took: 100%), with Checkpointer.aside_peak and with it + 16 MiB (the bound).
    The first write under pushes is reported apart from the median of the later ones.
JSON: bench/results/checkpoint/incremental.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path  # noqa: E402

from pserver.config import ServerConfig  # noqa: E402
from pserver.optim import make_optimizer  # noqa: E402
from pserver.persist import checkpoint  # noqa: E402
from pserver.server.checkpoint import Checkpointer
from pserver.server.store import ShardStore  # noqa: E402
from pserver.sparse import TableConfig  # noqa: E402
from pserver.sparse.merge import RowGrads  # noqa: E402

MiB = 1 << 20


def vmrss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- (a) f and r on a real run ------------------------------------------------------------------

def real_run(args, work: Path) -> dict:
    ckpt, aside = work / "ckpt", work / "aside"
    aside.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pserver", "launch", "--ps", "1", "--workers", str(args.workers),
           "--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", str(args.run_samples),
           "--test-samples", "2000", "--batch-size", "64", "--optimizer", "adam", "--lr", "0.001",
           "--row-lr", "0.05", "--epochs", "1", "--seed", "5", "--mode", "async",
           "--checkpoint-dir", str(ckpt), "--checkpoint-secs", str(args.secs), "--full-every", "10"]
    print("(a) " + " ".join(cmd[2:]), flush=True)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    while p.poll() is None:                 # link each file aside before pruning removes it
        for name in os.listdir(ckpt) if ckpt.is_dir() else []:
            if checkpoint.NAME.match(name) and not (aside / name).exists():
                try:
                    os.link(ckpt / name, aside / name)
                except OSError:
                    pass
        time.sleep(0.05)
    reader.join(10)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit("".join(out)[-3000:])
    result = analyze(str(aside))
    result.update(command=" ".join(cmd[2:]), wall_s=wall, interval_s=args.secs)
    print(f"    {wall:.0f} s")
    return result


def analyze(directory: str) -> dict:
    """Each file of a run: kind, bytes, rows; per delta f (rows in it / rows at its version; also
    by bytes), r (its bytes / a full file's at its version: the bytes of every entry, the dense
    arrays and the small arrays; also / its base's bytes) and the bound 1.1 f + dense / full + 1%."""
    files = sorted(checkpoint.candidates(directory, 0, 1))
    rows, bases = [], {}
    for version, path in files:
        meta, arrays = checkpoint.read(path)
        size = os.path.getsize(path)
        dense = sum(a.nbytes for k, a in arrays.items() if k == "params" or k.startswith("opt."))
        tables = range(len(meta["tables"]))
        changed = sum(arrays[f"rows.{i}.entries"].shape[0] for i in tables)
        changed_bytes = sum(arrays[f"rows.{i}.entries"].nbytes for i in tables)
        whole = checkpoint.load(path)
        held = sum(st.size for st in whole.rows.values())
        held_bytes = sum(checkpoint.entries_of(st, ["rows"] + sorted(st.slots)).nbytes
                         for st in whole.rows.values())
        small = sum(a.nbytes for k, a in arrays.items() if k.startswith("rows.") and ".entries" not in k
                    and not k.endswith(f".{checkpoint.REMOVED}"))
        full = held_bytes + dense + small                # a base's arrays at this version
        row = {"version": version, "file": os.path.basename(path), "kind": meta.get("kind", "base"),
               "bytes": size, "dense_bytes": dense, "full_bytes_est": full, "rows": held,
               "changed_rows": changed}
        if row["kind"] == "base":
            bases[version] = size
        else:
            f, fb = changed / max(held, 1), changed_bytes / max(held_bytes, 1)
            r, dense_frac = size / full, dense / full
            bound = 1.1 * f + dense_frac + 0.01
            row.update(f=f, f_bytes=fb, r=r, r_vs_base=size / bases[meta["base"]] if meta["base"] in bases
                       else None, dense_over_full=dense_frac, bound=bound, ok=bool(r <= bound))
        rows.append(row)
    print(f"    {len(files)} files: f = rows in the delta / rows at its version (f_b: by bytes); "
          "r = its bytes / a full file's at its version; bound = 1.1 f + dense/full + 0.01")
    print("    version  kind   bytes       rows     changed  f       f_b     r       r/base  dense/full  "
          "bound   ok")
    for x in rows:
        extra = (f"  {x['f']:.4f}  {x['f_bytes']:.4f}  {x['r']:.4f}  {x['r_vs_base'] or float('nan'):.4f}"
                 f"  {x['dense_over_full']:.4f}      {x['bound']:.4f}  {x['ok']}"
                 if x["kind"] == "delta" else "")
        print(f"    {x['version']:7d}  {x['kind']:5s}  {x['bytes']:10,d}  {x['rows']:8,d}  "
              f"{x['changed_rows']:8,d}{extra}")
    deltas = [x for x in rows if x["kind"] == "delta"]
    return {"files": rows, "deltas": len(deltas), "all_within_bound": all(x["ok"] for x in deltas)}


# -- a store with one big table -----------------------------------------------------------------

def big_store(rows: int, directory: str, full_every: int, dim: int = 16):
    store = ShardStore(0, 1, lambda n: make_optimizer("adam", n, lr=0.001))
    table = TableConfig("emb", dim, optimizer="adagrad", lr=0.05, seed=3)
    with store.cond:
        store.configure("sig", 1024, 0, 1024, [table])
        store.version = 0
    ids = np.arange(1, rows + 1, dtype=np.uint64)
    grads = np.full((1 << 18, dim), 0.01, np.float32)
    for i in range(0, rows, 1 << 18):           # every row created
        part = ids[i:i + (1 << 18)]
        push(store, part, grads[:part.shape[0]])
    cfg = ServerConfig(optimizer="adam", full_every=full_every, checkpoint_dir=directory)
    return store, Checkpointer(directory, "--checkpoint-dir", store, cfg), ids


def push(store, ids, grads):
    with store.cond:
        store.apply([np.zeros(store.size, np.float32)], [1], [(RowGrads("emb", ids, grads), 1)])


# -- (b) restore time ---------------------------------------------------------------------------

def restore_times(args, work: Path) -> dict:
    """Both chains written first, then REPS rounds each loading the one base and both chains'
    newest deltas (the order rotating each round): the two ratios share one base timing."""
    out, newest, full = {}, {}, None
    rng = np.random.default_rng(0)
    # The most the rules allow: --full-every 10, and deltas adding up to under CHAIN_LIMIT of the base
    # (the last delta's own bytes may cross it: the check is before each write).
    for label, deltas, frac in (("9 deltas of 3.5%", 9, 0.035), ("2 deltas of 16%", 2, 0.16)):
        chain_dir = str(work / f"chain{deltas}")
        store, ck, ids = big_store(args.restore_rows, chain_dir, full_every=10)
        ck.request()
        grads = np.full((int(frac * ids.shape[0]), 16), 0.01, np.float32)
        for _ in range(deltas):
            push(store, np.sort(rng.choice(ids, grads.shape[0], replace=False)), grads)
            ck.request()
        files = checkpoint.candidates(chain_dir, 0, 1)
        newest[label] = files[0][1]
        assert checkpoint.base_of(newest[label]) is not None, f"{label}: the newest file is a base ({files})"
        chain = [p for _, p in files if checkpoint.base_of(p) == checkpoint.base_of(newest[label])]
        assert len(chain) == deltas, \
            f"{label}: the rules cut the chain: {[os.path.basename(p) for _, p in files]}"
        if full is None:        # one base, of the first store's state: the same rows and size as both
            base_dir = str(work / "base")
            full, _ = Checkpointer(base_dir, "--checkpoint-dir", store,
                                              ServerConfig(optimizer="adam", full_every=1,
                                                           checkpoint_dir=base_dir)).request()
        out[label] = {"rows": args.restore_rows, "base_bytes": os.path.getsize(full),
                      "deltas_bytes": sum(os.path.getsize(p) for p in chain), "chain_s": []}
        ck.writer.shutdown()
        del store, ck
    base_t = []
    series = [("base", full), *newest.items()]
    for r in range(args.reps):                  # interleaved, the order rotating
        for label, path in series[r % 3:] + series[:r % 3]:
            t = time.perf_counter()
            loaded = checkpoint.load(path)
            (base_t if label == "base" else out[label]["chain_s"]).append(time.perf_counter() - t)
            del loaded
    for label, o in out.items():
        o["base_s"] = base_t
        o["ratio"] = float(np.median(o["chain_s"]) / np.median(base_t))
        o["ok"] = o["ratio"] <= 1.6
        print(f"(b) {label}: {args.restore_rows:,} rows x 16, base {o['base_bytes'] / MiB:.0f} MiB, deltas "
              f"{o['deltas_bytes'] / MiB:.0f} MiB; load base {np.median(base_t):.3f} s (the one base "
              f"series), base + chain {np.median(o['chain_s']):.3f} s (medians of {args.reps}): ratio "
              f"{o['ratio']:.2f} (target <= 1.6)", flush=True)
    return out


# -- (c) extra RSS during a write ---------------------------------------------------------------

def rss_during_write(args, work: Path) -> dict:
    """One pusher thread for the whole part, as a server's RPC threads are there before and after a
    write: a thread started with the write would count its own heap (its malloc arena, its
    temporaries) as the write's. Windows, REPS times, interleaved: pushes without a write (as long
    as the last write took: the baseline), a write under pushes, a write with pushes stopped."""
    directory = str(work / "rss")
    store, ck, ids = big_store(args.rows, directory, full_every=1)
    table = store.tables["emb"]
    entry = table.entry_dtype().itemsize
    nb = table.nbytes
    state_bytes = int(nb() if callable(nb) else nb) + store.params.nbytes * 3   # rows, slots, index; dense
    ck.request()                                 # the first write's buffers are in the heap now
    rng = np.random.default_rng(1)
    grads = np.full((args.push, 16), 0.01, np.float32)
    out = {"rows": args.rows, "dim": 16, "entry_bytes": entry, "state_bytes": state_bytes,
           "push_ids": args.push, "push_period_s": args.period, "windows": []}
    stop, paused, pushed = threading.Event(), threading.Event(), [0]

    def pusher():
        while not stop.is_set():
            if paused.is_set():
                stop.wait(0.005)
                continue
            batch = np.unique(rng.choice(ids, args.push))
            push(store, batch, grads[:batch.shape[0]])
            pushed[0] += batch.shape[0]
            stop.wait(args.period)

    thread = threading.Thread(target=pusher)
    thread.start()
    time.sleep(args.warmup)                      # the pusher's heap as it is in a running server
    length = 2.0
    try:
        for rep in range(args.reps):
            for label in ("pushes, no write", "write under pushes", "write, pushes stopped"):
                if label.endswith("stopped"):
                    paused.set()
                    time.sleep(0.1)
                push(store, ids[:1], grads[:1])  # a new version: the write is not skipped as done
                before, n0 = vmrss(), pushed[0]
                peak, done = [before], threading.Event()

                def sample():
                    while not done.is_set():
                        peak[0] = max(peak[0], vmrss())
                        done.wait(0.002)

                sampler = threading.Thread(target=sample)
                sampler.start()
                t0 = time.perf_counter()
                if label.startswith("write"):
                    ck.request()
                else:
                    time.sleep(length)
                secs = time.perf_counter() - t0
                done.set()
                sampler.join()
                paused.clear()
                if label == "write under pushes":
                    length = secs
                extra = peak[0] - before
                aside = ck.aside_peak if label.startswith("write") else 0
                bound = aside + 16 * MiB
                row = {"rep": rep, "window": label, "secs": secs, "rss_before": before, "extra_rss": extra,
                       "aside_peak": aside, "pushed_ids": pushed[0] - n0,
                       "extra_over_state": extra / state_bytes, "bound_aside_plus_16MiB": bound,
                       "ok_issue_bound": extra <= bound, "ok_15pct": extra <= 0.15 * state_bytes}
                out["windows"].append(row)
                print(f"(c) {rep} {label:21s} {secs:5.2f} s, {pushed[0] - n0:9,d} ids pushed; extra RSS "
                      f"{extra / MiB:6.1f} MiB = {100 * extra / state_bytes:4.1f}% of the state "
                      f"({state_bytes / MiB:.0f} MiB); kept aside {aside / MiB:5.1f} MiB"
                      + (f"; bound (aside + 16 MiB) {bound / MiB:.1f} MiB: "
                         f"{'ok' if row['ok_issue_bound'] else 'MISSED'}"
                         if label.startswith("write") else ""),
                      flush=True)
    finally:
        stop.set()
        thread.join()
    summary = {}
    for label in ("pushes, no write", "write under pushes", "write, pushes stopped"):
        rows = [w for w in out["windows"] if w["window"] == label]
        later = rows[1:]
        x = summary[label] = {
            "first_extra_rss": rows[0]["extra_rss"], "first_aside": rows[0]["aside_peak"],
            "median_extra_rss_later": float(np.median([w["extra_rss"] for w in later])) if later else None,
            "median_aside_later": float(np.median([w["aside_peak"] for w in later])) if later else None,
            "max_extra_over_state": max(w["extra_over_state"] for w in rows),
            "all_within_bound": all(w["ok_issue_bound"] for w in rows)}
        print(f"(c) {label}: first {x['first_extra_rss'] / MiB:.1f} MiB "
              f"(aside {x['first_aside'] / MiB:.1f}); "
              + (f"median of the {len(later)} after {x['median_extra_rss_later'] / MiB:.1f} MiB "
                 f"(aside {x['median_aside_later'] / MiB:.1f}); " if later else "")
              + f"at most {100 * x['max_extra_over_state']:.1f}% of the state", flush=True)
    out["summary"] = summary
    ck.writer.shutdown()
    shutil.rmtree(directory)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secs", type=float, default=30.0, help="--checkpoint-secs of the real run (a)")
    ap.add_argument("--run-samples", type=int, default=400_000, help="samples of the real run (a)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--restore-rows", type=int, default=1_000_000, help="rows of (b)'s table")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=3_000_000, help="rows of (c)'s table")
    ap.add_argument("--push", type=int, default=4096, help="ids per push in (c)")
    ap.add_argument("--period", type=float, default=0.01, help="seconds between pushes in (c)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of pushes before (c)'s first window")
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--analyze", default=None, help="(a) on a directory of a run's files kept aside, "
                    "not a run")
    ap.add_argument("--dir", default=None, help="where files go (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    from pserver.launch import allocator
    m["malloc_tuned"] = allocator.tune()          # as `pserver serve` does: freed heap is kept
    work = Path(tempfile.mkdtemp(prefix="pserver-incr-", dir=args.dir))
    result = {"machine": m, "args": vars(args)}
    try:
        if args.analyze:
            print(f"(a) the files in {args.analyze}")
            result["real_run"] = analyze(args.analyze)
        elif "a" in args.parts:
            result["real_run"] = real_run(args, work)
        if "b" in args.parts:
            result["restore"] = restore_times(args, work)
        if "c" in args.parts:
            result["rss"] = rss_during_write(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(f"load average (1 min) at the end: {result['load_avg_1m_end']}")
    path = result_path(args.out, "checkpoint/incremental.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
