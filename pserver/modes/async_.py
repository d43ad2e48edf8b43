"""async (Hogwild): every push is applied on arrival, with no lock around the update.

Concurrent pushes race on the same array from several gRPC threads; the optimizer
kernels release the GIL so the race is real (Hogwild!, Niu et al. 2011), and sparse-ish
updates make it harmless in practice. Each push records its staleness: the version now
minus the version its gradient was computed on.
"""

from __future__ import annotations

from pserver.errors import StaleStep
from pserver.modes.base import Outcome, Policy


class AsyncPolicy(Policy):
    """A push of 0 samples (an empty contribution) applies nothing and leaves the version: it only
    takes the sender's clock on, which in ssp frees the others' pulls (a worker with no chunk of
    the data sends them, so that it does not hold the others back, Leases.wait)."""
    name = "async"

    def registered(self, rank):
        if rank >= self.members.num_workers:     # a joiner takes pushes at once
            self.members.join_at[rank] = 0

    def push(self, req, grad):
        store, rank, step = self.store, req.rank, req.step
        with store.cond:
            self.members.check_session(rank, req.session)   # not taken over while it streamed in
            version = store.version
            if step > version or step < 0:
                raise StaleStep(f"step: push computed on version {step} but shard "
                                f"{store.shard} is at version {version}")
            store.counters.add("pushes_applied")
            if req.num_samples:
                store.counters.record_staleness(version - step)
                store.counters.add("samples_pushed", req.num_samples)
        try:
            if req.num_samples:      # an empty contribution is a clock tick: nothing applied
                store.apply_hogwild(grad, req.rows, req.statistics)    # outside the lock, on purpose
        finally:
            store.pool.release(grad)
        self.pushed(rank, req.clock)
        return Outcome.APPLIED, ""

    def pushed(self, rank: int, clock: int) -> None:
        """The push is applied: its step is taken in (ssp also wakes the pulls its clock frees)."""
        with self.store.cond:
            self.store.took(rank, clock)
