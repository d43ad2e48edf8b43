"""The prediction server (pserver.serving, issue 51): real gRPC and HTTP clients against a real
server over a model file and its deltas. It answers as the model file predicts, names the
version that answered, follows a directory of deltas in their chain's order, refuses a corrupt
or out-of-order delta and keeps serving, and no answer mixes two versions while deltas apply."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pserver import load_model
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import DataError
from pserver.serving import ModelServer, ServeModelConfig
from pserver.serving.app import to_array, to_named
from tests.support.processes import env_with, wait_until
from tests.support.serving import chain, http, records, start

TOKEN = "s3cret-token-for-serving-tests"


@pytest.fixture
def files(tmp_path):
    """A base export and 3 chained deltas, and an empty directory to follow."""
    base, deltas = chain(str(tmp_path), np.random.default_rng(0), 3)
    follow = tmp_path / "follow"
    follow.mkdir()
    return base, deltas, str(follow)


def grpc_predict(server: ModelServer, x, token=None):
    stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    r = stub.Predict(pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])]),
                     metadata=metadata, timeout=30)
    return to_array(r.outputs), r.version, r.export_id


def test_grpc_and_http_answer_as_the_model_file_predicts_and_name_the_version(files):
    base, _, _ = files
    x = records(7, np.random.default_rng(1))
    want = load_model(base).predict(x)
    server = start(base)
    try:
        out, version, export_id = grpc_predict(server, x)
        assert out.tobytes() == want.tobytes() and version == 10 and export_id == server.served.export_id
        rows = [{"dense": x["dense"][i].tolist(), "cat": x["cat"][i].tolist()} for i in range(7)]
        code, text = http(server, "/v1/models/wide_deep:predict", {"instances": rows})
        assert code == 200, text
        body = json.loads(text)
        np.testing.assert_array_equal(np.array(body["predictions"], np.float32), want)
        assert body["version"] == 10
        code, text = http(server, "/v1/models/wide_deep:predict",
                          {"inputs": {"dense": x["dense"].tolist(), "cat": x["cat"].tolist()}})
        np.testing.assert_array_equal(np.array(json.loads(text)["predictions"], np.float32), want)
        code, text = http(server, "/v1/models/wide_deep")
        assert code == 200 and json.loads(text)["model_version_status"][0]["version"] == "10"
        assert http(server, "/healthz") == (200, "ok\n")
        metrics = http(server, "/metrics")[1]
        assert 'pserver_serving_requests_total{outcome="ok",protocol="grpc"} 1.0' in metrics
        assert 'pserver_serving_requests_total{outcome="ok",protocol="http"} 2.0' in metrics
        assert "pserver_serving_version 10.0" in metrics
        assert 'pserver_serving_rows{table="linear"} 40.0' in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("inputs, match", [
    ({"dense": np.zeros((2, 3), np.float32)}, "missing 'cat'"),
    ({"dense": np.zeros((2, 3), np.float32), "cat": np.zeros((3, 4), np.int64)}, "the same number"),
    ({"dense": np.full((2, 3), np.nan, np.float32), "cat": np.zeros((2, 4), np.int64)}, "not finite"),
    ({"dense": np.zeros((2, 5), np.float32), "cat": np.zeros((2, 4), np.int64)}, "input 'dense'"),
    ({"dense": np.zeros((2, 3), np.float32), "cat": np.zeros((2, 4), np.int64),
      "extra": np.zeros(2, np.int64)}, "unknown 'extra'"),
])
def test_a_bad_request_is_invalid_argument_naming_the_input_and_changes_nothing(files, inputs, match):
    base, _, _ = files
    server = start(base)
    try:
        stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(pb.PredictRequest(inputs=[to_named(k, v) for k, v in inputs.items()]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()
        code, text = http(server, "/v1/models/wide_deep:predict",
                          {"inputs": {k: np.nan_to_num(v, nan=0).tolist() for k, v in inputs.items()}}
                          if "not finite" not in match else {"instances": [[1, 2], [3]]})
        assert code == 400 and "error" in json.loads(text)
        x = records(3, np.random.default_rng(2))
        assert grpc_predict(server, x)[0].tobytes() == load_model(base).predict(x).tobytes()
    finally:
        server.stop()


def test_a_hostile_http_request_gets_an_answer_and_the_server_keeps_answering(files):
    """A negative or unreadable Content-Length (read as "until the end": a handler stuck), a body
    over the limit, a body that is not JSON, an unknown path: each a 4xx at once."""
    import socket
    base, _, _ = files
    server = start(base)
    try:
        for length in ("-1", "abc", str(1 << 30)):
            with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
                s.sendall(f"POST /v1/models/wide_deep:predict HTTP/1.1\r\nHost: x\r\n"
                          f"Content-Length: {length}\r\n\r\n".encode())
                status = s.recv(100).split(b"\r\n")[0]
            assert status in (b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 413 Request Entity Too Large"), status
        req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/models/wide_deep:predict",
                                     data=b"{not json", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400
        assert http(server, "/v1/models/other:predict", {"instances": [[1]]})[0] == 404
        x = records(2, np.random.default_rng(9))
        assert grpc_predict(server, x)[1] == 10
    finally:
        server.stop()


def test_a_token_is_asked_of_both_protocols_but_not_of_the_probes(files):
    base, _, _ = files
    server = start(base, auth_token=TOKEN)
    x = records(2, np.random.default_rng(3))
    try:
        with pytest.raises(grpc.RpcError) as err:
            grpc_predict(server, x)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert grpc_predict(server, x, TOKEN)[1] == 10
        body = {"inputs": {"dense": x["dense"].tolist(), "cat": x["cat"].tolist()}}
        assert http(server, "/v1/models/wide_deep:predict", body)[0] == 401
        assert http(server, "/v1/models/wide_deep:predict", body, token="wrong")[0] == 401
        assert http(server, "/v1/models/wide_deep:predict", body, token=TOKEN)[0] == 200
        assert http(server, "/healthz")[0] == 200 and http(server, "/metrics")[0] == 200
        probe = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        answer = probe.Check(health_pb2.HealthCheckRequest(service="pserver.v1.Predictor"), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_it_follows_deltas_in_their_chains_order_and_refuses_a_corrupt_one(files):
    """Delta 2 arrives before delta 1: it waits, then both apply in order. A copy of delta 3
    with a damaged file is refused, counted and named, the version served stays and it still
    answers; the intact delta 3 then applies. Each version answers as the model file with the
    same deltas applied (load_model + apply)."""
    base, deltas, follow = files
    x = records(9, np.random.default_rng(4))
    expect = load_model(base)
    wants = [expect.predict(x)]
    for d in deltas:
        expect.apply(d)
        wants.append(expect.predict(x))
    server = start(base, follow=follow, poll=0.05)
    try:
        shutil.copytree(deltas[1], os.path.join(follow, "delta-2"))
        assert not wait_until(lambda: server.served.version != 10, 0.5)      # out of order: waits
        shutil.copytree(deltas[0], os.path.join(follow, "delta-1"))
        assert wait_until(lambda: server.served.version == 30, 10), server.served.status()
        out, version, _ = grpc_predict(server, x)
        assert version == 30 and out.tobytes() == wants[2].tobytes()
        bad = os.path.join(follow, "delta-3-bad")
        shutil.copytree(deltas[2], bad)
        with open(os.path.join(bad, "tables", "linear.rows.npy"), "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\x00\x00\x80\x7f")
        assert wait_until(lambda: server.served.refused == 1, 10), server.served.status()
        assert "delta-3-bad" in server.served.last_refusal and server.served.version == 30
        assert grpc_predict(server, x)[0].tobytes() == wants[2].tobytes()
        shutil.copytree(deltas[2], os.path.join(follow, "delta-3"))
        assert wait_until(lambda: server.served.version == 40, 10), server.served.status()
        assert grpc_predict(server, x)[0].tobytes() == wants[3].tobytes()
        status = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).ModelStatus(
            pb.ModelStatusRequest(), timeout=30)
        assert (status.version, status.deltas_applied, status.deltas_refused) == (40, 3, 1)
    finally:
        server.stop()


def test_two_servers_of_one_model_file_each_apply_to_the_file_they_verified(files):
    """Two servers of one model directory (they share its pages): B takes deltas 1 and 2 and
    compacts, which replaces the directory's files; A then applies delta 1. A's first apply used
    to map the rows again by path, reading B's compacted file: A answered "version 20" with
    rows of version 30. Each must read as the model file with the same deltas applied."""
    base, deltas, _ = files
    x = records(64, np.random.default_rng(5))
    expect = load_model(base)
    wants = []
    for d in deltas[:2]:
        expect.apply(d)
        wants.append(expect.predict(x))
    a, b = load_model(base), load_model(base)
    b.apply(deltas[0])
    b.apply(deltas[1])
    b.compact()
    a.apply(deltas[0])
    assert [m.meta["origin"]["version"] for m in (a, b)] == [20, 30]
    assert a.predict(x).tobytes() == wants[0].tobytes()
    assert b.predict(x).tobytes() == wants[1].tobytes()


def crafted(delta: str, out: str, edit) -> str:
    """A copy of `delta` whose JSON `edit(meta)` changed, every checksum kept valid: what the
    files' checks cannot catch."""
    shutil.copytree(delta, out)
    with np.load(os.path.join(delta, "model.npz"), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["pserver_model"]))
    edit(meta, out)
    arrays["pserver_model"] = np.array(json.dumps(meta))
    np.savez(os.path.join(out, "model.npz"), **arrays)
    return out


def nan_rows(meta, out):
    import hashlib
    name = "tables/linear.rows.npy"
    rows = np.load(os.path.join(out, name))
    rows[: len(rows) // 2] = np.nan
    np.save(os.path.join(out, name), rows)
    data = open(os.path.join(out, name), "rb").read()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("edit, match", [
    (lambda m, _: m["origin"].update(version="abc"), r'"origin"\."version" is \'abc\', not an integer'),
    (lambda m, _: m.update(origin="v99"), r'"origin" is \'v99\', not an object'),
    (lambda m, _: m.pop("export_id"), r'"export_id" is missing'),
    (lambda m, _: m.update(tables="linear"), r'"tables" is \'linear\', not a list of objects'),
    (lambda m, _: m.update(tables=[5]), r'"tables" is \'\[5\]\', not a list of objects'),
    (nan_rows, r"table 'linear' has rows that are not finite"),
], ids=["version-str", "origin-str", "no-export-id", "tables-str", "tables-of-numbers", "nan-rows"])
def test_a_delta_whose_json_is_crafted_is_refused_whole_and_the_next_one_applies(files, tmp_path, edit,
                                                                                   match):
    """Checksums valid, JSON not (an adversarial pass): the server applied such a delta and then
    failed every request, or committed the rows and died on a missing export id, serving a half
    applied delta under the old version. Refused before anything changes; the good delta after it
    applies."""
    base, deltas, follow = files
    x = records(9, np.random.default_rng(4))
    expect = load_model(base)
    before = expect.predict(x)
    expect.apply(deltas[0])
    after = expect.predict(x)
    m = load_model(base)
    bad = crafted(deltas[0], str(tmp_path / "bad"), edit)
    with pytest.raises(DataError, match=match):
        m.apply(bad)
    assert m.predict(x).tobytes() == before.tobytes()
    m.apply(deltas[0])
    assert m.predict(x).tobytes() == after.tobytes()


def test_another_models_delta_is_refused_and_counted_not_waited_for(files, tmp_path):
    """A delta of a model of another layout in the followed directory: it can never follow this
    model, so it is refused, counted and named (it used to be passed over in silence at every
    round, as if it were a later delta come first); this model's own deltas apply around it."""
    base, deltas, follow = files

    def other_layout(meta, _):
        meta["signature"], meta["delta"]["base_id"] = "f" * 16, "0" * 32
    server = start(base, follow=follow, poll=0.05)
    try:
        crafted(deltas[0], os.path.join(follow, "delta-0-other"), other_layout)
        shutil.copytree(deltas[0], os.path.join(follow, "delta-1"))
        assert wait_until(lambda: server.served.refused == 1 and server.served.version == 20, 10), \
            server.served.status()
        why = server.served.last_refusal
        assert "delta-0-other" in why and "a delta of model 000" in why, why
    finally:
        server.stop()


def test_a_failed_compaction_leaves_the_model_served_and_the_deltas_followed(files, tmp_path):
    """--compact-every 1 where the model file cannot be rewritten (its directory is gone, a file
    in its place; a read-only or full disk did the same in an adversarial pass): the follow
    thread died of the OSError, and the server answered version 20 for ever while it said it was
    healthy. The failure is said once and counted, and the next delta still applies."""
    base, deltas, follow = files
    moved = str(tmp_path / "served")
    shutil.copytree(base, os.path.join(moved, "model"))
    x = records(9, np.random.default_rng(4))
    expect = load_model(base)
    for d in deltas[:2]:
        expect.apply(d)
    lines = []
    server = ModelServer(ServeModelConfig(os.path.join(moved, "model"), port=0, http_port=0, follow=follow,
                                          poll=0.05, compact_every=1), say=lines.append).start()
    try:
        os.rename(moved, moved + ".gone")          # the mapped files stay; MODEL's directory does not
        open(moved, "w").close()
        shutil.copytree(deltas[0], os.path.join(follow, "delta-1"))
        assert wait_until(lambda: server.served.follow_errors >= 1, 10), server.served.status()
        shutil.copytree(deltas[1], os.path.join(follow, "delta-2"))
        assert wait_until(lambda: server.served.version == 30, 10), (server.served.status(), lines)
        assert grpc_predict(server, x)[0].tobytes() == expect.predict(x).tobytes()
        status = json.loads(http(server, f"/v1/models/{server.served.name}")[1])["model_version_status"][0]
        assert status["follow_errors"] >= 1 and "NotADirectoryError" in status["last_follow_error"], status
        reply = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).ModelStatus(
            pb.ModelStatusRequest(), timeout=30)
        assert reply.follow_errors >= 1 and "NotADirectoryError" in reply.last_follow_error
        assert sum("still serving version 20, following on" in line for line in lines) == 1, lines
    finally:
        server.stop()


def test_no_answer_mixes_two_versions_while_deltas_apply(files):
    """Clients predict without pause while the three deltas apply: every answer equals exactly
    the prediction of the version it names (a request that read some rows of the old version
    and some of the new, or the new rows with the old dense weights, matches neither)."""
    base, deltas, _ = files
    x = records(64, np.random.default_rng(5))
    expect = load_model(base)
    wants = {10: expect.predict(x).tobytes()}
    for k, d in enumerate(deltas):
        expect.apply(d)
        wants[10 * (k + 2)] = expect.predict(x).tobytes()
    server = start(base)
    seen, bad, stop = [], [], threading.Event()

    def client():
        stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        req = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
        while not stop.is_set():
            r = stub.Predict(req, timeout=30)
            seen.append(r.version)
            if to_array(r.outputs).tobytes() != wants[r.version]:
                bad.append(r.version)

    threads = [threading.Thread(target=client) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for d in deltas:
            wait_until(lambda: len(seen) > 20, 10)
            seen_before = len(seen)
            server.served.apply(d)
            wait_until(lambda n=seen_before: len(seen) > n + 20, 10)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
    assert not bad, bad
    assert set(seen) == {10, 20, 30, 40}, sorted(set(seen))


@pytest.mark.e2e
def test_the_command_serves_follows_and_stops_on_sigterm(files, tmp_path):
    base, deltas, follow = files
    proc = subprocess.Popen([sys.executable, "-m", "pserver", "serve-model", base, "--port", "0",
                             "--http-port", "0", "--follow", follow, "--poll", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_with({}))
    try:
        first = proc.stdout.readline()
        assert "gRPC on port" in first, first
        grpc_port = int(first.split("gRPC on port ")[1].split(",")[0])
        http_port = int(first.split("HTTP on port ")[1].split(";")[0])
        shutil.copytree(deltas[0], os.path.join(follow, "delta-1"))
        line = proc.stdout.readline()
        assert "applied delta-1: version 20" in line, line
        stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        x = records(4, np.random.default_rng(6))
        r = stub.Predict(pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])]),
                         timeout=30)
        assert r.version == 20
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=30) as h:
            assert h.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopped at version 20: 1 delta(s) applied, 0 refused" in out, out


def test_a_missing_model_file_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pserver", "serve-model", str(tmp_path / "none"),
                        "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env_with({}))
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stdout + r.stderr


@pytest.mark.e2e
def test_a_server_killed_by_sigkill_comes_back_at_the_version_its_deltas_make(files):
    """kill -9 mid-follow, then the same command again: it loads the model file and applies the
    deltas in the directory from the start of their chain, so it answers at the newest version
    (its state is the files, nothing of its own to lose)."""
    base, deltas, follow = files
    for k, d in enumerate(deltas):
        shutil.copytree(d, os.path.join(follow, f"delta-{k + 1}"))
    cmd = [sys.executable, "-m", "pserver", "serve-model", base, "--port", "0", "--http-port", "-1",
           "--follow", follow, "--poll", "0.05"]
    x = records(5, np.random.default_rng(7))
    expect = load_model(base)
    for d in deltas:
        expect.apply(d)
    for attempt in range(2):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env_with({}))
        try:
            first = proc.stdout.readline()
            assert "gRPC on port" in first, (first, proc.stdout.read() if proc.poll() is not None else "")
            port = int(first.split("gRPC on port ")[1].split(";")[0].split(",")[0])
            applied = [proc.stdout.readline() for _ in deltas]
            assert "version 40" in applied[-1], applied
            stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            request = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
            r = stub.Predict(request, timeout=30)
            assert r.version == 40 and to_array(r.outputs).tobytes() == expect.predict(x).tobytes()
        finally:
            proc.send_signal(signal.SIGKILL if attempt == 0 else signal.SIGTERM)
            proc.communicate(timeout=60)


def test_with_a_certificate_both_protocols_speak_tls(files, tmp_path):
    """Catches a token sent in the clear: HTTP is HTTPS too when the server has a certificate."""
    import ssl

    from tests.support.certs import make_certs
    base, _, _ = files
    certs = make_certs(tmp_path)
    server = start(base, auth_token=TOKEN, tls_cert=str(certs.cert), tls_key=str(certs.key))
    x = records(2, np.random.default_rng(8))
    try:
        channel = grpc.secure_channel(f"localhost:{server.port}",
                                      grpc.ssl_channel_credentials(certs.ca.read_bytes()))
        stub = pb_grpc.PredictorStub(channel)
        request = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
        answer = stub.Predict(request, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=30)
        assert answer.version == 10
        body = json.dumps({"inputs": {"dense": x["dense"].tolist(), "cat": x["cat"].tolist()}}).encode()
        req = urllib.request.Request(f"https://localhost:{server.http_port}/v1/models/wide_deep:predict",
                                     data=body, method="POST", headers={"Authorization": f"Bearer {TOKEN}"})
        context = ssl.create_default_context(cafile=str(certs.ca))
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            assert json.loads(r.read())["version"] == 10
        with pytest.raises((urllib.error.URLError, ConnectionError)):      # plain HTTP is not answered
            urllib.request.urlopen(f"http://localhost:{server.http_port}/healthz", timeout=5)
    finally:
        server.stop()


def test_a_keras_models_answers_are_what_its_predict_gives(tmp_path):
    """A softmax last layer computes logits (its loss takes them): the server answers the
    probabilities, as Keras's predict and TensorFlow Serving do (a CTR model's logit stays one)."""
    from pserver import keras
    x = np.random.default_rng(0).standard_normal((200, 5)).astype("float32")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, (x[:, 0] > 0).astype("int64"), epochs=1, batch_size=50, verbose=0)
    model.save(tmp_path / "m.keras")
    server = start(str(tmp_path / "m.keras"))
    try:
        code, text = http(server, f"/v1/models/{server.served.name}:predict", {"instances": x[:4].tolist()})
        got = np.array(json.loads(text)["predictions"], np.float32)
        np.testing.assert_allclose(got, model.predict(x[:4], verbose=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.sum(axis=1), 1, rtol=1e-5)
    finally:
        server.stop()


def test_compact_every_rewrites_the_model_file_and_a_restart_takes_only_the_later_deltas(files):
    """--compact-every 2: after two deltas the model file on disk is the model at their version
    (its export id the second delta's), the answers unchanged; a server started again from it
    is at that version at once and takes only the third delta."""
    from pserver.persist import model_file
    base, deltas, follow = files
    x = records(6, np.random.default_rng(10))
    expect = load_model(base)
    for d in deltas:
        expect.apply(d)
    server = start(base, follow=follow, poll=0.05, compact_every=2)
    try:
        for k in (0, 1):
            shutil.copytree(deltas[k], os.path.join(follow, f"delta-{k + 1}"))
        assert wait_until(lambda: server.served.compacted_at == 2, 10), server.served.status()
        assert model_file.read(base)[0]["export_id"] == model_file.read(deltas[1])[0]["export_id"]
        assert grpc_predict(server, x)[1] == 30
    finally:
        server.stop()
    again = start(base, follow=follow, poll=0.05)
    try:
        assert again.served.version == 30
        shutil.copytree(deltas[2], os.path.join(follow, "delta-3"))
        assert wait_until(lambda: again.served.version == 40, 10), again.served.status()
        out, version, _ = grpc_predict(again, x)
        assert out.tobytes() == expect.predict(x).tobytes() and again.served.applied == 1
    finally:
        again.stop()


def test_a_list_feature_comes_as_lists_of_any_length_and_is_padded_as_the_model_pads(tmp_path):
    """A user's history as JSON lists of different lengths (an empty one too), as Keras's fit and
    predict take them: the server pads them with the model's padding and answers as predict
    does; a list longer than the input is a 400 naming it."""
    from pserver import keras
    from pserver.keras import layers
    items = keras.Input(shape=(4,), dtype="int64", name="items")
    user = keras.Input(shape=(), dtype="int64", name="user")
    e = layers.Embedding(None, 3, sparse=True, mask_zero=True, combiner="mean")(items)
    u = layers.Embedding(None, 3, sparse=True)(user)
    model = keras.Model({"items": items, "user": user},
                        layers.Dense(1, activation="sigmoid")(layers.Concatenate()([e, u])))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    rng = np.random.default_rng(1)
    lists = [list(rng.integers(1, 30, rng.integers(0, 5))) for _ in range(300)]
    model.fit({"items": lists, "user": rng.integers(0, 9, 300)}, rng.integers(0, 2, 300).astype("float32"),
              epochs=1, batch_size=50, verbose=0)
    model.save(tmp_path / "m.keras")
    ask = {"items": [[3, 17], [5], [], [1, 2, 3, 4]], "user": [1, 2, 3, 4]}
    want = model.predict({"items": ask["items"], "user": np.array(ask["user"])}, verbose=0)
    server = start(str(tmp_path / "m.keras"))
    try:
        name = server.served.name
        code, text = http(server, f"/v1/models/{name}:predict",
                          {"instances": [{"items": i, "user": u} for i, u in zip(ask["items"], ask["user"])]})
        assert code == 200, text
        np.testing.assert_allclose(np.array(json.loads(text)["predictions"], np.float32), want, rtol=1e-6)
        code, text = http(server, f"/v1/models/{name}:predict",
                          {"inputs": {"items": [[1, 2, 3, 4, 5], [1]], "user": [1, 2]}})
        assert code == 400 and "'items'" in json.loads(text)["error"], text
    finally:
        server.stop()


@pytest.mark.e2e
def test_a_job_its_delta_exporter_and_a_server_the_server_ends_at_the_jobs_last_checkpoint(tmp_path):
    """Real processes: a wide_deep job saves its model; a server serves it and follows a
    directory that `pserver export --follow` fills from the job's checkpoints while the job goes
    on for another epoch; the server ends at the last checkpoint's version and answers exactly
    as a fresh export of that checkpoint (the deltas' chain loses and mixes nothing)."""
    from pserver.data import load_dataset
    from tests.support.processes import on_one_blas_thread, run
    job = ["--model", "wide_deep", "--dataset", "criteo-synthetic", "--samples", "2000",
           "--test-samples", "500"]
    train = ["launch", "--ps", "2", "--workers", "1", *job, "--batch-size", "256", "--checkpoint-dir",
             str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    r = run(*train, "--epochs", "1", "--save", str(tmp_path / "base"), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    deltas = tmp_path / "deltas"
    serve = subprocess.Popen([sys.executable, "-m", "pserver", "serve-model", str(tmp_path / "base"),
                              "--port", "0", "--http-port", "-1", "--follow", str(deltas), "--poll", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_with({}))
    export = subprocess.Popen([sys.executable, "-m", "pserver", "export", "--restore",
                               str(tmp_path / "ckpt"), "--since", str(tmp_path / "base"), "--out",
                               str(deltas), "--follow", "--poll", "0.2", *job], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env_with({}))
    try:
        port = int(serve.stdout.readline().split("gRPC on port ")[1].split(";")[0].split(",")[0])
        r = run(*train, "--epochs", "2", "--restore", str(tmp_path / "ckpt"), timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        fresh = tmp_path / "fresh"
        r = run("export", "--restore", str(tmp_path / "ckpt"), *job, "--out", str(fresh))
        assert r.returncode == 0 and "at version 16" in r.stdout, r.stdout + r.stderr
        x = load_dataset("criteo-synthetic", samples=2000, test_samples=500).x_test[:64]
        stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = pb.PredictRequest(inputs=[to_named("dense", x["dense"]), to_named("cat", x["cat"])])
        assert wait_until(lambda: stub.Predict(request, timeout=30).version == 16, 60)
        assert to_array(stub.Predict(request, timeout=30).outputs).tobytes() == \
            on_one_blas_thread(load_model(str(fresh)).predict, x).tobytes()     # as the server computes
    finally:
        for proc in (export, serve):
            proc.send_signal(signal.SIGTERM)
        out_export, _ = export.communicate(timeout=60)
        out_serve, _ = serve.communicate(timeout=60)
    assert export.returncode == 0 and "wrote" in out_export and "stopped after" in out_export, out_export
    assert serve.returncode == 0 and "stopped at version 16" in out_serve, out_serve
