import pytest
from hypothesis import given
from hypothesis import strategies as st

from pserver.errors import ConfigError
from pserver.wire.sharding import shard_range, shard_ranges


@given(total=st.integers(0, 10**9), num_shards=st.integers(1, 64))
def test_ranges_cover_every_element_once_and_are_balanced(total, num_shards):
    ranges = shard_ranges(total, num_shards)
    assert len(ranges) == num_shards
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c                      # contiguous: no gap, no overlap
    sizes = [b - a for a, b in ranges]
    assert all(s >= 0 for s in sizes)
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == total


@given(total=st.integers(0, 5000), num_shards=st.integers(1, 12))
def test_every_index_has_exactly_one_owner(total, num_shards):
    owners = [0] * total
    for j in range(num_shards):
        a, b = shard_range(total, num_shards, j)
        for i in range(a, b):
            owners[i] += 1
    assert owners == [1] * total


def test_bad_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--num-shards"):
        shard_ranges(10, 0)
    with pytest.raises(ConfigError, match="--shard"):
        shard_range(10, 2, 2)
