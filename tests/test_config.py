import json

import pytest

from pserver.config import ServerConfig, WorkerConfig, notice_every, parse_address, parse_tf_config
from pserver.errors import ConfigError


def test_tf_config_chief_is_rank_zero_and_workers_follow():
    env = json.dumps({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1"],
                                  "ps": ["p0:2222", "p1:3333"]},
                      "task": {"type": "worker", "index": 1}})
    c = parse_tf_config(env)
    assert c.ps == ("p0:2222", "p1:3333")
    assert c.workers == ("c:2222", "w0:2222", "w1:2222")     # default port 2222, as in TF
    assert c.rank == 2


def test_tf_config_without_chief():
    c = parse_tf_config(json.dumps({"cluster": {"worker": ["a:1", "b:2"], "ps": ["p:3"]},
                                    "task": {"type": "worker", "index": 0}}))
    assert c.rank == 0 and not c.has_chief


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ('{"cluster": {"ps": "p:1"}}', "cluster.ps"),
    ('{"cluster": {"ps": ["p:1"]}, "task": {"type": "ps", "index": 3}}', "not in cluster.ps"),
    ('{"cluster": {"ps": ["p:x"]}}', "host:port"),
    ('{"cluster": {}, "task": {"type": "boss"}}', "task.type"),
    ('[1, 2]', "expected an object"),
])
def test_malformed_tf_config_is_one_clear_error(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_tf_config(text)


def test_unset_tf_config_is_none():
    assert parse_tf_config(None) is None and parse_tf_config("") is None


def test_addresses():
    assert parse_address("h") == "h:2222"
    assert parse_address(" h:99 ") == "h:99"
    with pytest.raises(ConfigError, match="--ps"):
        parse_address("h:0")


@pytest.mark.parametrize("kw, flag", [
    (dict(mode="bsp"), "--mode"), (dict(shard=2, num_shards=2), "--shard"),
    (dict(port=70000), "--port"), (dict(step_timeout=0), "--step-timeout"),
    (dict(table_threads=0), "--table-threads"), (dict(table_threads=65), "--table-threads"),
    (dict(table_threads=2.0), "--table-threads")])
def test_server_config_validation(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**kw)


@pytest.mark.parametrize("kw, flag", [
    (dict(rank=3, num_workers=3), "--rank"), (dict(batch_size=0), "--batch-size"),
    (dict(epochs=0), "--epochs"), (dict(ps=()), "--ps"),
    (dict(row_params="initial_accumulator"), "--row-params: 'initial_accumulator' is not KEY=VALUE"),
    (dict(row_params="eps=1,eps=2"), "--row-params: eps is given twice"),
    (dict(row_params="eps=small"), "--row-params: eps='small' is not a number"),
    (dict(row_params="eps=1=2"), "--row-params: eps='1=2' is not a number"),
    (dict(row_params="beta=1"), "--row-params: adagrad takes no parameter 'beta'"),
    (dict(row_optimizer="ftrl", row_params="l2=-1"), "--row-params: ftrl l2 must be a finite number >= 0"),
    (dict(row_lr=0.0), "--row-params: adagrad lr must be")])
def test_worker_config_validation(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        WorkerConfig(**kw)


def test_row_params_reach_the_models_tables():
    from pserver.build import table_options
    cfg = WorkerConfig(model="lr", row_optimizer="ftrl", row_lr=0.1, row_params=" l2=4,, beta=0.5 ,")
    assert table_options(cfg)["optimizer_params"] == {"l2": 4.0, "beta": 0.5}
    assert table_options(WorkerConfig(model="lr"))["optimizer_params"] == {}


def test_each_rank_gets_its_delay():
    from pserver.launch.base import LaunchConfig, parse_delay_for, worker_delay
    cfg = LaunchConfig(num_workers=4, delay="fixed:0.02", delay_for=parse_delay_for(["0,3=fixed:0.08"], 4))
    assert [worker_delay(cfg, r) for r in range(4)] == ["fixed:0.08", "fixed:0.02", "fixed:0.02",
                                                        "fixed:0.08"]
    only = LaunchConfig(num_workers=3, delay="fixed:0.1", delay_ranks=(1,))
    assert [worker_delay(only, r) for r in range(3)] == [None, "fixed:0.1", None]


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "ten", ""])
def test_a_bad_notice_interval_is_one_clear_error(monkeypatch, raw):
    monkeypatch.setenv("PSERVER_NOTICE_EVERY", raw)
    with pytest.raises(ConfigError, match=r"^\$PSERVER_NOTICE_EVERY=.*must be a positive number of seconds$"):
        notice_every()


def test_the_notice_interval_is_ten_seconds_or_the_environments(monkeypatch):
    monkeypatch.delenv("PSERVER_NOTICE_EVERY", raising=False)
    assert notice_every() == 10.0
    monkeypatch.setenv("PSERVER_NOTICE_EVERY", "2.5")
    assert notice_every() == 2.5
