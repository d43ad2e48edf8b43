"""The launch interface (pserver.launch): the per-process configs a backend starts from the
cluster's configs, the checks made before anything starts, and the child's entry point."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

import pserver
from pserver.config import ServerConfig, WorkerConfig
from pserver.errors import ConfigError
from pserver.launch import LaunchConfig, launch
from pserver.launch.base import shard_config, stats_path, worker_config
from tests.support.certs import make_certs


def test_each_shard_gets_its_index_a_free_port_and_no_token():
    cfg = LaunchConfig(num_shards=3, num_workers=4, metrics_port=9100)
    server = ServerConfig(num_shards=3, mode="backup", backup_workers=1, lr=0.2, auth_token="secret-token")
    shards = [shard_config(cfg, server, j, "127.0.0.1") for j in range(3)]
    assert [(s.shard, s.port, s.num_shards, s.num_workers) for s in shards] == [(j, 0, 3, 4)
                                                                               for j in range(3)]
    assert [s.metrics_port for s in shards] == [9100, 9101, 9102]   # shards first
    assert all(s.auth_token is None and (s.mode, s.backup_workers, s.lr) == ("backup", 1, 0.2)
               for s in shards)


def test_each_worker_gets_its_rank_the_addresses_its_delay_and_the_chief_the_summary(tmp_path):
    cfg = LaunchConfig(num_shards=2, num_workers=3, delay="fixed:0.01", delay_for=((2, "fixed:0.5"),),
                       metrics_port=0)
    worker = WorkerConfig(num_workers=3, model="logreg", epochs=2, auth_token="secret-token")
    chief = str(tmp_path / "chief.json")
    addresses = ("127.0.0.1:1", "127.0.0.1:2")
    got = [worker_config(cfg, worker, i, addresses, chief, f"cuda:{i}") for i in range(3)]
    assert [(w.rank, w.ps, w.num_workers, w.device) for w in got] == [(i, addresses, 3, f"cuda:{i}")
                                                                       for i in range(3)]
    assert [w.summary_json for w in got] == [chief, None, None]
    assert [w.stats_json for w in got] == [stats_path(chief, i) for i in range(3)]
    assert [w.delay for w in got] == ["fixed:0.01", "fixed:0.01", "fixed:0.5"]
    assert [w.metrics_port for w in got] == [0, 0, 0]               # 0: each on a free port
    assert all(w.auth_token is None and (w.model, w.epochs) == ("logreg", 2) for w in got)


def test_without_a_metrics_port_no_process_serves_metrics():
    cfg = LaunchConfig(num_shards=1, num_workers=1)
    assert shard_config(cfg, ServerConfig(), 0, "127.0.0.1").metrics_port is None


@pytest.mark.parametrize("kw, match", [
    (dict(num_shards=0), "--ps: launch needs 1 or more, got 0"),
    (dict(num_workers=0), "--workers: launch needs 1 or more, got 0"),
    (dict(backend="mpi"), "--backend: 'mpi' is not one of local, ray"),
    (dict(address="auto"), "--address: 'auto' is a Ray cluster's address; give it with --backend ray"),
])
def test_a_launch_config_that_cannot_run_is_refused(kw, match):
    with pytest.raises(ConfigError, match="^" + match):
        LaunchConfig(**kw)


def test_launch_checks_the_tls_pair_and_the_summary_before_starting_anything(tmp_path):
    ca = make_certs(tmp_path).ca
    cfg = LaunchConfig(num_shards=1, num_workers=1)
    with pytest.raises(ConfigError, match="^--tls-ca: launch needs --tls-cert/--tls-key and --tls-ca"):
        launch(cfg, ServerConfig(), WorkerConfig(num_workers=1, tls_ca=str(ca)))
    bad = LaunchConfig(num_shards=1, num_workers=1, summary_json=str(tmp_path / "no" / "such" / "s.json"))
    with pytest.raises(ConfigError, match="^--summary-json"):
        launch(bad, ServerConfig(), WorkerConfig(num_workers=1))


@pytest.mark.parametrize("option", ["bogus", "rank", "port", "host", "num_shards", "summary_json"])
def test_launch_cluster_refuses_what_is_not_a_launch_option(option):
    """rank, port, ...: fields of a config that launch sets per process itself."""
    with pytest.raises(ConfigError, match=f"^{option}: not a launch option"):
        pserver.launch_cluster(**{option: 1})


def test_the_child_entry_point_says_how_to_call_it():
    r = subprocess.run([sys.executable, "-m", "pserver.launch.child", "dance", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "usage: python -m pserver.launch.child serve|worker CONFIG_FILE" in r.stderr


def test_a_child_runs_its_role_on_the_config_file_with_the_token_of_its_environment(tmp_path):
    """The config file holds no token (launch strips it): the child takes PSERVER_AUTH_TOKEN.
    With it, the worker trains against a shard that requires it; without it, it is refused."""
    with pserver.serve(num_workers=1, auth_token="token-from-the-environment") as shard:
        path = tmp_path / "worker0.config"
        cfg = WorkerConfig(ps=(shard.address,), num_workers=1, model="logreg", samples=400, features=4,
                           classes=2, batch_size=16, epochs=1, connect_timeout=10)
        path.write_bytes(pickle.dumps(cfg))
        argv = [sys.executable, "-m", "pserver.launch.child", "worker", str(path)]
        env = {k: v for k, v in os.environ.items() if k != "PSERVER_AUTH_TOKEN"}
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode != 0 and "token" in refused.stderr.splitlines()[-1], refused.stderr
        env["PSERVER_AUTH_TOKEN"] = "token-from-the-environment"
        ok = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert shard.status()["counters"]["updates_applied"] > 0


def test_prestarted_shards_wait_for_their_config_then_listen_with_it(tmp_path):
    """`pserver run` starts its shards with the workers, before their settings exist (--wait):
    each imports pserver, stays silent and alive without a config, then reads the config the
    launcher writes at the workers' fit and listens with those settings. Catches: a waiting child
    that exits on the missing file, reads a half-written one, or starts with no settings."""
    import time

    from pserver.launch.local import configure_shards, prestart_shards, stop_all
    from pserver.observe.progress import Relay

    lines = []

    class Keep(Relay):
        def line(self, role, text):
            lines.append((role, text))

    tmpdir = str(tmp_path)
    os.chmod(tmpdir, 0o700)
    shards = prestart_shards(2, dict(os.environ), tmpdir, Keep())
    try:
        time.sleep(3.0)                                # long enough to import and start waiting
        assert all(p.popen.poll() is None and p.port is None for p in shards) and lines == []
        server = ServerConfig(num_shards=2, optimizer="momentum", lr=0.03)
        configure_shards(shards, LaunchConfig(num_shards=2, num_workers=1), server, tmpdir)
        assert all(p.port for p in shards) and len({p.port for p in shards}) == 2
        said = "".join(text for _, text in lines)
        assert "shard 0/2" in said and "shard 1/2" in said and "optimizer=momentum lr=0.03" in said
    finally:
        stop_all(shards)
    assert sorted(os.listdir(tmpdir)) == ["ps0.config", "ps1.config"]    # renamed into place
    assert all(os.stat(os.path.join(tmpdir, f)).st_mode & 0o777 == 0o600 for f in os.listdir(tmpdir))


@pytest.mark.parametrize("call, module", [
    ("from pserver.launch.roles import preload; preload('serve')", "pserver.server.app"),
    ("import pserver.api; pserver.api.preload()", "pserver.worker.loop"),
])
def test_a_process_that_waits_loads_its_role_and_numba_first(call, module):
    """What a prestarted shard does while it waits for its config (roles.preload), and a Keras fit
    while its shards start (api.preload): its role's modules imported and numba's CPU target set
    up, which a process's first kernel call otherwise does (0.12 s measured on a 2-core Xeon, then
    on the path to the first step). Catches a preload that leaves either for later."""
    # numba.np.arrayobj: among the implementations numba's CPU target loads at its first kernel call
    code = f"import sys; {call}; print({module!r} in sys.modules, 'numba.np.arrayobj' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]
    bare = subprocess.run([sys.executable, "-c", "import sys, pserver.api; "
                           "print('numba.np.arrayobj' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert bare.stdout.split() == ["False"], "importing pserver sets numba up: the test sees nothing"


def test_the_child_refuses_an_argument_it_does_not_know(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pserver.launch.child", "serve", str(tmp_path / "c"), "--wiat"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: python -m pserver.launch.child serve|worker CONFIG_FILE [--wait]" \
        in r.stderr
