"""LayerNormalization, BatchNormalization and GroupNormalization, with Keras's arguments, defaults
and weights.

Each standardizes its input over some axes, then scales by gamma and shifts by beta.
LayerNormalization takes the moments of each sample over `axis`; BatchNormalization, in training,
those of the batch per channel (the last axis), and at inference its moving mean and variance.
Over the last axis (LayerNormalization's default) and for BatchNormalization the backend's
layer_norm and batch_norm kernels run (the reference ones are pserver.ops.nn's NumPy, which the
CPU takes: the work is memory-bound; CUDA's on the GPU); other axes run pserver.ops.nn here.

BatchNormalization's moving statistics are weights that training does not differentiate: they
live on the shards (non-trainable, so the optimizer leaves them) and are marked as statistics
(Weight.momentum), which the shards update from the workers' batch statistics
(pserver.server.statistics, docs/semantics.md). What a worker pushes in their gradient slots
is its batch's statistics: m - c for the mean, c the moving mean it pulled, and v + (m - c)^2
for the variance, from which the shard takes the union of the workers' batches (see there).
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import initializers
from pserver.layers.base import Layer, Weight, rows
from pserver.ops.nn import moments, standardize_vjp, standardized


def _unsupported(owner: str, **given) -> None:
    bad = {k: v for k, v in given.items() if v not in (None, False)}
    if bad:
        k = sorted(bad)[0]
        raise ConfigError(f"{owner}: {k}={bad[k]!r} is not supported (docs/guide/keras.md)")


def _epsilon(owner: str, epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ConfigError(f"{owner}: epsilon must be a positive number, got {epsilon!r}")
    return float(epsilon)


class _Normalization(Layer):
    """gamma and beta (as `center` and `scale` ask) over the normalized values y."""
    supports_masking = True

    def __init__(self, epsilon, center, scale, beta_initializer, gamma_initializer, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.epsilon = _epsilon(owner, epsilon)
        self.center, self.scale = bool(center), bool(scale)
        self.beta_initializer = initializers.get(beta_initializer, f"{owner}: beta_initializer")
        self.gamma_initializer = initializers.get(gamma_initializer, f"{owner}: gamma_initializer")

    def output_shape_for(self, input_shape):
        return input_shape

    def affine_weights(self, shape: tuple[int, ...]) -> list[Weight]:
        return ([Weight("gamma", shape, self.gamma_initializer)] if self.scale else []) + \
               ([Weight("beta", shape, self.beta_initializer)] if self.center else [])

    def affine(self, p: dict, y, out, shape) -> None:
        """out[:] = y * gamma + beta, gamma and beta reshaped to `shape` to broadcast."""
        if self.scale:
            np.multiply(y, p["gamma"].reshape(shape), out=out)
        else:
            np.copyto(out, y)
        if self.center:
            out += p["beta"].reshape(shape)

    def affine_grads(self, p: dict, g: dict, y, dout, sum_axes, shape):
        """gamma's and beta's gradients into g; returns d loss / d y."""
        if self.center:
            g["beta"][...] = dout.sum(axis=sum_axes).reshape(g["beta"].shape)
        if not self.scale:
            return dout
        g["gamma"][...] = (dout * y).sum(axis=sum_axes).reshape(g["gamma"].shape)
        return dout * p["gamma"].reshape(shape)


class LayerNormalization(_Normalization):
    """Each sample standardized over `axis` (default the last), then gamma * y + beta."""

    kind = "layer_normalization"

    def __init__(self, axis=-1, epsilon: float = 1e-3, center: bool = True, scale: bool = True,
                 rms_scaling: bool = False, beta_initializer="zeros", gamma_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 **kwargs):
        _unsupported("LayerNormalization", rms_scaling=rms_scaling, beta_regularizer=beta_regularizer,
                     gamma_regularizer=gamma_regularizer, beta_constraint=beta_constraint,
                     gamma_constraint=gamma_constraint)
        super().__init__(epsilon, center, scale, beta_initializer, gamma_initializer, **kwargs)
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if not axes or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes):
            raise ConfigError(f"LayerNormalization: axis must be an integer or a list of them, got {axis!r}")
        self.axis = [int(a) for a in axes]

    def output_shape_for(self, input_shape):
        rank = len(input_shape) + 1          # with the batch
        if any(not -rank <= a < rank or a % rank == 0 for a in self.axis):
            raise ConfigError(f"{self.label}: axis {self.axis} must name axes of the input {input_shape} "
                              "other than the batch (0)")
        self.axes = tuple(sorted({a % rank - rank for a in self.axis}))     # negative: any batch size
        return input_shape

    def weights(self):
        return self.affine_weights(tuple(self.input_shape[a] for a in self.axes))

    def _shape(self):
        shape = [1] * (len(self.input_shape) + 1)
        for a in self.axes:
            shape[a] = self.input_shape[a]
        return tuple(shape)

    @property
    def over_last_axis(self) -> bool:
        """Whether it normalizes over the last axis alone (Keras's default): the backend's
        layer_norm kernels then run it, on the host or the GPU; other axes run NumPy here."""
        return self.axes == (-1,)

    def scratch(self, n, dtype):
        s = {"y": np.empty((n, *self.output_shape), dtype)}
        if self.over_last_axis:
            s["scale"] = np.empty((n, *self.output_shape[:-1], 1), dtype)
        return s

    def forward(self, k, p, x, out, s, run):
        if self.over_last_axis:
            k.layer_norm_forward(rows(x), p.get("gamma"), p.get("beta"), self.epsilon, rows(s["y"]),
                                 rows(s["scale"]), rows(out))
            return
        y, s["scale"] = standardized(x, *moments(x, self.axes), self.epsilon)
        s["y"][...] = y
        self.affine(p, y, out, self._shape())

    def backward(self, k, p, g, x, out, dout, dx, s):
        if self.over_last_axis:
            k.layer_norm_backward(rows(dout), rows(s["y"]), rows(s["scale"]), p.get("gamma"), g.get("gamma"),
                                  g.get("beta"), rows(dx))
            return
        others = tuple(a for a in range(x.ndim) if a - x.ndim not in self.axes)
        dy = self.affine_grads(p, g, s["y"], dout, others, self._shape())
        if dx is not None:
            dx[...] = standardize_vjp(dy, s["y"], s["scale"], self.axes)


class BatchNormalization(_Normalization):
    """Per channel (the last axis): in training, standardized with the batch's moments; at
    inference (and when the layer is frozen, as Keras's) with the moving mean and variance."""

    kind = "batch_normalization"

    def __init__(self, axis=-1, momentum: float = 0.99, epsilon: float = 1e-3, center: bool = True,
                 scale: bool = True, beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones", beta_regularizer=None,
                 gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 synchronized: bool = False, **kwargs):
        _unsupported("BatchNormalization", beta_regularizer=beta_regularizer,
                     gamma_regularizer=gamma_regularizer, beta_constraint=beta_constraint,
                     gamma_constraint=gamma_constraint, synchronized=synchronized)
        super().__init__(epsilon, center, scale, beta_initializer, gamma_initializer, **kwargs)
        if axis != -1:
            raise ConfigError(f"BatchNormalization: axis={axis!r}: pserver's tensors are channels-last; "
                              "only axis=-1 is supported")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise ConfigError(f"BatchNormalization: momentum must be in [0, 1], got {momentum!r}")
        self.axis, self.momentum = -1, float(momentum)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer,
                                                        "BatchNormalization: moving_mean_initializer")
        self.moving_variance_initializer = initializers.get(moving_variance_initializer,
                                                            "BatchNormalization: moving_variance_initializer")

    def weights(self):
        c = (self.input_shape[-1],)
        return self.affine_weights(c) + [
            Weight("moving_mean", c, self.moving_mean_initializer, trainable=False, momentum=self.momentum),
            Weight("moving_variance", c, self.moving_variance_initializer, trainable=False,
                   momentum=self.momentum)]

    def scratch(self, n, dtype):
        c = self.input_shape[-1]
        return {"y": np.empty((n, *self.output_shape), dtype), "scale": np.empty(c, dtype),
                "batch_mean": np.empty(c, dtype), "batch_var": np.empty(c, dtype),
                "sums": np.empty((2, c), dtype)}

    def forward(self, k, p, x, out, s, run):
        """The backend's batch_norm kernels on the channels as columns (x as (rows, c)), on the
        host or the GPU: in training the batch's moments, else the moving ones."""
        s["training"] = run.training and self.trainable
        s["mean"], s["var"] = (s["batch_mean"], s["batch_var"]) if s["training"] else \
            (p["moving_mean"], p["moving_variance"])
        k.batch_norm_forward(rows(x), p.get("gamma"), p.get("beta"), s["mean"], s["var"], s["training"],
                             self.epsilon, rows(s["y"]), s["scale"], rows(out))

    def backward(self, k, p, g, x, out, dout, dx, s):
        k.batch_norm_backward(rows(dout), rows(s["y"]), s["scale"], p.get("gamma"), s["training"],
                              g.get("gamma"), g.get("beta"), s["sums"], rows(dx))
        # The statistics' slots carry the batch's moments to the shards (the module's docstring);
        # a pass at inference sends the moving values back, which leaves them as they are.
        k.batch_norm_statistics(s["mean"], s["var"], p["moving_mean"], g["moving_mean"], g["moving_variance"])


class GroupNormalization(_Normalization):
    """Keras's GroupNormalization: the channels (the last axis) cut into `groups` runs of
    channels // groups, each sample standardized over its positions and one group's channels,
    then gamma * y + beta per channel."""

    kind = "group_normalization"

    def __init__(self, groups: int = 32, axis=-1, epsilon: float = 1e-3, center: bool = True,
                 scale: bool = True, beta_initializer="zeros", gamma_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 **kwargs):
        _unsupported("GroupNormalization", beta_regularizer=beta_regularizer,
                     gamma_regularizer=gamma_regularizer, beta_constraint=beta_constraint,
                     gamma_constraint=gamma_constraint)
        super().__init__(epsilon, center, scale, beta_initializer, gamma_initializer, **kwargs)
        if axis != -1:
            raise ConfigError(f"GroupNormalization: axis={axis!r}: pserver's tensors are channels-last; "
                              "only axis=-1 is supported")
        if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
            raise ConfigError(f"GroupNormalization: groups must be a positive integer, got {groups!r}")
        self.axis, self.groups = -1, int(groups)

    def output_shape_for(self, input_shape):
        channels = input_shape[-1]
        if channels % self.groups:
            raise ConfigError(f"{self.label}: {channels} channels (input {input_shape}) do not split into "
                              f"groups={self.groups} groups of equal size")
        return input_shape

    def weights(self):
        return self.affine_weights((self.input_shape[-1],))

    def _grouped(self, a):
        """a as (n, ..., groups, channels per group), and the axes each group's moments span."""
        grouped = a.reshape(*a.shape[:-1], self.groups, -1)
        return grouped, tuple(range(1, grouped.ndim - 2)) + (grouped.ndim - 1,)

    def scratch(self, n, dtype):
        return {"y": np.empty((n, *self.output_shape), dtype)}

    def forward(self, k, p, x, out, s, run):
        xg, axes = self._grouped(x)
        y, s["scale"] = standardized(xg, *moments(xg, axes), self.epsilon)
        s["y"][...] = y.reshape(x.shape)
        self.affine(p, s["y"], out, (self.input_shape[-1],))

    def backward(self, k, p, g, x, out, dout, dx, s):
        dy = self.affine_grads(p, g, s["y"], dout, tuple(range(x.ndim - 1)), (self.input_shape[-1],))
        if dx is not None:
            yg, axes = self._grouped(s["y"])
            dx[...] = standardize_vjp(self._grouped(dy)[0], yg, s["scale"], axes).reshape(x.shape)


__all__ = ["LayerNormalization", "BatchNormalization", "GroupNormalization"]
