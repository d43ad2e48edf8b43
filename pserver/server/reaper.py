"""A shard's reaper: silent sessions expire and stalled streams are cancelled even when no call
is waiting.

A thread per shard that holds it only weakly, so that a Shard that is dropped (tests make
many) takes its thread with it.
"""

from __future__ import annotations

import threading
import time
import weakref

from pserver.server import memory

EXPIRY_SLACK = 0.005                  # seconds the reaper wakes after a session falls due (and at least)


def start(shard, tick: float) -> None:
    """Reap `shard` (a Shard) every `tick` seconds, and when a session falls due."""
    threading.Thread(target=_reap, args=(weakref.ref(shard), tick), name="pserver-reaper",
                     daemon=True).start()


def _reap(ref: weakref.ref, tick: float) -> None:
    """Expire silent sessions when they fall due (a little after --step-timeout of silence,
    not a tick later); every tick also cancel stalled streams and trim the heap."""
    wait, next_tick = tick, time.monotonic() + tick
    while True:
        time.sleep(wait)
        shard = ref()
        if shard is None or shard.store.closed:
            return
        with shard.store.cond:
            due = shard.members.expire()
        now = time.monotonic()
        if now >= next_tick:
            shard.limits.cancel_idle()
            memory.trim()
            next_tick = now + tick
        del shard
        wait = next_tick - now if due is None else min(next_tick - now, due + EXPIRY_SLACK)
        wait = max(wait, EXPIRY_SLACK)
