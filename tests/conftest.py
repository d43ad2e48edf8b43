import functools
import http.server
import os
import pathlib
import tempfile
import threading
import time

import grpc
import pytest

from pserver.config import ServerConfig
from pserver.server.app import create_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The real MNIST files (the four IDX files): $PSERVER_MNIST_DIR, else shared/datasets/mnist beside
# the checkout, where CI keeps them.
MNIST_DIR = pathlib.Path(os.environ.get("PSERVER_MNIST_DIR", ROOT.parent / "shared" / "datasets" / "mnist"))


# Workers keep their session files under $XDG_STATE_HOME (pserver/worker/sessions.py); the tests'
# workers, and the processes they start, keep theirs in a directory of the run's own.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="pserver-tests-state-")


def pytest_runtest_logstart(nodeid, location):
    """With $PSERVER_TEST_TRACE set (.ci/run sets it), each test's id and start time are appended
    there first: a run cut off by CI's time limit still says which test it was in."""
    trace = os.environ.get("PSERVER_TEST_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {nodeid}\n")


@pytest.fixture(scope="session", autouse=True)
def grpc_core_stays_up():
    """One idle channel for the whole session, never closed. Each gRPC channel and server holds a
    reference on gRPC core, which shuts down (grpc_shutdown, waiting for its threads) whenever the
    last one goes; that teardown can deadlock on the GIL (grpc/grpc#42247), at whatever test drops
    the last reference. Held here, the core starts once and ends with the pytest process."""
    yield grpc.insecure_channel("127.0.0.1:9")   # never connects: no call is made on it


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
