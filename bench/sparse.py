"""Sparse rows per second through pserver's real client and shard processes: row pulls (ids
in, rows out) and row pushes (unique ids and their gradients, through the row optimizer),
over the same-host data plane and over gRPC only, for 1, 2 and 4 shards.

Each shard is a `python -m pserver serve` process (sync mode, one worker, so every push is
one step that the shard applies before it answers); this process is the worker, a PSClient,
with a model of one sparse table (--dim, adagrad) and a 16-element dense tensor. The table
is first filled with --rows rows per shard (untimed pushes of fresh ids); then each request
carries --ids distinct ids per shard, drawn from the stored ones, deduplicated beforehand as
a worker does. The baseline, measured in the same run: np.add.at of the same number of
gradient rows into a float32 matrix of --rows rows, which is what a shard's update costs
without a hash table or an optimizer.

    python bench/sparse.py              # 1,2,4 shards, 1M rows, 64k ids, dim 16: results/sparse.{json,png}
    python bench/sparse.py --quick      # 100k rows, 16k ids, 1 shard
    python bench/sparse.py --json r.json --plot r.png    # elsewhere; --no-plot: no matplotlib needed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pserver.observe.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util, _plots, transport sit beside this file
from _util import machine, machine_lines, positive_ints, result_path, summary, table  # noqa: E402
from transport import running, shard_argv, time_round_trips  # noqa: E402

DEFINITIONS = """\
rows/s: distinct ids in one request / seconds per request (one client, requests one after another);
        a request to S shards carries S x --ids ids, each shard its own; per shard = rows/s / S
pull: PSClient.pull_rows (ids out, rows back); push: PSClient.push with the rows' gradients, one
      sync step, applied by adagrad on the shard before it answers
each figure: the median of the repeats (min, max beside it); x np.add.at = rows/s / np.add.at's rows/s"""
PLANES = {"data plane": "auto", "gRPC": "grpc"}
TABLE = "emb"
DENSE = 16                  # dense elements: every shard holds some, so the data plane is offered


def layout(dim: int):
    from pserver.models.layout import Layout
    from pserver.sparse import TableConfig
    return Layout.of([("b", (DENSE,))], [TableConfig(TABLE, dim, optimizer="adagrad", lr=0.01)])


def shard_ids(shards: int, count: int, start: int = 0) -> np.ndarray:
    """`count` ids per shard: the smallest ids >= start that shard_of sends to each shard."""
    from pserver.sparse import shard_of
    out, per = [], [0] * shards
    while min(per) < count:
        cand = np.arange(start, start + 2 * shards * count, dtype=np.uint64)
        owner = shard_of(cand, shards)
        for j in range(shards):
            take = cand[owner == j][:count - per[j]]
            out.append(take)
            per[j] += take.size
        start += cand.size
    return np.concatenate(out)


def requests(stored: np.ndarray, shards: int, args, count: int = 8) -> list:
    """`count` lookups of --ids distinct stored ids per shard, with gradients."""
    from pserver.sparse import TableLookup, shard_of
    rng = np.random.default_rng(1)
    owner = shard_of(stored, shards)
    out = []
    for _ in range(count):
        ids = np.concatenate([rng.choice(stored[owner == j], args.ids, replace=False) for j in range(shards)])
        lk = TableLookup.of(ids.view(np.int64), args.dim)
        lk.grads[:] = rng.standard_normal(lk.grads.shape, dtype=np.float32) * 0.01
        out.append(lk)
    return out


class Worker:
    """One PSClient on the shards, on one plane; pushes carry the step each shard is at."""

    def __init__(self, addresses: list[str], plane: str, args) -> None:
        from pserver.worker.client import PSClient
        self.client = PSClient(addresses, rank=0, num_workers=1, rpc_deadline=600, data_plane=plane)
        self.client.connect(120)
        self.client.register(layout(args.dim))
        self.dense = np.zeros(DENSE, np.float32)
        self.client.init(self.dense)
        self.steps = self.client.pull(self.dense)
        self.pushes = 0

    def pull(self, lk) -> None:
        self.client.pull_rows([lk], [TABLE])

    def push(self, lk) -> None:
        replies = self.client.push(self.dense, 1, steps=self.steps, lookups=[lk], tables=[TABLE])
        if {o for o, _ in replies} != {"aggregated"}:
            raise RuntimeError(f"push: the shards answered {replies}, not one step each")
        self.steps = [v for _, v in replies]
        self.pushes += 1

    def close(self) -> None:
        self.client.leave()
        self.client.close()


def fill(worker: Worker, shards: int, args) -> np.ndarray:
    """Push fresh ids until every shard holds --rows rows; returns the ids."""
    ids = shard_ids(shards, args.rows)
    from pserver.sparse import TableLookup
    batch = args.ids * shards
    for a in range(0, ids.size, batch):
        lk = TableLookup.of(ids[a:a + batch].view(np.int64), args.dim)
        lk.grads[:] = 0.01
        worker.push(lk)
    return ids


def measure_plane(worker: Worker, lookups: list, args) -> dict:
    """Seconds per pull and per push request, each request cycling through `lookups`."""
    out = {}
    for op in ("pull", "push"):
        turn = iter(range(1 << 62))
        call = getattr(worker, op)
        seconds, n, _ = time_round_trips(lambda: call(lookups[next(turn) % len(lookups)]), args.repeats)
        out[op] = (seconds, n)
    return out


def snapshot(worker: Worker, lk) -> np.ndarray:
    worker.pull(lk)
    return lk.rows.copy()


def measure_shards(shards: int, args) -> list[dict]:
    """Both planes on the same shard processes, one after the other: the first fills the table.
    Each plane pulls the same rows where the one before left them: the bench measured the
    real thing on each."""
    argvs = [(f"pserver shard {j}", shard_argv(j, shards, 1 << 20)) for j in range(shards)]
    results, lookups, left = [], None, None
    with running(argvs) as addresses:
        for label, plane in track(PLANES.items(), f"planes at {shards} shard(s)"):
            worker = Worker(addresses, plane, args)
            try:
                if lookups is None:
                    lookups = requests(fill(worker, shards, args), shards, args)
                elif not np.array_equal(snapshot(worker, lookups[0]), left):
                    raise RuntimeError(f"{label} pulled other rows than the plane before it")
                path = worker.client.plane_description()
                timing = measure_plane(worker, lookups, args)
                left = snapshot(worker, lookups[0])
            finally:
                worker.close()
            for op, (seconds, n) in timing.items():
                results.append({"plane": label, "path": path, "shards": shards, "op": op,
                                "ids_per_request": int(lookups[0].uniq.size), "requests_per_repeat": n,
                                "rows_per_s": [lookups[0].uniq.size / s for s in seconds]})
            print(progress(results[-2:]), flush=True)
    return results


def progress(rows: list[dict]) -> str:
    return "  ".join(f"{r['plane']}, {r['shards']} shard(s), {r['op']}: "
                     f"{summary(r['rows_per_s'])[0] / 1e6:.2f}M rows/s" for r in rows)


def add_at_baseline(args) -> dict:
    """np.add.at of --ids gradient rows into a (--rows, --dim) float32 matrix, distinct rows."""
    rng = np.random.default_rng(2)
    matrix = np.zeros((args.rows, args.dim), np.float32)
    batches = [(rng.choice(args.rows, args.ids, replace=False),
                rng.standard_normal((args.ids, args.dim), dtype=np.float32)) for _ in range(8)]
    turn = iter(range(1 << 62))

    def update():
        idx, grads = batches[next(turn) % len(batches)]
        np.add.at(matrix, idx, grads)

    seconds, n, _ = time_round_trips(update, args.repeats)
    return {"plane": "np.add.at", "path": "in process", "shards": 1, "op": "push",
            "ids_per_request": args.ids, "requests_per_repeat": n,
            "rows_per_s": [args.ids / s for s in seconds]}


def result_table(results: list[dict], base: float) -> str:
    rows = []
    for r in results:
        med, lo, hi = summary(r["rows_per_s"])
        rows.append([r["plane"], r["op"], str(r["shards"]), f"{r['ids_per_request']:,}",
                     f"{med / 1e6:.2f}M", f"{lo / 1e6:.2f}M-{hi / 1e6:.2f}M",
                     f"{med / r['shards'] / 1e6:.2f}M", f"{med / base:.2f}x"])
    return table(["plane", "op", "shards", "ids/request", "rows/s", "min-max", "per shard", "x np.add.at"],
                 rows, left=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=positive_ints, default=[1, 2, 4], help="shard counts (default 1,2,4)")
    p.add_argument("--rows", type=int, default=1 << 20, help="rows per shard in the table "
                                                             "(default 1,048,576)")
    p.add_argument("--ids", type=int, default=1 << 16, help="distinct ids per shard per request "
                                                            "(default 65,536)")
    p.add_argument("--dim", type=int, default=16, help="floats per row (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (default 5)")
    p.add_argument("--json", metavar="PATH", help="write the results here (default results/sparse.json)")
    p.add_argument("--plot", metavar="PATH", help="draw rows/s against shards into this PNG "
                   "(default results/sparse.png; needs matplotlib, the bench extra)")
    p.add_argument("--no-plot", action="store_true", help="draw nothing")
    p.add_argument("--quick", action="store_true", help="100k rows, 16k ids, 1 shard, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.ids, args.shards, args.repeats = 100_000, 1 << 14, [1], 3
    for name in ("rows", "ids", "dim", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.ids > args.rows:
        p.error(f"--ids {args.ids}: a request draws distinct stored ids, so at most --rows ({args.rows})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.no_plot:
        import _plots  # noqa: F401  (matplotlib, the bench extra: fail before measuring, not after)
    host = machine(("grpcio", "numpy", "numba"))
    print("\n".join(machine_lines(host)))
    print(f"table: {args.rows:,} rows of dim {args.dim} per shard, adagrad; {args.ids:,} distinct ids per "
          f"shard per request\n{DEFINITIONS}\n", flush=True)
    base = add_at_baseline(args)
    print(progress([base]), flush=True)
    results = [r for s in args.shards for r in measure_shards(s, args)]
    base_rate = summary(base["rows_per_s"])[0]
    print("\n" + result_table(results + [base], base_rate))
    path = result_path(args.json, "sparse.json")
    with open(path, "w") as f:
        json.dump({"machine": host, "args": {k: v for k, v in vars(args).items()
                                             if k not in ("json", "plot", "no_plot")},
                   "definitions": DEFINITIONS, "results": results + [base]}, f, indent=2)
    print(f"wrote {path}")
    if not args.no_plot:
        png = result_path(args.plot, "sparse.png")
        _plots.sparse_figure(png, results, base_rate, args)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
