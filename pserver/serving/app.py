"""`pserver serve-model DIR`: a model file's predictions over gRPC (pserver.v1.Predictor) and
HTTP/JSON (TensorFlow Serving's REST shape), with health, Prometheus metrics and the shards'
token and TLS options, following a training job's delta exports.

HTTP (on --http-port):
    POST /v1/models/NAME:predict   {"instances": [...]} (one sample each: a value list, or an
                                   object by input name) or {"inputs": {name: [...]}} (columns)
                                   -> {"predictions": [[...], ...], "version": V, "export_id": ID}
    GET  /v1/models/NAME           {"model_version_status": [{"version": "V", "state": "AVAILABLE", ...}]}
    GET  /healthz                  200 "ok" once the model is loaded
    GET  /metrics                  Prometheus: requests by protocol and outcome, latency histogram,
                                   the version served, deltas applied and refused, rows in the tables
A bad request is a 400 {"error": "..."} (INVALID_ARGUMENT over gRPC) naming what is wrong, an
answer that would not be finite included (replies are strict JSON: no NaN); another method is a
405 naming the one the path takes.
A token (--auth-token, $PSERVER_AUTH_TOKEN) is asked of both: gRPC's metadata as the shards ask it,
HTTP's `Authorization: Bearer TOKEN` (the health and metrics paths excepted, as probes call them).
With --tls-cert and --tls-key both speak TLS (HTTPS) with that certificate.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import os
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import ConfigError, DataError
from pserver.serving.model import ServedModel, as_input
from pserver.wire.security import add_port, check_tls_files, server_interceptors, token_matches

MAX_BODY = 64 << 20            # an HTTP request's body: larger ones are refused (413)
IDLE_SECONDS = 60              # an HTTP connection that sends nothing this long is closed
FLOAT32_MAX = float(np.finfo(np.float32).max)
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class ServeModelConfig:
    path: str                          # the model file (a directory for a model with sparse tables)
    port: int = 8500                   # gRPC (TensorFlow Serving's default ports: 8500 gRPC, 8501 REST)
    http_port: int = 8501              # -1: no HTTP
    host: str = "127.0.0.1"
    follow: str | None = None          # a directory of delta exports to apply as they appear
    poll: float = 0.5                  # seconds between looks at --follow
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    threads: int = 8                   # gRPC worker threads
    compact_every: int = 0             # rewrite the model file after every that many deltas (0: never)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, served: ServedModel) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pserver_serving_requests", "prediction requests", ["protocol", "outcome"],
                                registry=r)
        self.samples = Counter("pserver_serving_samples", "samples predicted", registry=r)
        self.latency = Histogram("pserver_serving_latency_seconds",
                                 "a prediction request's time in the server",
                                 ["protocol"], buckets=LATENCY_BUCKETS, registry=r)
        gauge = Gauge("pserver_serving_version", "the training version of the model served", registry=r)
        gauge.set_function(lambda: served.version)
        applied = Gauge("pserver_serving_deltas_applied", "deltas applied since the start", registry=r)
        applied.set_function(lambda: served.applied)
        refused = Gauge("pserver_serving_deltas_refused", "deltas refused since the start", registry=r)
        refused.set_function(lambda: served.refused)
        failed = Gauge("pserver_serving_follow_errors", "rounds of --follow that failed (a full or "
                       "read-only disk, ...): the model served stays, the last reason is in the status",
                       registry=r)
        failed.set_function(lambda: served.follow_errors)
        rows = Gauge("pserver_serving_rows",
                     "rows a sparse table holds: the file's, plus the deltas' new ids, "
                     "less those they removed", ["table"], registry=r)
        for i, t in enumerate(served.saved.tables):
            rows.labels(t.name).set_function(lambda i=i: _rows_held(served.saved.tables[i]))


def _rows_held(t) -> int:
    over_ids, _, tombs = t.extra
    return int(t.ids.shape[0] + over_ids.shape[0] - tombs.shape[0])


def to_array(a: pb.NamedArray) -> np.ndarray:
    try:
        dtype = np.dtype(a.dtype)
    except TypeError:
        raise ValueError(f"input {a.name!r}: dtype {a.dtype!r} is not a numpy dtype") from None
    if dtype.kind not in "biuf":
        raise ValueError(f"input {a.name!r}: dtype {a.dtype!r}; inputs are numbers")
    shape = tuple(a.shape)
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != len(a.data):
        raise ValueError(f"input {a.name!r}: {len(a.data)} bytes do not hold {a.dtype} of shape {shape}")
    return np.frombuffer(a.data, dtype.newbyteorder("<")).reshape(shape)


def to_named(name: str, a: np.ndarray) -> pb.NamedArray:
    a = np.ascontiguousarray(a)
    return pb.NamedArray(name=name, dtype=a.dtype.name, shape=list(a.shape),
                         data=a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def in_float32(name: str, a: np.ndarray) -> np.ndarray:
    """`a`, refused (ValueError naming the input) if it holds a finite value beyond float32's range:
    the model computes in float32, where such a value is inf, so a check for finite values made
    before the cast (as_input's) passes a float64 1e300 that the model then computes as inf."""
    if a.dtype.kind == "f" and a.dtype.itemsize > 4:
        with np.errstate(over="ignore", invalid="ignore"):
            beyond = np.isfinite(a) & ~np.isfinite(a.astype(np.float32))
        if beyond.any():
            raise ValueError(f"input {name or 'x'!r} holds values beyond float32's range "
                             f"(|x| > {FLOAT32_MAX:.4g}): not finite in the model, which computes in float32")
    return a


def predict(served: ServedModel, inputs: dict) -> tuple[np.ndarray, int, str]:
    """served.predict, its answer finite or refused (ValueError): finite inputs can still
    overflow in the model (3e38 times a weight), and NaN or Infinity is neither JSON nor a
    prediction."""
    out, version, export_id = served.predict(inputs)
    if out.dtype.kind == "f" and not np.isfinite(out).all():
        raise ValueError("the model's output is not finite for these inputs (it overflowed float32); "
                         "no prediction to give")
    return out, version, export_id


class Predictor(pb_grpc.PredictorServicer):
    def __init__(self, served: ServedModel, metrics: Metrics) -> None:
        self.served, self.metrics = served, metrics

    def Predict(self, request, context):
        started = time.perf_counter()
        try:
            inputs = {a.name: in_float32(a.name, to_array(a)) for a in request.inputs}
            if len(inputs) != len(request.inputs):
                raise ValueError("an input is given twice")
            out, version, export_id = predict(self.served, inputs)
        except ValueError as e:
            self.metrics.requests.labels("grpc", "invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, " ".join(str(e).split()))
        self.metrics.requests.labels("grpc", "ok").inc()
        self.metrics.samples.inc(len(out))
        self.metrics.latency.labels("grpc").observe(time.perf_counter() - started)
        return pb.PredictReply(outputs=to_named("outputs", out), version=version, export_id=export_id)

    def ModelStatus(self, request, context):
        return pb.ModelStatusReply(**self.served.status())


def instances_to_inputs(body: dict, names: list[str]) -> dict:
    """TensorFlow Serving's request body as arrays by input name: "instances" (row format: each a
    value, or an object by input name) or "inputs" (column format: a value, or an object by name)."""
    if not isinstance(body, dict) or ("instances" in body) == ("inputs" in body):
        raise ValueError('the body is a JSON object with "instances" (a list of samples) or "inputs" '
                         "(the inputs' columns)")
    if "inputs" in body:
        cols = body["inputs"]
        cols = cols if isinstance(cols, dict) else {"": cols}
        return {k: _array(v, k) for k, v in cols.items()}
    rows = body["instances"]
    if not isinstance(rows, list) or not rows:
        raise ValueError('"instances" is a list of one or more samples')
    if all(isinstance(r, dict) for r in rows):
        keys = set(rows[0])
        if any(set(r) != keys for r in rows):
            raise ValueError('every instance names the same inputs')
        return {k: _array([r[k] for r in rows], k) for k in rows[0]}
    if any(isinstance(r, dict) for r in rows):
        raise ValueError("instances are all objects (by input name) or all values")
    return {"": _array(rows, "")}


def _array(values, name: str):
    """A JSON column as an array, float32 or int64 (as_input: lists of different lengths, a list
    feature's ids, stay lists, which the model pads)."""
    a = as_input(name, values)
    if isinstance(a, list):
        return a
    return in_float32(name, a).astype(np.float32) if a.dtype.kind == "f" else a.astype(np.int64)


def http_handler(served: ServedModel, metrics: Metrics, token: str | None):
    predict_path = f"/v1/models/{served.name}:predict"
    status_path = f"/v1/models/{served.name}"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_SECONDS             # a connection silent this long is closed (its thread freed)

        def log_message(self, *args):          # quiet: the metrics count the requests
            pass

        def _send(self, code: int, body: dict | str, kind: str = "application/json",
                  headers: tuple = ()) -> None:
            # strict JSON: NaN or Infinity, which no JSON parser need read, is an error here
            data = (body if isinstance(body, str) else json.dumps(body, allow_nan=False)).encode()
            self.send_response(code)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if token is None:
                return True
            given = self.headers.get("Authorization", "")
            ok = given.startswith("Bearer ") and token_matches(given[7:].encode(), token.encode())
            if not ok:
                self._send(401, {"error": "UNAUTHENTICATED: give Authorization: Bearer TOKEN "
                                          "(the server's --auth-token)"})
            return ok

        def do_GET(self):
            if self.path == "/healthz":
                return self._send(200, "ok\n", "text/plain")
            if self.path == "/metrics":
                return self._send(200, generate_latest(metrics.registry).decode(),
                                  "text/plain; version=0.0.4")
            if not self._authorized():
                return None
            if self.path == status_path:
                s = served.status()
                return self._send(200, {"model_version_status": [{
                    "version": str(s["version"]), "state": "AVAILABLE", "export_id": s["export_id"],
                    "deltas_applied": s["deltas_applied"], "deltas_refused": s["deltas_refused"],
                    "last_refusal": s["last_refusal"], "follow_errors": s["follow_errors"],
                    "last_follow_error": s["last_follow_error"],
                    "status": {"error_code": "OK", "error_message": ""}}]})
            return self._send(404, {"error": f"no such path {self.path!r}; POST {predict_path}"})

        def do_POST(self):
            started = time.perf_counter()
            if not self._authorized():
                metrics.requests.labels("http", "unauthenticated").inc()
                self.close_connection = True     # its body is left unread: it is not the next request
                return None
            if self.path != predict_path:
                metrics.requests.labels("http", "not_found").inc()
                self.close_connection = True
                return self._send(404, {"error": f"no such path {self.path!r}; POST {predict_path}"})
            if self.headers.get("Transfer-Encoding"):
                # Chunked bodies are not read: their chunks were taken for the next request
                metrics.requests.labels("http", "invalid").inc()
                self.close_connection = True
                return self._send(411, {"error": "send the body with a Content-Length (Transfer-Encoding "
                                                 f"{self.headers.get('Transfer-Encoding')!r} is not read)"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:
                metrics.requests.labels("http", "invalid").inc()
                self.close_connection = True
                return self._send(400, {"error": "Content-Length must be the body's size in bytes"})
            if length > MAX_BODY:
                metrics.requests.labels("http", "too_large").inc()
                self.close_connection = True
                return self._send(413, {"error": f"the body is {length} bytes; at most {MAX_BODY}"})
            try:
                body = _json(self.rfile.read(length) or b"null")
                out, version, export_id = predict(served, instances_to_inputs(body, served.inputs))
            except ValueError as e:             # json.JSONDecodeError too
                metrics.requests.labels("http", "invalid").inc()
                return self._send(400, {"error": " ".join(str(e).split())})
            metrics.requests.labels("http", "ok").inc()
            metrics.samples.inc(len(out))
            self._send(200, {"predictions": out.tolist(), "version": version, "export_id": export_id})
            metrics.latency.labels("http").observe(time.perf_counter() - started)
            return None

        def _not_allowed(self):
            """A JSON 405 naming the methods the path takes, as the rest of the API answers
            (BaseHTTPRequestHandler's own is a 501 HTML page). The body, if any, is left
            unread, so the connection closes."""
            self.close_connection = True
            if self.path not in (predict_path, status_path, "/healthz", "/metrics"):
                return self._send(404, {"error": f"no such path {self.path!r}; POST {predict_path}"})
            allowed = "POST" if self.path == predict_path else "GET"
            return self._send(405, {"error": f"method {self.command} is not allowed on {self.path!r}; "
                                             f"it takes {allowed}"}, headers=(("Allow", allowed),))

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    return Handler


def _json(data: bytes):
    """The body's JSON; ValueError for one that nests too deep to read (Python's parser recurses
    and raises RecursionError, which left the client with no reply at all)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"the body nests too deep to read (over about {sys.getrecursionlimit()} "
                         "levels of lists and objects); a model's inputs nest a few") from None


class ModelServer:
    """The running server: gRPC and HTTP front ends over one ServedModel, and the follower."""

    def __init__(self, cfg: ServeModelConfig, say=print) -> None:
        check_tls_files(cfg.tls_cert, cfg.tls_key)
        self.cfg, self.say = cfg, say
        self.served = ServedModel.load(cfg.path)
        if cfg.follow:                     # the exporter may not have made it yet
            try:
                os.makedirs(cfg.follow, exist_ok=True)
            except OSError as e:
                raise DataError(f"--follow {cfg.follow}: cannot create it ({e.strerror})") from None
        self.metrics = Metrics(self.served)
        # no SO_REUSEPORT: a second server on a port in use is refused, not handed half the requests
        self.grpc = grpc.server(concurrent.futures.ThreadPoolExecutor(cfg.threads),
                                interceptors=server_interceptors(cfg.auth_token),
                                options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_PredictorServicer_to_server(Predictor(self.served, self.metrics), self.grpc)
        self.health = health.HealthServicer()        # grpc.health.v1, for probes: SERVING once loaded
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        for name in ("", "pserver.v1.Predictor"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        busy = cfg.port and _bind_error("--port", cfg.host, cfg.port)
        if busy:
            raise busy
        try:
            self.port = add_port(self.grpc, f"{cfg.host}:{cfg.port}", cfg.tls_cert, cfg.tls_key)
        except RuntimeError:                 # grpcio >= 1.60: "Failed to bind to address", no reason
            self.port = 0
        if not self.port:
            raise _bind_error("--port", cfg.host, cfg.port) or ConfigError(
                f"--port {cfg.port}: gRPC cannot listen on {cfg.host}:{cfg.port}")
        self.http = None
        if cfg.http_port >= 0:
            try:
                self.http = ThreadingHTTPServer((cfg.host, cfg.http_port),
                                                http_handler(self.served, self.metrics, cfg.auth_token))
            except OSError as e:
                self.grpc.stop(None)          # its port, bound above, is given back
                raise _bind_error("--http-port", cfg.host, cfg.http_port) or ConfigError(
                    f"--http-port {cfg.http_port}: cannot listen on {cfg.host}:{cfg.http_port} "
                    f"({e.strerror or e})") from None
            self.http.daemon_threads = True
            if cfg.tls_cert:                 # HTTPS with the same certificate as gRPC
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
                # the handshake in each request's thread, not in the accepting one: a client that
                # stalls it holds its own thread only
                self.http.socket = context.wrap_socket(self.http.socket, server_side=True,
                                                       do_handshake_on_connect=False)
        self.stop_event = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.server_address[1]

    def start(self) -> ModelServer:
        self.grpc.start()
        if self.http is not None:
            self._spawn(self.http.serve_forever, "http")
        if self.cfg.follow:
            self.served.follow_once(self.cfg.follow, self.say)        # what is there already
        http = f", HTTP on port {self.http_port}" if self.http is not None else ""
        follow = f"; following {self.cfg.follow} every {self.cfg.poll:g} s" if self.cfg.follow else ""
        self.say(f"pserver serve-model: {self.served.name} version {self.served.version} "
                 f"({self.served.export_id}) from {self.cfg.path}: gRPC on port {self.port}{http}{follow}")
        if self.cfg.follow:              # after the line above: the first line printed is always it
            self._spawn(lambda: self.served.follow(self.cfg.follow, self.cfg.poll, self.stop_event, self.say,
                                                   self.cfg.compact_every), "follow")
        return self

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=f"serve-model-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, grace: float = 1.0) -> None:
        self.stop_event.set()
        self.health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.grpc.stop(grace).wait()


def _bind_error(flag: str, host: str, port: int) -> ConfigError | None:
    """Why the server could not listen on host:port, asked of a socket bound as gRPC binds
    (SO_REUSEADDR), as one line naming the flag, which the CLI prints before exiting 2 as for any
    configuration error; None if it can. gRPC says only that it failed, after a log line of its
    own, so its port is asked first."""
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
        return None
    except OSError as e:               # socket.gaierror too: a host that does not resolve
        if e.errno == errno.EADDRINUSE:
            return ConfigError(f"{flag} {port}: address already in use on {host} (another server there?)")
        return ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e})")


def serve_model(cfg: ServeModelConfig) -> int:
    """Run until SIGTERM or SIGINT (pserver serve-model)."""
    import signal
    try:
        server = ModelServer(cfg).start()
    except DataError as e:
        print(f"pserver serve-model: {e}", flush=True)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    s = server.served.status()
    print(f"pserver serve-model: stopped at version {s['version']}: {s['deltas_applied']} delta(s) applied, "
          f"{s['deltas_refused']} refused", flush=True)
    return 0


__all__ = ["ModelServer", "ServeModelConfig", "instances_to_inputs", "serve_model", "to_array", "to_named"]
