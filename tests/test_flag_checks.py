"""Flag values an adversarial pass found accepted and failing later: a traceback, exit 1, a
retryable 138, or a write lost after training. Each is now one ConfigError line naming the flag
(exit 2) from pserver.config, before anything starts. In-process where the check is the point;
the command as a subprocess where its exit code and its one line are."""

import argparse
import importlib.util
import math
import os
import subprocess
import sys

import pytest

from pserver import cli
from pserver.config import (
    MAX_SECONDS,
    ServerConfig,
    WorkerConfig,
    check_delay_ranks,
    check_writable,
    parse_log_level,
    parse_rank,
)
from pserver.errors import ConfigError

TENSORBOARD = importlib.util.find_spec("tensorboardX") is not None
needs_tensorboard = pytest.mark.skipif(not TENSORBOARD, reason="--tensorboard needs tensorboardX")


def pserver(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pserver", *argv], capture_output=True, text=True,
                          timeout=60)


def one_line_exit_2(result: subprocess.CompletedProcess, command: str, flag: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pserver {command}: error: ") and flag in lines[0], \
        result.stderr


def ns(*argv: str):
    return cli.build_parser().parse_args(list(argv))


# 1. --seed past int64: the worker's Register failed (ValueError: Value out of range, exit 1).

@pytest.mark.parametrize("seed", [10**20, 2**63, -1])
def test_a_seed_the_wire_cannot_carry_is_refused(seed):
    with pytest.raises(ConfigError, match=rf"^--seed: {seed}; give an integer in \[0, 2\*\*63\)"):
        WorkerConfig(seed=seed)
    assert WorkerConfig(seed=2**63 - 1).seed == 2**63 - 1        # the largest is taken


def test_launch_with_a_huge_seed_is_one_line_and_exit_2():
    one_line_exit_2(pserver("launch", "--ps", "1", "--workers", "1", "--samples", "300", "--features", "5",
                            "--seed", "99999999999999999999"), "launch", "--seed")


# 2. Seconds: inf, 1e10 or nan overflowed a timestamp (traceback) or became a gRPC deadline
#    read as passed (Deadline Exceeded, exit 138).

@pytest.mark.parametrize("field, flag", [("connect_timeout", "--connect-timeout"),
                                         ("rpc_deadline", "--rpc-deadline")])
@pytest.mark.parametrize("value", [math.inf, 1e10, 1e300, math.nan])
def test_a_worker_wait_must_be_finite_positive_and_at_most_a_day(field, flag, value):
    with pytest.raises(ConfigError, match=f"^{flag}: .*at most 86400"):
        WorkerConfig(**{field: value})


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0])
def test_log_every_is_finite_and_positive_and_may_be_large(value):
    """A large --log-every is how a run silences its progress lines (bench/throughput.py gives
    100000): it is compared with elapsed time, no deadline, so only a day's cap would break it."""
    with pytest.raises(ConfigError, match=r"^--log-every: .*a finite number of seconds > 0"):
        WorkerConfig(log_every=value)
    assert WorkerConfig(log_every=100000.0).log_every == 100000.0


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, MAX_SECONDS * 2])
def test_eval_every_is_0_or_seconds(value):
    with pytest.raises(ConfigError, match=r"^--eval-every: .*give 0 \(per epoch only\)"):
        WorkerConfig(eval_every=value)
    WorkerConfig(eval_every=0.0, rpc_deadline=MAX_SECONDS, connect_timeout=0.5)   # 0 and a day are taken
    ServerConfig(step_timeout=MAX_SECONDS, checkpoint_secs=0.0)


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e10])
def test_a_shards_step_timeout_and_checkpoint_secs_are_finite(value, tmp_path):
    with pytest.raises(ConfigError, match="^--step-timeout: "):
        ServerConfig(step_timeout=value)
    with pytest.raises(ConfigError, match=r"^--checkpoint-secs: .*give 0 \(off\)"):
        ServerConfig(checkpoint_secs=value, checkpoint_dir=str(tmp_path))


def test_export_follow_poll_nan_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^--poll: nan"):
        cli.cmd_export(ns("export", "--restore", str(tmp_path), "--out", str(tmp_path / "deltas"), "--follow",
                          "--since", str(tmp_path / "model"), "--poll", "nan"))


def test_serve_model_poll_inf_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^--poll: inf"):
        cli.cmd_serve_model(ns("serve-model", str(tmp_path / "model"), "--poll", "inf"))


# 3. status --timeout: inf a traceback, -1 or nan Deadline Exceeded (138).

@pytest.mark.parametrize("value", ["inf", "-1", "nan", "0"])
def test_status_timeout_is_checked_before_dialing(value):
    with pytest.raises(ConfigError, match=f"^--timeout: {value}"):
        cli.cmd_status(ns("status", "--ps", "127.0.0.1:1", "--timeout", value))


def test_status_timeout_inf_is_one_line_and_exit_2():
    one_line_exit_2(pserver("status", "--ps", "127.0.0.1:1", "--timeout", "inf"), "status", "--timeout")


# 4. --log-level bogus: logging's ValueError as a traceback once the shard started.

@pytest.mark.parametrize("command", ["serve", "slurm"])
@pytest.mark.parametrize("level", ["bogus", ""])
def test_an_unknown_log_level_is_a_flag_error(command, level, capsys):
    argv = [command, "--log-level", level] + (["--ps", "1"] if command == "slurm" else [])
    with pytest.raises(SystemExit) as e:
        ns(*argv)
    assert e.value.code == 2
    assert f"argument --log-level: {level!r} is not one of DEBUG, INFO" in capsys.readouterr().err
    assert parse_log_level("debug") == "DEBUG" and ns("serve").log_level == "INFO"   # any case


# 5. Output paths: checked up front, not after training (when the result was lost).

def test_an_existing_directory_is_no_summary_or_stats_file(tmp_path):
    for field, flag in (("summary_json", "--summary-json"), ("stats_json", "--stats-json")):
        with pytest.raises(ConfigError, match=f"^{flag}: .* is a directory; give a file's path"):
            WorkerConfig(**{field: str(tmp_path)})


def test_launch_summary_json_a_directory_is_one_line_and_exit_2(tmp_path):
    # launch's --summary-json is its own (the chief writes a temporary one): launch() checks it
    one_line_exit_2(pserver("launch", "--ps", "1", "--workers", "1", "--samples", "50", "--features", "3",
                            "--summary-json", str(tmp_path)), "launch", "--summary-json")
    assert os.listdir(tmp_path) == []


def test_save_to_a_directory_that_is_not_a_model_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match="^--save: .* is a directory that is not a pserver model"):
        WorkerConfig(save=str(tmp_path))
    (tmp_path / "model.npz").write_bytes(b"")        # a sparse model's directory: --save replaces it
    assert WorkerConfig(save=str(tmp_path)).save == str(tmp_path)


def test_a_path_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [("--save", dict(save=str(tmp_path / "file" / "m.npz"))),
             ("--summary-json", dict(summary_json=str(tmp_path / "file" / "s.json")))]
    if TENSORBOARD:
        cases.append(("--tensorboard", dict(tensorboard=str(tmp_path / "file" / "tb" / "run"))))
    for flag, kw in cases:
        with pytest.raises(ConfigError, match=f"^{flag}: .*file is not a directory"):
            WorkerConfig(**kw)


@needs_tensorboard
@pytest.mark.parametrize("how", ["access", "probe"])
def test_a_directory_that_refuses_writes_is_refused(tmp_path, monkeypatch, how):
    WorkerConfig(save=str(tmp_path / "m.npz"), summary_json=str(tmp_path / "s.json"),
                 tensorboard=str(tmp_path / "tb" / "run"))
    assert os.listdir(tmp_path) == []                # a writable one is taken, and the probe is gone
    # Read-only mounts cannot be made here (root passes a chmod): refuse through either check.
    if how == "access":
        monkeypatch.setattr(os, "access", lambda *a, **k: False)
    else:
        import tempfile

        def refuse(*a, **k):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match=f"^--save: cannot write in directory {tmp_path}"):
        WorkerConfig(save=str(tmp_path / "m.npz"))
    with pytest.raises(ConfigError, match=f"^--tensorboard: cannot write in directory {tmp_path}"):
        WorkerConfig(tensorboard=str(tmp_path / "tb"))
    with pytest.raises(ConfigError, match=f"^--summary-json: cannot write in directory {tmp_path}"):
        check_writable("--summary-json", str(tmp_path / "s.json"))


@pytest.mark.parametrize("make, flag", [
    (lambda: WorkerConfig(save=""), "--save"), (lambda: WorkerConfig(summary_json=""), "--summary-json"),
    (lambda: WorkerConfig(tensorboard=""), "--tensorboard"),
    (lambda: ServerConfig(checkpoint_dir=""), "--checkpoint-dir"),
    (lambda: ServerConfig(restore=""), "--restore")])
def test_an_empty_path_is_refused(make, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: '' is an empty path"):
        make()


# 6. A synthetic dataset past the machine's memory: numpy's _ArrayMemoryError traceback.

@pytest.mark.parametrize("kw, flag", [(dict(samples=10**12), "--samples"),
                                      (dict(classes=10**11), "--classes"),
                                      (dict(test_samples=10**12), "--test-samples")])
def test_a_synthetic_dataset_past_memory_is_refused(kw, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: the synthetic dataset .* GiB, more than this machine's"):
        WorkerConfig(**kw)
    WorkerConfig(dataset="criteo-synthetic", model="lr", **kw)     # generated as it is read: not sized so


# 7. --num-shards 0 blamed --shard; --rank -1 ran as auto.

def test_zero_shards_names_num_shards():
    with pytest.raises(ConfigError, match="^--num-shards: must be >= 1, got 0"):
        ServerConfig(num_shards=0)


def test_a_negative_rank_is_not_auto(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=r"-1; give 0\.\.N-1"):
        parse_rank("-1")
    with pytest.raises(SystemExit) as e:
        ns("worker", "--rank", "-1")
    assert e.value.code == 2 and "argument --rank: -1; give 0..N-1" in capsys.readouterr().err
    assert parse_rank("auto") == -1 and parse_rank("0") == 0


# 8. --delay-ranks outside [0, workers): accepted, delaying no worker.

@pytest.mark.parametrize("ranks", [(5,), (-1,), (0, 2)])
def test_delay_ranks_outside_the_workers_are_refused(ranks):
    with pytest.raises(ConfigError, match=r"^--delay-ranks: rank -?\d is outside \[0, --workers=2\)"):
        check_delay_ranks(ranks, 2)
    check_delay_ranks((0, 1), 2)
    check_delay_ranks(None, 2)


def test_launch_delay_ranks_5_is_one_line_and_exit_2():
    one_line_exit_2(pserver("launch", "--ps", "1", "--workers", "2", "--samples", "50", "--features", "3",
                            "--delay", "fixed:0.01", "--delay-ranks", "5"), "launch", "--delay-ranks")


def test_configs_name_of_a_sparse_models_file_is_the_model_files():
    from pserver.config import SPARSE_MODEL_NPZ
    from pserver.persist.model_file import MODEL_NPZ
    assert SPARSE_MODEL_NPZ == MODEL_NPZ
