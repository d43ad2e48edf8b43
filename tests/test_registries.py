"""One registry per kind of name: the CLI's choices, the configs' checks and the help all agree
with it, so a name added to (or dropped from) a registry cannot be missed elsewhere."""

from __future__ import annotations

import argparse
import re

import pytest

from pserver import layers
from pserver.cli import build_parser
from pserver.config import DATA_ASSIGNMENTS, DATA_PLANES, MODES, SCHEDULING, ServerConfig, WorkerConfig
from pserver.data import DATASETS, load_dataset
from pserver.data.npz import SCALE_UINT8
from pserver.errors import ConfigError
from pserver.kernels import reference
from pserver.launch.base import BACKENDS, LaunchConfig
from pserver.layers.activations import ACTIVATIONS
from pserver.models import MODELS, check_model_spec
from pserver.models.ctr import CTR_MODELS
from pserver.modes import POLICIES
from pserver.optim import OPTIMIZERS, SCHEDULES, make_optimizer, parse_schedule
from pserver.registry import Registry
from pserver.sparse.compact import ROW_DTYPES, STATE_DTYPES
from pserver.sparse.optim import ROWS, RowOptimizer
from pserver.wire.compress import CODECS, PULL_CODECS, parse, parse_pull

# Every flag of the CLI that has `choices=`, and where they must come from.
CHOICES = {"mode": MODES.names(), "optimizer": OPTIMIZERS.names(), "row_optimizer": ROWS.names(),
           "data_plane": DATA_PLANES.names(), "backend": BACKENDS.names(), "scale_uint8": SCALE_UINT8,
           "row_dtype": ROW_DTYPES.names(), "state_dtype": STATE_DTYPES.names(),
           "data_assignment": DATA_ASSIGNMENTS.names(), "sched": SCHEDULING.names()}


def parsers(parser: argparse.ArgumentParser):
    """The parser and its subcommands' parsers, as (command, parser)."""
    yield "pserver", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub


def flags_with_choices():
    return [(command, action) for command, p in parsers(build_parser()) for action in p._actions
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction)]


def test_every_cli_choices_list_is_its_registry():
    seen = set()
    for command, action in flags_with_choices():
        assert action.dest in CHOICES, (f"pserver {command} {action.option_strings[0]}: choices "
                                        f"{list(action.choices)} come from no registry in CHOICES")
        assert tuple(action.choices) == tuple(CHOICES[action.dest]), f"pserver {command} {action.dest}"
        seen.add(action.dest)
    assert seen == set(CHOICES)        # no flag lost its choices


def unknown_names(message: str, names) -> None:
    """The message lists exactly `names`, in order, after 'one of'."""
    listed = message.split("one of ", 1)[1].split(", ")
    listed[-1] = listed[-1].split(" ")[0]      # "sign" of "sign" / "deepfm," of "..., or FILE.py"
    assert [n.rstrip(",") for n in listed[:len(names)]] == list(names), message


def test_modes_config_and_policies_agree():
    assert tuple(POLICIES) == MODES.names()
    for mode in MODES:
        assert ServerConfig(mode=mode, backup_workers=1 if mode == "backup" else 0).mode == mode
    with pytest.raises(ConfigError, match="^--mode: unknown mode 'bsp'") as e:
        ServerConfig(mode="bsp")
    unknown_names(str(e.value), MODES.names())


def test_dense_optimizers_and_schedules():
    for name in OPTIMIZERS:
        opt = make_optimizer(name, 3, lr=0.1)
        assert type(opt) is OPTIMIZERS.get(name) and opt.name == name
    with pytest.raises(ConfigError) as e:
        make_optimizer("lion", 3, lr=0.1)
    unknown_names(str(e.value), OPTIMIZERS.names())
    examples = {"constant": "constant", "step": "step:10,0.5", "warmup": "warmup:5", "cosine": "cosine:100",
                "exponential": "exponential:10,0.5", "inverse_time": "inverse_time:10,0.5,staircase",
                "piecewise": "piecewise:1,10,0.5"}
    assert tuple(examples) == SCHEDULES.names()
    for name, spec in examples.items():
        assert type(parse_schedule(spec)) is SCHEDULES.get(name)
    with pytest.raises(ConfigError, match="expected one of " + re.escape(", ".join(SCHEDULES.forms()))):
        parse_schedule("linear:3")


def test_row_optimizers_each_own_their_slots_and_kernels():
    for name in ROWS:
        rule = ROWS.get(name)
        opt = RowOptimizer(name, 0.1, {})
        assert opt.rule is rule and opt.slots == rule.slots and len(opt.initial) == len(rule.slots)
        assert set(rule.kernel_params) <= {"lr", *rule.params}
        kernel, twin = rule.kernels
        assert kernel.__name__ == name and twin.__name__ == f"{name}_numpy"
        assert WorkerConfig(row_optimizer=name).row_optimizer == name
    with pytest.raises(ConfigError) as e:
        WorkerConfig(row_optimizer="rmsprop")
    unknown_names(str(e.value), ROWS.names())


def test_codecs():
    for form in CODECS.forms():
        assert str(parse(form.replace("RATIO", "0.5"))).split(":")[0] in CODECS
        WorkerConfig(compress=form.replace("RATIO", "0.5"))
    with pytest.raises(ConfigError) as e:
        parse("lz4")
    unknown_names(str(e.value), CODECS.forms())
    for name in PULL_CODECS:
        assert parse_pull(name) == name
    with pytest.raises(ConfigError) as e:
        parse_pull("fp16")
    unknown_names(str(e.value), PULL_CODECS.names())


def test_models_datasets_backends():
    for name in MODELS:
        check_model_spec(name)
    assert set(CTR_MODELS) <= set(MODELS)
    with pytest.raises(ConfigError) as e:
        check_model_spec("resnet")
    unknown_names(str(e.value), MODELS.names())
    with pytest.raises(ConfigError) as e:
        load_dataset("cifar")
    named = [f for f in DATASETS.forms() if ":" not in f and "." not in f]
    assert str(e.value).startswith(f"--dataset: unknown dataset 'cifar'; choose {', '.join(named)}, ")
    assert "criteo:PATH" in DATASETS.forms() and "PATH.npz" in DATASETS.forms()
    for name in BACKENDS:
        assert LaunchConfig(backend=name).backend == name
    with pytest.raises(ConfigError, match="^--backend: 'mpi' is not one of " + ", ".join(BACKENDS)):
        LaunchConfig(backend="mpi")


def test_layers_and_activations():
    exported = {n for n in layers.__all__ if isinstance(getattr(layers, n), type)
                and issubclass(getattr(layers, n), layers.Layer) and getattr(layers, n) is not layers.Layer}
    assert set(layers.LAYERS) == exported
    for name in layers.LAYERS:
        assert layers.LAYERS.get(name).__name__ == name
    # softmax is no kernel's: Sequential fuses it (last layer only) into the cross-entropy
    assert set(ACTIVATIONS) - {"softmax"} == set(reference.ACTIVATIONS)


def test_help_lists_every_entry_with_its_summary():
    # Compared without whitespace: argparse wraps lines, at hyphens too.
    worker = "".join(dict(parsers(build_parser()))["worker"].format_help().split())
    for registry in (ROWS, CODECS, PULL_CODECS, DATASETS):
        for form, summary in registry.table_rows():
            assert "".join(f"{form}: {summary}".split()) in worker, (registry, form)
    top = build_parser().format_help()
    for name, summary in MODES.table_rows():
        assert name in top and summary in top


def test_registry():
    r = Registry("colour", "--colour")
    assert r.add("red", "the first", 1) == 1
    r.add("blue", "the second", 2, form="blue:SHADE")
    assert r.names() == ("red", "blue") and r.forms() == ("red", "blue:SHADE") and len(r) == 2
    assert r.get("blue") == 2 and "red" in r and list(r) == ["red", "blue"]
    assert r.table_rows() == [("red", "the first"), ("blue:SHADE", "the second")]
    with pytest.raises(ConfigError, match=r"^--colour: unknown colour 'green'; choose one of red, blue$"):
        r.get("green")
    with pytest.raises(ConfigError, match=r"^paint: unknown colour"):
        r.get("green", "paint")
    with pytest.raises(ValueError, match="twice"):
        r.add("red", "again")
    with pytest.raises(ValueError, match="one line"):
        r.add("grey", "two\nlines")
