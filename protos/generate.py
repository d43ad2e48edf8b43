"""Regenerate pserver/_proto/ from protos/pserver.proto (the one script that does it).

    python protos/generate.py          # needs grpcio-tools (the `test`/`dev` extra)

The generated modules are committed and never edited by hand; tests/test_proto.py
fails when they no longer match the schema.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "pserver.proto"
OUT = ROOT / "pserver" / "_proto"


def generate(out_dir: pathlib.Path = OUT) -> None:
    import grpc_tools
    from grpc_tools import protoc  # imported here: only developers need grpcio-tools
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")
    # protoc writes a top-level import; the modules live in a package, so make it relative.
    grpc_mod = out_dir / "pserver_pb2_grpc.py"
    text = re.sub(r"^import pserver_pb2 as", "from . import pserver_pb2 as",
                  grpc_mod.read_text(), flags=re.M)
    grpc_mod.write_text(text)


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"generated {OUT.relative_to(ROOT)}/ from {PROTO.relative_to(ROOT)}")
