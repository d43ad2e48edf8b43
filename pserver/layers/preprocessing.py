"""Preprocessing of numbers, Keras's: Rescaling(scale, offset=0.0), x * scale + offset (a list
scales each channel); Normalization(axis=-1, mean=None, variance=None, invert=False), standardized
with given statistics or those `adapt` learns from data (non-trainable weights: on a cluster the
chief's, docs/semantics.md)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.layers.base import Layer, Weight
from pserver.layers.initializers import Initializer


def _factor(what: str, value) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        a = None
    if a is None or a.ndim > 1 or not np.all(np.isfinite(a)):
        raise ConfigError(f"Rescaling: {what} must be a finite number or a list of them (one per "
                          f"channel), got {value!r}")
    return a


class Rescaling(Layer):
    """x * scale + offset; a list gives each channel (the last axis) its own."""

    kind = "rescaling"
    supports_masking = True

    def __init__(self, scale, offset=0.0, **kwargs):
        super().__init__(**kwargs)
        self.scale, self.offset = _factor("scale", scale), _factor("offset", offset)

    def output_shape_for(self, input_shape):
        for what, a in (("scale", self.scale), ("offset", self.offset)):
            if a.ndim and a.size not in (1, input_shape[-1]):
                raise ConfigError(f"{self.label}: {what} has {a.size} values for {input_shape[-1]} channels")
        return input_shape

    def scratch(self, n, dtype):
        # scale and offset in the pass's dtype (as one value or one per channel: they broadcast),
        # where the backend reads them (device memory on the GPU)
        return {"scale": self.scale.astype(dtype).reshape(self.scale.shape or (1,)),
                "offset": self.offset.astype(dtype).reshape(self.offset.shape or (1,))}

    def forward(self, k, p, x, out, s, run):
        k.elementwise("multiply", x, s["scale"], out)
        k.elementwise("add", out, s["offset"], out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.elementwise("multiply", dout, s["scale"], dx)


class _Adapted(Initializer):
    """Fills one of Normalization's statistics with what `adapt` found when the weights are made
    (so an adapt after the model was built counts): the initial values the chief writes to the
    shards, and so what every worker pulls (docs/semantics.md)."""

    def __init__(self, layer: "Normalization", index: int):
        self.layer, self.index = layer, index

    def __call__(self, rng, out):
        shape = self.layer.stats_shape
        out[...] = (self.layer.adapted or (np.zeros(shape), np.ones(shape), 0.0))[self.index]


def _axes(axis) -> tuple[int, ...]:
    axes = () if axis is None else (axis,) if isinstance(axis, (int, np.integer)) else axis
    if not isinstance(axes, (tuple, list)) or not all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes):
        raise ConfigError(f"Normalization: axis must be an integer, a tuple of them or None, got {axis!r}")
    return tuple(int(a) for a in axes)


class Normalization(Layer):
    """(x - mean) / max(sqrt(variance), 1e-7) with a mean and variance per index of the kept
    `axis` (Keras's: axis counts the batch as 0; None: one of each for all values); invert=True
    maps back: mean + x * max(sqrt(variance), 1e-7). The statistics are given (mean=,
    variance=: constants, no weights, as Keras's) or learned by `adapt(data)` (the
    non-trainable weights mean, variance and count)."""

    supports_masking = True

    kind = "normalization"
    EPSILON = 1e-7                 # keras.backend.epsilon(), Keras's floor on the deviation

    def __init__(self, axis=-1, mean=None, variance=None, invert=False, **kwargs):
        super().__init__(**kwargs)
        self.axis, self.invert = _axes(axis), bool(invert)
        if (mean is None) != (variance is None):
            raise ConfigError("Normalization: give mean and variance together, or neither (then adapt)")
        if mean is not None and np.shape(mean) != np.shape(variance):
            raise ConfigError(f"Normalization: mean has shape {np.shape(mean)}, variance "
                              f"{np.shape(variance)}")
        if mean is not None and np.ndim(mean) > len(self.axis):
            raise ConfigError(f"Normalization: mean has {np.ndim(mean)} axes, more than axis={axis!r} keeps")
        self.given = None if mean is None else tuple(np.asarray(v, np.float64) for v in (mean, variance))
        self.adapted: tuple[np.ndarray, np.ndarray, float] | None = None

    def output_shape_for(self, input_shape):
        rank = len(input_shape) + 1                    # with the batch
        if any(not -rank <= a < rank or a % rank == 0 for a in self.axis):
            raise ConfigError(f"{self.label}: axis {self.axis} must name axes of the input {input_shape} "
                              "other than the batch (0)")
        self.keep = tuple(sorted(a % rank for a in self.axis))
        self.stats_shape = tuple((None, *input_shape)[a] for a in self.keep)
        self.broadcast = tuple(d if a in self.keep else 1 for a, d in enumerate((1, *input_shape)))
        if self.given is not None:
            self.constants = self._constants()
        if self.adapted is not None and self.adapted[0].shape != self.stats_shape:
            raise ConfigError(f"{self.label}: adapted on data with statistics of shape "
                              f"{self.adapted[0].shape}, called on {input_shape}")
        return input_shape

    def _constants(self) -> tuple[np.ndarray, np.ndarray]:
        """The given mean and variance broadcast over the input (Keras's: their axes are the
        last kept axes)."""
        shaped = []
        for v in self.given:
            shape = [1] * len(self.broadcast)
            for i in range(1, v.ndim + 1):
                shape[self.keep[-i]] = v.shape[-i]
            try:
                shaped.append(np.broadcast_to(v.reshape(shape), self.broadcast))
            except ValueError:
                raise ConfigError(f"{self.label}: mean of shape {v.shape} does not broadcast to the kept "
                                  f"axes' shape {self.stats_shape}") from None
        return tuple(shaped)

    def weights(self):
        if self.given is not None:
            return []
        return [Weight("mean", self.stats_shape, _Adapted(self, 0), trainable=False),
                Weight("variance", self.stats_shape, _Adapted(self, 1), trainable=False),
                Weight("count", (), _Adapted(self, 2), trainable=False)]

    def adapt(self, data) -> None:
        """The mean and variance (population) of `data` per kept index, in float64, as Keras's:
        an array at once; batches (an iterable of arrays or (x, y) tuples, a PyDataset) merged
        one by one. Set before the model's weights are first made (fit, predict, get_weights):
        they are the weights' initial values."""
        if self.given is not None:
            raise ConfigError(f"{self.label}: was given mean and variance; adapt learns them instead")
        batches = _batches(data)
        first = next(batches, None)
        if first is None:
            raise DataError(f"{self.label}: adapt got no data (an empty iterable)")
        self.build_once(first.shape[1:])
        reduce = tuple(a for a in range(first.ndim) if a not in self.keep)
        mean, var, count = np.zeros(self.stats_shape), np.zeros(self.stats_shape), 0
        for batch in itertools.chain([first], batches):
            if batch.shape[1:] != first.shape[1:]:
                raise DataError(f"{self.label}: adapt got batches of shapes {first.shape} and {batch.shape}")
            n = math.prod(batch.shape[a] for a in reduce)
            count += n
            w = n / count
            new_mean = mean * (1 - w) + batch.mean(axis=reduce) * w
            var = (var + (mean - new_mean) ** 2) * (1 - w) + (batch.var(axis=reduce) +
                                                              (batch.mean(axis=reduce) - new_mean) ** 2) * w
            mean = new_mean
        self.adapted = (mean, var, float(count))

    def _deviation(self, var, dtype):
        return np.maximum(np.sqrt(var), self.EPSILON).astype(dtype)

    def scratch(self, n, dtype):
        """The divisor (and given constants' mean), in the pass's dtype, where the backend reads
        them (device memory on the GPU): given statistics' made once here (in float64, then
        cast), learned ones' from the weights at each pass (forward)."""
        if self.given is None:
            return {"dev": np.empty(self.broadcast, dtype)}
        mean, var = self.constants
        return {"mean": mean.astype(dtype), "dev": self._deviation(var, dtype)}

    def forward(self, k, p, x, out, s, run):
        if self.given is None:
            mean = p["mean"].reshape(self.broadcast)
            k.deviation(p["variance"].reshape(self.broadcast), self.EPSILON, s["dev"])
        else:
            mean = s["mean"]
        if self.invert:
            k.elementwise("multiply", x, s["dev"], out)
            k.elementwise("add", out, mean, out)
        else:
            k.elementwise("subtract", x, mean, out)
            k.elementwise("divide", out, s["dev"], out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is None:
            return
        k.elementwise("multiply" if self.invert else "divide", dout, s["dev"], dx)
        for name in ("mean", "variance", "count"):     # statistics, not trained: no gradient
            if name in g:
                k.fill(g[name], 0.0)

    def get_config(self):
        config = super().get_config()
        config["axis"] = None if not self.axis else list(self.axis)
        for name, v in zip(("mean", "variance"), self.given or (None, None)):
            config[name] = None if v is None else v.tolist()
        return config


def _batches(data):
    """adapt's data as float64 arrays, batch by batch: an array is one batch; a PyDataset-like
    (__len__ and __getitem__) is read by index; another iterable yields batches; a tuple batch
    is (x, y, ...), of which x."""
    if isinstance(data, np.ndarray):
        items = iter([data])
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, (list, tuple)):
        items = (data[i] for i in range(len(data)))
    elif hasattr(data, "__iter__"):
        items = iter(data)
    else:
        raise ConfigError(f"Normalization.adapt: takes an array, an iterable of batches or a PyDataset, got "
                          f"{type(data).__name__}")
    for item in items:
        x = np.asarray(item[0] if isinstance(item, tuple) else item, np.float64)
        if x.ndim < 1:
            raise DataError("Normalization.adapt: a batch must have a batch dimension, got a scalar")
        yield x


__all__ = ["Rescaling", "Normalization"]
