import pathlib

import pytest

from pserver.config import ServerConfig
from pserver.server.app import create_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
MNIST_DIR = ROOT.parent / "shared" / "datasets" / "mnist"


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
