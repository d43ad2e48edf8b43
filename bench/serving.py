"""The prediction server (`pserver serve-model`) under load: requests/s and latency at batch 1
over gRPC and HTTP, samples/s at batch 256, and batch 1 again while a delta is applied every
--delta-every seconds; failed requests counted. The server is a real `pserver serve-model`
process over a wide_deep export with Criteo's shape (26 fields, --rows ids per table); the
clients are --clients threads in this process, each sending its next request when the last
one answered (closed loop), for --seconds per case. Latency is the client's: from sending the
request to reading the answer.

    python bench/serving.py                               # results/serving/serving.json, .md, .png
    python bench/serving.py --seconds 5 --clients 2 --rows 20000

On 2 cores the server and the clients share them: the figures are what one machine serving and
loading itself gives, not the server's alone.
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
import urllib.request
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, result_path, table  # noqa: E402

from pserver._proto import pserver_pb2 as pb  # noqa: E402
from pserver._proto import pserver_pb2_grpc as pb_grpc  # noqa: E402
from pserver.models import make_model  # noqa: E402
from pserver.models.ctr import ctr_arguments  # noqa: E402
from pserver.persist import model_file  # noqa: E402
from pserver.serving.app import to_named  # noqa: E402

HEADERS = ["case", "requests/s", "samples/s", "p50 ms", "p99 ms", "failed", "versions"]


def write_model(directory: Path, rows: int, deltas: int, changed: int,
                seed: int = 0) -> tuple[str, list[str]]:
    """A wide_deep export with `rows` ids per table and `deltas` chained deltas of `changed` rows."""
    rng = np.random.default_rng(seed)
    model = make_model("wide_deep", (), 2, backend="cpu")
    definition = {"model": "wide_deep", "arguments": {"num_classes": 2, **ctr_arguments(model)},
                  "dataset": None}

    def rows_of(n):
        return (rng.standard_normal((n, 8)) * 0.05).astype(np.float32)

    ids = np.arange(rows, dtype=np.uint64)
    base = str(directory / "model")
    model_file.save(base, model, rng.standard_normal(model.layout.total).astype(np.float32) * 0.05,
                    definition, {},
                    tables={t.name: (ids, rows_of(rows)[:, :t.dim]) for t in model.sparse_tables},
                    origin={"live": True, "num_shards": 1, "versions": [1], "version": 1})
    export_id = model_file.read(base)[0]["export_id"]
    paths = []
    for k in range(deltas):
        path = str(directory / "made" / f"delta-{k + 1:03d}")
        touched = np.sort(rng.choice(rows, changed, replace=False)).astype(np.uint64)
        model_file.save(path, model, rng.standard_normal(model.layout.total).astype(np.float32) * 0.05,
                        definition, {}, removed={},
                        tables={t.name: (touched, rows_of(changed)[:, :t.dim]) for t in model.sparse_tables},
                        origin={"live": True, "num_shards": 1, "versions": [k + 2], "version": k + 2},
                        delta={"base_id": export_id, "base_version": k + 1, "base_versions": [k + 1]})
        export_id = model_file.read(path)[0]["export_id"]
        paths.append(path)
    return base, paths


def requests(n: int, batch: int, rows: int, seed: int = 1) -> list[tuple]:
    """n requests of `batch` Criteo-shaped records: (gRPC request, HTTP body)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = rng.random((batch, 13)).astype(np.float32)
        cat = rng.integers(0, rows, (batch, 26))
        out.append((pb.PredictRequest(inputs=[to_named("dense", dense), to_named("cat", cat)]),
                    json.dumps({"inputs": {"dense": dense.tolist(), "cat": cat.tolist()}}).encode()))
    return out


def load(protocol: str, grpc_port: int, http_port: int, reqs: list, clients: int, seconds: float) -> dict:
    """Closed-loop clients for `seconds`: each request's latency, the versions that answered,
    and the failures."""
    latencies, versions, failures = [], set(), []
    lock, stop = threading.Lock(), threading.Event()

    def client(c: int):
        mine, seen, bad = [], set(), []
        if protocol == "grpc":
            stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        url = f"http://127.0.0.1:{http_port}/v1/models/wide_deep:predict"
        k = c
        while not stop.is_set():
            grpc_req, body = reqs[k % len(reqs)]
            k += clients
            t0 = time.perf_counter()
            try:
                if protocol == "grpc":
                    seen.add(stub.Predict(grpc_req, timeout=30).version)
                else:
                    req = urllib.request.Request(url, data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=30) as r:
                        seen.add(json.loads(r.read())["version"])
            except Exception as e:      # noqa: BLE001 - every failure is counted and named
                bad.append(f"{type(e).__name__}: {e}"[:200])
                continue
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)
            versions.update(seen)
            failures.extend(bad)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.array(latencies) * 1e3
    return {"requests": len(latencies), "per_second": len(latencies) / wall,
            "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
            "failed": len(failures), "failures": failures[:5], "versions": sorted(versions),
            "latencies_ms": ms.tolist()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="per case (default 10)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--rows", type=int, default=200_000, help="ids per table in the export (default 200000)")
    p.add_argument("--changed", type=int, default=5_000, help="rows each delta changes (default 5000)")
    p.add_argument("--delta-every", type=float, default=0.5, help="seconds between deltas (default 0.5)")
    p.add_argument("--json", default=None,
                   help="where the result goes (default results/serving/serving.json)")
    args = p.parse_args()
    host = machine(("grpcio", "numpy", "prometheus_client"))
    print("\n".join(machine_lines(host)), flush=True)
    deltas_needed = int(args.seconds / args.delta_every) + 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, deltas = write_model(tmp, args.rows, deltas_needed, args.changed)
        follow = tmp / "follow"
        follow.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "pserver", "serve-model", base, "--port", "0",
                                 "--http-port", "0", "--follow", str(follow), "--poll", "0.05"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            first = proc.stdout.readline()
            grpc_port = int(first.split("gRPC on port ")[1].split(",")[0])
            http_port = int(first.split("HTTP on port ")[1].split(";")[0])
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # drain
            one, big = requests(512, 1, args.rows), requests(16, 256, args.rows)
            cases = [("gRPC, batch 1", "grpc", one, args.clients, None),
                     ("HTTP, batch 1", "http", one, args.clients, None),
                     ("gRPC, batch 256", "grpc", big, 2, None),
                     (f"gRPC, batch 1, a delta every {args.delta_every:g} s", "grpc", one, args.clients,
                      deltas)]
            for label, protocol, reqs, clients, feed in cases:
                load(protocol, grpc_port, http_port, reqs, clients, 1.0)           # warm up
                stop = threading.Event()
                if feed:
                    def feeder():
                        for d in feed:
                            if stop.wait(args.delta_every):
                                return
                            shutil.copytree(d, follow / (Path(d).name + ".part"))
                            os.rename(follow / (Path(d).name + ".part"), follow / Path(d).name)
                    threading.Thread(target=feeder, daemon=True).start()
                r = load(protocol, grpc_port, http_port, reqs, clients, args.seconds)
                stop.set()
                batch = reqs[0][0].inputs[0].shape[0]
                r.update(case=label, protocol=protocol, batch=batch, clients=clients,
                         samples_per_second=r["per_second"] * batch)
                results.append(r)
                print(f"{label}: {r['per_second']:,.0f} requests/s "
                      f"({r['samples_per_second']:,.0f} samples/s), "
                      f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, {r['failed']} failed, "
                      f"versions {r['versions'][0]}..{r['versions'][-1]} ({len(r['versions'])})", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    rows = [[r["case"], f"{r['per_second']:,.0f}", f"{r['samples_per_second']:,.0f}", f"{r['p50_ms']:.2f}",
             f"{r['p99_ms']:.2f}", str(r["failed"]), str(len(r["versions"]))] for r in results]
    print(table(HEADERS, rows))
    path = result_path(args.json, "serving/serving.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/serving.py " + " ".join(sys.argv[1:])
    stored = [{k: v for k, v in r.items() if k != "latencies_ms"} for r in results]
    path.write_text(json.dumps({"command": command.strip(), "machine": host, "settings": vars(args),
                                "results": stored}, indent=1))
    path.with_suffix(".md").write_text(
        f"# pserver serve-model under load\n\n- command: `{command.strip()}`\n"
        + "".join(f"- {line}\n" for line in machine_lines(host)) + "\n```\n"
        + table(HEADERS, rows) + "\n```\n")
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return 0


def plot(results: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in results:
        ms = np.sort(np.array(r["latencies_ms"]))
        if len(ms):
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{r['case']} (p99 {r['p99_ms']:.1f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms (client's, log scale)")
    ax.set_ylabel("fraction of requests answered within")
    ax.set_title("pserver serve-model: latency by case (closed loop)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
