"""Freshness: how long after a training step's update a prediction reflects it, through the pipeline
a user runs today: the shards checkpoint every --checkpoint-secs (deltas of the rows changed),
`pserver export --follow` turns each new checkpoint into a delta export, and `pserver serve-model
--follow` applies it.

Real processes on this machine: --ps shards (`pserver serve --checkpoint-secs`), one worker training
a CTR model on criteo-synthetic for --seconds, the exporter and the server (both --poll). A probe in
this process asks shard 0 for its version (Status) and the server for the version it serves
(ModelStatus) every --probe seconds and keeps when each version was first seen. An update is a
version u of shard 0; it is reflected once the server serves a version >= u. Freshness(u) = (first
time the server served >= u) - (first time shard 0 was at u), over every version u reached after
the server applied its first delta (before it, the exporter's own start: a second or two of
imports). The step that made u may have begun up to one probe interval earlier; the probe's
own resolution is --probe.

    python bench/freshness.py                              # results/freshness/freshness.json, .md, .png
    python bench/freshness.py --seconds 20 --checkpoint-secs 0.5 --poll 0.1

--stream measures the whole way instead, from an event's arrival to a prediction that reflects it:
a writer appends planted click events (pserver.data.stream.event_lines) at --rate events/s to a
file that --workers workers train on (`--dataset stream:FILE`, async, the lr model), the chief
exporting every --export-every seconds (`--export-every`, deltas after a first export) and
`pserver serve-model --follow` applying them. Every --marker-every seconds the writer appends a
marker: an event whose ad no event had before. The probe asks the server, every --probe seconds,
for the predictions of every pending marker's record and of a control record (an ad never
written): a marker is reflected once its prediction differs from the control's (its row exists
in the served model). Freshness = that time - the time its line was written and flushed.

    python bench/freshness.py --stream --seconds 30 --export-every 0.5 --json results/freshness/stream.json

What the first mode leaves out: an event's own way into training (it trains on criteo-synthetic),
so it is the time from an update on the shards to a prediction.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _util sits beside this file
from _util import machine, machine_lines, result_path, table  # noqa: E402

from pserver._proto import pserver_pb2 as pb  # noqa: E402
from pserver._proto import pserver_pb2_grpc as pb_grpc  # noqa: E402

HEADERS = ["checkpoint every s", "poll s", "updates", "served versions", "p50 s", "p90 s", "p99 s", "max s"]


def pserver(*args: str) -> list[str]:
    return [sys.executable, "-m", "pserver", *args]


def first_line_port(proc: subprocess.Popen, pattern: str, lines: list[str]) -> int:
    """The port `pattern` finds in proc's output (read until it appears); the lines read are kept."""
    for line in proc.stdout:
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return int(m.group(1))
    raise RuntimeError(f"{proc.args[3]} ended before it said its port:\n{''.join(lines[-20:])}")


def drain(proc: subprocess.Popen, lines: list[str]) -> None:
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, last started first; SIGKILL one that does not stop."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def nothing_reached(what: str, logs: dict[str, list[str]]) -> int:
    print(f"no {what} reached the server; the processes said:")
    for name, lines in logs.items():
        print(f"-- {name}\n" + "".join(lines[-15:]))
    return 1


def watch(call, every: float, stop: threading.Event, seen: dict) -> None:
    """seen[version] = monotonic time call() first returned it; errors (a process starting) skipped."""
    while not stop.is_set():
        try:
            v = call()
            now = time.monotonic()
            if v >= 0 and v not in seen:
                seen[v] = now
        except grpc.RpcError:
            pass
        stop.wait(every)


def freshness(shard_seen: dict, served_seen: dict, since: float) -> np.ndarray:
    """For each version u shard 0 reached after `since`: first time the server served >= u, minus u's
    time (u not yet served by the end: left out, and counted by the caller)."""
    served = sorted(served_seen.items())
    out = []
    for u, t in sorted(shard_seen.items()):
        if t < since:
            continue
        later = [ts for v, ts in served if v >= u]
        if later:
            out.append(max(min(later) - t, 0.0))
    return np.array(out)


MARKER_AD, CONTROL_AD, MARKER_SITE = 0x10000000, 0xFFFFFF00, 7    # planted ads are below EVENT_ADS


def marker_line(ad: int) -> str:
    """A clicked event whose only values are its ad and a site: the marker's, or the control's."""
    return "1" + "\t" * 13 + f"\t{ad:08x}\t{MARKER_SITE:08x}" + "\t" * 24


class StreamWriter(threading.Thread):
    """Appends `rate` planted events per second, in ticks of 50 ms, and a marker every `every`
    seconds; markers[k] = (its ad, monotonic time its line was flushed)."""

    def __init__(self, path: Path, rate: int, every: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.path, self.rate, self.every, self.stop = path, rate, every, stop
        self.markers: list[tuple[int, float]] = []
        self.events = 0
        self.marking = True       # off at the end: events go on, so the last markers' batches fill

    def run(self) -> None:
        from pserver.data.stream import event_lines
        tick, began, next_marker = 0.05, time.monotonic(), time.monotonic() + self.every
        with open(self.path, "a") as f:
            while not self.stop.is_set():
                due = int((time.monotonic() - began) * self.rate) - self.events
                if due > 0:
                    f.write("".join(line + "\n" for line in event_lines(self.events, due)))
                    self.events += due
                if self.marking and time.monotonic() >= next_marker:
                    ad = MARKER_AD + len(self.markers)
                    f.write(marker_line(ad) + "\n")
                    f.flush()
                    self.markers.append((ad, time.monotonic()))
                    next_marker += self.every
                f.flush()
                self.stop.wait(tick)


def stream_main(args, host: dict) -> int:
    """--stream: from an event's arrival to a prediction that reflects it (see the docstring)."""
    from pserver.data.criteo import parse_block
    from pserver.serving.app import to_array, to_named

    def records(ads: list[int]):
        text = "".join(marker_line(ad) + "\n" for ad in ads).encode()
        x = parse_block(np.frombuffer(text, np.uint8), 0).x
        return [to_named("dense", x["dense"]), to_named("cat", x["cat"])]

    procs: list[subprocess.Popen] = []
    logs: dict[str, list[str]] = {}
    reflected: dict[int, float] = {}
    versions: dict[int, float] = {}
    stop_writer, stop_probe = threading.Event(), threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        events, ckpt, ex = tmp / "events.tsv", tmp / "ckpt", tmp / "ex"
        writer = StreamWriter(events, args.rate, args.marker_every, stop_writer)
        try:
            ports = []
            for j in range(args.ps):
                logs[f"shard{j}"] = []
                proc = subprocess.Popen(pserver("serve", "--port", "0", "--shard", str(j), "--num-shards",
                                                str(args.ps), "--num-workers", str(args.workers), "--mode",
                                                "async", "--checkpoint-dir", str(ckpt)),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                procs.append(proc)
                ports.append(first_line_port(proc, r"listening on \S+:(\d+)", logs[f"shard{j}"]))
                drain(proc, logs[f"shard{j}"])
            ps = ",".join(f"127.0.0.1:{port}" for port in ports)
            writer.start()
            for r in range(args.workers):
                logs[f"worker{r}"] = []
                worker = subprocess.Popen(pserver(
                    "worker", "--ps", ps, "--rank", str(r), "--num-workers", str(args.workers), "--model",
                    "lr", "--dataset", f"stream:{events}", "--batch-size", str(args.batch_size),
                    "--window-batches", "1000", "--epochs", "100000", "--log-every", "5", "--export-every",
                    str(args.export_every), "--export-dir", str(ex)),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                procs.append(worker)
                drain(worker, logs[f"worker{r}"])
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not (ex / "model").exists():
                time.sleep(0.1)
            logs["server"] = []
            server = subprocess.Popen(pserver("serve-model", str(ex / "model"), "--port", "0", "--http-port",
                                              "-1", "--follow", str(ex / "deltas"), "--poll", str(args.poll)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(server)
            server_port = first_line_port(server, r"gRPC on port (\d+)", logs["server"])
            drain(server, logs["server"])
            predictor = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server_port}"))
            since = time.monotonic()          # markers from here on are measured

            def probe():
                while not stop_probe.is_set():
                    pending = [ad for ad, t in writer.markers if t >= since and ad not in reflected]
                    if pending:
                        try:
                            request = pb.PredictRequest(inputs=records([CONTROL_AD, *pending]))
                            reply = predictor.Predict(request, timeout=5)
                            now = time.monotonic()
                            versions.setdefault(reply.version, now)
                            out = to_array(reply.outputs).reshape(len(pending) + 1, -1)
                            for ad, row in zip(pending, out[1:]):
                                if not np.array_equal(row, out[0]):
                                    reflected[ad] = now
                        except grpc.RpcError:
                            pass
                    stop_probe.wait(args.probe)
            prober = threading.Thread(target=probe, daemon=True)
            prober.start()
            time.sleep(args.seconds)
            writer.marking = False
            last = writer.markers[-1][1] if writer.markers else since
            while time.monotonic() < last + 15 and any(ad not in reflected for ad, t in writer.markers
                                                       if t >= since):
                time.sleep(0.1)
            stop_probe.set()
            prober.join()
            stop_writer.set()
            writer.join()
        finally:
            stop_writer.set()
            stop_probe.set()
            stop_all(procs)
    measured = [(ad, t) for ad, t in writer.markers if t >= since]
    f = np.array([reflected[ad] - t for ad, t in measured if ad in reflected])
    if not len(f):
        return nothing_reached("marker", logs)
    stats = {q: float(np.percentile(f, q)) for q in (50, 90, 99)}
    heads = ["events/s", "export every s", "poll s", "markers reflected", "versions served", "p50 s", "p90 s",
             "p99 s", "max s"]
    row = [f"{args.rate:,}", f"{args.export_every:g}", f"{args.poll:g}", f"{len(f)} of {len(measured)}",
           str(len(versions)), f"{stats[50]:.2f}", f"{stats[90]:.2f}", f"{stats[99]:.2f}", f"{f.max():.2f}"]
    print(table(heads, [row]))
    path = result_path(args.json, "freshness/stream.json")
    command = ("python bench/freshness.py " + " ".join(sys.argv[1:])).strip()
    path.write_text(json.dumps({
        "command": command, "machine": host, "settings": vars(args), "events_written": writer.events,
        "markers": len(measured), "markers_reflected": int(len(f)), "versions_served": len(versions),
        "freshness_s": {"p50": stats[50], "p90": stats[90], "p99": stats[99], "max": float(f.max()),
                        "mean": float(f.mean())},
        "per_marker": [[round(t - since, 4), round(reflected[ad] - t, 4) if ad in reflected else None]
                       for ad, t in measured]}, indent=1))
    path.with_suffix(".md").write_text(
        f"# Freshness: from an event's arrival to a prediction that reflects it\n\n- command: "
        f"`{command}`\n" + "".join(f"- {line}\n" for line in machine_lines(host)) + "\n```\n"
        + table(heads, [row]) + "\n```\n")
    plot_stream([(t - since, reflected[ad] - t) for ad, t in measured if ad in reflected], f,
                path.with_suffix(".png"), args)
    print(f"wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return 0


def plot_stream(points: list[tuple[float, float]], f: np.ndarray, out: Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ts, fs = zip(*points)
    a.plot(ts, fs, ".", markersize=4)
    a.set_xlabel("seconds since the server started (when the marker was written)")
    a.set_ylabel("freshness, s")
    a.set_title(f"{args.rate:,} events/s, the chief exporting every {args.export_every:g} s")
    a.set_ylim(bottom=0)
    a.grid(True, alpha=0.3)
    distribution(b, f, "an event written", "markers")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def distribution(ax, f: np.ndarray, start: str, what: str) -> None:
    """The right-hand panel of both plots: the fraction of `what` reflected within each time."""
    s = np.sort(f)
    ax.plot(s, np.arange(1, len(s) + 1) / len(s))
    ax.set_xlabel(f"freshness, s: {start} -> a prediction that reflects it")
    ax.set_ylabel(f"fraction of {what} within")
    ax.set_title(f"p50 {np.percentile(f, 50):.2f} s, p99 {np.percentile(f, 99):.2f} s")
    ax.grid(True, alpha=0.3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="training time measured (default 30)")
    p.add_argument("--checkpoint-secs", type=float, default=0.5, help="the shards' (default 0.5)")
    p.add_argument("--poll", type=float, default=0.1, help="the exporter's and the server's (default 0.1)")
    p.add_argument("--probe", type=float, default=0.01,
                   help="seconds between the probe's calls (default 0.01)")
    p.add_argument("--ps", type=int, default=2, help="shards (default 2)")
    p.add_argument("--model", default="wide_deep", help="a CTR built-in (default wide_deep)")
    p.add_argument("--samples", type=int, default=20_000, help="criteo-synthetic samples (default 20000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--json", default=None,
                   help="where the result goes (default results/freshness/freshness.json)")
    p.add_argument("--stream", action="store_true", help="from an event's arrival (see above)")
    p.add_argument("--rate", type=int, default=2000, help="--stream: events per second (default 2000)")
    p.add_argument("--workers", type=int, default=2, help="--stream: workers (default 2)")
    p.add_argument("--export-every", type=float, default=0.5, help="--stream: the chief's (default 0.5)")
    p.add_argument("--marker-every", type=float, default=0.25,
                   help="--stream: seconds between markers (default 0.25)")
    args = p.parse_args()
    host = machine(("grpcio", "numpy"))
    print("\n".join(machine_lines(host)), flush=True)
    if args.stream:
        return stream_main(args, host)
    job = ["--model", args.model, "--dataset", "criteo-synthetic", "--samples", str(args.samples),
           "--test-samples", "500"]
    procs: list[subprocess.Popen] = []
    logs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt, base, deltas = tmp / "ckpt", tmp / "base", tmp / "deltas"
        try:
            ports = []
            for j in range(args.ps):
                logs[f"shard{j}"] = []
                proc = subprocess.Popen(pserver("serve", "--port", "0", "--shard", str(j), "--num-shards",
                                                str(args.ps), "--num-workers", "1", "--optimizer", "adam",
                                                "--lr", "0.001", "--checkpoint-dir", str(ckpt),
                                                "--checkpoint-secs", str(args.checkpoint_secs)),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                procs.append(proc)
                ports.append(first_line_port(proc, r"listening on \S+:(\d+)", logs[f"shard{j}"]))
                drain(proc, logs[f"shard{j}"])
            ps = ",".join(f"127.0.0.1:{port}" for port in ports)
            logs["worker"] = []
            worker = subprocess.Popen(pserver("worker", "--ps", ps, *job, "--batch-size",
                                              str(args.batch_size), "--epochs", "100000", "--log-every", "5"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(worker)
            drain(worker, logs["worker"])
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not all(   # every shard's first checkpoint
                    any(ckpt.glob(f"shard{j}-of{args.ps}-v*.ckpt")) for j in range(args.ps)):
                time.sleep(0.2)
            time.sleep(2 * args.checkpoint_secs)            # and a version every shard has written
            r = subprocess.run(pserver("export", "--restore", str(ckpt), *job, "--out", str(base)),
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"export failed: {r.stdout}{r.stderr}")
            print(r.stdout.strip(), flush=True)
            logs["server"], logs["exporter"] = [], []
            server = subprocess.Popen(pserver("serve-model", str(base), "--port", "0", "--http-port", "-1",
                                              "--follow", str(deltas), "--poll", str(args.poll)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(server)
            server_port = first_line_port(server, r"gRPC on port (\d+)", logs["server"])
            drain(server, logs["server"])
            exporter = subprocess.Popen(pserver("export", "--restore", str(ckpt), "--since", str(base),
                                                "--out", str(deltas), "--follow", "--poll", str(args.poll),
                                                *job),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(exporter)
            drain(exporter, logs["exporter"])
            shard0 = pb_grpc.ParameterServerStub(grpc.insecure_channel(f"127.0.0.1:{ports[0]}"))
            predictor = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server_port}"))
            shard_seen: dict[int, float] = {}
            served_seen: dict[int, float] = {}
            stop = threading.Event()
            since = time.monotonic()
            watchers = [threading.Thread(target=watch, args=(lambda: shard0.Status(pb.StatusRequest(),
                                                                                   timeout=5).version,
                                                             args.probe, stop, shard_seen)),
                        threading.Thread(target=watch, args=(lambda: predictor.ModelStatus(
                            pb.ModelStatusRequest(), timeout=5).version, args.probe, stop, served_seen))]
            for t in watchers:
                t.start()
            time.sleep(args.seconds)
            worker.send_signal(signal.SIGTERM)          # no more updates; the last ones drain through
            worker.wait(timeout=120)
            time.sleep(args.checkpoint_secs + 4 * args.poll + 2.0)
            stop.set()
            for t in watchers:
                t.join()
        finally:
            stop_all(procs)
    # Steady state: from the first delta the server applied (the exporter's own start, a second or
    # two of imports and the first read of every checkpoint, is left out)
    first_served = sorted(served_seen.items())
    since = first_served[1][1] if len(first_served) > 1 else since
    f = freshness(shard_seen, served_seen, since)
    reached = [u for u, t in shard_seen.items() if t >= since]
    served_versions = sorted(v for v, t in served_seen.items() if t >= since)
    if not len(f):
        return nothing_reached("update", logs)
    stats = {q: float(np.percentile(f, q)) for q in (50, 90, 99)}
    row = [f"{args.checkpoint_secs:g}", f"{args.poll:g}", f"{len(f):,} of {len(reached):,}",
           str(len(served_versions)), f"{stats[50]:.2f}", f"{stats[90]:.2f}", f"{stats[99]:.2f}",
           f"{f.max():.2f}"]
    print(table(HEADERS, [row]))
    path = result_path(args.json, "freshness/freshness.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = ("python bench/freshness.py " + " ".join(sys.argv[1:])).strip()
    t0 = min(shard_seen.values())
    path.write_text(json.dumps({
        "command": command, "machine": host, "settings": vars(args),
        "updates_reached": len(reached), "updates_served": int(len(f)), "served_versions": served_versions,
        "freshness_s": {"p50": stats[50], "p90": stats[90], "p99": stats[99], "max": float(f.max()),
                        "mean": float(f.mean())},
        "timeline": {"shard0": sorted([v, round(t - t0, 4)] for v, t in shard_seen.items()),
                     "served": sorted([v, round(t - t0, 4)] for v, t in served_seen.items())}}, indent=1))
    path.with_suffix(".md").write_text(
        f"# Freshness: from an update on the shards to a prediction that reflects it\n\n- command: "
        f"`{command}`\n" + "".join(f"- {line}\n" for line in machine_lines(host)) + "\n```\n"
        + table(HEADERS, [row]) + "\n```\n")
    plot(shard_seen, served_seen, f, since, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return 0


def plot(shard_seen: dict, served_seen: dict, f: np.ndarray, since: float, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for seen, label in ((shard_seen, "shard 0's version (training)"), (served_seen, "version served")):
        pts = sorted((t - since, v) for v, t in seen.items() if t >= since)
        if pts:
            ts, vs = zip(*pts)
            a.step(ts, vs, where="post", label=label)
    a.set_xlabel("seconds since the server applied its first delta")
    a.set_ylabel("version (global step)")
    a.set_title("the server follows the training job")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    distribution(b, f, "update on the shards", "updates")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
