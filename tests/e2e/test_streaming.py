"""Training from a stream (--dataset stream:PATH) with real processes: a writer appends planted click
events to a file while 2 shards and 2 workers train on it, leased by line offset; a worker SIGKILLed
or shard 0 SIGKILLed and restored from its checkpoint loses no event, and what was trained twice is
counted. Each window's progressive metrics (measured before training) are in the chief's summary."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from pserver.data.stream import event_lines
from tests.support.processes import free_port, read_json, wait_until

pytestmark = pytest.mark.e2e

BATCH, WINDOW, CHUNK, WINDOWS = 100, 10, 2, 4
EVENTS = BATCH * WINDOW * WINDOWS                 # 4,000 events: the stream the job trains on
CHUNKS = WINDOWS * WINDOW // CHUNK                # 20 chunks, each done once
TRAIN = ["--model", "lr", "--batch-size", str(BATCH), "--window-batches", str(WINDOW), "--chunk-batches",
         str(CHUNK), "--epochs", str(WINDOWS), "--log-every", "0.2", "--rpc-deadline", "60"]


class Writer(threading.Thread):
    """Appends the events, `per_tick` lines every `tick` seconds (a line may be cut between two
    writes: the readers must wait for its newline)."""

    def __init__(self, path, per_tick=50, tick=0.1, total=EVENTS):
        super().__init__(daemon=True)
        self.path, self.per_tick, self.tick, self.total = path, per_tick, tick, total
        self.text = "".join(s + "\n" for s in event_lines(0, total)).encode()

    def run(self):
        cut, step = 0, len(self.text) // (self.total // self.per_tick)
        while cut < len(self.text):
            with open(self.path, "ab") as f:
                f.write(self.text[cut:cut + step])
            cut += step
            time.sleep(self.tick)


def shards(procs, mode, extra=()):
    return [procs("serve", "--port", "0", "--shard", str(i), "--num-shards", "2", "--num-workers", "2",
                  "--mode", mode, "--step-timeout", "1.5", "--optimizer", "sgd", "--lr", "0.05", *extra)
            for i in range(2)]


def workers(procs, addrs, path, summary):
    return [procs("worker", "--ps", ",".join(addrs), "--rank", str(r), "--num-workers", "2",
                  "--dataset", f"stream:{path}", *TRAIN,
                  *(["--summary-json", str(summary)] if r == 0 else []))
            for r in range(2)]


def streamed_job(procs, tmp_path, mode):
    """2 shards and 2 workers on a stream the Writer then appends: (the chief's summary file, workers)."""
    path, summary = tmp_path / "events.tsv", tmp_path / "summary.json"
    ws = workers(procs, [s.address() for s in shards(procs, mode)], path, summary)
    Writer(path).start()
    return summary, ws


def events_trained(summary: dict) -> int:
    """Every window's events as shard 0 summed the pushes it took (each measured before training)."""
    return sum(e["progressive"]["events"] for e in summary["per_epoch"])


def test_a_worker_killed_mid_stream_loses_no_event(procs, tmp_path):
    """Worker 1 SIGKILLed while the stream still arrives (sync; the served chain below kills one in
    async): it is marked dead, the rest of its chunk goes to worker 0, which trains the stream to
    its end. Every chunk of every window is done once
    (fails if the killed worker's lease is lost: the job never ends, or ends short), the events
    trained are the stream's plus at most the one batch in flight at the kill, counted in
    batches_retrained (fails if a chunk is trained twice uncounted), and the progressive AUC of the
    last window shows the planted model learned (fails for metrics measured on the wrong outputs)."""
    summary, ws = streamed_job(procs, tmp_path, "sync")
    assert wait_until(lambda: "epoch 2/4 step" in ws[1].output, 120), ws[1].output
    ws[1].popen.send_signal(signal.SIGKILL)
    assert ws[0].wait(180) == 0, ws[0].output
    s = read_json(summary)
    assert s["chunks_done"] == CHUNKS, s
    assert s["batches_retrained"] <= 1, s
    assert EVENTS <= events_trained(s) <= EVENTS + BATCH * s["batches_retrained"], s["per_epoch"]
    assert s["per_epoch"][-1]["progressive"]["auc"] > 0.6, s["per_epoch"]
    assert "window 4/4: " in ws[0].output and "progressive logloss" in ws[0].output, ws[0].output


def test_a_chief_stopped_while_the_other_worker_trains_windows_still_reports_every_window(procs, tmp_path):
    """The chief SIGSTOPped in window 1 past --step-timeout (marked dead, its lease released) while
    worker 1 trains the stream's later windows alone, then SIGCONT: its next ask finds the
    coordinator several windows on, and it hears each window it missed with what every worker's
    batches of it measured (shard 0 keeps each epoch's sums; the chief asks for those it did not
    see end). Fails if the chief's summary lacks a window or has one without its events (CI saw
    both once a restarted shard 0 kept the chief backing off while worker 1 trained on)."""
    summary, ws = streamed_job(procs, tmp_path, "async")
    assert wait_until(lambda: "epoch 1/4 step" in ws[0].output, 120), ws[0].output
    ws[0].popen.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: "epoch 4/4" in ws[1].output or ws[1].popen.poll() is not None, 120), \
        ws[1].output
    ws[0].popen.send_signal(signal.SIGCONT)
    assert ws[0].wait(180) == 0 and ws[1].wait(180) == 0, ws[0].output + ws[1].output
    s = read_json(summary)
    assert s["chunks_done"] == CHUNKS, s
    assert [e["epoch"] for e in s["per_epoch"]] == [1, 2, 3, 4], s["per_epoch"]
    assert all(e["progressive"]["events"] > 0 for e in s["per_epoch"]), s["per_epoch"]
    assert EVENTS <= events_trained(s) <= EVENTS + BATCH * s["batches_retrained"], s["per_epoch"]
    assert ws[0].output.count("progressive logloss") == 4, ws[0].output


def test_shard_0_killed_mid_stream_restores_its_offsets_from_the_checkpoint(procs, tmp_path):
    """Shard 0 (which holds the offsets) SIGKILLed mid-stream and restarted with --restore: the
    coordinator goes on from the offsets its checkpoint recorded, the workers report what they
    trained after it (counted in batches_retrained), and the job still ends with every chunk done
    once and every event trained (fails if the restored coordinator starts the stream over, or
    skips what was leased after the checkpoint)."""
    path, summary, ckpt = tmp_path / "events.tsv", tmp_path / "summary.json", tmp_path / "ckpt"
    ckpt.mkdir()
    port = free_port()
    serve0 = ["serve", "--port", str(port), "--shard", "0", "--num-shards", "2", "--num-workers", "2",
              "--mode", "async", "--step-timeout", "5", "--optimizer", "sgd", "--lr", "0.05",
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", "--restore", str(ckpt)]
    shard0 = procs(*serve0)
    shard1 = procs("serve", "--port", "0", "--shard", "1", "--num-shards", "2", "--num-workers", "2",
                   "--mode", "async", "--step-timeout", "5", "--optimizer", "sgd", "--lr", "0.05")
    addrs = [shard0.address(), shard1.address()]
    ws = workers(procs, addrs, path, summary)
    Writer(path).start()
    assert wait_until(lambda: any(ckpt.glob("shard0-*.ckpt")) and "epoch 2/4 step" in ws[0].output, 120), \
        shard0.output + ws[0].output
    shard0.popen.send_signal(signal.SIGKILL)
    shard0.popen.wait()
    restarted = procs(*serve0)
    restarted.address()
    assert ws[0].wait(180) == 0 and ws[1].wait(180) == 0, ws[0].output + ws[1].output
    assert "restored version" in restarted.output, restarted.output
    s = read_json(summary)
    assert s["chunks_done"] == CHUNKS, s
    assert events_trained(s) >= EVENTS, s["per_epoch"]
    print(f"retrained {s['batches_retrained']} batches, {events_trained(s) - EVENTS} events over the "
          f"stream's")


def test_a_stream_served_as_it_trains_through_a_worker_s_a_shard_s_and_the_server_s_kill(procs, tmp_path):
    """The whole chain: events appended to a file, 2 shards (checkpointing), 2 workers, the chief
    exporting every 0.5 s (--export-every), and `pserver serve-model --follow` answering a client
    thread. Worker 1, then shard 1 (restarted with --restore), then the server (restarted on its
    port from the model and the deltas there) are SIGKILLed in turn. Every chunk of every window is
    done once and every event trained; the server fails no request except while it is dead, each
    answer names one version, a server's versions never go back, and the restarted server serves
    the chain's last delta (fails if it restarts from the first export only, or if the chief's
    exports stop at a shard's kill)."""
    import grpc
    import numpy as np

    from pserver._proto import pserver_pb2 as pb
    from pserver._proto import pserver_pb2_grpc as pb_grpc
    from pserver.data.criteo import parse_block
    from pserver.serving.app import to_named

    path, summary = tmp_path / "events.tsv", tmp_path / "summary.json"
    ckpt, ex = tmp_path / "ckpt", tmp_path / "ex"
    ports = [free_port(), free_port()]

    def shard(j):
        return procs("serve", "--port", str(ports[j]), "--shard", str(j), "--num-shards", "2",
                     "--num-workers", "2", "--mode", "async", "--step-timeout", "1.5", "--optimizer", "sgd",
                     "--lr", "0.05", "--checkpoint-dir", str(ckpt), "--restore", str(ckpt))
    shards = [shard(0), shard(1)]
    addrs = [s.address() for s in shards]
    ws = [procs("worker", "--ps", ",".join(addrs), "--rank", str(r), "--num-workers", "2",
                "--dataset", f"stream:{path}", *TRAIN, "--epochs", "6",
                *(["--summary-json", str(summary), "--export-every", "0.5", "--export-dir", str(ex)] if r == 0
                  else [])) for r in range(2)]
    Writer(path, per_tick=25, total=6000).start()
    assert wait_until(lambda: (ex / "model").exists(), 120), ws[0].output
    serve_port = free_port()
    serve = ["serve-model", str(ex / "model"), "--port", str(serve_port), "--http-port", "-1", "--follow",
             str(ex / "deltas"), "--poll", "0.1"]
    servers = [procs(*serve)]
    assert wait_until(lambda: "gRPC on port" in servers[0].output, 60), servers[0].output
    text = np.frombuffer("".join(s + "\n" for s in event_lines(0, 16)).encode(), np.uint8)
    x = parse_block(text, 0).x
    request = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
    stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{serve_port}"))
    lives: list[list[int]] = [[]]          # the versions each server life answered with
    failures: list[str] = []
    down = threading.Event()
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            try:
                lives[-1].append(stub.Predict(request, timeout=10).version)
            except grpc.RpcError as e:
                if not down.is_set():
                    failures.append(f"{e.code()}: {e.details()}")
            time.sleep(0.01)
    client = threading.Thread(target=ask, daemon=True)
    client.start()
    try:
        assert wait_until(lambda: "epoch 2/6 step" in ws[1].output, 120), ws[1].output
        ws[1].popen.send_signal(signal.SIGKILL)
        assert wait_until(lambda: "window 3/6" in ws[0].output, 120), ws[0].output
        shards[1].popen.send_signal(signal.SIGKILL)
        shards[1].popen.wait()
        shards[1] = shard(1)
        shards[1].address()
        assert wait_until(lambda: "window 4/6" in ws[0].output, 120), ws[0].output
        down.set()
        servers[0].popen.send_signal(signal.SIGKILL)
        servers[0].popen.wait()
        lives.append([])
        servers.append(procs(*serve))
        assert wait_until(lambda: "gRPC on port" in servers[1].output, 60), servers[1].output
        assert wait_until(lambda: len(lives[-1]) > 0, 30)
        down.clear()
        assert ws[0].wait(180) == 0, ws[0].output
        last = max(int(p.name.split("-v")[1]) for p in (ex / "deltas").glob("delta-v*"))
        assert wait_until(lambda: lives[-1] and lives[-1][-1] == last, 60), (lives[-1][-5:], last)
    finally:
        stop.set()
        client.join(30)
    s = read_json(summary)
    assert s["chunks_done"] == 6 * WINDOW // CHUNK, s
    assert events_trained(s) >= 6 * WINDOW * BATCH, s["per_epoch"]
    assert failures == [], failures[:5]
    assert all(life == sorted(life) for life in lives), [sorted(set(life)) for life in lives]
    assert len(set(lives[0])) >= 2, sorted(set(lives[0]))
    assert "restored version" in shards[1].output, shards[1].output[-2000:]
    print(f"{len(list((ex / 'deltas').glob('delta-v*')))} deltas; versions served by each server's life: "
          f"{[len(set(life)) for life in lives]}; {s['batches_retrained']} batches trained twice")


def test_export_every_against_shards_without_checkpoints_says_so_once_and_trains_on(procs, tmp_path):
    """--export-every exports what the shards' checkpoints hold: shards started without
    --checkpoint-dir get one line saying what to do, the run still ends well, and nothing is
    written (fails if the failure stops the run or is said at every interval)."""
    shard = procs("serve", "--port", "0", "--num-workers", "1")
    worker = procs("worker", "--ps", shard.address(), "--model", "logreg", "--samples", "4000",
                   "--epochs", "1", "--delay", "fixed:0.005", "--export-every", "0.1",
                   "--export-dir", str(tmp_path / "ex"))
    assert worker.wait(120) == 0, worker.output
    assert worker.output.count("start every shard with the same --checkpoint-dir") == 1, worker.output
    assert not (tmp_path / "ex").exists()


def test_events_sent_over_tcp_are_appended_whole_and_a_job_trains_on_them(procs, tmp_path):
    """`pserver ingest`: two senders write interleaved, each line cut across sends; the file gets
    every complete line once and whole (fails for lines split by another sender's bytes, or a
    partial line written), a connection's bytes after its last newline are dropped and counted,
    and a worker trains every event of the stream (2 windows) as they arrive over TCP."""
    import socket
    events = tmp_path / "events.tsv"
    ingest = procs("ingest", "--port", "0", "--out", str(events))
    port = int(ingest.address().rsplit(":", 1)[1])
    lines = [s + "\n" for s in event_lines(0, 2 * WINDOW * BATCH)]
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--mode", "async")
    summary = tmp_path / "summary.json"
    worker = procs("worker", "--ps", shard.address(), "--dataset", f"stream:{events}", *TRAIN,
                   "--epochs", "2", "--summary-json", str(summary))
    senders = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for k in range(0, len(lines), 50):        # sender k % 2 sends lines k .. k + 49, cut mid-line
        data = "".join(lines[k:k + 50]).encode()
        sock = senders[(k // 50) % 2]
        sock.sendall(data[:len(data) // 2 + 7])
        time.sleep(0.002)
        sock.sendall(data[len(data) // 2 + 7:])
    unfinished = b"0\t1\tan unfinished line"
    senders[0].sendall(unfinished)
    for sock in senders:
        sock.close()
    assert worker.wait(120) == 0, worker.output
    ingest.popen.send_signal(signal.SIGTERM)
    assert ingest.wait(30) == 0, ingest.output
    written = events.read_text().splitlines(keepends=True)
    assert sorted(written) == sorted(lines), (len(written), len(lines))
    assert "2,000 line(s) from 2 connection(s)" in ingest.output, ingest.output
    assert f"{len(unfinished)} byte(s) after a connection's last newline dropped" in ingest.output, \
        ingest.output
    s = read_json(summary)
    assert events_trained(s) == 2 * WINDOW * BATCH and s["chunks_done"] == 2 * WINDOW // CHUNK, s
