"""A watch on the test that runs too long: where its main thread is, written to the trace."""

from __future__ import annotations

import sys
import threading
import time
import traceback


class StuckWatch:
    """Where the main thread is when a test has run for STUCK_AFTER seconds, appended to the
    trace. pytest's faulthandler dump (at faulthandler_timeout) prints at most 100 threads, newest
    first, so in a process holding more than that the main thread, the one that hangs, is cut.
    Python-level, so it writes whenever the stuck thread waits with the GIL released (a lock, a
    socket, a condition): the faulthandler dump still covers a hang that holds the GIL."""

    STUCK_AFTER = 480.0          # below pyproject's faulthandler_timeout (600 s)
    POLL = 5.0

    def __init__(self):
        self.lock = threading.Lock()
        self.test, self.since, self.trace, self.thread = None, 0.0, None, None

    def started(self, nodeid: str, trace: str) -> None:
        with self.lock:
            self.test, self.since, self.trace = nodeid, time.monotonic(), trace
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="stuck-watch", daemon=True)
                self.thread.start()

    def _watch(self) -> None:
        main = threading.main_thread().ident
        reported = None
        while True:
            time.sleep(self.POLL)
            with self.lock:
                test, since, trace = self.test, self.since, self.trace
            if test == reported or time.monotonic() - since < self.STUCK_AFTER:
                continue
            reported = test
            frame = sys._current_frames().get(main)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            with open(trace, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} still in {test} after {self.STUCK_AFTER:.0f} s "
                        f"({threading.active_count()} threads); the main thread:\n{stack}")
