"""Modules generated from protos/pserver.proto by protos/generate.py. Do not edit."""

from . import pserver_pb2, pserver_pb2_grpc

__all__ = ["pserver_pb2", "pserver_pb2_grpc"]
