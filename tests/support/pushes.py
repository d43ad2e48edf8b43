"""Pushes to in-process shards: a PushRequest by name, with a first push's defaults."""

from __future__ import annotations

import numpy as np

from pserver.records import PushRequest


def fill_with(values):
    """A fill (PushRequest.fill, Shard.init) that copies `values` into the shard's buffer."""
    return lambda dest: dest.__setitem__(slice(None), values)


def push_request(g: np.ndarray | None = None, *, rank: int = 0, shard: int = 0, step: int = 0,
                 samples: int = 1, clock: int = 0, dtype: str = "float32", fill=None,
                 size: int | None = None, **more) -> PushRequest:
    """Worker `rank`'s push to shard `shard` for `step`. g: the gradient, copied in through
    fill_with, of its own size unless `size` says otherwise; or, without g, any `fill`
    PushRequest takes (a callable, an array, the data plane's Parts) and its `size`. `more`:
    PushRequest's optional fields (session, rows, lease, trained)."""
    if g is not None:
        fill, size = fill_with(g), g.size if size is None else size
    return PushRequest(rank=rank, shard=shard, step=step, num_elements=size, dtype=dtype,
                       num_samples=samples, clock=clock, fill=fill, **more)


def push(shard, rank, step, g, clock=0):
    """Worker `rank` pushes gradient g (one sample) to a one-shard cluster: the outcome."""
    return shard.push(push_request(g, rank=rank, step=step, clock=clock))[0]


def push_all(shards, rank, steps, g, num_samples=1, clock=0):
    """Worker `rank` pushes its slice of the flat gradient g to every shard j, for steps[j]."""
    return [s.push(push_request(g[s.store.start:s.store.end], rank=rank, shard=j, step=steps[j],
                                size=s.store.size, samples=num_samples, clock=clock))[0]
            for j, s in enumerate(shards)]
