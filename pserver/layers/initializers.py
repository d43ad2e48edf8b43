"""Weight initialisers with Keras's names: each fills a view of the flat vector in place.

All of them draw from one `numpy.random.Generator`, in layout order, so the same seed gives the
same initial vector on every worker. `fans(shape)` follows Keras: a dense kernel (in, out) has
fans (in, out); a conv kernel (kh, kw, c, f) has (kh*kw*c, kh*kw*f).
"""

from __future__ import annotations

import abc
import math

import numpy as np

from pserver.errors import ConfigError

DISTRIBUTIONS = ("truncated_normal", "untruncated_normal", "uniform")
MODES = ("fan_in", "fan_out", "fan_avg")
# The std of a standard normal truncated to [-2, 2]: Keras divides by it so the truncated
# draw keeps the asked-for variance.
_TRUNCATED_STD = 0.87962566103423978


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


class Initializer(abc.ABC):
    @abc.abstractmethod
    def __call__(self, rng: np.random.Generator, out: np.ndarray) -> None:
        """Fill `out` in place with initial values drawn from `rng`."""


class Zeros(Initializer):
    def __call__(self, rng, out):
        out[...] = 0      # draws nothing: a zero bias does not move the stream


class Ones(Initializer):
    def __call__(self, rng, out):
        out[...] = 1      # draws nothing, as Zeros (BatchNormalization's gamma, a scale)


class RandomUniform(Initializer):
    def __init__(self, minval: float = -0.05, maxval: float = 0.05):
        self.minval, self.maxval = float(minval), float(maxval)

    def __call__(self, rng, out):
        out[...] = rng.uniform(self.minval, self.maxval, out.shape)


class RandomNormal(Initializer):
    def __init__(self, mean: float = 0.0, stddev: float = 0.05):
        self.mean, self.stddev = float(mean), float(stddev)

    def __call__(self, rng, out):
        out[...] = rng.normal(self.mean, self.stddev, out.shape)


class VarianceScaling(Initializer):
    """Keras's VarianceScaling: variance scale / fan, drawn from `distribution`."""

    def __init__(self, scale: float = 1.0, mode: str = "fan_in",
                 distribution: str = "truncated_normal"):
        if mode not in MODES:
            raise ConfigError(f"VarianceScaling: mode {mode!r} is not one of {', '.join(MODES)}")
        if distribution not in DISTRIBUTIONS:
            raise ConfigError(f"VarianceScaling: distribution {distribution!r} is not one of "
                              f"{', '.join(DISTRIBUTIONS)}")
        if not scale > 0:
            raise ConfigError(f"VarianceScaling: scale must be > 0, got {scale}")
        self.scale, self.mode, self.distribution = float(scale), mode, distribution

    def __call__(self, rng, out):
        fan_in, fan_out = fans(out.shape)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        var = self.scale / max(1.0, fan)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * var)
            out[...] = rng.uniform(-limit, limit, out.shape)
        elif self.distribution == "untruncated_normal":
            rng.standard_normal(out.shape, dtype=np.float32, out=out)
            out *= np.float32(math.sqrt(var))
        else:
            out[...] = _truncated_normal(rng, out.shape) * (math.sqrt(var) / _TRUNCATED_STD)


class Orthogonal(Initializer):
    """Keras's Orthogonal (the recurrent layers' recurrent_kernel): the Q of a normal draw's QR
    factorization, signs fixed by R's diagonal, over the shape flattened to (rows, last)."""

    def __init__(self, gain: float = 1.0):
        self.gain = float(gain)

    def __call__(self, rng, out):
        rows, cols = math.prod(out.shape[:-1]), out.shape[-1]
        q, r = np.linalg.qr(rng.standard_normal((max(rows, cols), min(rows, cols))))
        q *= np.sign(np.diag(r))
        out[...] = self.gain * (q.T if rows < cols else q).reshape(out.shape)


def _truncated_normal(rng, shape) -> np.ndarray:
    """Standard normal redrawn outside [-2, 2], as Keras does."""
    z = rng.standard_normal(shape)
    bad = np.abs(z) > 2
    while bad.any():
        z[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(z) > 2
    return z


_NAMED = {
    "zeros": Zeros,
    "ones": Ones,
    "uniform": RandomUniform,
    "random_uniform": RandomUniform,
    "normal": RandomNormal,
    "random_normal": RandomNormal,
    "orthogonal": Orthogonal,
    "glorot_uniform": lambda: VarianceScaling(1.0, "fan_avg", "uniform"),
    "glorot_normal": lambda: VarianceScaling(1.0, "fan_avg", "truncated_normal"),
    "he_uniform": lambda: VarianceScaling(2.0, "fan_in", "uniform"),
    "he_normal": lambda: VarianceScaling(2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": lambda: VarianceScaling(1.0, "fan_in", "uniform"),
    "lecun_normal": lambda: VarianceScaling(1.0, "fan_in", "truncated_normal"),
}


def get(spec, owner: str) -> Initializer:
    """An Initializer from a Keras name or an Initializer; `owner` names the argument."""
    if isinstance(spec, Initializer):
        return spec
    if isinstance(spec, str) and spec in _NAMED:
        return _NAMED[spec]()
    raise ConfigError(f"{owner}: unknown initializer {spec!r}; choose one of {', '.join(_NAMED)} "
                      "or pass an Initializer")


__all__ = ["Initializer", "Zeros", "Ones", "RandomUniform", "RandomNormal", "VarianceScaling", "Orthogonal",
           "fans", "get"]
