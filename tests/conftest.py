import os
import pathlib

import pytest

from pserver.config import ServerConfig
from pserver.server.app import create_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The real MNIST files, beside the repo as in CI (../shared); PSERVER_MNIST_DIR overrides.
MNIST_DIR = pathlib.Path(os.environ.get("PSERVER_MNIST_DIR", ROOT.parent / "shared" / "datasets" / "mnist"))


@pytest.fixture
def shard_server():
    """Start real gRPC shard servers on free ports; stopped at the end of the test."""
    started = []

    def start(**cfg):
        cfg = {"port": 0} | cfg
        server, port, shard = create_server(ServerConfig(**cfg))
        started.append((server, shard))
        return f"127.0.0.1:{port}", shard

    yield start
    for server, shard in started:
        shard.close()
        server.stop(0)
