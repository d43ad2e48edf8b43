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

    def __init__(self, path, per_tick=50, tick=0.1):
        super().__init__(daemon=True)
        self.path, self.per_tick, self.tick = path, per_tick, tick
        self.text = "".join(s + "\n" for s in event_lines(0, EVENTS)).encode()

    def run(self):
        cut, step = 0, len(self.text) // (EVENTS // self.per_tick)
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
                  "--dataset", f"stream:{path}", *TRAIN, *(["--summary-json", str(summary)] if r == 0 else []))
            for r in range(2)]


def events_trained(summary: dict) -> int:
    """Every window's events as shard 0 summed the pushes it took (each measured before training)."""
    return sum(e["progressive"]["events"] for e in summary["per_epoch"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_killed_mid_stream_loses_no_event(procs, tmp_path, mode):
    """Worker 1 SIGKILLed while the stream still arrives: it is marked dead, the rest of its chunk
    goes to worker 0, which trains the stream to its end. Every chunk of every window is done once
    (fails if the killed worker's lease is lost: the job never ends, or ends short), the events
    trained are the stream's plus at most the one batch in flight at the kill, counted in
    batches_retrained (fails if a chunk is trained twice uncounted), and the progressive AUC of the
    last window shows the planted model learned (fails for metrics measured on the wrong outputs)."""
    path, summary = tmp_path / "events.tsv", tmp_path / "summary.json"
    addrs = [s.address() for s in shards(procs, mode)]
    ws = workers(procs, addrs, path, summary)
    Writer(path).start()
    assert wait_until(lambda: "epoch 2/4 step" in ws[1].output, 120), ws[1].output
    ws[1].popen.send_signal(signal.SIGKILL)
    assert ws[0].wait(180) == 0, ws[0].output
    s = read_json(summary)
    assert s["chunks_done"] == CHUNKS, s
    assert s["batches_retrained"] <= 1, s
    assert EVENTS <= events_trained(s) <= EVENTS + BATCH * s["batches_retrained"], s["per_epoch"]
    assert s["per_epoch"][-1]["progressive"]["auc"] > 0.6, s["per_epoch"]
    assert "window 4/4: " in ws[0].output and "progressive logloss" in ws[0].output, ws[0].output


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
    print(f"retrained {s['batches_retrained']} batches, {events_trained(s) - EVENTS} events over the stream's")
