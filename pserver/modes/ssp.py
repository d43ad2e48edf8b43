"""ssp (stale synchronous parallel, bounded staleness): async updates, bounded clocks.

A worker's clock is how many pushes it has completed. A worker at clock c may not pull
while the slowest live worker's clock is below c - s. s = 0 is sync without averaging;
a large s is async. Workers that have not registered yet count at clock 0, so nobody
runs ahead of a worker that is still starting; one that stalls longer than
--step-timeout is marked dead and no longer holds the others back.
"""

from __future__ import annotations

from pserver.modes.async_ import AsyncPolicy
from pserver.modes.base import StepWatch


class SSPPolicy(AsyncPolicy):
    name = "ssp"

    def __init__(self, store, cfg, members) -> None:
        super().__init__(store, cfg, members)
        self.watch = StepWatch(cfg.step_timeout)

    def registered(self, rank):
        """A joining worker's clock starts at the slowest live clock: it neither holds the
        others back nor runs ahead of them (docs/operations.md, "Elastic workers")."""
        if rank >= self.members.num_workers:
            low, _ = self.slowest()
            self.clocks[rank] = max(self.clocks.get(rank, 0), low if low < (1 << 62) else 0)
        super().registered(rank)

    def pushed(self, rank, clock):
        with self.store.cond:
            self.store.took(rank, clock)       # before the wake-up: waiters read the clocks
            self.watch.reset()                 # progress: whoever waits, waits anew
            self.store.cond.notify_all()

    def slowest(self) -> tuple[int, set[int]]:
        """The slowest live clock and the ranks at it."""
        live = self.members.expected()
        if not live:
            return 1 << 62, set()
        low = min(self.clocks.get(r, 0) for r in live)
        return low, {r for r in live if self.clocks.get(r, 0) == low}

    def wait_pull(self, rank, seen_version, clock, timeout, waiter=None):
        store, s = self.store, self.cfg.staleness

        def may_pull() -> bool:
            return store.initialized and self.slowest()[0] >= clock - s

        def on_tick() -> None:
            self.watch.start()
            if self.watch.expired():
                low, ranks = self.slowest()
                self.members.mark_dead(ranks - {rank}, f"clock {low} did not advance for "
                                               f"{self.cfg.step_timeout:g} s (--step-timeout)")
                self.watch.reset()

        # A pull at clock c proves c pushes: after a shard restart (clocks restored from an
        # older checkpoint, or none) the slowest clock must not lag behind what workers show.
        if clock > self.clocks.get(rank, 0):
            self.clocks[rank] = clock
            store.cond.notify_all()            # a pull waiting for this worker may go on
        store.wait_for(may_pull, timeout, on_tick=on_tick, waiter=waiter)
        low = self.slowest()[0]
        if low < (1 << 62):
            store.counters.raise_to("clock_gap_max", max(clock - low, 0))
