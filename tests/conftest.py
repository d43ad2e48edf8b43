import functools
import http.server
import os
import pathlib
import threading
import time

import pytest

from pserver.config import ServerConfig
from pserver.server.app import create_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The real MNIST files (the four IDX files): $PSERVER_MNIST_DIR, else shared/datasets/mnist beside
# the checkout, where CI keeps them.
MNIST_DIR = pathlib.Path(os.environ.get("PSERVER_MNIST_DIR", ROOT.parent / "shared" / "datasets" / "mnist"))


def pytest_runtest_logstart(nodeid, location):
    """With $PSERVER_TEST_TRACE set (.ci/run sets it), each test's id and start time are appended
    there first: a run cut off by CI's time limit still says which test it was in."""
    trace = os.environ.get("PSERVER_TEST_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {nodeid}\n")


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


@pytest.fixture
def mirror(tmp_path_factory):
    """A real HTTP server on port 0 serving a directory; yields (directory, base URL)."""
    root = tmp_path_factory.mktemp("mirror")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/mnist"
    server.shutdown()
    server.server_close()
