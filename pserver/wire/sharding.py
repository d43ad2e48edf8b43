"""Cutting the flat parameter vector into contiguous shard ranges (ps-lite's key ranges).

Pure functions: P elements over S shards give S ranges whose sizes differ by at most
one, the first P % S shards taking the extra element. Load is balanced whatever the
tensor sizes, because a range may cut a tensor anywhere.
"""

from __future__ import annotations

from pserver.errors import ConfigError


def shard_ranges(total: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) for every shard, in order; together they cover [0, total) exactly once."""
    if num_shards < 1:
        raise ConfigError(f"--num-shards: must be at least 1, got {num_shards}")
    if total < 0:
        raise ConfigError(f"total_params: must be >= 0, got {total}")
    base, extra = divmod(total, num_shards)
    ranges, start = [], 0
    for j in range(num_shards):
        end = start + base + (1 if j < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def shard_range(total: int, num_shards: int, shard: int) -> tuple[int, int]:
    """The range of shard `shard` (0-based)."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"--shard: {shard} is outside [0, {num_shards})")
    return shard_ranges(total, num_shards)[shard]
