"""The generated modules must match protos/pserver.proto: regenerate and compare."""

import pathlib
import subprocess
import sys

from google.protobuf import descriptor_pb2

from pserver._proto import pserver_pb2, pserver_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_modules_are_not_stale(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), str(tmp_path)], check=True)
    # Compare the schema itself (the serialized FileDescriptorProto), not the text, so a
    # different grpcio-tools version that formats code differently is not a false alarm.
    fresh = descriptor_pb2.FileDescriptorProto()
    text = (tmp_path / "pserver_pb2.py").read_text()
    committed = descriptor_pb2.FileDescriptorProto()
    pserver_pb2.DESCRIPTOR.CopyToProto(committed)
    start = text.index("AddSerializedFile(") + len("AddSerializedFile(")
    fresh.ParseFromString(eval(text[start:text.index(")\n", start)]))  # a bytes literal
    assert fresh == committed, "pserver/_proto is stale: run `python protos/generate.py`"
    fresh_grpc = (tmp_path / "pserver_pb2_grpc.py").read_text()
    assert fresh_grpc == pathlib.Path(pserver_pb2_grpc.__file__).read_text(), \
        "pserver/_proto/pserver_pb2_grpc.py is stale: run `python protos/generate.py`"


def test_every_rpc_and_field_is_commented():
    lines = (ROOT / "protos" / "pserver.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "//"))
        if s.startswith("rpc ") or is_field:
            commented = "//" in s or lines[i - 1].strip().startswith("//")
            assert commented, f"protos/pserver.proto line {i + 1} has no comment: {s}"


def test_the_server_registers_every_rpc_of_the_schema(shard_server):
    """The servicer registers handlers by hand (for the tensor streams' codec): every rpc
    of the service must be there, answering rather than UNIMPLEMENTED."""
    import grpc
    addr, _ = shard_server()
    channel = grpc.insecure_channel(addr)
    for method in pserver_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods:
        call = channel.unary_unary(f"/pserver.v1.ParameterServer/{method.name}")
        try:
            call(b"", timeout=5)
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.UNIMPLEMENTED, method.name
