"""Independent twins that tests compare pserver's code with, written from the published algorithm."""

from __future__ import annotations


def splitmix64_python(seed, count):
    """splitmix64 as published (Steele, Lea and Flood 2014; Vigna's splitmix64.c), in Python ints."""
    out, state, m = [], seed, (1 << 64) - 1
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & m
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(z ^ (z >> 31))
    return out
