"""Progress of long work (pserver.observe.progress): a bar on a terminal, plain lines elsewhere, and a
large checkpoint's restore counted to its last byte."""

from __future__ import annotations

import io
import json
import re
import time

import numpy as np

from pserver.observe import progress
from pserver.observe.progress import Bar, track
from pserver.persist import checkpoint


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_lines_come_every_few_seconds_and_one_at_the_end():
    out = io.StringIO()
    with Bar("work", total=4, unit="files", stream=out, every=0.0) as bar:
        for _ in range(4):
            bar.update()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split(",")[0] for ln in lines] == [f"work: {i} files of 4 files ({25 * i}%)"
                                                  for i in (1, 2, 3, 4, 4)]
    assert lines[-1].endswith(", done")


def test_track_counts_what_it_can_and_says_the_time_it_took():
    sized, unsized = io.StringIO(), io.StringIO()
    assert list(track(["a", "b", "c"], "q", stream=sized, every=0.0)) == ["a", "b", "c"]
    assert list(track((i for i in range(2)), "g", stream=unsized, every=0.0)) == [0, 1]
    assert [ln.split(",")[0] for ln in sized.getvalue().splitlines()] == \
        ["q: 1 it of 3 it (33%)", "q: 2 it of 3 it (67%)", "q: 3 it of 3 it (100%)", "q: 3 it of 3 it (100%)"]
    assert [ln.split(",")[0] for ln in unsized.getvalue().splitlines()] == ["g: 1 it", "g: 2 it", "g: 2 it"]
    seconds = [float(re.search(r", ([\d.]+) s", ln).group(1)) for ln in sized.getvalue().splitlines()]
    assert all(0 <= t < 60 for t in seconds), seconds


def test_short_work_off_a_terminal_prints_nothing():
    out = io.StringIO()
    assert list(track(range(3), "quick", stream=out, every=60.0)) == [0, 1, 2]
    assert out.getvalue() == ""


def test_on_a_terminal_a_bar_appears_once_the_work_has_taken_a_second():
    quick, slow = Terminal(), Terminal()
    list(track(range(3), "quick", stream=quick))
    assert quick.getvalue() == ""
    for _ in track(range(2), "slow", stream=slow):
        time.sleep(0.6)
    assert "\r" in slow.getvalue() and "slow" in slow.getvalue()


def test_restoring_a_checkpoint_counts_reading_and_checking_every_byte(tmp_path, monkeypatch, capsys):
    ckpt = checkpoint.Checkpoint(path="", version=7, shard=0, num_shards=1, signature="sig", total=3 << 20,
                                 start=0, end=3 << 20, optimizer="sgd", params=np.ones(3 << 20, np.float32),
                                 state={})
    path = checkpoint.save(str(tmp_path), ckpt)
    monkeypatch.setattr(progress, "EVERY", 0.0)
    assert checkpoint.load(path).version == 7
    lines = capsys.readouterr().err.splitlines()
    done = re.fullmatch(r"restoring shard0-of1-v000000000007\.ckpt: (\d+) MiB of (\d+) MiB "
                        r"\(100%\), .*, done", lines[-1])
    assert done and done.group(1) == done.group(2) == "24", lines[-3:]    # 12 MiB read, 12 MiB hashed


def test_the_chief_draws_the_bar_on_a_terminal_the_others_stay_quiet_and_a_log_gets_lines():
    assert [progress.style_for("auto", r, True) for r in (0, 1)] == ["bar", "quiet"]
    assert [progress.style_for("auto", r, False) for r in (0, 1)] == ["lines", "lines"]
    assert [progress.style_for("relay", r, False) for r in (0, 1)] == ["relay", "quiet"]
    assert [progress.style_for("lines", r, True) for r in (0, 1)] == ["lines", "lines"]


def test_the_launchers_relay_draws_the_chiefs_records_as_one_bar_and_copies_every_other_line():
    out, bar = Terminal(), Terminal()
    relay = progress.Relay(out, bar)
    relay.line("worker1", "hello\n")
    fig = {"epoch": 1, "epochs": 2, "step": 30, "steps": 50, "clock": 30, "start": 0, "total": 100,
           "loss": 0.25, "rate": 1234.0}
    relay.line("worker0", progress.RECORD + json.dumps(fig) + "\n")
    time.sleep(0.01)                      # the bar shows from its second record on (tqdm's delay)
    relay.line("worker0", progress.RECORD + json.dumps(fig) + "\n")
    relay.line("ps0", "a line under the bar\n")
    relay.line("worker0", progress.RECORD + json.dumps(fig | {"step": 50, "clock": 100, "epoch": 2}) + "\n")
    relay.close()
    assert out.getvalue() == "[worker1] hello\n[ps0] a line under the bar\n"
    frames = bar.getvalue().split("\r")
    assert any(f.startswith("epoch 1/2 step 30/50:  30%|") and "| loss 0.2500, 1,234 samples/s, ETA" in f
               for f in frames), frames
    assert "epoch 2/2 step 50/50: 100%" in frames[-1] and bar.getvalue().endswith("\n")   # closed at the end
    assert progress.RECORD not in out.getvalue() + bar.getvalue()


def test_training_lines_in_a_log_come_every_few_seconds_with_an_eta_and_the_epochs_last():
    out = io.StringIO()
    p = progress.Progress(epochs=2, steps_per_epoch=4, every=3600, style="lines", out=out)
    shown = [p.step(0, s, 1.0, 16, force=s == 3) for s in range(4)]
    assert shown[:3] == [None] * 3 and shown[3][0] == 1.0
    assert re.fullmatch(r"epoch 1/2 step 4/4 loss 1\.0000 [\d,]+ samples/s, ETA \d\d:\d\d\n", out.getvalue())


def test_a_leased_epoch_that_ended_elsewhere_shows_as_its_last_step_and_the_eta_counts_it():
    """Leased data: this worker trained 2 of its 4 expected steps when the epoch ended on another
    worker. Its line says the epoch's last step (the epoch is done), with an ETA after epoch 1 and
    none after the last; nothing when it trained no step since its last line. Catches a line
    left at step 2/4, an ETA still counting the steps it never trained."""
    out = io.StringIO()
    p = progress.Progress(epochs=2, steps_per_epoch=4, every=3600, style="lines", out=out)
    p.step(0, 0, 1.0, 16)
    p.step(0, 1, 1.0, 16)
    assert p.epoch_ended(0) is not None and p.epoch_ended(0) is None
    p.step(1, 0, 0.5, 16)
    assert p.epoch_ended(1)[0] == 0.5
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"epoch 1/2 step 4/4 loss 1\.0000 [\d,]+ samples/s, ETA \d\d:\d\d", lines[0]), lines
    assert re.fullmatch(r"epoch 2/2 step 4/4 loss 0\.5000 [\d,]+ samples/s", lines[1]), lines


def test_a_leased_epoch_ends_on_its_last_step_in_a_log_even_right_after_a_timed_line():
    """The worker's last step of the epoch was shown by a timed line (step 2/4) and the epoch then
    ended elsewhere: the log still shows step 4/4, with that line's figures, once; no new figures
    are returned (the metrics had them). Catches a log whose epoch stops at 2/4 (a CI run's
    chief ended epoch 2 at 99/100 so)."""
    out = io.StringIO()
    p = progress.Progress(epochs=2, steps_per_epoch=4, every=3600, style="lines", out=out)
    p.step(0, 0, 1.0, 16)
    assert p.step(0, 1, 2.0, 16, force=True) is not None            # a timed line, say
    assert p.epoch_ended(0) is None and p.epoch_ended(0) is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch 1/2 step 2/4 loss 1.5000"), lines
    assert lines[1].startswith("epoch 1/2 step 4/4 loss 1.5000"), lines


def test_a_version_before_init_reads_not_initialized():
    from pserver._proto import pserver_pb2 as pb
    from pserver.observe.status import rows
    assert [r["version"] for r in rows([pb.StatusReply(version=-1), pb.StatusReply(version=7)])] == \
        ["not initialized", "7"]


def test_a_worker_that_trained_more_than_its_share_ends_its_bar_at_100_percent_and_draws_it_once():
    """Leased data: the chief trained 6 steps of an epoch of 4 (another worker was slow). Its
    records stop at the bar's total (tqdm past the total drops it and draws 0%: CI saw
    'step 100/100:   0%'), and a record after the bar closed draws no second bar. Catches the
    record's clock left past the total, and the relay opening a new bar after the end."""
    p = progress.Progress(epochs=1, steps_per_epoch=4, every=3600, style="relay", out=io.StringIO())
    assert p.record(0, 3, 1.0, 10.0)["clock"] == 0
    for s in range(6):
        p.step(0, min(s, 3), 1.0, 16)
    assert p.clock == 6 and p.record(0, 3, 1.0, 10.0)["clock"] == 4
    bar = Terminal()
    relay = progress.Relay(io.StringIO(), bar)
    fig = {"epoch": 1, "epochs": 1, "step": 4, "steps": 4, "clock": 2, "start": 0, "total": 4,
           "loss": 0.25, "rate": 1234.0}
    relay.line("worker0", progress.RECORD + json.dumps(fig) + "\n")
    time.sleep(0.01)
    relay.line("worker0", progress.RECORD + json.dumps(p.record(0, 3, 0.25, 1234.0)) + "\n")
    relay.line("worker0", progress.RECORD + json.dumps(p.record(0, 3, 0.25, 1234.0)) + "\n")
    relay.close()
    frames = [f for f in re.split(r"[\r\n]", bar.getvalue()) if "%|" in f]
    assert frames and "step 4/4: 100%" in frames[-1], frames
    assert bar.getvalue().count("\n") == 1, bar.getvalue()          # one bar, closed once
