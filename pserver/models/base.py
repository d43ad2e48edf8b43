"""What a model is to a worker, and the one kind of model pserver has: a stack of dense layers.

A model owns no parameters. It reads them from the flat vector `w` that the shards serve and
writes its gradient into a flat vector of the same layout, both through `Layout.views` (views,
no copies), so what the worker pushes is exactly what the kernels wrote.
"""

from __future__ import annotations

import abc
import threading

import numpy as np

from pserver.kernels import get_backend
from pserver.models.layout import Layout

# Activation buffers are kept per (batch size, dtype); a run sees a training size, the last
# short batch of an epoch and an evaluation size, so a handful is plenty.
_MAX_CACHED_BATCH_SIZES = 4


class Model(abc.ABC):
    """A model's parameters (its layout) and its math on a flat parameter vector."""

    name: str
    layout: Layout
    task: str            # "classification" or "regression"
    num_classes: int     # 0 for regression
    in_features: int

    @abc.abstractmethod
    def init_params(self, seed: int) -> np.ndarray:
        """A fresh flat float32 vector of length layout.total, the same for the same seed."""

    @abc.abstractmethod
    def loss_and_grad(self, w: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad_out: np.ndarray) -> float:
        """Mean loss over the batch; the flat gradient of it is written into grad_out."""

    @abc.abstractmethod
    def evaluate(self, w: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch_size: int = 4096) -> dict:
        """{"loss", "accuracy"} (classification) or {"loss", "r2"} (regression) over all of x."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout.describe()})"


class DenseModel(Model):
    """Dense layers w0,b0,w1,b1,... with ReLU between them and a loss at the end.

    widths = (in_features, hidden..., outputs); w_i has shape (fan_in, fan_out). The loss is
    softmax cross-entropy for classification, 0.5 * mean squared error for regression.
    """

    def __init__(self, name: str, widths: tuple[int, ...], task: str, backend: str):
        self.name, self.task, self.widths = name, task, tuple(int(d) for d in widths)
        self.in_features = self.widths[0]
        self.num_classes = self.widths[-1] if task == "classification" else 0
        self.backend = backend
        self.kernels = get_backend(backend)
        self.layout = Layout.of(pair for i, (a, b) in enumerate(zip(widths, widths[1:]))
                                for pair in ((f"w{i}", (a, b)), (f"b{i}", (b,))))
        # Buffers are per thread: a worker may evaluate in one thread while it trains in another.
        self._local = threading.local()

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1

    def init_params(self, seed: int) -> np.ndarray:
        """He-normal weights into ReLUs, LeCun-normal into the output; zero biases.

        He (std sqrt(2/fan_in)) keeps activations' scale through ReLU layers; the output layer
        gets std sqrt(1/fan_in) so the first logits are O(1) and the first loss is near log(k).
        """
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.layout.total, dtype=np.float32)
        views = self.layout.views(flat)
        for i in range(self.num_layers):
            fan_in = self.widths[i]
            gain = 2.0 if i < self.num_layers - 1 else 1.0
            W = views[f"w{i}"]
            rng.standard_normal(W.shape, dtype=np.float32, out=W)
            W *= np.float32(np.sqrt(gain / fan_in))
        return flat

    # -- training --------------------------------------------------------------------------

    def loss_and_grad(self, w, x, y, grad_out):
        x, y = self._check_batch(w, x, y)
        # A strided grad_out would make layout.views copy, and the gradient would be lost.
        if grad_out.dtype != w.dtype or not grad_out.flags.c_contiguous:
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector, "
                             f"got {grad_out.dtype} with strides {grad_out.strides}")
        params, grads = self.layout.views(w), self.layout.views(grad_out)
        acts, deltas = self._buffers(x.shape[0], w.dtype)
        self._forward(params, x, acts)
        loss = self._loss(acts[-1], y, deltas[-1])
        self._backward(params, x, acts, deltas, grads)
        return float(loss)

    def _forward(self, params, x, acts):
        """acts[i] = output of layer i (post-ReLU for hidden layers, logits/pred for the last)."""
        k, inp = self.kernels, x
        for i in range(self.num_layers):
            last = i == self.num_layers - 1
            k.dense_forward(inp, params[f"w{i}"], params[f"b{i}"], acts[i], not last)
            inp = acts[i]

    def _loss(self, out, y, dout):
        if self.task == "classification":
            return self.kernels.softmax_xent(out, y, dout)
        return self.kernels.mse(out, y, dout)

    def _backward(self, params, x, acts, deltas, grads):
        """deltas[i] = d loss / d (pre-activation of layer i), from the top down."""
        k = self.kernels
        for i in range(self.num_layers - 1, 0, -1):
            # Layer i's input is acts[i-1], a ReLU output: the fused mask gives deltas[i-1].
            k.dense_backward(acts[i - 1], params[f"w{i}"], deltas[i], grads[f"w{i}"],
                             grads[f"b{i}"], deltas[i - 1], True)
        k.dense_param_grads(x, deltas[0], grads["w0"], grads["b0"])

    def _buffers(self, n: int, dtype) -> tuple[list, list]:
        """Per-layer output and delta buffers for batch size n, reused across steps."""
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        key = (n, np.dtype(dtype))
        if key not in cache:
            if len(cache) >= _MAX_CACHED_BATCH_SIZES:
                cache.clear()
            acts = [np.empty((n, d), dtype) for d in self.widths[1:]]
            deltas = [np.empty((n, d), dtype) for d in self.widths[1:]]
            cache[key] = (acts, deltas)
        return cache[key]

    def _check_batch(self, w, x, y):
        """x as C-contiguous (n, in_features) in w's dtype, y as int32 labels or w's dtype."""
        if w.shape != (self.layout.total,) or w.dtype.kind != "f":
            raise ValueError(f"w has shape {w.shape} and dtype {w.dtype}; "
                             f"{self.name} needs float ({self.layout.total},)")
        if x.ndim != 2 or x.shape[1] != self.in_features or x.shape[0] == 0:
            raise ValueError(f"x has shape {x.shape}; {self.name} needs "
                             f"(n >= 1, {self.in_features})")
        if y.shape != (x.shape[0],):
            raise ValueError(f"y has shape {y.shape}; x has {x.shape[0]} rows")
        ydtype = np.int32 if self.task == "classification" else w.dtype
        return np.ascontiguousarray(x, dtype=w.dtype), np.ascontiguousarray(y, dtype=ydtype)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, w, x, y, batch_size=4096):
        x, y = self._check_batch(w, x, y)
        params = self.layout.views(w)
        n, loss_sum, correct, sse = x.shape[0], 0.0, 0, 0.0
        for a in range(0, n, batch_size):
            xb, yb = x[a:a + batch_size], y[a:a + batch_size]
            acts, deltas = self._buffers(xb.shape[0], w.dtype)
            self._forward(params, xb, acts)
            # The loss kernels also write a gradient; the delta buffer is scratch here.
            loss_sum += self._loss(acts[-1], yb, deltas[-1]) * xb.shape[0]
            if self.task == "classification":
                correct += int(np.count_nonzero(acts[-1].argmax(axis=1) == yb))
            else:
                sse += float(np.sum((acts[-1][:, 0].astype(np.float64) - yb) ** 2))
        if self.task == "classification":
            return {"loss": loss_sum / n, "accuracy": correct / n}
        sst = float(np.sum((y.astype(np.float64) - y.mean(dtype=np.float64)) ** 2))
        # A constant target has no variance to explain: r2 is 1 for a perfect fit, else 0.
        r2 = 1.0 - sse / sst if sst > 0 else float(sse == 0)
        return {"loss": loss_sum / n, "r2": r2}
