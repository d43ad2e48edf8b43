"""A prediction server that follows a training job (issue 51) while a training shard is killed with
SIGKILL mid-run and restarted from its checkpoints, the exporter keeping the 3 newest deltas: the
server answers every request throughout, each answer names one version, the versions it serves
never go back, and it ends at the job's last checkpoint, answering as a fresh export of it."""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import pytest

from pserver import load_model
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.data import load_dataset
from pserver.serving.app import to_array, to_named
from tests.support.processes import free_port, on_one_blas_thread, run, wait_until

pytestmark = pytest.mark.e2e

JOB = ["--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", "4000", "--test-samples", "500"]


def shard_args(j: int, port: int, ckpt) -> list[str]:
    return ["serve", "--port", str(port), "--shard", str(j), "--num-shards", "2", "--num-workers", "1",
            "--restore", str(ckpt), "--checkpoint-every", "2"]


def test_the_server_answers_throughout_a_training_shard_s_kill_and_restart(procs, tmp_path):
    ckpt, base, deltas = tmp_path / "ckpt", tmp_path / "base", tmp_path / "deltas"
    ckpt.mkdir()
    ports = [free_port(), free_port()]
    shards = [procs(*shard_args(j, ports[j], ckpt)) for j in range(2)]
    for s in shards:
        s.address()
    ps = ",".join(f"127.0.0.1:{p}" for p in ports)
    train = ["worker", "--ps", ps, *JOB, "--batch-size", "128", "--log-every", "0.5"]
    first = procs(*train, "--epochs", "1", "--save", str(base))
    assert first.wait(240) == 0, first.output[-3000:]
    server = procs("serve-model", str(base), "--port", "0", "--http-port", "-1", "--follow", str(deltas),
                   "--poll", "0.1")
    assert wait_until(lambda: "gRPC on port" in server.output, 60), server.output
    port = int(re.search(r"gRPC on port (\d+)", server.output).group(1))
    exporter = procs("export", "--restore", str(ckpt), "--since", str(base), "--out", str(deltas), "--follow",
                     "--poll", "0.2", "--keep-deltas", "3", *JOB)
    x = load_dataset("criteo-synthetic", samples=4000, test_samples=500).x_test[:32]
    request = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
    stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    answers: list[int] = []
    failures: list[str] = []
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            try:
                answers.append(stub.Predict(request, timeout=30).version)
            except grpc.RpcError as e:
                failures.append(f"{e.code()}: {e.details()}")
            time.sleep(0.005)
    client = threading.Thread(target=ask, daemon=True)
    client.start()
    try:
        second = procs(*train, "--epochs", "4", "--delay", "fixed:0.03", "--rpc-deadline", "60")
        before = set(ckpt.glob("shard1-*.ckpt"))
        assert wait_until(lambda: set(ckpt.glob("shard1-*.ckpt")) - before, 120), second.output[-3000:]
        shards[1].popen.send_signal(signal.SIGKILL)       # a training shard, mid-run
        shards[1].popen.wait()
        time.sleep(0.5)
        shards[1] = procs(*shard_args(1, ports[1], ckpt))
        shards[1].address()
        assert second.wait(240) == 0, second.output[-3000:]
        assert "restored version" in shards[1].output, shards[1].output[-2000:]
        fresh = tmp_path / "fresh"
        r = run("export", "--restore", str(ckpt), *JOB, "--out", str(fresh))
        assert r.returncode == 0, r.stdout + r.stderr
        last = int(re.search(r"at version (\d+)", r.stdout).group(1))
        assert wait_until(lambda: answers and answers[-1] == last, 60), (answers[-5:], last,
                                                                         exporter.output[-2000:])
        got = stub.Predict(request, timeout=30)
        assert got.version == last
        want = on_one_blas_thread(load_model(str(fresh)).predict, x)        # as the server computes
        assert to_array(got.outputs).tobytes() == want.tobytes()
    finally:
        stop.set()
        client.join(60)
    assert failures == [], failures[:5]
    assert answers == sorted(answers) and len(set(answers)) >= 3, sorted(set(answers))
    kept = [p.name for p in deltas.iterdir() if not p.name.startswith(".")]
    assert 1 <= len(kept) <= 3, kept                      # --keep-deltas 3: the directory stays bounded
