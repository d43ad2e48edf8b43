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

--pooled measures list features instead: a worker's whole step over 26 tables on one shard, as
MLPerf DLRMv2's model has (each feature's ids made unique, every table's rows pulled in one
request, each feature's embedding forward and backward, every table's gradients pushed in one),
one-hot (one id per table and sample, Embedding's plain kernels) and multi-hot (MLPerf's list
lengths, 1 to 100 ids, 214 per sample, pooled by mean). Ids are drawn skewed (Zipf, a = 1.1)
from each table's --rows stored rows. Cost per id = seconds per step / ids in the step.

    python bench/sparse.py --pooled --rows 100000 --batch 4096       # results/sparse_pooled.json
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
# MLPerf DLRMv2's multi_hot_sizes: the ids per sample of each of the 26 Criteo features
MLPERF_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
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


def skewed_ids(stored: np.ndarray, shape: tuple, rng) -> np.ndarray:
    """Ids from `stored`, Zipf-skewed (a = 1.1) over them in a fixed shuffled order: a few hot."""
    ranks = np.minimum(rng.zipf(1.1, shape) - 1, stored.size - 1)
    return stored[ranks].view(np.int64)


class Tables:
    """A worker of a model with one sparse table per feature (MLPerf DLRMv2's 26), on one shard:
    a step pulls every table's rows in one request and pushes them in one."""

    def __init__(self, address: str, args) -> None:
        from pserver.models.layout import Layout
        from pserver.sparse import TableConfig
        from pserver.worker.client import PSClient
        self.names = [f"feature{f}" for f in range(len(MLPERF_MULTI_HOT))]
        self.client = PSClient([address], rank=0, num_workers=1, rpc_deadline=600, data_plane="auto")
        self.client.connect(120)
        tables = [TableConfig(n, args.dim, optimizer="adagrad", lr=0.01) for n in self.names]
        self.client.register(Layout.of([("b", (DENSE,))], tables))
        self.dense = np.zeros(DENSE, np.float32)
        self.client.init(self.dense)
        self.steps = self.client.pull(self.dense)

    def step(self, ids: list, dim: int, scratch: list, pooled: bool) -> None:
        """One worker step: each feature's ids made unique, every table's rows pulled, each
        feature's embedding forward and backward (pooled by mean, or one vector per id), every
        table's rows' gradients pushed."""
        from pserver.kernels import cpu, reference
        from pserver.sparse import PaddedIds, TableLookup
        lks = [TableLookup.of(PaddedIds(x, -1) if pooled else x, dim) for x in ids]
        self.client.pull_rows(lks, self.names)
        for lk, s in zip(lks, scratch):
            if pooled:
                cpu.pooled_embedding_forward(lk.inverse, s["w"], lk.rows, reference.POOL_MEAN, s["out"])
                cpu.pooled_embedding_backward(lk.inverse, s["w"], s["dy"], reference.POOL_MEAN, lk.grads)
            else:
                cpu.embedding_forward(lk.inverse, lk.rows, s["out"])
                cpu.embedding_backward(lk.inverse, s["dy"], lk.grads)
        replies = self.client.push(self.dense, 1, steps=self.steps, lookups=lks, tables=self.names)
        self.steps = [v for _, v in replies]

    def close(self) -> None:
        self.client.leave()
        self.client.close()


def measure_pooled(args) -> list[dict]:
    """Seconds per step of the 26 tables, one-hot (one id per table) and multi-hot (MLPerf's list
    lengths), on one shard (data plane); each table first filled with --rows rows."""
    from pserver.sparse import TableLookup
    argvs = [("pserver shard 0", shard_argv(0, 1, 1 << 20))]
    rng, results = np.random.default_rng(3), []
    with running(argvs) as addresses:
        worker = Tables(addresses[0], args)
        try:
            stored = [np.arange(args.rows, dtype=np.uint64) + (f << 32) for f in range(len(worker.names))]
            for a in range(0, args.rows, args.ids):                 # untimed: every table filled
                lks = [TableLookup.of(s[a:a + args.ids].view(np.int64), args.dim) for s in stored]
                for lk in lks:
                    lk.grads[:] = 0.01
                replies = worker.client.push(worker.dense, 1, steps=worker.steps, lookups=lks,
                                             tables=worker.names)
                worker.steps = [v for _, v in replies]
            stored = [s[rng.permutation(s.size)] for s in stored]
            for label, lengths, pooled in track([("one-hot", (1,) * len(MLPERF_MULTI_HOT), False),
                                                 ("MLPerf multi-hot", MLPERF_MULTI_HOT, True)], "profiles"):
                batches = [[skewed_ids(s, (args.batch, n), rng) for s, n in zip(stored, lengths)]
                           for _ in range(4)]
                per = [() if pooled else (n,) for n in lengths]    # one-hot: a vector per id
                scratch = [{"w": np.ones((args.batch, n), np.float32),
                            "out": np.empty((args.batch, *p, args.dim), np.float32),
                            "dy": rng.standard_normal((args.batch, *p, args.dim), dtype=np.float32) * 0.01}
                           for n, p in zip(lengths, per)]
                turn = iter(range(1 << 62))
                seconds, n, _ = time_round_trips(
                    lambda: worker.step(batches[next(turn) % 4], args.dim, scratch, pooled), args.repeats)
                ids = args.batch * sum(lengths)
                uniq = np.mean([sum(np.unique(x).size for x in b) for b in batches])
                results.append({"case": label, "lengths": list(lengths), "pooled": pooled,
                                "batch": args.batch, "ids_per_step": ids, "unique_ids_per_step": float(uniq),
                                "steps_per_repeat": n, "seconds_per_step": seconds,
                                "us_per_id": [1e6 * s / ids for s in seconds]})
                print(f"{label}: {1e3 * summary(seconds)[0]:.1f} ms per step, "
                      f"{summary(results[-1]['us_per_id'])[0]:.3f} us per id ({uniq / ids:.2f} unique per "
                      "id)", flush=True)
        finally:
            worker.close()
    return results


def pooled_profile(results: list[dict]) -> dict:
    """The multi-hot step's cost per id against the one-hot step's."""
    one_hot, multi = (summary(r["us_per_id"])[0] for r in results)
    return {"mlperf_us_per_id": multi, "one_hot_us_per_id": one_hot, "ratio_to_one_hot": multi / one_hot}


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
    p.add_argument("--pooled", action="store_true", help="list features: cost per id of a worker's step "
                   "at each MLPerf DLRMv2 list length and one-hot, one shard (see above)")
    p.add_argument("--batch", type=int, default=4096, help="--pooled: samples per step (default 4096)")
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
    if not args.no_plot and not args.pooled:
        import _plots  # noqa: F401  (matplotlib, the bench extra: fail before measuring, not after)
    host = machine(("grpcio", "numpy", "numba"))
    print("\n".join(machine_lines(host)))
    if args.pooled:
        return main_pooled(args, host)
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


def main_pooled(args, host: dict) -> int:
    print(f"26 tables of {args.rows:,} rows of dim {args.dim}, adagrad, one shard (data plane); "
          f"{args.batch:,} samples per step, ids Zipf(1.1)-skewed; a step = dedupe, pull, forward, "
          "backward, push", flush=True)
    results = measure_pooled(args)
    profile = pooled_profile(results)
    rows = [[r["case"], f"{r['ids_per_step']:,}", f"{r['unique_ids_per_step']:,.0f}",
             f"{1e3 * summary(r['seconds_per_step'])[0]:.2f}", f"{summary(r['us_per_id'])[0]:.3f}"]
            for r in results]
    print("\n" + table(["case", "ids/step", "unique", "ms/step", "us/id"], rows, left=1))
    print(f"\nMLPerf DLRMv2 multi-hot: {profile['mlperf_us_per_id']:.3f} us per id, one-hot "
          f"{profile['one_hot_us_per_id']:.3f}: {profile['ratio_to_one_hot']:.2f}x one-hot's cost per id")
    path = result_path(args.json, "sparse_pooled.json")
    with open(path, "w") as f:
        json.dump({"machine": host, "args": {k: v for k, v in vars(args).items()
                                             if k not in ("json", "plot", "no_plot")},
                   "mlperf_multi_hot_sizes": MLPERF_MULTI_HOT, "results": results, "profile": profile},
                  f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
