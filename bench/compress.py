"""Push compression on a slow link: time to a test accuracy, and the accuracy after the run.

For each link of --links, --repeats rounds of one training run per codec of --codecs, the codecs
interleaved within each round: a shard and --workers workers (MLP 784-256-256-10 on MNIST,
--epochs epochs, async), every worker on `--data-plane grpc` so that every byte crosses the
link. The chief evaluates every --eval-every seconds and after each epoch, so time to --target
is read off those evaluations, not interpolated (a run that never reaches it counts as slower
than any that does). Each codec's figure is the median over its repeats, and its speedup is
none's median time over its own, on the same link.

Links: `loopback` (everything on 127.0.0.1) and RATE (e.g. 100mbit, 1gbit, 10gbit): the shard in one
network namespace, the workers in another, joined by a veth pair whose both ends a
`tc qdisc tbf` limits to RATE (needs root, ip and tc; the namespaces are removed afterwards).

    .venv/bin/python bench/compress.py --data-dir DIR    # every codec on every link, 5 repeats (as root)
    .venv/bin/python bench/compress.py --links loopback --codecs none,bf16
    .venv/bin/python bench/compress.py --links 1gbit --codecs none,bf16,bf16+bf16,topk:0.01+bf16

A codec is what `--compress` takes, optionally followed by `+bf16`: then the workers also pull
in bf16 (`--pull-compress bf16`), so both directions shrink.

Writes JSON: a row per run {codec, link, repeat, time_to_target_s, final_accuracy, ...} and a
summary row per link and codec (medians, speedup), and PNG plots.

`--encode-times` trains nothing: it times what a worker does per push for each push codec of
--codecs, in this process on one thread (pserver.worker.compress.ErrorFeedback.pack: residual
added, encoded, decoded, residual kept) on a gradient of --encode-params float32 (default
269,322, the MLP's), median of --repeats x 10 calls after one warm-up, and writes JSON:

    .venv/bin/python bench/compress.py --encode-times --out results/compress/encode-times.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path, table  # noqa: E402

PS_IP, WORKER_IP, PORT = "10.78.0.1", "10.78.0.2", 23461
PY = [sys.executable, "-m", "pserver"]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def link(rate: str):
    """Yield (shard prefix, worker prefix, shard host): commands run in the right namespace."""
    if rate == "loopback":
        yield [], [], "127.0.0.1"
        return
    tag = str(os.getpid() % 100000)
    ps_ns, w_ns, a, b = f"pscmp-ps-{tag}", f"pscmp-w-{tag}", f"pcm{tag}a", f"pcm{tag}b"
    try:
        sh("ip", "netns", "add", ps_ns)
        sh("ip", "netns", "add", w_ns)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        # A bucket of 1 ms at the link's rate (at least 1 MB) lets TCP reach the rate.
        bits = float(rate[:-4]) * {"gbit": 1e9, "mbit": 1e6}[rate[-4:]]
        burst = max(1 << 20, int(bits / 8 / 1000))
        for ns, dev, ip in ((ps_ns, a, PS_IP), (w_ns, b, WORKER_IP)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "50ms")
        yield ["ip", "netns", "exec", ps_ns], ["ip", "netns", "exec", w_ns], PS_IP
    finally:
        for ns in (ps_ns, w_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def codecs(entry: str) -> tuple[str, str]:
    """'PUSH' or 'PUSH+bf16' -> (--compress, --pull-compress)."""
    push, _, pull = entry.partition("+")
    return push, pull or "none"


def one_run(codec: str, rate: str, args, tmp: Path) -> dict:
    push, pull = codecs(codec)
    with link(rate) as (ps_pre, w_pre, host):
        shard = subprocess.Popen(ps_pre + PY + ["serve", "--host", host, "--port", str(PORT),
                                                "--mode", "async", "--num-workers", str(args.workers),
                                                "--optimizer", "momentum", "--lr", str(args.lr),
                                                "--data-plane", "grpc"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        workers = []
        try:
            summary = tmp / f"{codec.replace(':', '_').replace('+', '_')}-{rate}.json"
            for r in range(args.workers):
                workers.append(subprocess.Popen(w_pre + PY + [
                    "worker", "--ps", f"{host}:{PORT}", "--rank", str(r), "--num-workers", str(args.workers),
                    "--model", "mlp", "--dataset", "mnist", "--epochs", str(args.epochs),
                    *(["--data-dir", args.data_dir] if args.data_dir else []),
                    "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every),
                    "--data-plane", "grpc", "--compress", push, "--pull-compress", pull,
                    "--summary-json", str(summary)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            start = time.monotonic()
            errors = [w.communicate(timeout=args.run_timeout)[1] for w in workers]
            wall = time.monotonic() - start
        finally:   # also on SIGTERM or an error: no worker outlives the run (or its namespace)
            for p in [*workers, shard]:
                p.terminate()
            for p in [*workers, shard]:
                p.wait(timeout=30)
    if any(w.returncode for w in workers):
        raise RuntimeError(f"{codec} over {rate}: a worker failed:\n" + "\n".join(e[-2000:] for e in errors))
    return row(codec, rate, json.loads(summary.read_text()), wall, args.target)


def row(codec: str, rate: str, s: dict, wall: float, target: float) -> dict:
    # Every evaluation the chief made: the periodic ones and the one after each epoch.
    curve = sorted((p["seconds"], p["accuracy"]) for p in s["eval_curve"] + s["per_epoch"])
    hit = next((t for t, acc in curve if acc >= target), None)
    push, pull = codecs(codec)
    return {"codec": codec, "push_codec": push, "pull_codec": pull, "link": rate,
            "time_to_target_s": hit, "target": target,
            "final_accuracy": s["test_accuracy"], "run_wall_s": round(wall, 2),
            "curve": [{"seconds": t, "accuracy": acc} for t, acc in curve]}


def figure(path: Path, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links), 4.2), squeeze=False)
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    for ax, lk in zip(axes[0], links):
        for r in (r for r in rows if r["link"] == lk):
            first = r.get("repeat", 0) == 0
            ax.plot([p["seconds"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]],
                    marker=".", lw=0.8, color=f"C{codecs.index(r['codec'])}",
                    label=r["codec"] if first else None)
        ax.axhline(rows[0]["target"], color="grey", lw=0.8, ls="--")
        ax.set(title=f"link: {lk}", xlabel="seconds since the chief started", ylabel="MNIST test accuracy",
               ylim=(0.85, 1.0))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def summarize(rows: list[dict]) -> list[dict]:
    """A row per link and codec: medians over its repeats (a run that never reached the target
    counts as infinitely slow: the median is None when half or more of them did not)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["link"], r["codec"]), []).append(r)
    out = []
    for (lk, codec), rs in groups.items():
        t = median([r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf for r in rs])
        out.append({"link": lk, "codec": codec, "repeats": len(rs),
                    "time_to_target_s": t if math.isfinite(t) else None,
                    "times_to_target_s": [r["time_to_target_s"] for r in rs],
                    "final_accuracy": median([r["final_accuracy"] for r in rs]),
                    "final_accuracies": [r["final_accuracy"] for r in rs],
                    "run_wall_s": median([r["run_wall_s"] for r in rs])})
    base = {s["link"]: s for s in out if s["codec"] == "none"}
    for s in out:
        b = base.get(s["link"])
        s["speedup"] = (b["time_to_target_s"] / s["time_to_target_s"]
                        if b and b["time_to_target_s"] and s["time_to_target_s"] else None)
        s["pp_vs_none"] = 100 * (s["final_accuracy"] - b["final_accuracy"]) if b else None
    return out


def speedups(summary: list[dict]) -> list[list[str]]:
    def times(s):
        return " ".join("-" if t is None else f"{t:.1f}" for t in s["times_to_target_s"])
    return [[s["link"], s["codec"], "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}",
             times(s), "-" if s["speedup"] is None else f"{s['speedup']:.2f}x", f"{s['final_accuracy']:.4f}",
             "-" if s["pp_vs_none"] is None else f"{s['pp_vs_none']:+.2f}", f"{s['run_wall_s']:.1f}"]
            for s in summary]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs",
                   default="none,bf16,bf16+bf16,none+bf16,fp16+bf16,topk:0.01,topk:0.01+bf16,sign")
    p.add_argument("--links", default="1gbit,loopback,10gbit")
    p.add_argument("--data-dir", default=None, help="the MNIST IDX files "
                                                    "(default: pserver's cache directory)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64: at 128 no codec "
                                                              "reached 0.96 in 2 epochs here)")
    p.add_argument("--lr", type=float, default=0.02, help="momentum 0.9 on the shard")
    p.add_argument("--eval-every", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5, help="runs per link and codec, interleaved (default 5)")
    p.add_argument("--target", type=float, default=0.96)
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="JSON path (default results/compress.json)")
    p.add_argument("--replot", action="store_true", help="only print the table and draw the plot of "
                   "--out (the rows finished so far, if the run was stopped)")
    p.add_argument("--encode-times", action="store_true", help="time each push codec's encoder with "
                   "error feedback on one thread instead of training (writes --out)")
    p.add_argument("--encode-params", type=int, default=269_322, help="gradient size for --encode-times "
                   "(default 269,322: the MLP's)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="write the JSON and the "
                   "table only (no matplotlib needed)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: must be >= 1, got {args.repeats}")
    if args.encode_times:
        pushes = dict.fromkeys(c.partition("+")[0] for c in args.codecs.split(","))   # in order, once
        codecs = [c for c in pushes if c != "none"]
        host = machine(("grpcio", "numpy", "numba"))
        print("\n".join(machine_lines(host)))
        rows = encode_times(codecs, args.encode_params, args.repeats)
        host["loadavg_after"] = os.getloadavg()
        out = result_path(args.out, "compress-encode.json")
        out.write_text(json.dumps({"host": host, "args": vars(args), "rows": rows}, indent=1))
        print(table(["codec", "ms per push (median)", "min", "max", "calls"],
                    [[r["codec"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['max_ms']:.2f}",
                      str(r["calls"])] for r in rows]))
        print(f"ErrorFeedback.pack of {args.encode_params:,} float32, one thread; wrote {out}")
        return 0
    if args.plots:
        try:
            import matplotlib  # noqa: F401 - checked before an hour of runs, not after
        except ImportError:
            p.error("the plots need matplotlib: `.venv/bin/pip install -e \".[bench]\"`, or pass --no-plots")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds `link`: namespaces removed
    out = result_path(args.out, "compress.json")
    if args.replot:
        report(out, json.loads(out.read_text())["rows"], args.plots)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.links.split(","):
            for repeat in range(args.repeats):
                for codec in args.codecs.split(","):      # codecs interleaved within each round
                    rows.append(one_run(codec, rate, args, Path(tmp)) | {"repeat": repeat})
                    r = rows[-1]
                    print(f"{rate:9s} {codec:10s} {repeat + 1}/{args.repeats} to {args.target}: "
                          f"{r['time_to_target_s']} s, final {r['final_accuracy']:.4f}, run "
                          f"{r['run_wall_s']} s, load {os.getloadavg()[0]:.1f}",
                          flush=True)
                    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))   # partial
    host = machine() | {"loadavg_after": os.getloadavg()}
    print("\n".join(machine_lines(host)))
    out.write_text(json.dumps({"host": host, "args": vars(args), "rows": rows, "summary": summarize(rows)},
                              indent=1))
    report(out, rows, args.plots)
    return 0


def encode_times(codecs: list[str], params: int, repeats: int, seed: int = 0) -> list[dict]:
    """Milliseconds per ErrorFeedback.pack of a `params`-element gradient, per push codec: the
    codecs interleaved, median (min, max) of repeats x 10 calls, a fresh gradient per call."""
    import numpy as np

    from pserver.wire.compress import parse
    from pserver.worker.compress import ErrorFeedback
    rng = np.random.default_rng(seed)
    grads = [rng.normal(0, 1e-3, params).astype(np.float32) for _ in range(10)]
    feedback = {c: ErrorFeedback(parse(c), params) for c in codecs}
    for c in codecs:                      # numba's first call (compile or cache load)
        feedback[c].pack(grads[0], 0, params)
    times: dict[str, list[float]] = {c: [] for c in codecs}
    for _ in range(repeats):
        for c in codecs:
            for g in grads:
                started = time.perf_counter()
                feedback[c].pack(g, 0, params)
                times[c].append((time.perf_counter() - started) * 1e3)
    return [{"codec": c, "params": params, "calls": len(t), "median_ms": statistics.median(t),
             "min_ms": min(t), "max_ms": max(t)} for c, t in times.items()]


def report(out: Path, rows: list[dict], plots: bool) -> None:
    print(table(["link", "codec", "time to target s", "each repeat", "speedup vs none", "final acc",
                 "pp vs none", "run s"], speedups(summarize(rows))))
    print("medians over the repeats; speedup: none's median time to target / the codec's")
    if plots:
        figure(out.with_suffix(".png"), rows)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plots else ""))


if __name__ == "__main__":
    sys.exit(main())
