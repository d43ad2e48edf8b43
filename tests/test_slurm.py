"""Slurm's environment read as TensorFlow's SlurmClusterResolver reads it: host lists,
tasks per node, and each task's role, host and port."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver import cli
from pserver.errors import ConfigError
from pserver.launch.slurm import expand_hostlist, expand_tasks_per_node, slurm_task


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[01-03,7],gpu1", ["node01", "node02", "node03", "node7", "gpu1"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("c[1-2]-ib,login", ["c1-ib", "c2-ib", "login"]),
    ("a,b[007-008]", ["a", "b007", "b008"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[3-1]", "n[1-2", "n1-2]", "n[a]", "", "a,,b", "n[[1]]"])
def test_a_host_list_that_is_not_one_names_the_variable(text):
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST"):
        expand_hostlist(text)


@given(st.text("abcxyz-", min_size=1, max_size=5),
       st.lists(st.tuples(st.integers(0, 500), st.integers(0, 20)), min_size=1, max_size=6),
       st.integers(1, 4))
def test_any_ranges_expand_to_every_number_zero_padded(prefix, ranges, width):
    spec = ",".join(f"{a:0{width}d}-{a + n:0{width}d}" for a, n in ranges)
    expected = [f"{prefix}{i:0{width}d}" for a, n in ranges for i in range(a, a + n + 1)]
    assert expand_hostlist(f"{prefix}[{spec}]") == expected


def test_tasks_per_node_repeat_counts():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("5") == [5]
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE.*'2x3'"):
        expand_tasks_per_node("2x3")


def step(procid: int, **extra) -> dict:
    """Slurm's variables for task `procid` of a 5-task step on n1 (3 tasks) and n2 (2)."""
    local = procid if procid < 3 else procid - 3
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_LOCALID": str(local),
            "SLURMD_NODENAME": "n1" if procid < 3 else "n2"} | extra


def test_the_first_s_tasks_serve_and_the_others_are_workers_on_ports_by_local_index():
    tasks = [slurm_task(step(i), num_shards=2, base_port=8888) for i in range(5)]
    assert [(t.is_shard, t.index) for t in tasks] == [(True, 0), (True, 1), (False, 0), (False, 1),
                                                      (False, 2)]
    assert all(t.shards == ("n1:8888", "n1:8889") for t in tasks)
    assert [(t.hosts[t.procid], t.ports[t.procid]) for t in tasks] == [
        ("n1", 8888), ("n1", 8889), ("n1", 8890), ("n2", 8888), ("n2", 8889)]
    assert tasks[3].num_workers == 3


@pytest.mark.parametrize("env, num_shards, message", [
    (step(3, SLURM_LOCALID="1"), 2, "--distribution=block"),          # a cyclic step
    (step(4, SLURMD_NODENAME="n1"), 2, "--distribution=block"),
    (step(0, SLURM_STEP_TASKS_PER_NODE="3,3"), 2, "does not place 5 tasks"),
    (step(0), 5, "--ps: 5 shard"),
    ({k: v for k, v in step(0).items() if k != "SLURM_PROCID"}, 1, "SLURM_PROCID: not set"),
    (step(0, SLURM_PROCID="x"), 1, "SLURM_PROCID: 'x' is not an integer"),
])
def test_an_environment_that_does_not_fit_is_one_clear_error(env, num_shards, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        slurm_task(env, num_shards=num_shards, base_port=8888)


def test_pserver_slurm_refuses_to_run_without_a_token(monkeypatch, capsys):
    for key, value in step(0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PSERVER_AUTH_TOKEN", raising=False)
    assert cli.main(["slurm", "--ps", "2"]) == 2
    assert "PSERVER_AUTH_TOKEN: pserver slurm needs a token" in capsys.readouterr().err
