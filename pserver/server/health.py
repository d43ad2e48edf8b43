"""Readiness: the standard gRPC health checking protocol (grpc.health.v1), which Kubernetes
gRPC probes, grpc_health_probe and load balancers call natively.

A shard reports NOT_SERVING from the moment it listens until it can accept workers (its
checkpoint restored), and again once it starts shutting down; SERVING in between. While
not ready, every call but the health check is answered UNAVAILABLE, which workers retry,
so a worker that connects during a long restore waits instead of registering with a shard
whose state is still being loaded.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pserver.wire.security import PUBLIC_METHODS, same_shape

SERVICE = "pserver.v1.ParameterServer"   # the service name a probe may ask about ("" = the server)


class Readiness(grpc.ServerInterceptor):
    """The shard's health servicer and the gate that holds other calls while not ready."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()
        self._ready = threading.Event()
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def serving(self) -> None:
        self._ready.set()
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def stopping(self) -> None:
        """NOT_SERVING for good; watchers are told at once, before the port closes."""
        self._ready.clear()
        self.servicer.enter_graceful_shutdown()

    def _set(self, status) -> None:
        for name in ("", SERVICE):
            self.servicer.set(name, status)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or self._ready.is_set() or details.method.startswith(PUBLIC_METHODS):
            return handler

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is not ready (restoring its checkpoint, "
                                                       "or shutting down)")
        return same_shape(handler, refuse)
