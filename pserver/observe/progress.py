"""Progress of long work that is not training (training prints its own lines, pserver.observe.metrics):
restoring a large checkpoint, a bench run. On a terminal, a bar (tqdm) that appears only once
the work has taken a second; elsewhere (a log file, CI, kubectl logs) a plain line every
`every` seconds (EVERY by default) and one at the end, never carriage returns.

    with Bar("restoring shard0-of2-v000000000100.ckpt", total=nbytes, unit="B") as bar:
        for chunk in chunks:
            ...
            bar.update(len(chunk))

    for size in track(SIZES, "sizes"):
        ...
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
EVERY = 10.0      # seconds between two plain lines


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
