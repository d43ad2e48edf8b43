"""The dense rmsprop, adamw and adagrad beyond their kernels: flags and ServerConfig with each
optimizer's own defaults, the settings a shard tells its workers, checkpoints of their state,
pserver.keras's RMSprop / AdamW / Adagrad objects, and short training runs whose loss falls."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import pserver.keras as keras
from pserver import cli
from pserver._proto import pserver_pb2 as pb
from pserver.config import ServerConfig
from pserver.errors import ConfigError, ModelFileError
from pserver.keras import layers
from pserver.models.layout import Layout
from pserver.observe.status import settings_of
from pserver.server.shard import Shard
from tests.support.pushes import push_all
from tests.support.shards import shard_state, trained_shard

KERAS_RULES = ("rmsprop", "adamw", "adagrad")


# -- flags and ServerConfig ------------------------------------------------------------------

def told(cfg: ServerConfig) -> dict:
    """What a shard with this config tells its workers at Register, through the wire message."""
    return settings_of(pb.TrainingSettings(**cfg.training_settings(1)))


def test_unset_shared_flags_take_the_optimizer_s_default():
    """Catches: --momentum's 0.9 (momentum's) running rmsprop with momentum, adam's eps 1e-8
    for the Keras rules, adamw without its weight decay; and the older rules changed."""
    assert {k: told(ServerConfig(optimizer="rmsprop"))[k] for k in ("momentum", "eps", "rho", "centered")} \
        == {"momentum": 0.0, "eps": 1e-7, "rho": 0.9, "centered": False}
    assert {k: told(ServerConfig(optimizer="adamw"))[k] for k in ("eps", "weight_decay")} \
        == {"eps": 1e-7, "weight_decay": 0.004}
    assert {k: told(ServerConfig(optimizer="adagrad"))[k] for k in ("eps", "initial_accumulator")} \
        == {"eps": 1e-7, "initial_accumulator": 0.1}
    old = told(ServerConfig(optimizer="adam"))
    assert (old["momentum"], old["eps"], old["weight_decay"]) == (0.9, 1e-8, 0.0)
    # `pserver run` builds its shards' config by replacing the optimizer: the defaults follow it
    run = dataclasses.replace(ServerConfig(), optimizer="adamw", lr=1e-3)
    assert told(run)["weight_decay"] == 0.004
    assert ServerConfig(optimizer="rmsprop") == ServerConfig(optimizer="rmsprop")


def test_flags_reach_the_config_and_are_checked():
    parse = cli.build_parser().parse_args
    cfg = cli.server_config(parse(["serve", "--optimizer", "rmsprop", "--rho", "0.8", "--centered",
                                   "--momentum", "0.5", "--eps", "1e-6"]))
    assert (cfg.rho, cfg.centered, cfg.momentum, cfg.eps) == (0.8, True, 0.5, 1e-6)
    cfg = cli.server_config(parse(["serve", "--optimizer", "adagrad", "--initial-accumulator", "0"]))
    assert told(cfg)["initial_accumulator"] == 0.0
    with pytest.raises(ConfigError, match=r"^--rho: must be in \[0, 1\), got 1.5"):
        cli.server_config(parse(["serve", "--optimizer", "rmsprop", "--rho", "1.5"]))
    with pytest.raises(ConfigError, match="^--eps: must be a number > 0"):
        ServerConfig(optimizer="adagrad", eps=-1e-7)


def test_run_takes_the_new_settings_from_compile_not_flags():
    """`pserver run`'s shards get the optimizer from the script: the new flags are not run's."""
    assert {"--rho", "--centered", "--initial-accumulator"} <= cli.RUN_FROM_COMPILE


# -- checkpoints -----------------------------------------------------------------------------

LAYOUT = Layout.of([("w", (50,))])


@pytest.mark.parametrize("optimizer, cfg, names", [
    ("rmsprop", dict(momentum=0.5, centered=True), ["average_gradient", "momentum", "velocity"]),
    ("adamw", {}, ["m", "v"]),
    ("adagrad", {}, ["accumulator"]),
])
def test_checkpoint_round_trip_keeps_the_state(tmp_path, optimizer, cfg, names):
    """Catches: a state array not checkpointed (adagrad's accumulator back at 0.1, rmsprop's
    momentum at 0): the step after the restore would differ."""
    shard = trained_shard(tmp_path, steps=3, optimizer=optimizer, **cfg)
    assert sorted(shard.store.optimizer.state) == names
    shard.checkpoint(0)
    restored = Shard(ServerConfig(num_workers=2, optimizer=optimizer, lr=0.01, restore=str(tmp_path), **cfg))
    assert shard_state(restored) == shard_state(shard)
    for r in range(2):
        restored.register(r, 2, 0, 1, LAYOUT)
    for s in (shard, restored):
        for r in range(2):
            push_all([s], r, [3], np.full(50, 0.5, np.float32))
    assert shard_state(restored) == shard_state(shard)


def test_a_checkpoint_of_one_optimizer_is_refused_by_another(tmp_path):
    """adamw and adam keep the same arrays (m, v): only the name tells them apart."""
    trained_shard(tmp_path, steps=3, optimizer="adamw").checkpoint(0)
    with pytest.raises(ConfigError, match="--optimizer adamw"):
        Shard(ServerConfig(optimizer="adam", restore=str(tmp_path)))
    with pytest.raises(ConfigError, match="--optimizer adamw"):
        Shard(ServerConfig(optimizer="rmsprop", restore=str(tmp_path)))


# -- pserver.keras ---------------------------------------------------------------------------

def test_keras_objects_have_keras_s_names_and_defaults():
    assert keras.optimizers.RMSprop().settings() == {"optimizer": "rmsprop", "lr": 0.001, "rho": 0.9,
                                                     "momentum": 0.0, "eps": 1e-7, "centered": False}
    assert keras.optimizers.AdamW().settings() == {"optimizer": "adamw", "lr": 0.001, "beta1": 0.9,
                                                   "beta2": 0.999, "eps": 1e-7, "weight_decay": 0.004}
    assert keras.optimizers.Adagrad().settings() == {"optimizer": "adagrad", "lr": 0.001,
                                                     "initial_accumulator": 0.1, "eps": 1e-7}
    assert keras.optimizers.RMSprop(learning_rate=0.01, rho=0.8, momentum=0.5, epsilon=1e-6,
                                    centered=True).settings()["centered"] is True
    assert keras.optimizers.AdamW(weight_decay=0.1).weight_decay == 0.1
    assert keras.optimizers.Adagrad(initial_accumulator_value=0.5).settings()["initial_accumulator"] == 0.5
    for name, cls in (("rmsprop", "RMSprop"), ("adamw", "AdamW"), ("adagrad", "Adagrad")):
        assert type(keras.optimizers.get(name)).__name__ == cls
    model = keras.Sequential([keras.Input(shape=(3,)), layers.Dense(2)])
    model.compile(loss="mse")                          # Keras's default optimizer: rmsprop
    assert model.optimizer.settings() == keras.optimizers.RMSprop().settings()


@pytest.mark.parametrize("opt", [keras.optimizers.RMSprop(0.01, 0.8, 0.5, 1e-6, True),
                                 keras.optimizers.AdamW(0.01, 0.1), keras.optimizers.Adagrad(0.1, 0.5)],
                         ids=KERAS_RULES)
def test_keras_settings_are_shard_settings_and_round_trip(opt):
    """Catches: a setting a shard cannot take (not a ServerConfig field) or does not report
    (not a TrainingSettings field: the check at Register would compare it with None)."""
    have = told(ServerConfig(**opt.settings()))
    assert {k: have[k] for k in opt.settings()} == opt.settings()
    again = keras.optimizers.from_settings(json.loads(json.dumps(opt.get_config())))
    assert type(again) is type(opt) and again.settings() == opt.settings()


def test_bad_keras_arguments_are_refused_naming_them():
    with pytest.raises(ConfigError, match="--rho"):
        ServerConfig(**keras.optimizers.RMSprop(rho=1.0).settings())
    with pytest.raises(ConfigError, match="AdamW: weight_decay must be a number >= 0"):
        keras.optimizers.AdamW(weight_decay=None)
    with pytest.raises(ConfigError, match="weight_decay=0.01 is not supported"):
        keras.optimizers.Adagrad(weight_decay=0.01)         # Keras's: decoupled; pserver's: coupled
    with pytest.raises(ModelFileError, match="centered=1: expected a bool"):
        keras.optimizers.from_settings(keras.optimizers.RMSprop().get_config() | {"centered": 1})


# -- training --------------------------------------------------------------------------------

def blobs(n=300, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, d))
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(size=(n, d))).astype(np.float32), y


def small_model():
    return keras.Sequential([keras.Input(shape=(6,)), layers.Dense(8, activation="relu"),
                             layers.Dense(3, activation="softmax")])


@pytest.mark.parametrize("opt", [keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
                                 keras.optimizers.AdamW(0.02), keras.optimizers.Adagrad(0.2)],
                         ids=KERAS_RULES)
def test_fit_trains_with_each_keras_rule(opt):
    """A plain fit starts shards running the compiled rule; the loss falls. Catches a rule
    that diverges or does not move (a sign, the decay's direction, an lr never applied)."""
    x, y = blobs()
    model = small_model()
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    before = model.evaluate(x, y, verbose=0)
    h = model.fit(x, y, batch_size=30, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0] and model.evaluate(x, y, verbose=0) < 0.5 * before


def test_fit_against_running_shards_checks_the_new_settings(monkeypatch):
    """Catches: a model compiled with RMSprop(rho=0.8) trained by shards running rho=0.9."""
    import pserver
    x, y = blobs(200)
    with pserver.serve(optimizer="rmsprop", lr=0.01, num_workers=1) as shard:
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": [shard.address],
                                                                "chief": ["localhost:1"]},
                                                    "task": {"type": "chief", "index": 0}}))
        model = small_model()
        model.compile(optimizer=keras.optimizers.RMSprop(0.01, rho=0.8),
                      loss="sparse_categorical_crossentropy")
        with pytest.raises(ConfigError, match=r"compiled with rho=0.8, .* run rho=0.9; .* --rho 0.8"):
            model.fit(x, y, batch_size=20, epochs=1, verbose=0)
        model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="sparse_categorical_crossentropy")
        assert len(model.fit(x, y, batch_size=20, epochs=1, verbose=0).history["loss"]) == 1


def test_train_in_process_with_the_flags_names():
    """pserver.train's shard options are the flags' names: --optimizer adagrad --initial-accumulator."""
    import pserver
    from pserver.layers import Dense
    x, y = blobs(600)
    model = pserver.Sequential([Dense(8, activation="relu", input_shape=(6,)), Dense(3)])
    s = pserver.train(model, x, y, ps=1, optimizer="adagrad", lr=0.2, initial_accumulator=0.01,
                      epochs=2, batch_size=32, log_every=60)
    assert s["optimizer"] == "adagrad" and s["test_accuracy"] >= 0.95


# -- frozen weights (layer.trainable = False, add_weight(trainable=False)) --------------------

def test_frozen_tensors_are_told_over_grpc_left_as_they_are_and_every_worker_must_agree(shard_server):
    """A worker registers a layout with "b" frozen over real gRPC; adamw (whose decay moves any
    weight) steps: "w" moves, "b" keeps its initial values bit for bit. A second worker that trains
    "b" (another frozen set) is refused in one line naming both, and the shard's values do not
    change. Fails if the flag is lost on the wire, if the optimizer steps a frozen range, or if
    two workers may train different weights of one model."""
    from pserver.errors import FailedPrecondition
    from tests.support.clients import LAYOUT, START, ready_client
    addr, shard = shard_server(optimizer="adamw", lr=0.1, num_workers=2, mode="async")
    frozen = LAYOUT.freezing(["b"])
    a = ready_client(addr, num_workers=2, rank=0, layout=frozen)
    w = np.empty(LAYOUT.total, np.float32)
    for _ in range(3):
        a.pull(w)
        a.push(np.ones(LAYOUT.total, np.float32), 1)
    a.pull(w)
    at, end = LAYOUT.offsets()["b"]
    assert w[at:end].tobytes() == START[at:end].tobytes()
    assert not np.array_equal(w[:at], START[:at])
    before = shard.store.params.copy()
    with pytest.raises(FailedPrecondition, match=r"the worker freezes 0 params in 0 tensor\(s\) \(not "
                                                 r"trained\), this shard 3 params in 1 tensor\(s\)") as e:
        ready_client(addr, num_workers=2, rank=1, init=False)
    assert "\n" not in str(e.value)
    assert np.array_equal(shard.store.params, before)
    a.close()
