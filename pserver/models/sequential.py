"""Sequential: a list of layers, as in Keras, trained on a flat parameter vector.

The layout is the layers' weights end to end, named "<layer>/<weight>" ("dense/kernel",
"conv2d/bias"), so shards, modes, checkpoints and the data plane see one flat vector of named
tensors whatever the layers are. Every layer writes its gradient straight into its views of
`grad_out`. Activations, deltas and scratch are preallocated per thread and batch size.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from pserver.errors import ConfigError, DataError
from pserver.kernels import get_backend
from pserver.layers import deserialize, serialize
from pserver.layers.base import Layer, Pass, as_shape
from pserver.models import losses, metrics
from pserver.models.base import BatchBuffers, Model, shaped_for
from pserver.models.layout import Layout


class Sequential(Model):
    """Sequential([Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)), ...]).

    `input_shape` goes on the first layer or here (without the batch dimension). The loss is
    sparse categorical cross-entropy from logits unless `compile(loss=...)` says otherwise.
    """

    def __init__(self, layers=(), input_shape=None, name: str = "sequential",
                 loss="sparse_categorical_crossentropy", backend: str = "cpu"):
        self.name = name
        self._built = False
        self.layers: list[Layer] = []
        self._input_shape = input_shape
        self.loss = losses.get(loss)
        self.output_activation = "linear"   # a softmax/sigmoid fused into the loss: see losses
        self.metrics: list[str] = []
        self.use_backend(backend)
        self._seeds = itertools.count()
        self._buffers = BatchBuffers(lambda n, dtype: _Buffers(self.layers, n, dtype))
        for layer in layers:
            self.add(layer)

    def add(self, layer: Layer) -> None:
        if not isinstance(layer, Layer):
            raise ConfigError(f"Sequential: {layer!r} is not a layer (pserver.layers.*)")
        if layer.traced or layer.takes_list:
            raise ConfigError(f"Sequential: {layer.label} runs in a graph (its call traced, or several "
                              "inputs): build the model with keras.Model(inputs, outputs)")
        if self._built:
            raise ConfigError("Sequential: the model is built (its layout is fixed); add layers first")
        self._name(layer)
        self.layers.append(layer)

    def compile(self, optimizer=None, loss="sparse_categorical_crossentropy",
                metrics=None) -> "Sequential":
        """The loss and the metrics (accuracy, plus AUC for a binary loss; r2 for regression).
        The optimizer runs on the shards: this model takes none (pserver.keras's Sequential
        takes one and gives it to the shards it starts, or checks it against theirs)."""
        if optimizer is not None:
            raise ConfigError(f"compile: optimizer={optimizer!r}: the optimizer runs on the shards; "
                              "give it to them (pserver serve --optimizer adam --lr 0.001, or "
                              "pserver.train(..., optimizer='adam', lr=0.001)), or use "
                              "pserver.keras.Sequential, whose fit starts them")
        self.metrics = check_metrics(metrics)
        self.loss = losses.get(loss)
        if self._built:
            self.loss.check_outputs(self.output_shape[-1], self.name)
            self._link_loss()
        return self

    def use_backend(self, backend: str) -> "Sequential":
        """Compute with this kernel module: "cpu" (numba) or "reference" (NumPy)."""
        if backend == "cuda":
            raise ConfigError("Sequential.use_backend: for cuda use pserver.models.on_device")
        self.backend, self.kernels = backend, get_backend(backend)
        return self

    # -- building ------------------------------------------------------------------------------

    def build(self, input_shape=None) -> "Sequential":
        """Fix every shape and the layout; a shape that cannot work names the layer and shapes."""
        if self._built:
            return self
        if not self.layers:
            raise ConfigError(f"{self.name}: has no layers")
        shape = input_shape or self._input_shape or self.layers[0].input_shape
        if shape is None:
            raise ConfigError(f"{self.name}: no input shape; give input_shape= to the first layer "
                              "or to Sequential")
        self._check_names()
        shapes = [as_shape("input_shape", shape)]
        for layer in self.layers:
            shapes.append(layer.build(shapes[-1]))
        self._fix_layout(shapes)
        # Layer i computes d loss / d input only if a layer below it has weights.
        self._needs_dx = [any(self._weights[:i]) for i in range(len(self._weights))]
        self._built = True
        return self

    def _fix_layout(self, shapes: list[tuple[int, ...]]) -> None:
        """The layout (every layer's weights, in order) and the loss on the output; `shapes`:
        the input's first, the output's last."""
        weights = [layer.weights() for layer in self.layers]
        layout = Layout.of((f"{layer.name}/{w.name}", w.shape)
                           for layer, ws in zip(self.layers, weights) for w in ws)
        shape = shapes[-1]
        if layout.total == 0:
            raise ConfigError(f"{self.name}: has no parameters to train (layers: "
                              f"{', '.join(layer.name for layer in self.layers)})")
        if len(shape) != 1:
            raise ConfigError(f"{self.name}: {self._output_label()} outputs {shape}; end with "
                              "Flatten() and Dense(...)")
        self.loss.check_outputs(shape[0], self.name)
        self._link_loss()
        self._shapes, self._layout, self._weights = shapes, layout, weights

    def _output_layer(self) -> Layer | None:
        """The layer that computes the model's output (its activation may fuse into the loss)."""
        return self.layers[-1]

    def _output_label(self) -> str:
        last = self._output_layer()
        return "the output" if last is None else f"the last layer ({last.label})"

    def _link_loss(self) -> None:
        """A softmax (sigmoid) last layer before a cross-entropy: the layer computes logits and
        the loss takes them (fused, stable); predict applies the activation. A softmax anywhere
        else is refused: no kernel computes it, or its gradient, on its own."""
        last = self._output_layer()
        for layer in self.layers:
            if layer is not last and getattr(layer, "activation", None) == "softmax":
                raise ConfigError(f"{self.name}: {layer.label}: activation='softmax' is supported on the "
                                  "last layer only (before a categorical cross-entropy)")
        if not hasattr(last, "activation"):
            self.output_activation = "linear"
            return
        declared = getattr(last, "declared_activation", last.activation)
        last.declared_activation = declared
        fused = self.loss.check_activation(declared, f"{self.name}: {self._output_label()}")
        last.activation = "linear" if fused else declared
        self.output_activation = declared if fused else "linear"

    # -- configs (Keras's get_config / from_config) --------------------------------------------

    def get_config(self) -> dict:
        """The model's definition as JSON: each layer's class and config, the input shape, the
        loss. `Sequential.from_config` builds the same model (weights are not in it)."""
        shape = self._input_shape or (self._shapes[0] if self._built else None)
        return {"name": self.name,
                "input_shape": None if shape is None else list(shape),
                "layers": self._layer_configs(self.layers),
                "loss": self.loss.get_config(), "metrics": list(getattr(self, "metrics", ()))}

    def _layer_configs(self, layers: list[Layer]) -> list[dict]:
        """Each layer's class name and config (pserver.layers.serialize)."""
        return [serialize(layer, self.name) for layer in layers]

    @classmethod
    def from_config(cls, config: dict, **kwargs) -> "Sequential":
        """The Sequential `config` describes (pserver.models.from_config builds either kind)."""
        try:
            layers = [deserialize(entry) for entry in config["layers"]]
            shape = config.get("input_shape")
            model = cls(layers, input_shape=None if shape is None else tuple(shape),
                        name=config.get("name", "sequential"), loss=losses.get(config["loss"]), **kwargs)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"a Sequential's config: {type(e).__name__} {e}") from None
        model.metrics = check_metrics(config.get("metrics"))
        return model

    def _name(self, layer: Layer) -> None:
        """Keras's default names (dense, dense_1, ...), numbered within this model."""
        if layer.name:
            return
        taken = {other.name for other in self.layers}
        n = 0
        while (name := layer.kind if n == 0 else f"{layer.kind}_{n}") in taken:
            n += 1
        layer.name = name

    def _check_names(self) -> None:
        names = [layer.name for layer in self.layers]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ConfigError(f"{self.name}: two layers are named {dup!r}")

    @property
    def layout(self) -> Layout:
        return self.build()._layout

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Without the batch dimension, as Keras's."""
        return self.build()._shapes[0]

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.build()._shapes[-1]

    @property
    def task(self) -> str:
        return self.loss.task

    @property
    def num_classes(self) -> int:
        if self.task == "regression":
            return 0
        return max(2, self.output_shape[-1])

    @property
    def in_features(self) -> int:
        return int(np.prod(self.input_shape))

    def summary(self, line_length: int | None = None, print_fn=None) -> None:
        """Keras's table (its plain-text form): layer (type), output shape, parameter count,
        and the totals; printed, or given line by line to print_fn, as Keras's. Returns None,
        as Keras's does: `summary_text()` is the same table as a string."""
        if line_length is not None:
            raise ConfigError("summary: line_length is not supported (docs/guide/keras.md)")
        for line in self.summary_text().splitlines():
            (print_fn or print)(line)

    def summary_text(self) -> str:
        sizes = {t.name: t.size for t in self.layout.tensors}
        rule, cols = "_" * 65, (29, 26, 10)

        def row(*cells):
            return " " + "".join(f"{c:<{w}}" for c, w in zip(cells, cols)).rstrip()

        lines = [f'Model: "{self.name}"', rule, row("Layer (type)", "Output Shape", "Param #"), "=" * 65]
        for i, layer in enumerate(self.layers):
            n = sum(v for k, v in sizes.items() if k.startswith(layer.name + "/"))
            lines.append(row(f"{layer.name} ({type(layer).__name__})", str((None, *layer.output_shape)),
                             f"{n}"))
            lines.append("" if i < len(self.layers) - 1 else "=" * 65)
        total = self.layout.total
        lines += [f"Total params: {total:,}", f"Trainable params: {total:,}", "Non-trainable params: 0",
                  rule]
        return "\n".join(lines)

    # -- parameters ----------------------------------------------------------------------------

    def init_params(self, seed: int) -> np.ndarray:
        """Each weight from its initialiser, in layout order, from one generator seeded `seed`."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.layout.total, dtype=np.float32)
        views = self.layout.views(flat)
        for layer, weights in zip(self.layers, self._weights):
            for w in weights:
                w.initializer(rng, views[f"{layer.name}/{w.name}"])
        return flat

    def _per_layer(self, flat_views: dict) -> list[dict]:
        """Each layer's views by short name ("kernel"), from the model's ("dense/kernel")."""
        return [{w.name: flat_views[f"{layer.name}/{w.name}"] for w in weights}
                for layer, weights in zip(self.layers, self._weights)]

    # -- training ------------------------------------------------------------------------------

    def loss_and_grad(self, w, x, y, grad_out, seed: int | None = None):
        """Mean loss of the batch; its gradient into grad_out. `seed` draws dropout masks
        (the worker derives one per rank and step); None takes the next of a counter."""
        x, y = self._check_batch(w, x, y)
        # A strided grad_out would make layout.views copy, and the gradient would be lost.
        if grad_out.shape != w.shape or grad_out.dtype != w.dtype or not grad_out.flags.c_contiguous:
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector of shape {w.shape}, "
                             f"got {grad_out.dtype} {grad_out.shape} with strides {grad_out.strides}")
        params = self._per_layer(self.layout.views(w))
        grads = self._per_layer(self.layout.views(grad_out))
        bufs = self._buffers(x.shape[0], w.dtype)
        run = Pass(training=True, seed=next(self._seeds) if seed is None else int(seed))
        ins = self._forward(params, x, bufs, run)
        if self.task != "regression":       # the batch's accuracy, for Keras's per-epoch metric
            self.batch_correct = metrics.accuracy(ins[-1], y)
        loss = self.loss(self.kernels, ins[-1], y, bufs.douts[-1])
        self._backward(params, grads, ins, bufs)
        return float(loss)

    def _forward(self, params, x, bufs, run, k=None) -> list[np.ndarray]:
        """[input, output of layer 0, output of layer 1, ...]. `k`: the kernels, if not this
        model's (CudaSequential passes the CUDA ones, bound to its stream, and device arrays)."""
        k = self.kernels if k is None else k
        acts = [x]
        for layer, p, out, s in zip(self.layers, params, bufs.outs, bufs.scratch):
            inp = acts[-1]
            if layer.reshapes_only:
                out = inp.reshape((inp.shape[0], *layer.output_shape))
            else:
                layer.forward(k, p, inp, out, s, run)
            acts.append(out)
        return acts

    def _backward(self, params, grads, acts, bufs, k=None) -> None:
        """From the top down; bufs.douts[i] = d loss / d (output of layer i). A reshaping
        layer has nothing to do: the buffer below it is a view of its own."""
        k = self.kernels if k is None else k
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            if layer.reshapes_only:
                continue
            dx = bufs.douts[i - 1] if self._needs_dx[i] else None
            layer.backward(k, params[i], grads[i], acts[i], acts[i + 1],
                           bufs.douts[i], dx, bufs.scratch[i])

    # -- checks --------------------------------------------------------------------------------

    @property
    def _takes_ids(self) -> bool:
        return getattr(self.layers[0], "takes_ids", False)

    def _check_ids(self, x) -> None:
        self.layers[0].check_ids(x)

    def _check_batch(self, w, x, y):
        """x as C-contiguous (n, *input_shape), y as the loss's labels; else ValueError."""
        self._check_w(w)
        x, y = self._fit(x, y)
        y = np.ascontiguousarray(y, dtype=self.loss.label_dtype(w.dtype))
        return np.ascontiguousarray(x, dtype=None if self._takes_ids else w.dtype), y

    def _check_w(self, w) -> None:
        if w.shape != (self.layout.total,) or w.dtype.kind != "f":
            raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}; "
                             f"{self.name} needs float ({self.layout.total},)")

    def _fit_x(self, x) -> np.ndarray:
        """x reshaped to the input; ValueError naming the layer and the shapes if it does not fit."""
        x = np.asarray(x)
        first = self.layers[0].label
        shaped = shaped_for(x, self.input_shape) if x.ndim >= 1 and x.shape[0] > 0 else None
        if shaped is None:
            raise ValueError(f"x has shape {x.shape}; {first} takes (n >= 1, "
                             f"{', '.join(map(str, self.input_shape))})")
        if x.dtype.kind not in "biuf":
            raise ValueError(f"x has dtype {x.dtype}; {first} takes numbers")
        return shaped

    def _fit(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """x reshaped to the input; ValueError naming the layer and the shapes if it does not
        fit, or if a label is outside what the last layer and the loss take."""
        shaped, y = self._fit_x(x), self.loss.labels(y)
        if y.shape != (shaped.shape[0],):
            raise ValueError(f"y has shape {y.shape}; x has {shaped.shape[0]} rows")
        if self.task != "regression" and y.size:
            hi = 1 if isinstance(self.loss, losses.BinaryCrossentropy) else self.output_shape[-1] - 1
            bad = (y < 0) | (y > hi) | (y != np.floor(y))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"label out of range: y[{i}] = {y[i].item()!r}; "
                                 f"{self._output_label()} with {self.loss.name} takes 0..{hi}")
        return shaped, y

    def check_data(self, x: np.ndarray, y: np.ndarray, what: str = "data") -> np.ndarray:
        """Everything about a whole dataset that would fail later, now; x reshaped to fit.

        The shape against the input, labels against the outputs, NaN or Inf in x, ids
        against an Embedding's input_dim: DataError naming `what`, the layer and the shapes.
        """
        try:
            x, y = self._fit(x, y)
            if self._takes_ids:
                self._check_ids(x)
        except ValueError as e:
            raise DataError(f"{what}: {e}") from None
        if not self._takes_ids and x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            raise DataError(f"{what}: x has NaN or Inf values in {int(bad.sum())} samples, the "
                            f"first at index {int(np.argmax(bad))}")
        return x

    # -- evaluation ----------------------------------------------------------------------------

    def predict(self, w, x, batch_size=4096) -> np.ndarray:
        """The last layer's outputs for every sample of x, (n, units) in w's dtype: logits for
        a classifier (argmax is the class), the prediction for regression."""
        self._check_w(w)
        x = np.ascontiguousarray(self._fit_x(x), dtype=None if self._takes_ids else w.dtype)
        params = self._per_layer(self.layout.views(w))
        out = np.empty((x.shape[0], *self.output_shape), w.dtype)
        batch_size = self._chunk(batch_size, w.dtype)
        for a in range(0, x.shape[0], batch_size):
            xb = x[a:a + batch_size]
            out[a:a + len(xb)] = self._forward(params, xb, self._buffers(len(xb), w.dtype),
                                               Pass(training=False))[-1]
        return out

    def _chunk(self, batch_size: int, dtype) -> int:
        """How many samples evaluation and prediction run at once: at most `batch_size`, and
        few enough that their arrays (EVAL_CHUNK_BYTES) stay in a core's cache. The results
        are the same per sample whatever the chunk; only the time differs."""
        elements = sum(layer.forward_elements() for layer in self.build().layers)
        per_sample = elements * np.dtype(dtype).itemsize
        return max(1, min(int(batch_size), EVAL_CHUNK_BYTES // max(per_sample, 1)))

    def evaluate(self, w, x, y, batch_size=4096, threads=1):
        """Loss plus accuracy (and AUC for a binary loss), or r2 for regression, over all of x.
        `threads`: run the chunks on that many threads (the kernels release the GIL), each with
        its own buffers; the result is the same whatever the number (chunks summed in order)."""
        x, y = self._check_batch(w, x, y)
        params = self._per_layer(self.layout.views(w))
        n = x.shape[0]
        batch_size = self._chunk(batch_size, w.dtype)
        starts = range(0, n, batch_size)
        parts: list = [None] * len(starts)

        def chunk(i: int) -> None:
            a = starts[i]
            xb, yb = x[a:a + batch_size], y[a:a + batch_size]
            bufs = self._buffers(xb.shape[0], w.dtype)
            out = self._forward(params, xb, bufs, Pass(training=False))[-1]
            # The loss also writes a gradient: a small scratch array, so evaluation never
            # allocates the per-layer gradient buffers (at 4096 images, hundreds of MB).
            loss = self.loss(self.kernels, out, yb, np.empty_like(out)) * xb.shape[0]
            if self.task == "regression":
                parts[i] = (loss, float(np.sum((out[:, 0].astype(np.float64) - yb) ** 2)), None)
            else:
                parts[i] = (loss, metrics.accuracy(out, yb), out[:, 0].copy() if out.shape[1] == 1 else None)

        each_index(chunk, len(starts), threads)
        loss_sum, total = 0.0, 0
        for loss, count, _ in parts:          # in chunk order: the sums of one thread's loop
            loss_sum += loss
            total += count
        if self.task == "regression":
            return {"loss": loss_sum / n, "r2": metrics.r2(total, y)}
        result = {"loss": loss_sum / n, "accuracy": total / n}
        scores = [p[2] for p in parts if p[2] is not None]
        if scores:
            result["auc"] = metrics.auc(np.concatenate(scores), y)
        return result


def each_index(fn, count: int, threads: int) -> None:
    """fn(i) for i in range(count): in this thread, or, threads > 1, on that many threads. The
    first exception raises here once every thread is done."""
    threads = max(1, min(int(threads), count))
    if threads == 1:
        for i in range(count):
            fn(i)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads, thread_name_prefix="pserver-eval") as pool:
        list(pool.map(fn, range(count)))


# Evaluation and prediction run the data in chunks whose arrays (each layer's output, a
# convolution's im2col matrix) take about this many bytes, so they stay in cache: keras.io's
# mnist_convnet (bench/keras_mnist_convnet.py) evaluated its 6,000 validation images on one core
# in 1.09 s of CPU in chunks of 4096 and 0.49 s in chunks of 8 or 16 (13 at this budget).
EVAL_CHUNK_BYTES = 4 << 20

METRICS = {"accuracy": "accuracy", "acc": "accuracy", "sparse_categorical_accuracy": "accuracy",
           "categorical_accuracy": "accuracy", "binary_accuracy": "accuracy", "auc": "auc", "r2": "r2"}


def check_metrics(metrics) -> list[str]:
    """Keras's metric names that evaluation reports (accuracy under its aliases, auc, r2)."""
    if metrics is None:
        return []
    if isinstance(metrics, str) or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"compile: metrics={metrics!r}: give a list of names "
                          f"({', '.join(METRICS)})")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError(f"compile: metrics: {unknown[0]!r} is not supported; evaluation reports "
                          "accuracy (and auc for binary_crossentropy) or r2 (mse)")
    return [METRICS[m] for m in metrics]


class _Buffers:
    """One batch size's arrays: each layer's output and d loss / d output, and its scratch."""

    def __init__(self, layers: list[Layer], n: int, dtype):
        self.layers, self.n, self.dtype = layers, n, dtype
        self.outs = [None if layer.reshapes_only else np.empty((n, *layer.output_shape), dtype)
                     for layer in layers]
        self.scratch = [layer.scratch(n, dtype) for layer in layers]

    @functools.cached_property
    def douts(self) -> list[np.ndarray]:
        """Made at the first training step of this size (evaluation needs none)."""
        layers, n = self.layers, self.n
        douts = [np.empty((n, *layer.output_shape), self.dtype) for layer in layers]
        for i in range(len(layers) - 1, 0, -1):
            if layers[i].reshapes_only:     # top down, so a chain of them shares one buffer
                douts[i - 1] = douts[i].reshape((n, *layers[i - 1].output_shape))
        return douts


__all__ = ["Sequential"]
