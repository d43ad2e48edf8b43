"""Stragglers on demand: a seeded per-step delay drawn from a named distribution.

    fixed:S              S seconds every step
    uniform:A,B          uniform in [A, B] seconds
    exponential:MEAN     exponential with that mean
    lognormal:MEAN,SIGMA lognormal whose mean is MEAN seconds, log-space sigma SIGMA

Seeded by (seed, rank), so two runs with the same flags are delayed identically.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pserver.config import parse_delay


class Delay:
    def __init__(self, spec: str | None, seed: int = 0, rank: int = 0) -> None:
        self.spec = spec
        self.kind, self.args = parse_delay(spec) if spec else ("none", ())
        self.rng = np.random.default_rng([seed, rank, 0x5EED])
        self.total = 0.0

    def sample(self) -> float:
        k, a = self.kind, self.args
        if k == "none":
            return 0.0
        if k == "fixed":
            return a[0]
        if k == "uniform":
            return float(self.rng.uniform(a[0], a[1]))
        if k == "exponential":
            return float(self.rng.exponential(a[0]))
        mean, sigma = a                           # lognormal with the given mean
        return float(self.rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))

    def sleep(self) -> float:
        d = self.sample()
        if d > 0:
            time.sleep(d)
            self.total += d
        return d
