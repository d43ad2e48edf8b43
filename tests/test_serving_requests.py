"""The prediction server against requests an adversarial tester sent it (/tmp/attack-serving):
each gets a clear refusal, HTTP 400 (strict JSON) or gRPC INVALID_ARGUMENT, and the server keeps
answering; a port it cannot listen on is one line naming the flag, exit 2. Real servers and
clients, as tests/test_serving.py starts them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from http.client import HTTPConnection

import grpc
import numpy as np
import pytest

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import ConfigError
from pserver.serving import ModelServer, ServeModelConfig
from pserver.serving.app import to_named
from tests.support.processes import env_with
from tests.support.serving import http, start


def _strict(text: str):
    """JSON as any parser reads it: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise AssertionError(f"the reply holds {constant}, which is not JSON: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def ones(tmp_path):
    """A model of one input of 4 values whose prediction is their sum (Dense(1), weights one):
    finite inputs of 3e38 overflow it."""
    from pserver import keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.set_weights([np.ones((4, 1), np.float32), np.zeros(1, np.float32)])
    model.save(tmp_path / "ones.keras")
    return str(tmp_path / "ones.keras")


def _listening() -> socket.socket:
    """A socket that holds a port, as another server would."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_body_nested_too_deep_is_a_400_and_the_server_keeps_answering(ones):
    """'[' * 100000: Python's JSON parser raised RecursionError in the handler, and the client
    got no reply at all (curl: Empty reply from server)."""
    server = start(ones)
    try:
        conn = HTTPConnection("127.0.0.1", server.http_port, timeout=10)
        conn.request("POST", "/v1/models/sequential:predict", body=b"[" * 100000 + b"]" * 100000)
        r = conn.getresponse()
        assert r.status == 400
        assert "nests too deep" in _strict(r.read().decode())["error"]
        code, text = http(server, "/v1/models/sequential:predict", {"instances": [[1, 2, 3, 4]]})
        assert code == 200 and _strict(text)["predictions"] == [[10.0]], text
    finally:
        server.stop()


def test_http_an_answer_that_is_not_finite_is_a_400_never_bare_nan_or_infinity(ones):
    """Finite inputs of 3e38 overflow the model: the reply was a 200 whose body held Infinity
    (NaN for another model), which is not JSON. And 1e39, beyond float32, is named as such."""
    server = start(ones)
    try:
        code, text = http(server, "/v1/models/sequential:predict", {"instances": [[3e38] * 4]})
        assert code == 400 and "output is not finite" in _strict(text)["error"], text
        code, text = http(server, "/v1/models/sequential:predict", {"instances": [[1e39, 0, 0, 0]]})
        assert code == 400 and "'x'" in (error := _strict(text)["error"]) and "float32" in error, text
        code, text = http(server, "/v1/models/sequential:predict", {"instances": [[1, 2, 3, 4]]})
        assert code == 200 and _strict(text)["predictions"] == [[10.0]], text
    finally:
        server.stop()


def test_grpc_a_float64_beyond_float32_or_an_answer_not_finite_is_invalid_argument(ones):
    """A float64 1e300 passed the check for finite inputs, made before the model's cast to
    float32 (where it is inf), and the answer was inf; 3e38 in float32 overflowed the model and
    its inf was answered too."""
    server = start(ones)
    try:
        stub = pb_grpc.PredictorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        for x, match in ((np.full((1, 4), 1e300), "input 'input_0' holds values beyond float32's range"),
                         (np.full((1, 4), 3e38, np.float32), "output is not finite")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(pb.PredictRequest(inputs=[to_named("input_0", x)]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert match in err.value.details(), err.value.details()
        r = stub.Predict(pb.PredictRequest(inputs=[to_named("input_0", np.ones((1, 4)))]), timeout=10)
        assert r.version == 0
    finally:
        server.stop()


def test_a_busy_port_is_a_config_error_naming_the_flag_and_the_port(ones):
    """A port another process holds was a raw OSError (HTTP) or RuntimeError (gRPC); and a second
    server on a first one's gRPC port took it (gRPC's SO_REUSEPORT) and half its requests."""
    holder = _listening()
    busy = holder.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"--http-port {busy}: address already in use"):
            ModelServer(ServeModelConfig(ones, port=0, http_port=busy), say=lambda *_: None)
        with pytest.raises(ConfigError, match=f"--port {busy}: address already in use"):
            ModelServer(ServeModelConfig(ones, port=busy, http_port=-1), say=lambda *_: None)
    finally:
        holder.close()
    first = start(ones)
    try:
        with pytest.raises(ConfigError, match=f"--port {first.port}: address already in use"):
            ModelServer(ServeModelConfig(ones, port=first.port, http_port=-1), say=lambda *_: None)
    finally:
        first.stop()


def test_the_command_on_a_busy_port_prints_one_line_and_exits_2(ones):
    holder = _listening()
    busy = holder.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "pserver", "serve-model", ones, "--port", "0",
                            "--http-port", str(busy)],
                           capture_output=True, text=True, timeout=60, env=env_with({}))
    finally:
        holder.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert out.strip() == f"pserver serve-model: error: --http-port {busy}: address already in use " \
                          f"on 127.0.0.1 (another server there?)", out


@pytest.mark.parametrize("method", ["PUT", "DELETE", "OPTIONS", "PATCH"])
def test_a_method_a_path_does_not_take_is_a_json_405_naming_the_allowed_one(ones, method):
    """They were 501 pages of HTML, unlike the rest of the API."""
    server = start(ones)
    try:
        for path, allowed in (("/v1/models/sequential:predict", "POST"), ("/v1/models/sequential", "GET"),
                              ("/healthz", "GET")):
            conn = HTTPConnection("127.0.0.1", server.http_port, timeout=10)
            conn.request(method, path, body=b"{}")
            r = conn.getresponse()
            error = _strict(r.read().decode())["error"]
            assert (r.status, r.getheader("Allow")) == (405, allowed), (path, r.status, error)
            assert method in error and allowed in error, error
            conn.close()
        code, text = http(server, "/v1/models/sequential:predict", {"instances": [[1, 2, 3, 4]]})
        assert code == 200, text
    finally:
        server.stop()


def raw_exchange(port: int, data: bytes) -> bytes:
    """What the server sends back to `data` written on one connection, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_a_body_left_unread_is_never_read_as_the_next_request(ones):
    """A 404, a 401 and a chunked body: the body stayed in the connection and was parsed as a
    second request (an HTML 400 after the JSON answer, an adversarial pass). The server answers
    once and closes the connection."""
    smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"      # what a body must never become
    server = start(ones)
    try:
        for head, code in ((b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", b"404"),
                           (b"POST /v1/models/sequential:predict HTTP/1.1\r\nHost: x\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n", b"411")):
            got = raw_exchange(server.http_port, head.replace(b"%d", str(len(smuggled)).encode()) + smuggled)
            assert got.startswith(b"HTTP/1.0 " + code) or got.startswith(b"HTTP/1.1 " + code), got[:200]
            assert got.count(b"HTTP/1.") == 1, got
    finally:
        server.stop()
    server = start(ones, auth_token="s3cret-token-for-serving-tests")
    try:
        head = b"POST /v1/models/sequential:predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        got = raw_exchange(server.http_port, head.replace(b"%d", str(len(smuggled)).encode()) + smuggled)
        assert b" 401 " in got.split(b"\r\n")[0] and got.count(b"HTTP/1.") == 1, got
    finally:
        server.stop()
