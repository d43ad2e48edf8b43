"""Progress of long work (pserver.observe.progress): a bar on a terminal, plain lines elsewhere, and a
large checkpoint's restore counted to its last byte."""

from __future__ import annotations

import io
import re
import time

import numpy as np

from pserver.observe import progress
from pserver.observe.progress import Bar, track
from pserver.server import checkpoint


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
    ckpt = checkpoint.Checkpoint("", 7, 0, 1, "sig", 3 << 20, 0, 3 << 20, "sgd",
                                 np.ones(3 << 20, np.float32), {})
    path = checkpoint.save(str(tmp_path), ckpt)
    monkeypatch.setattr(progress, "EVERY", 0.0)
    assert checkpoint.load(path).version == 7
    lines = capsys.readouterr().err.splitlines()
    done = re.fullmatch(r"restoring shard0-of1-v000000000007\.ckpt: (\d+) MiB of (\d+) MiB "
                        r"\(100%\), .*, done", lines[-1])
    assert done and done.group(1) == done.group(2) == "24", lines[-3:]    # 12 MiB read, 12 MiB hashed
