"""The dense models on a CUDA GPU: weights, activations and gradients stay on the device.

`CudaDenseModel` has the interface of every `Model` (layout, init_params, loss_and_grad,
evaluate), so the worker loop runs it unchanged; `on_device(model, "cuda")` builds one from a
Sequential of Dense layers (ReLU between them, a linear last layer: mlp, logreg, linreg and
their like). Other layers run on the CPU for now; asking for cuda with them is a ConfigError.
Per training step, all on this thread's CUDA stream, in order:

    host -> device   the pulled flat weight vector w (P floats), the batch x (n x features)
                     and its labels or targets y (n): each staged through a pinned host buffer,
                     so the copy is a true async DMA (from pageable memory the driver would
                     stage it itself, synchronously)
    on the device    forward, loss (reduced on the device), backward into one flat gradient
                     vector whose per-tensor views are where the kernels write
    device -> host   the flat gradient (P floats) and the loss (one float64), into pinned
                     buffers; then the step's one wait, and a host copy into grad_out

The per-thread state (stream, pinned buffers, device buffers per batch size) mirrors the CPU
model's per-thread buffers: a worker may evaluate in one thread while it trains in another.
Everything is float32, as on the wire.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import cuda

from pserver.device import current_index
from pserver.errors import ConfigError
from pserver.kernels import get_backend
from pserver.layers import Dense
from pserver.models import losses, metrics
from pserver.models.base import _MAX_CACHED_BATCH_SIZES, Model
from pserver.models.sequential import Sequential


class CudaDenseModel(Model):
    """A Sequential of Dense layers whose math runs in `pserver.kernels.cuda`."""

    def __init__(self, host: Sequential):
        _check_dense_only(host)
        # The host model checks batches and initialises; its layout is ours, tensor for tensor.
        self.host, self.name, self.layout = host, host.name, host.layout
        self.task, self.num_classes, self.in_features = host.task, host.num_classes, host.in_features
        dense = host.layers
        self.widths = (host.in_features, *(layer.units for layer in dense))
        self.tensor_names = [(f"{d.name}/kernel", f"{d.name}/bias") for d in dense]
        self.hidden = self.widths[1:-1]
        self.kernels = get_backend("cuda")
        self._local = threading.local()
        # The device that is current now (pserver.device.select made it so). Other threads
        # would otherwise start on device 0, so every call enters this one explicitly.
        self.device_id = current_index()

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1

    def init_params(self, seed):
        return self.host.init_params(seed)

    # -- training --------------------------------------------------------------------------

    def loss_and_grad(self, w, x, y, grad_out):
        x, y = self._check(w, x, y)
        if (grad_out.shape != w.shape or grad_out.dtype != w.dtype
                or not grad_out.flags.c_contiguous):
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector of shape "
                             f"{w.shape}, got {grad_out.dtype} {grad_out.shape} with strides "
                             f"{grad_out.strides}")
        with cuda.gpus[self.device_id]:
            st = self._state()
            b, s = st.batch(self, x.shape[0]), st.stream
            st.upload_weights(w)
            b.upload(x, y, s)
            self._forward_on_device(st.params, b, s)
            self._loss_on_device(b, s)
            self._backward_on_device(st.params, b, st.grads, s)
            st.g.copy_to_host(st.g_host, stream=s)
            b.loss.copy_to_host(st.loss_host, stream=s)
            # The step's one wait: after it the gradient and the loss are in pinned memory,
            # and the staging buffers are free for the next step.
            s.synchronize()
        np.copyto(grad_out, st.g_host)
        if self._loss_scale != 1:
            grad_out *= np.float32(self._loss_scale)   # linear in the output's gradient
        return float(st.loss_host[0]) * self._loss_scale

    @property
    def _loss_scale(self) -> float:
        """The mse kernel computes half the squared error; Keras's MSE is twice that."""
        return 2.0 if self.task == "regression" else 1.0

    def _forward_on_device(self, params, b, stream):
        """b.acts[i] = output of layer i (post-ReLU for hidden layers, logits/pred for the last)."""
        inp = b.x
        for i in range(self.num_layers):
            last = i == self.num_layers - 1
            kernel, bias = self.tensor_names[i]
            self.kernels.dense_forward(inp, params[kernel], params[bias], b.acts[i],
                                       not last, stream=stream)
            inp = b.acts[i]

    def _loss_on_device(self, b, stream):
        """b.deltas[-1] = d loss / d output; b.loss[0] = the mean loss, left on the device."""
        into = (self.kernels.softmax_xent_into if self.task == "classification"
                else self.kernels.mse_into)
        into(b.acts[-1], b.y, b.deltas[-1], b.row_loss, b.loss, stream=stream)

    def _backward_on_device(self, params, b, grads, stream):
        """Deltas from the top down (the ReLU mask fused), gradients into the flat vector."""
        k = self.kernels
        for i in range(self.num_layers - 1, 0, -1):
            kernel, bias = self.tensor_names[i]
            k.dense_backward(b.acts[i - 1], params[kernel], b.deltas[i], grads[kernel],
                             grads[bias], b.deltas[i - 1], True, stream=stream)
        kernel, bias = self.tensor_names[0]
        k.dense_param_grads(b.x, b.deltas[0], grads[kernel], grads[bias], stream=stream)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, w, x, y, batch_size=4096):
        x, y = self._check(w, x, y)
        n, loss_sum, correct, sse = x.shape[0], 0.0, 0, 0.0
        with cuda.gpus[self.device_id]:
            st = self._state()
            st.upload_weights(w)
            for a in range(0, n, batch_size):
                xb, yb = x[a:a + batch_size], y[a:a + batch_size]
                b, s = st.batch(self, xb.shape[0]), st.stream
                b.upload(xb, yb, s)
                self._forward_on_device(st.params, b, s)
                self._loss_on_device(b, s)    # its gradient output is scratch here
                b.acts[-1].copy_to_host(b.out_host, stream=s)
                b.loss.copy_to_host(st.loss_host, stream=s)
                s.synchronize()               # outputs in; staging free for the next batch
                loss_sum += float(st.loss_host[0]) * xb.shape[0] * self._loss_scale
                if self.task == "classification":
                    correct += int(np.count_nonzero(b.out_host.argmax(axis=1) == yb))
                else:
                    sse += float(np.sum((b.out_host[:, 0].astype(np.float64) - yb) ** 2))
        if self.task == "classification":
            return {"loss": loss_sum / n, "accuracy": correct / n}
        return {"loss": loss_sum / n, "r2": metrics.r2(sse, y)}

    # -- buffers and checks ----------------------------------------------------------------

    def _check(self, w, x, y):
        if w.dtype != np.float32:
            raise ValueError(f"w has dtype {w.dtype}; the cuda model computes in float32")
        # The host model checks shapes and labels (a bad label would make the loss NaN here).
        x, y = self.host._check_batch(w, x, y)
        return x.reshape(x.shape[0], -1), y

    def _state(self) -> "_DeviceState":
        st = getattr(self._local, "device_state", None)
        if st is None:
            st = self._local.device_state = _DeviceState(self)
        return st


def _check_dense_only(host: Sequential) -> None:
    """The device-resident path runs Dense layers with ReLU between them and a linear last."""
    why = None
    for i, layer in enumerate(host.layers):
        last = i == len(host.layers) - 1
        if not isinstance(layer, Dense):
            why = f"{layer.label} is not Dense"
        elif not layer.use_bias or layer.activation != ("linear" if last else "relu"):
            why = (f"{layer.label} has activation {layer.activation!r}"
                   f"{'' if layer.use_bias else ' and no bias'}; the GPU path takes ReLU between "
                   "layers and a linear last layer, with biases")
        if why:
            break
    if why is None and not isinstance(host.loss, (losses.SparseCategoricalCrossentropy,
                                                  losses.MeanSquaredError)):
        why = f"its loss is {host.loss.name}"
    if why:
        raise ConfigError(f"--device cuda: runs models of Dense layers on the GPU; {host.name}: "
                          f"{why}. Use --device cpu for this model")


class _DeviceState:
    """One thread's stream, flat weight and gradient vectors (device + pinned host twins)."""

    def __init__(self, model: CudaDenseModel):
        p = model.layout.total
        self.stream = cuda.stream()
        self.w_host = cuda.pinned_array(p, np.float32)
        self.g_host = cuda.pinned_array(p, np.float32)
        self.loss_host = cuda.pinned_array(1, np.float64)
        self.w = cuda.device_array(p, np.float32)
        self.g = cuda.device_array(p, np.float32)
        # Views into the flat device vectors, as Layout.views gives on the host: the kernels
        # write each tensor's gradient in place, so the flat gradient needs no gathering.
        self.params, self.grads = model.layout.views(self.w), model.layout.views(self.g)
        self._batches: dict[int, _Batch] = {}

    def upload_weights(self, w: np.ndarray) -> None:
        np.copyto(self.w_host, w)
        self.w.copy_to_device(self.w_host, stream=self.stream)

    def batch(self, model: CudaDenseModel, n: int) -> "_Batch":
        if n not in self._batches:
            if len(self._batches) >= _MAX_CACHED_BATCH_SIZES:
                self._batches.clear()
            self._batches[n] = _Batch(model, n, self.stream)
        return self._batches[n]


class _Batch:
    """Device buffers for batch size n: input, labels, per-layer outputs and deltas, loss."""

    def __init__(self, model: CudaDenseModel, n: int, stream):
        ydtype = np.int32 if model.task == "classification" else np.float32
        self.x_host = cuda.pinned_array((n, model.in_features), np.float32)
        self.y_host = cuda.pinned_array(n, ydtype)
        self.out_host = cuda.pinned_array((n, model.widths[-1]), np.float32)
        self.x = cuda.device_array((n, model.in_features), np.float32, stream=stream)
        self.y = cuda.device_array(n, ydtype, stream=stream)
        self.acts = [cuda.device_array((n, d), np.float32, stream=stream) for d in model.widths[1:]]
        self.deltas = [cuda.device_array((n, d), np.float32, stream=stream)
                       for d in model.widths[1:]]
        self.row_loss = cuda.device_array(n, np.float32, stream=stream)
        self.loss = cuda.device_array(1, np.float64, stream=stream)

    def upload(self, x: np.ndarray, y: np.ndarray, stream) -> None:
        np.copyto(self.x_host, x)
        np.copyto(self.y_host, y)
        self.x.copy_to_device(self.x_host, stream=stream)
        self.y.copy_to_device(self.y_host, stream=stream)


__all__ = ["CudaDenseModel"]
