"""Memory per row of a sparse table on real shards: RSS growth over each shard's idle RSS.

    .venv/bin/python bench/sparse_memory.py --ids 10_000_000 --dim 16 --shards 2

Starts S `pserver serve` processes, registers a model with one sparse table (adagrad by
default), pushes --ids distinct ids in batches (sync mode, one worker, so every row is
created), then reads each shard's VmRSS from /proc. Bytes per row = (RSS after - RSS idle
after Register) / rows on the shard; the bound printed beside it is 1.2 x (dim x 4 bytes +
the optimizer's state) + 32 bytes. A checkpoint is written afterwards and the shard's peak
RSS during it (VmHWM) reported separately: a snapshot copies the table while it is written.
The peak while the table grew (VmHWM before the checkpoint) is reported beside the end's RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, positive_ints, result_path  # noqa: E402

from pserver.config import DATA_PLANES  # noqa: E402
from pserver.models.layout import Layout  # noqa: E402
from pserver.sparse import ROWS, TableConfig, TableLookup  # noqa: E402
from pserver.worker.client import PSClient  # noqa: E402

MiB = 1 << 20


def rss(pid: int, field: str = "VmRSS") -> int:
    """Bytes of a process's resident set (or its peak, VmHWM), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def start_shards(n: int, ckpt: str, extra: list[str] = ()) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addrs = [], []
    for j in range(n):
        p = subprocess.Popen([sys.executable, "-m", "pserver", "serve", "--port", "0", "--shard", str(j),
                              "--num-shards", str(n), "--num-workers", "1", "--checkpoint-dir", ckpt,
                              "--optimizer", "sgd", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            if "listening on" in line:
                addrs.append(line.split("listening on")[1].split()[0].rstrip(",;"))
                break
        procs.append(p)
    return procs, addrs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=positive_ints, default=[10_000_000], help="distinct ids to push "
                                                                            "(default 10M)")
    ap.add_argument("--dim", type=int, default=16, help="values per row (default 16)")
    ap.add_argument("--shards", type=int, default=2, help="shards (default 2)")
    ap.add_argument("--optimizer", default="adagrad", choices=ROWS.names(), help="row optimizer "
                                                                                  "(default adagrad)")
    ap.add_argument("--batch", type=int, default=1 << 18, help="ids per push (default 262144)")
    ap.add_argument("--data-plane", default="auto", choices=DATA_PLANES.names(),
                    help="how the pushes travel: auto (shared memory, this machine) or grpc (default auto)")
    ap.add_argument("--json", default=None, help="write the results here "
                                                 "(default results/sparse_memory.json)")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    table = TableConfig("emb", args.dim, optimizer=args.optimizer, lr=0.01)
    layout = Layout.of([("b", (1,))], [table])
    with tempfile.TemporaryDirectory() as ckpt:
        procs, addrs = start_shards(args.shards, ckpt)
        try:
            result = measure(args, layout, procs, addrs)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    result["machine"] = m
    path = result_path(args.json, "sparse_memory.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


def table_rows(client: PSClient, field: str = "rows") -> list[int]:
    return [sum(getattr(t, field) for t in st.tables) for st in client.status()]


def push(client: PSClient, w: np.ndarray, ids: np.ndarray, dim: int) -> None:
    """One sync step that creates the rows of `ids`."""
    grads = np.full((ids.size, dim), 0.01, np.float32)
    lk = TableLookup(ids, np.arange(ids.size), np.empty_like(grads), grads)
    client.push(np.zeros(1, np.float32), ids.size, lookups=[lk], tables=["emb"])
    client.pull(w)


def measure(args, layout: Layout, procs, addrs) -> dict:
    client = PSClient(addrs, rpc_deadline=600, data_plane=args.data_plane)
    client.connect(60)
    client.register(layout)
    client.init(np.zeros(1, np.float32))
    w = np.empty(1, np.float32)
    client.pull(w)
    n, dim = args.ids[0], args.dim
    # Warm up first: the kernels compile at the first push, and their code is not table memory.
    push(client, w, np.arange(n + 1, n + 1 + 64 * args.shards, dtype=np.uint64), dim)
    time.sleep(1.0)
    idle = [rss(p.pid) for p in procs]
    warm = table_rows(client)
    started, slowest = time.monotonic(), 0.0
    for a in range(0, n, args.batch):
        t0 = time.monotonic()
        push(client, w, np.arange(a + 1, min(a + args.batch, n) + 1, dtype=np.uint64), dim)
        slowest = max(slowest, time.monotonic() - t0)
    seconds = time.monotonic() - started
    time.sleep(1.0)
    after = [rss(p.pid) for p in procs]
    growth_peak = [rss(p.pid, "VmHWM") for p in procs]     # the most it held while the table grew
    rows, held = table_rows(client), table_rows(client, "bytes")
    client.checkpoint()
    peak = [rss(p.pid, "VmHWM") for p in procs]
    client.close()
    slots = len(ROWS.get(args.optimizer).slots)      # float32 state values per row value
    bound = 1.2 * (dim * 4 + slots * dim * 4) + 32
    per_row = [(b - i) / (r - r0) for i, b, r, r0 in zip(idle, after, rows, warm)]
    print(f"{n:,} distinct ids, dim {dim}, {args.optimizer}, {args.shards} shards, pushed in {seconds:.1f} s "
          f"({n / seconds:,.0f} rows/s, --data-plane {args.data_plane}); slowest push "
          f"{slowest * 1000:,.0f} ms, mean {seconds / -(-n // args.batch) * 1000:,.0f} ms")
    for j in range(args.shards):
        print(f"shard {j}: {rows[j]:,} rows; RSS idle {idle[j] / MiB:,.0f} MiB -> {after[j] / MiB:,.0f} MiB: "
              f"{per_row[j]:.1f} bytes/row (bound {bound:.1f}; the table's arrays hold "
              f"{held[j] / rows[j]:.1f}); peak while growing {growth_peak[j] / MiB:,.0f} MiB "
              f"({growth_peak[j] / after[j]:.2f} x the end); peak during a checkpoint "
              f"{peak[j] / MiB:,.0f} MiB (+{(peak[j] - after[j]) / MiB:,.0f} MiB for the snapshot)")
    worst = max(per_row)
    print(f"worst shard: {worst:.1f} bytes/row = {worst / bound:.2f} x the bound")
    return {"ids": n, "dim": dim, "optimizer": args.optimizer, "shards": args.shards, "rows": rows,
            "rss_idle": idle, "rss_after": after, "rss_peak_growth": growth_peak,
            "rss_peak_checkpoint": peak, "table_bytes": held,
            "bytes_per_row": per_row, "bound_bytes_per_row": bound, "push_seconds": seconds,
            "slowest_push_seconds": slowest}


if __name__ == "__main__":
    raise SystemExit(main())
