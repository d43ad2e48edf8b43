"""A step's pushed rows merged per table and id on the shard: the sparse half of a step's mean.

Each push brings, per table, unique ids and their gradients (RowGrads); merge_rows sums the
parts of one table per id, weighted by the samples of the push that carried each part, as
mean_gradient (pserver.server.store) does for the dense slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pserver.sparse.dedupe import segment_sum, unique_inverse
from pserver.sparse.table import first_nonfinite_row


@dataclass
class RowGrads:
    """A push's gradients for some rows of one sparse table: unique ids on this shard and
    their rows' gradients, (n, dim) float32, in shard-owned memory once received."""
    table: str
    ids: np.ndarray
    grads: np.ndarray


# What merge_rows allocates per row of a table merged from several parts, at most: the ids
# concatenated, their unique copy, inverse and hash slots (48 bytes), and three float32 rows
# (the gradients concatenated, weighted, summed).
MERGE_ID_BYTES, MERGE_ROWS = 48, 3


def merge_bytes(part: RowGrads) -> int:
    """The most merge_rows allocates for `part` in a step's merge (its share of the peak)."""
    return part.ids.shape[0] * MERGE_ID_BYTES + MERGE_ROWS * part.grads.nbytes


def merge_rows(parts: list[tuple[RowGrads, int]], total: int) -> list[tuple[RowGrads, float]]:
    """One (rows, scale) per table: the step's rows of a table summed per id, each part weighted
    by the samples n of the push that carried it (parts: (rows, n) pairs), to be applied times
    scale, so that every row gets sum(n_i g_i) / total, total being the step's samples: a push
    that did not touch a row adds zero to it, and its samples count all the same. A table whose
    parts carry the same count n is summed as it is, with scale n / total (equal batches: 1/N,
    the unweighted mean, bit for bit). A sum of finite rows can overflow float32; such a table
    is summed again from its rows scaled by n_i / total first, with scale 1, so the mean that is
    applied is finite, as every pushed row was."""
    by_table: dict[str, list[tuple[RowGrads, int]]] = {}
    for p, n in parts:
        by_table.setdefault(p.table, []).append((p, n))
    merged = []
    for name, group in by_table.items():
        if len(group) == 1:
            merged.append((group[0][0], group[0][1] / total))
            continue
        ids = np.concatenate([p.ids for p, _ in group])
        uniq, inverse = unique_inverse(ids)
        grads = np.concatenate([p.grads for p, _ in group])
        sizes = [p.ids.size for p, _ in group]
        ns = [n for _, n in group]
        if len(set(ns)) == 1:
            summed, scale = segment_sum(grads, inverse, uniq.size), ns[0] / total
        else:
            with np.errstate(over="ignore"):    # found below, and summed again scaled first
                weighted = grads * np.repeat(np.asarray(ns, np.float32), sizes)[:, None]
            summed, scale = segment_sum(weighted, inverse, uniq.size), 1.0 / total
        if first_nonfinite_row(summed) < 0:
            merged.append((RowGrads(name, uniq, summed), scale))
        else:
            grads *= np.repeat(np.asarray([n / total for n in ns], np.float32), sizes)[:, None]
            merged.append((RowGrads(name, uniq, segment_sum(grads, inverse, uniq.size)), 1.0))
    return merged


__all__ = ["RowGrads", "merge_bytes", "merge_rows"]
