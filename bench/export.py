"""The export of a big sparse table against a full checkpoint's write, on real shards.

    python bench/export.py --ids 2_000_000 --dim 16 --shards 2

Starts S `pserver serve` processes (--full-every 1: every checkpoint is a full base),
pushes --ids distinct ids (one sync worker: every row is created; bench/sparse_memory.py's
pushes), then times, interleaved --repeats times, from the chief's side:
  checkpoint  the Checkpoint call on every shard (each writes its full file and fsyncs it)
  export      what `--save` does for the table: ExportRows streamed from every shard, merged
              into sorted ids and rows, written as .npy files and fsynced (pserver.persist.model_file)
The ratio export/checkpoint of the medians is the figure (the target: at most 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path  # noqa: E402
from sparse_memory import push, start_shards  # noqa: E402

from pserver.models.layout import Layout  # noqa: E402
from pserver.persist import model_file as saved  # noqa: E402
from pserver.sparse import ROWS, TableConfig  # noqa: E402
from pserver.worker.client import PSClient  # noqa: E402


class TableModel:
    """The least a model file needs: a dense layout and one sparse table."""
    name = "bench-table"

    def __init__(self, table: TableConfig) -> None:
        self.layout = Layout.of([("b", (1,))])
        self.sparse_tables = [table]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=2_000_000, help="distinct ids (default 2M)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--optimizer", default="adagrad", choices=ROWS.names(),
                    help="row optimizer (its state is in the checkpoint, not in the export; default adagrad)")
    ap.add_argument("--batch", type=int, default=1 << 18)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="default results/ctr/export-<ids>.json")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    table = TableConfig("emb", args.dim, optimizer=args.optimizer, lr=0.01)
    layout = Layout.of([("b", (1,))], [table])
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        ckpt = os.path.join(work, "ckpt")
        os.makedirs(ckpt)
        procs, addrs = start_shards(args.shards, ckpt, ["--full-every", "1"])
        try:
            client = PSClient(addrs, rpc_deadline=600, data_plane="auto")
            client.connect(60)
            client.register(layout)
            client.init(np.zeros(1, np.float32))
            w = np.empty(1, np.float32)
            client.pull(w)
            for a in range(0, args.ids, args.batch):
                ids = np.arange(a + 1, min(a + args.batch, args.ids) + 1, dtype=np.uint64)
                push(client, w, ids, args.dim)
            times = {"checkpoint": [], "export": []}
            model, out = TableModel(table), os.path.join(work, "model")
            for _ in range(args.repeats):
                push(client, w, np.array([1], np.uint64), args.dim)     # a new version: a new file
                t0 = time.perf_counter()
                client.checkpoint()
                times["checkpoint"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                versions, count, pages = client.export_table("emb")
                saved.save(out, model, w, None, {}, tables={"emb": saved.TableRows(count, pages)})
                times["export"].append(time.perf_counter() - t0)
            client.close()
            files = sorted(os.listdir(ckpt))
            ckpt_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files[-args.shards:])
            export_bytes = sum(os.path.getsize(os.path.join(out, "tables", f))
                               for f in os.listdir(os.path.join(out, "tables")))
            ids = np.load(os.path.join(out, "tables", "emb.ids.npy"), mmap_mode="r")
            assert ids.shape == (args.ids,) and ids[0] == 1 and ids[-1] == args.ids
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["export"] / med["checkpoint"]
    print(f"{args.ids:,} rows x {args.dim} ({args.optimizer}) on {args.shards} shards, {args.repeats} "
          f"interleaved repeats: full checkpoint {med['checkpoint']:.2f} s median "
          f"({ckpt_bytes / 2**20:,.0f} MiB), export (ExportRows + merge + .npy) {med['export']:.2f} s "
          f"({export_bytes / 2**20:,.0f} MiB): ratio {ratio:.2f} (target <= 1.5)")
    result = {"ids": args.ids, "dim": args.dim, "optimizer": args.optimizer, "shards": args.shards,
              "seconds": times, "median": med, "ratio": ratio, "checkpoint_bytes": ckpt_bytes,
              "export_bytes": export_bytes, "machine": m}
    path = result_path(args.json, f"ctr/export-{args.ids}.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
