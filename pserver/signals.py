"""How every pserver process stops: on SIGTERM (Kubernetes, Slurm, systemd), SIGHUP (a closed
terminal) and SIGINT (Ctrl-C), cleanly, exiting 128+signal (docs/semantics.md, "Signals").

    with stop_on_signals():
        try:
            work()
        except Stopped as e:
            clean_up()
            return e.exit_code
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(BaseException):
    """Raised in the main thread by a stop signal. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on the way up swallows it, while every `finally` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals():
    """Inside: the first stop signal raises Stopped in the main thread; later ones are
    ignored, so the clean-up that Stopped starts is not cut short. The previous handlers
    come back on leaving."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def handler(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
