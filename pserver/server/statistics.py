"""Moving statistics on a shard: BatchNormalization's moving mean and variance, updated from the
workers' batch statistics (docs/semantics.md, "BatchNormalization's moving statistics").

A worker's push carries, in the statistics' slots of its gradient (pserver.layers.normalization),
d_i = m_i - c for each mean element (its batch mean less the moving mean c it pulled) and
v_i + d_i^2 for each variance element. Their sample-weighted mean over a step's pushes is
D = M - c (M the union's mean) and V + D^2 (V the union's variance, since sum n_i (v_i + (m_i -
c)^2) / n = V + (M - c)^2). So the shard takes mean = c + D and variance = slot - D^2, the
union's as one batch, and applies Keras's rule, moving = momentum * moving + (1 - momentum) *
batch. A variance element needs its mean element's D: a range boundary may put that on another
shard, so the push carries those few D values apart (PushRequest.statistics, in the order of
`away`); they are averaged with the same weights. Pure: tests call it without a shard.
"""

from __future__ import annotations

import numpy as np

from pserver.models.layout import away_means


class MovingStatistics:
    """The statistics elements of one shard's range [start, end) of the flat vector: index arrays
    from the layout's pairs (Layout.statistics_pairs), local to the range."""

    def __init__(self, pairs=(), start: int = 0, end: int = 0):
        self.pairs = tuple(pairs)
        away = {int(i): j for j, i in enumerate(away_means(self.pairs, start, end))}
        means, var, source, momenta = [], [], [], []
        for mean_at, var_at, size, momentum in self.pairs:
            for i in range(mean_at, mean_at + size):
                if start <= i < end:
                    means.append((i - start, momentum))
                if start <= i - mean_at + var_at < end:
                    var.append(i - mean_at + var_at - start)
                    momenta.append(momentum)
                    source.append(i - start if start <= i < end else -1 - away[i])
        self.means = np.asarray([i for i, _ in means], np.int64)
        self.mean_momenta = np.asarray([m for _, m in means], np.float64)
        self.var, self.var_momenta = np.asarray(var, np.int64), np.asarray(momenta, np.float64)
        self.source = np.asarray(source, np.int64)     # >= 0: a local index; -1 - j: away[j]
        self.away = len(away)

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def update(self, w: np.ndarray, g: np.ndarray, away: np.ndarray | None = None) -> None:
        """w's statistics from g (the step's mean of the pushes' slots, or one push's) and `away`
        (the same mean of the pushes' D values for the means another shard holds)."""
        if self.var.size:
            local = g[np.maximum(self.source, 0)].astype(np.float64)
            if self.away:
                carried = np.asarray(away, np.float64)[np.maximum(-1 - self.source, 0)]
                local = np.where(self.source >= 0, local, carried)
            batch = np.maximum(g[self.var].astype(np.float64) - np.square(local), 0)
            m = self.var_momenta
            w[self.var] = m * w[self.var] + (1 - m) * batch
        if self.means.size:
            w[self.means] = w[self.means] + (1 - self.mean_momenta) * g[self.means].astype(np.float64)


def weighted_mean(values: list[np.ndarray], counts: list[int]) -> np.ndarray:
    """sum n_i a_i / sum n_i in rank order (the away values of a sync step's pushes)."""
    total = sum(counts)
    out = np.zeros(len(values[0]) if values else 0, np.float64)
    for a, n in zip(values, counts):
        out += np.asarray(a, np.float64) * (n / total)
    return out


__all__ = ["MovingStatistics", "weighted_mean"]
