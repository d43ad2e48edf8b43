"""Real processes with a token and TLS: training works, the wrong credentials get one line,
and `pserver launch` never puts its token on a command line."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess

import pytest

from pserver import cli
from pserver.launch import local as launch_module
from pserver.wire.security import TOKEN_ENV
from tests.support.certs import make_certs
from tests.support.processes import LOGREG, one_clear_line, read_json, run, wait_until

pytestmark = pytest.mark.e2e
TOKEN = "e2e-Token_0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_and_token_train_logreg_and_wrong_credentials_fail_in_one_line(procs, tmp_path, certs):
    env = {TOKEN_ENV: TOKEN}
    shard = procs("serve", "--port", "0", "--num-workers", "1", "--optimizer", "sgd", "--lr", "0.1",
                  "--tls-cert", str(certs.cert), "--tls-key", str(certs.key), env=env)
    addr = shard.address()
    assert "(TLS) (token required)" in shard.output and TOKEN not in shard.output
    fast = ("--connect-timeout", "2", "--rpc-deadline", "2")
    no_ca = run("worker", "--ps", addr, *fast, *LOGREG, env=env)
    one_clear_line(no_ca, f"shard 0 at {addr}", "no answer", "--tls-ca")
    wrong_ca = run("worker", "--ps", addr, "--tls-ca", str(certs.other_ca), *fast, *LOGREG, env=env)
    one_clear_line(wrong_ca, f"shard 0 at {addr}", "no answer")
    no_token = run("worker", "--ps", addr, "--tls-ca", str(certs.ca), *fast, *LOGREG, env={TOKEN_ENV: ""})
    one_clear_line(no_token, f"shard 0 at {addr}", "requires a token")
    assert no_token.returncode == 1
    summary = tmp_path / "summary.json"
    chief = procs("worker", "--ps", addr, "--tls-ca", str(certs.ca), *LOGREG, "--summary-json", str(summary),
                  env=env)
    assert chief.wait() == 0, chief.output
    s = read_json(summary)
    assert s["test_accuracy"] >= 0.9 and s["pushes_rejected"] == 0, s
    status = run("status", "--ps", addr, "--tls-ca", str(certs.ca), env=env)
    assert status.returncode == 0 and "version" in status.stdout, status.stderr
    for out in (chief.output, status.stdout, shard.output):
        assert TOKEN not in out
    shard.stop()


def test_unreadable_tls_files_and_bad_tokens_are_one_line_exit_2(tmp_path):
    missing = str(tmp_path / "missing.pem")
    r = run("serve", "--port", "0", "--tls-cert", missing, "--tls-key", missing)
    one_clear_line(r, "--tls-", f"cannot read {missing}")
    assert r.returncode == 2
    r = run("status", "--ps", "127.0.0.1:1", "--tls-ca", missing)
    one_clear_line(r, f"--tls-ca: cannot read {missing}")
    r = run("serve", "--port", "0", "--auth-token", "two words")
    one_clear_line(r, "--auth-token", "printable ASCII")
    assert "two words" not in r.stderr and r.returncode == 2


def test_launch_generates_a_token_and_passes_it_only_in_the_environment(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    started = []
    real_popen = subprocess.Popen

    def spy(argv, *args, **kwargs):
        with open(argv[-1], "rb") as f:         # the child's config file (pserver.launch.child)
            config = f.read()
        started.append((list(argv), dict(kwargs.get("env") or {}), config))
        return real_popen(argv, *args, **kwargs)

    monkeypatch.setattr(launch_module.subprocess, "Popen", spy)
    summary = tmp_path / "s.json"
    code = cli.main(["launch", "--ps", "1", "--workers", "2", *LOGREG, "--epochs", "1",
                     "--optimizer", "sgd", "--lr", "0.1", "--summary-json", str(summary)])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err
    assert len(started) == 3                        # one shard, two workers
    tokens = {env.get(TOKEN_ENV) for _, env, _ in started}
    assert len(tokens) == 1
    token = tokens.pop()
    assert token and len(token) >= 40               # secrets.token_urlsafe(32): 43 characters
    for argv, _, config in started:
        assert not any(token in a for a in argv) and "--auth-token" not in argv
        assert token.encode() not in config and b"auth_token" in config   # the field, left empty
    assert token not in out.out + out.err
    assert "(token required)" in out.out
    assert read_json(summary)["test_accuracy"] >= 0.85


def test_launch_prints_a_status_command_that_works_and_its_token_file_dies_with_the_cluster(procs, tmp_path):
    """`pserver status` on a launched cluster failed with an authentication error: launch made
    a random token and never said where it was."""
    env = {TOKEN_ENV: "", "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    launch = procs("launch", "--ps", "2", "--workers", "1", "--model", "logreg", "--samples", "20000",
                   "--features", "20", "--batch-size", "16", "--epochs", "1", "--delay", "fixed:0.01",
                   env=env)
    assert wait_until(lambda: "watch it from another terminal with: pserver status" in launch.output, 60), \
        launch.output
    line = next(ln for ln in launch.lines if "watch it from another terminal" in ln)
    command = shlex.split(line.split("with: pserver ", 1)[1])
    path = command[command.index("--token-file") + 1]
    assert path.startswith(str(tmp_path / "run" / "pserver")) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    shown = run(*command, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "cluster:" in shown.stdout and "settings differ" not in shown.stdout
    refused = run(*command[:command.index("--token-file")], env=env)       # the same without the file
    assert refused.returncode != 0 and "token" in refused.stderr
    assert launch.wait(180) == 0, launch.output
    assert not os.path.exists(path)                       # the token dies with the cluster
    assert sum("watch it from another terminal" in ln for ln in launch.lines) == 1
