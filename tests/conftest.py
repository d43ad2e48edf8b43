import contextlib
import functools
import hashlib
import http.server
import os
import pathlib
import tempfile
import threading
import time

import grpc
import pytest

from pserver.config import ServerConfig
from pserver.data import load_dataset
from pserver.data.mnist import MNIST_DIR_ENV, MNIST_FILES
from pserver.data.mnist import mnist_dir as find_mnist_dir
from pserver.errors import DataError
from pserver.server.app import create_server
from tests.support import simulator
from tests.support.clients import TOKEN, worker
from tests.support.processes import missing
from tests.support.shards import load_kernels
from tests.support.stuck import StuckWatch

# MNIST_DIR_ENV: the tests' (and every pserver command's) MNIST directory; .ci/run sets it.


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
        _stuck.started(nodeid, trace)


_stuck = StuckWatch()


SIMULATOR_RUNS = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    """The `cuda_sim` tests last: they collect the simulator runs started when collection ended."""
    items.sort(key=lambda item: item.get_closest_marker("cuda_sim") is not None)


def pytest_collection_finish(session):
    """Start the simulator modules now if any `cuda_sim` test is selected (tests/support/simulator.py),
    so that they run beside the suite."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("cuda_sim") for item in session.items):
        session.config.stash[SIMULATOR_RUNS] = simulator.start()


def pytest_sessionfinish(session):
    for run in session.config.stash.get(SIMULATOR_RUNS, {}).values():   # a run cut short (-x)
        run.stop()


@pytest.fixture(scope="session")
def simulator_runs(request):
    return request.config.stash[SIMULATOR_RUNS]


@pytest.fixture(scope="session", autouse=True)
def grpc_core_stays_up():
    """One idle channel for the whole session, never closed. Each gRPC channel and server holds a
    reference on gRPC core, which shuts down (grpc_shutdown, waiting for its threads) whenever the
    last one goes; that teardown can deadlock on the GIL (grpc/grpc#42247), at whatever test drops
    the last reference. Held here, the core starts once and ends with the pytest process."""
    yield grpc.insecure_channel("127.0.0.1:9")   # never connects: no call is made on it


def _pserver_reads(name: str) -> bool:
    """The variables that change what pserver does (libraries' own, Ray's say, are theirs)."""
    return name.startswith("PSERVER_") or name == "TF_CONFIG"


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """A test that leaves a variable pserver reads changed in os.environ fails, and the change is
    undone: left behind, it reaches every later test (keras.utils.set_random_seed's seed once made
    a test of another module depend on the order the modules ran in)."""
    before = {k: v for k, v in os.environ.items() if _pserver_reads(k)}
    yield
    after = {k: v for k, v in os.environ.items() if _pserver_reads(k)}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        pytest.fail(f"the test left os.environ changed: {', '.join(changed)} (use monkeypatch)")


def _original_mnist_gz(directory: str) -> list[str]:
    """The names of the four MNIST files whose original .gz (size and sha256) is not in directory."""
    wrong = []
    for name, (size, sha256) in MNIST_FILES.items():
        path = os.path.join(directory, name + ".gz")
        if not (os.path.isfile(path) and os.path.getsize(path) == size
                and hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest() == sha256):
            wrong.append(name)
    return wrong


@pytest.fixture(scope="session")
def mnist_dir() -> pathlib.Path:
    """A directory with the four original MNIST .gz files, found as a user's run finds them:
    $PSERVER_MNIST_DIR (the tests' --data-dir), else the user's cache (data.mnist_dir), where
    pserver's loader downloads what is missing and keeps it only if its checksum matches. Without
    them (no files, no network) the tests that need them go through missing(). Tests that take
    this fixture are marked `mnist` (pytest -m 'not mnist' leaves them out)."""
    where, _ = find_mnist_dir()
    if _original_mnist_gz(where):
        with contextlib.suppress(DataError):
            load_dataset("mnist", data_dir=where)      # fetches the files that are not there
        if wrong := _original_mnist_gz(where):
            missing("the MNIST tests",
                    f"MNIST is not in {where} (no original {wrong[0]}.gz) and could not be downloaded: "
                    f"set {MNIST_DIR_ENV} to a directory holding the four MNIST .gz files")
    return pathlib.Path(where)


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
def two_sync_workers(shard_server):
    """Start (shard, worker 0, worker 1): a sync shard (SGD, lr 1) that worker 0 initialized."""
    clients = []

    def start(**cfg) -> tuple:
        addr, shard = shard_server(auth_token=TOKEN, optimizer="sgd", lr=1.0, mode="sync", **cfg)
        clients.extend([worker(addr, rank=0, num_workers=2), worker(addr, rank=1, num_workers=2, init=False)])
        return shard, *clients

    yield start
    for c in clients:
        c.close()


@pytest.fixture(scope="module")
def kernels_loaded():
    """The numba kernels loaded once, before any test whose short --step-timeout starts
    counting while the first push loads them (pytestmark = usefixtures("kernels_loaded"))."""
    load_kernels()


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
