"""The gRPC health checking protocol (grpc.health.v1) against a real `pserver serve`: what a
Kubernetes gRPC probe sees, with no token, while the rest of the shard still needs one."""

from __future__ import annotations

import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.config import ServerConfig
from pserver.errors import ConfigError
from pserver.server.app import create_server
from pserver.server.health import SERVICE
from pserver.wire.security import TOKEN_ENV
from tests.support.processes import free_port

pytestmark = pytest.mark.e2e
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(stub, service: str):
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_a_running_shard_is_serving_without_a_token_and_not_serving_once_sigterm_came(procs):
    shard = procs("serve", "--port", "0", "--num-workers", "1", env={TOKEN_ENV: "health-Token_0123456789"})
    with grpc.insecure_channel(shard.address()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert check(health, "") == SERVING and check(health, SERVICE) == SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(health, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as refused:   # the token still guards everything else
            pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
        assert next(watch).status == SERVING
        shard.popen.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING       # told before the port closes
    assert shard.wait(30) == 128 + signal.SIGTERM, shard.output


def test_a_shard_that_is_not_ready_answers_unavailable_which_workers_retry(shard_server):
    addr, shard = shard_server(num_workers=1)
    with grpc.insecure_channel(addr) as channel:
        health, ps = health_pb2_grpc.HealthStub(channel), pb_grpc.ParameterServerStub(channel)
        assert check(health, SERVICE) == SERVING
        assert ps.Status(pb.StatusRequest(), timeout=5).shard == 0
        shard.readiness.stopping()
        assert check(health, SERVICE) == NOT_SERVING and check(health, "") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as held:
            ps.Status(pb.StatusRequest(), timeout=5)
        assert held.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in held.value.details()


def test_a_restore_that_fails_closes_the_port_it_opened(tmp_path):
    (tmp_path / "ckpt").write_text("a file, not a directory")
    port = free_port()
    with pytest.raises(ConfigError, match="--restore"):
        create_server(ServerConfig(port=port, restore=str(tmp_path / "ckpt")))
    with socket.socket() as again:                    # free again: the server was stopped
        again.bind(("127.0.0.1", port))
