"""Progress, on a terminal as a bar (tqdm), elsewhere (a log file, CI, kubectl logs) as plain
lines every few seconds, never carriage returns.

Long work that is not training (restoring a large checkpoint, a bench run): Bar and track,
a bar that appears only once the work has taken a second, or a line every `every` seconds
(EVERY by default) and one at the end.

    with Bar("restoring shard0-of2-v000000000100.ckpt", total=nbytes, unit="B") as bar:
        for chunk in chunks:
            ...
            bar.update(len(chunk))

    for size in track(SIZES, "sizes"):
        ...

Training: Progress, on each worker, in the style that style_for picks: the chief draws one bar
(epoch, step of steps, loss, samples/s, ETA) on a terminal, and the others show nothing
periodic; in a log each writes a line every --log-every seconds. Under `pserver launch` on a
terminal the chief's figures travel as records (RECORD) on its output, and the launcher, which
owns the terminal, draws the bar (Relay) among the lines it copies from every process.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Iterable, Iterator, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
EVERY = 10.0      # seconds between two plain lines
RECORD = "pserver-progress "   # a line of the chief's that carries the bar's figures (relay style)
BAR_EVERY = 0.5   # seconds between two updates of a training bar's figures
STYLES = ("bar", "relay", "lines", "quiet")


class Bar:
    """`total` units of work, `update(n)` as they are done."""

    def __init__(self, what: str, total: float, unit: str = "it", stream: TextIO | None = None,
                 every: float | None = None) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.every = EVERY if every is None else every
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.started = 0.0, time.monotonic()
        self.last = self.started
        self.bar = (tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B", file=self.stream,
                         delay=1.0, leave=False)
                    if self.stream.isatty() else None)

    def update(self, n: float = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            self._line()

    def _line(self, end: str = "") -> None:
        of = f" of {self.amount(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        print(f"{self.what}: {self.amount(self.done)}{of}, {time.monotonic() - self.started:.1f} s{end}",
              file=self.stream, flush=True)

    def amount(self, n: float) -> str:
        return f"{n / 2**20:,.0f} MiB" if self.unit == "B" else f"{n:,.0f} {self.unit}"

    def close(self) -> None:
        """The bar goes; a plain stream gets a last line when it had any before."""
        if self.bar is not None:
            self.bar.close()
        elif self.last > self.started:
            self._line(", done")

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(items: Iterable[T], what: str, total: int | None = None, unit: str = "it",
          stream: TextIO | None = None, every: float | None = None) -> Iterator[T]:
    """Each item of `items`, with a Bar over them."""
    if total is None:
        total = len(items) if hasattr(items, "__len__") else 0
    with Bar(what, total, unit, stream, every) as bar:
        for item in items:
            yield item
            bar.update()


def style_for(setting: str, rank: int, terminal: bool) -> str:
    """How a worker shows its training progress (one of STYLES), from WorkerConfig.progress:
    auto picks a bar for the chief on a terminal and nothing periodic for the others there,
    lines in a log; relay (set by `pserver launch` on a terminal) is the chief's records for
    the launcher's bar, the others quiet; bar and lines are that style for the chief, lines
    for the others off a terminal."""
    chief = rank == 0
    if setting == "relay":
        return "relay" if chief else "quiet"
    if setting == "lines" or not terminal:
        return "lines"
    return "bar" if chief else "quiet"


class Window:
    """The samples, mean loss and samples/s of the steps since `since`."""

    def __init__(self, now: float) -> None:
        self.since, self.samples, self.loss_sum, self.n = now, 0, 0.0, 0

    def add(self, samples: int, loss: float) -> None:
        self.samples += samples
        self.loss_sum += loss
        self.n += 1

    def figures(self, now: float) -> tuple[float, float]:
        return self.loss_sum / max(self.n, 1), self.samples / max(now - self.since, 1e-9)


class _Tqdm(tqdm):
    """tqdm with one more field for bar_format: `figures` (tqdm's own postfix comes with a comma
    in front of it)."""

    figures = ""

    @property
    def format_dict(self):
        return {**super().format_dict, "figures": self.figures}


class StepBar:
    """One tqdm bar over the steps of a run: epoch, step of steps, loss, samples/s, ETA."""

    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None) -> None:
        fmt = ("{desc}: {percentage:3.0f}%|{bar}| {figures}, ETA {remaining}" if total else
               "{desc}: {figures}, {elapsed}")
        self.bar = _Tqdm(total=total or None, initial=initial, file=stream or sys.stderr, bar_format=fmt,
                         dynamic_ncols=True, mininterval=0, miniters=1, leave=True, delay=1e-3)

    def show(self, fig: dict) -> None:
        """Draw the figures of a record (Progress.record)."""
        self.bar.set_description_str(f"epoch {fig['epoch']}/{fig['epochs']} step {fig['step']}/"
                                     f"{fig['steps'] or '?'}", refresh=False)
        self.bar.figures = f"loss {fig['loss']:.4f}, {fig['rate']:,.0f} samples/s"
        self.bar.update(fig["clock"] - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def write_under(bar: StepBar | None, text: str, out: TextIO) -> None:
    """A line on `out` while `bar` may be drawn on the same terminal: the bar is cleared,
    the line written, the bar drawn again below it."""
    if bar is None:
        out.write(text)
        out.flush()
        return
    with tqdm.external_write_mode(file=out):
        out.write(text)
        out.flush()


class Progress:
    """A training run's progress on one worker, shown in one of STYLES:

        bar     one StepBar on stderr (the chief on a terminal)
        relay   the bar's figures as RECORD lines on stdout, for the launcher's Relay
        lines   a line every `every` seconds and at each epoch's end (a log)
        quiet   nothing periodic (a worker other than the chief, on a terminal)

    Whatever it shows, `step` returns (mean loss, samples/s) every `every` seconds, for the
    metrics and TensorBoard, and None in between."""

    def __init__(self, epochs: int, steps_per_epoch: int, every: float, style: str = "lines",
                 start: int = 0, stream: TextIO | None = None, out: TextIO | None = None) -> None:
        self.epochs, self.steps, self.every, self.style = epochs, steps_per_epoch, every, style
        self.total, self.start, self.clock = steps_per_epoch * epochs, start, start
        self.out = out or sys.stdout
        self.started = now = time.monotonic()
        self.window, self.bar_window = Window(now), Window(now)
        self.bar = StepBar(self.total, start, stream) if style == "bar" else None
        self.last_line: tuple | None = None        # (epoch, step, figures) of the last line shown

    def step(self, epoch: int, step: int, loss: float, samples: int,
             force: bool = False) -> tuple[float, float] | None:
        """Step `step` of epoch `epoch` (both from 0) is done, with its loss on `samples` samples;
        `force`: the last of an epoch (or of the run), shown whatever the time."""
        now = time.monotonic()
        self.clock += 1
        self.window.add(samples, loss)
        self.bar_window.add(samples, loss)
        return self._emit(epoch, step, now, force or now - self.bar_window.since >= BAR_EVERY,
                          force or now - self.window.since >= self.every)

    def epoch_ended(self, epoch: int) -> tuple[float, float] | None:
        """Epoch `epoch` is done (leased data: whoever trained its last batch): shown as its last
        step, as the last step of an epoch is, with the figures of this worker's steps since the
        last line; the line's figures, or None when this worker trained none since."""
        now, step = time.monotonic(), max(self.steps - 1, 0)
        self.clock = max(self.clock, (epoch + 1) * self.steps)   # the ETA counts the epochs done
        figures = self._emit(epoch, step, now, self.bar_window.n > 0, self.window.n > 0)
        last = self.last_line
        if figures is None and self.style == "lines" and last is not None and last[:2] != (epoch, step) \
                and last[0] == epoch:
            # A timed line came right after this worker's last step of the epoch: the epoch's end
            # is shown all the same (a log ends each epoch at its last step), with that line's figures.
            self.say(self.line(epoch, step, *last[2]))
            self.last_line = (epoch, step, last[2])
        return figures

    def _emit(self, epoch: int, step: int, now: float, draw: bool, line: bool) -> tuple[float, float] | None:
        """The bar's record when `draw`, and, when `line`, the figures since the last line (a line
        in the 'lines' style); each window starts again once shown."""
        if draw and self.style in ("bar", "relay"):
            self._draw(self.record(epoch, step, *self.bar_window.figures(now)))
            self.bar_window = Window(now)
        if not line:
            return None
        figures = self.window.figures(now)
        if self.style == "lines":
            self.say(self.line(epoch, step, *figures))
            self.last_line = (epoch, step, figures)
        self.window = Window(now)
        return figures

    def record(self, epoch: int, step: int, loss: float, rate: float) -> dict:
        # Leased data: a worker may train more than its share of an epoch's steps; the bar stops
        # at its total (tqdm past it drops the total and shows 0%).
        clock = min(self.clock, self.total) if self.total else self.clock
        return {"epoch": epoch + 1, "epochs": self.epochs, "step": step + 1, "steps": self.steps,
                "clock": clock, "start": self.start, "total": self.total, "loss": loss, "rate": rate}

    def _draw(self, fig: dict) -> None:
        if self.bar is not None:
            self.bar.show(fig)
        else:
            self.say(RECORD + json.dumps(fig))

    def line(self, epoch: int, step: int, loss: float, rate: float) -> str:
        return (f"epoch {epoch + 1}/{self.epochs} step {step + 1}/{self.steps or '?'} loss {loss:.4f} "
                f"{rate:,.0f} samples/s{self.eta()}")

    def eta(self) -> str:
        """', ETA 01:23' from the steps of this run so far; '' when the end is not known."""
        done, left = self.clock - self.start, self.total - self.clock
        if not self.total or done <= 0 or left <= 0:
            return ""
        return f", ETA {tqdm.format_interval(left * self.elapsed / done)}"

    def say(self, text: str) -> None:
        """A line of the training loop's, printed under the bar where there is one."""
        write_under(self.bar, text + "\n", self.out)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Relay:
    """`pserver launch`'s copy of its processes' output: every line on `out` with its role's
    prefix ("[worker0] ..."), except the chief's progress records, which become one StepBar
    on `stream` (a terminal), kept below the lines."""

    def __init__(self, out: TextIO | None = None, stream: TextIO | None = None) -> None:
        self.out, self.stream = out or sys.stdout, stream or sys.stderr
        self.bar: StepBar | None = None
        self.completed = False             # the bar reached its total and was closed
        self.lock = threading.Lock()       # a reader thread per process

    def line(self, role: str, line: str) -> None:
        with self.lock:
            if line.startswith(RECORD):
                try:
                    fig = json.loads(line[len(RECORD):])
                except ValueError:
                    fig = None
                if fig is not None:
                    self._show(fig)
                    return
            write_under(self.bar, f"[{role}] {line}", self.out)

    def _show(self, fig: dict) -> None:
        if self.completed:                 # a record after the bar's end (leased data: the chief
            return                         # hears the last epoch end after its own last step)
        if self.bar is None:
            self.bar = StepBar(fig["total"], fig.get("start", 0), self.stream)
        self.bar.show(fig)
        if fig["total"] and fig["clock"] >= fig["total"]:
            self.close_bar()
            self.completed = True

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        with self.lock:
            self.close_bar()
