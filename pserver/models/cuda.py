"""Models on a CUDA GPU: weights, activations and gradients stay on the device.

`CudaModel` has the interface of every `Model` (layout, init_params, loss_and_grad,
evaluate), so the worker loop runs it unchanged; `on_device(model, "cuda")` builds one from a
Functional or a Sequential. It runs the model's own graph (pserver.models.graph's plan, forward
and backward, with its layer objects unchanged) with `pserver.kernels.cuda` on device arrays in
place of the CPU kernels, the ops' device forms (pserver.models.cuda_ops) in place of NumPy's,
and its buffers in device memory. What runs (the layers, the ops, the losses) and the one-line
refusal of anything else (a sparse Embedding, the CTR models): pserver.models.cuda_support. Per
training step, all on this thread's CUDA stream, in order:

    host -> device   the pulled flat weight vector w (P floats), the batch x (n x input shape)
                     and its labels or targets y (n): each staged through a pinned host buffer,
                     so the copy is a true async DMA (from pageable memory the driver would
                     stage it itself, synchronously)
    on the device    forward, loss (reduced on the device), backward into one flat gradient
                     vector whose per-tensor views are where the kernels write
    device -> host   the flat gradient (P floats), the loss (one float64) and the output (for
                     the batch's accuracy), into pinned buffers; then the step's one wait, and a
                     host copy into grad_out

That is a loss the GPU computes (cuda_support.loss_on_device: one output, sparse categorical
cross-entropy or MSE, no compiled metric). Any other loss runs on the host, the host model's
own (Functional.output_loss): the step's outputs come to the host, and their d loss / d output
go back before the backward pass. Evaluation scores on the host in every case
(Functional.evaluate_with), from the outputs of the forward pass on the device.

The per-thread state (stream, pinned buffers, device buffers per batch size) mirrors the CPU
model's per-thread buffers: a worker may evaluate in one thread while it trains in another.
Everything is float32, as on the wire. `timings=True` on loss_and_grad records CUDA events
between the three phases (bench/kernels.py reads them; the worker does not ask).

Step graphs. Launching a kernel from Python costs the host tens of microseconds (numba-cuda's
dispatcher checks and packs every argument), and a step is dozens of kernels, so a small model's
step is the host's launches, not the GPU's work. From the second training step of a batch size
on, the step is therefore a CUDA graph (StepGraph): its copies and kernels are captured once from
the stream and replayed with one launch, the host only staging w, x and y into the pinned
buffers the graph copies from. The same kernels run in the same order on the same buffers, so a
replayed step gives the eager step's loss and gradient bit for bit. Not for a model whose
training pass draws from the step's seed (Dropout: cuda_support.draws_at_random), in the CUDA
simulator (it has no graphs), or with PSERVER_CUDA_GRAPHS=0; those run every kernel eagerly.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref

import numpy as np
from numba import config, cuda

from pserver.kernels import cuda_gemm, get_backend
from pserver.kernels.cuda import columns_from
from pserver.kernels.device import current_index
from pserver.layers.base import Pass
from pserver.models import cuda_support, graph, metrics
from pserver.models.base import _MAX_CACHED_BATCH_SIZES, Model
from pserver.models.cuda_ops import DeviceOps
from pserver.models.functional import Functional, ModelBuffers


class CudaModel(Model):
    """A Functional (or Sequential) model whose math runs in `pserver.kernels.cuda`, on device
    arrays."""

    def __init__(self, host: Functional):
        cuda_support.check(host)
        # The host model checks batches and initialises; its layout is ours, tensor for tensor.
        self.host, self.name, self.layout = host, host.name, host.layout
        self.task, self.num_classes, self.in_features = host.task, host.num_classes, host.in_features
        self.layers = host.layers
        self.kernels = get_backend("cuda")
        self._seeds = host._seeds
        self._local = threading.local()
        # The device that is current now (pserver.kernels.device.select made it so). Other threads
        # would otherwise start on device 0, so every call enters this one explicitly.
        self.device_id = current_index()
        # Whether training steps become step graphs (the module's docstring): False in the
        # simulator, for a model with dropout, with PSERVER_CUDA_GRAPHS=0, or for a step whose
        # loss runs on the host (loss_on_host).
        self.step_graphs = (not config.ENABLE_CUDASIM and os.environ.get("PSERVER_CUDA_GRAPHS", "1") != "0"
                            and cuda_support.draws_at_random(host) is None)

    @property
    def loss_on_host(self) -> bool:
        """Whether a training step brings its outputs to the host for the loss (the host model's
        own, cuda_support.loss_on_device says when) and takes d loss / d outputs back."""
        return not cuda_support.loss_on_device(self.host)

    # The batch's metrics as the host model measured them (Functional.output_loss): the worker
    # pushes them with each step, and Keras's History reads them.
    batch_correct = property(lambda self: getattr(self.host, "batch_correct", 0.0))
    batch_metric_sums = property(lambda self: getattr(self.host, "batch_metric_sums", ()))
    batch_sums = property(lambda self: getattr(self.host, "batch_sums", {}))

    def init_params(self, seed):
        return self.host.init_params(seed)

    def check_data(self, x, y, what: str = "data"):
        """The host model's check of a whole dataset before step 1 (shapes, labels, NaN, ids
        against an Embedding's table): the device reads ids unchecked, an id outside the table
        giving a row of NaN."""
        return self.host.check_data(x, y, what)

    def frozen_weights(self) -> list[str]:
        """The host model's frozen tensors (the shards leave them as they are)."""
        return self.host.frozen_weights()

    # -- training --------------------------------------------------------------------------

    def loss_and_grad(self, w, x, y, grad_out, seed: int | None = None, timings: bool = False):
        """As Sequential.loss_and_grad. With `timings`, returns (loss, {"h2d", "compute",
        "d2h"}: milliseconds between CUDA events recorded on the step's stream)."""
        y, sample_weight = self.host.unweigh(y)
        x, y = self._check(w, x, y)
        if (grad_out.shape != w.shape or grad_out.dtype != w.dtype
                or not grad_out.flags.c_contiguous):
            raise ValueError(f"grad_out must be a C-contiguous {w.dtype} vector of shape "
                             f"{w.shape}, got {grad_out.dtype} {grad_out.shape} with strides "
                             f"{grad_out.strides}")
        run = Pass(training=True, seed=next(self._seeds) if seed is None else int(seed))
        if self.loss_on_host:
            if timings:
                raise ValueError(f"loss_and_grad(timings=True) times a step whose loss runs on the GPU; "
                                 f"{self.name}'s runs on the host")
            loss = self._step_with_host_loss(w, x, y, sample_weight, run)
            np.copyto(grad_out, self._state().g_host)
            return loss + self.host._regularize(w, grad_out)
        with cuda.gpus[self.device_id]:
            st = self._state()
            b, s = st.batch(self, x.shape[0]), st.stream
            events = [cuda.event() for _ in range(4)] if timings else None
            np.copyto(st.w_host, w)              # staged: the step's copies read the pinned buffers
            b.stage(x, y)
            if events is None and self.step_graphs and b.step_graph is None and b.trained:
                # The second step of this size (the first made every buffer): captured, not run.
                b.step_graph = StepGraph.capture(s, lambda: self._enqueue_step(st, b, run))
            if events is None and b.step_graph:
                b.step_graph.launch(s)
            else:
                self._enqueue_step(st, b, run, events)
            b.trained = True
            # The step's one wait: after it the gradient, the loss and the output are in pinned
            # memory, and the staging buffers are free for the next step.
            s.synchronize()
        if self.task == "classification":        # the batch's accuracy, as the host model's
            self.host.batch_correct = metrics.accuracy(b.outs_host[0], y)
        np.copyto(grad_out, st.g_host)
        if self._loss_scale != 1:
            grad_out *= np.float32(self._loss_scale)   # linear in the output's gradient
        # The weights' regularization penalty (keras.regularizers), on the host: w and grad_out are there.
        loss = float(st.loss_host[0]) * self._loss_scale + self.host._regularize(w, grad_out)
        if not timings:
            return loss
        ms = [events[i].elapsed_time(events[i + 1]) for i in range(3)]
        return loss, dict(zip(("h2d", "compute", "d2h"), ms))

    def _enqueue_step(self, st, b, run, events=None) -> None:
        """A training step's work, queued on the stream: the staged w, x and y to the device,
        forward, loss, backward, and the gradient and loss to the pinned buffers."""
        s = st.stream
        _record(events, 0, s)
        st.w.copy_to_device(st.w_host, stream=s)
        b.upload_staged(s)
        _record(events, 1, s)
        acts = self._forward_on_device(st, b, run)
        self._loss_on_device(acts[-1], b, b.graph.dloss, s)
        self._backward_on_device(st, acts, b)
        _record(events, 2, s)
        st.g.copy_to_host(st.g_host, stream=s)
        b.loss.copy_to_host(st.loss_host, stream=s)
        if self.task == "classification":      # for the batch's accuracy (loss_and_grad)
            b.outputs_to_host(acts[-1:], s)
        _record(events, 3, s)

    def _step_with_host_loss(self, w, x, y, sample_weight, run) -> float:
        """A training step whose loss runs on the host: forward on the device, the outputs to
        the host, the host model's loss and metrics there (Functional.output_loss), d loss / d
        outputs back, backward on the device; the gradient left in the pinned g_host. Eager:
        the step waits for the device mid-way."""
        with cuda.gpus[self.device_id]:
            st = self._state()
            b, s = st.batch(self, x.shape[0]), st.stream
            st.upload_weights(w)
            b.upload(x, stream=s)
            acts = self._forward_on_device(st, b, run)
            outs = b.outputs_to_host([acts[i] for i in self.host._plan(True).outputs], s)
            s.synchronize()
            loss = self.host.output_loss(outs, y, sample_weight, b.dlosses_host)
            for dev, host in zip(b.graph.dlosses, b.dlosses_host, strict=True):
                dev.copy_to_device(host, stream=s)
            self._backward_on_device(st, acts, b)
            st.g.copy_to_host(st.g_host, stream=s)
            s.synchronize()
        return loss

    @property
    def _loss_scale(self) -> float:
        """The mse kernel computes half the squared error; Keras's MSE is twice that."""
        return 2.0 if self.task == "regression" else 1.0

    def _forward_on_device(self, st, b, run) -> list:
        """Every slot's value, the output's last: the model's own pass, with the CUDA kernels."""
        plan = self.host._plan(run.training)
        st.ops.begin(b.op_buffers[run.training])     # backward continues this pass's buffers
        k = _OnStream(self.kernels, st.stream)
        return graph.forward(plan, k, st.layer_params, b.inputs, b.graph.of(plan), run, st.ops)

    def _loss_on_device(self, out, b, dout, stream):
        """dout = d loss / d output; b.loss[0] = the mean loss, left on the device."""
        into = (self.kernels.softmax_xent_into if self.task == "classification"
                else self.kernels.mse_into)
        into(out, b.y, dout, b.row_loss, b.loss, stream=stream)

    def _backward_on_device(self, st, acts, b):
        """The model's own backward pass, with the CUDA kernels: gradients into the flat
        vector's views."""
        plan = self.host._plan(True)
        graph.backward(plan, _OnStream(self.kernels, st.stream), st.layer_params, st.layer_grads, acts,
                       b.graph.dlosses, b.graph.of(plan), st.ops)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, w, x, y, batch_size=4096):
        """The host model's evaluation (Functional.evaluate_with: its losses and metrics, on the
        host), each chunk of batch_size samples through the forward pass on the device and its
        outputs brought back."""
        if w.dtype != np.float32:
            raise ValueError(f"w has dtype {w.dtype}; the cuda model computes in float32")
        slots = self.host._plan(False).outputs
        with cuda.gpus[self.device_id]:
            st = self._state()
            st.upload_weights(w)

            def forward(xb) -> dict:
                b, s = st.batch(self, xb.shape[0]), st.stream
                b.upload(xb, stream=s)
                vals = self._forward_on_device(st, b, Pass(training=False))
                outs = b.outputs_to_host([vals[i] for i in slots], s)
                s.synchronize()               # outputs in; staging free for the next chunk
                return dict(zip(slots, outs))

            return self.host.evaluate_with(forward, w, x, y, batch_size)

    # -- buffers and checks ----------------------------------------------------------------

    def _check(self, w, x, y):
        if w.dtype != np.float32:
            raise ValueError(f"w has dtype {w.dtype}; the cuda model computes in float32")
        # The host model checks shapes and labels (a bad label would make the loss NaN here).
        return self.host._check_batch(w, x, y)

    def _state(self) -> "_DeviceState":
        st = getattr(self._local, "device_state", None)
        if st is None:
            st = self._local.device_state = _DeviceState(self)
        return st


def _record(events, i, stream) -> None:
    if events is not None:
        events[i].record(stream)


class _OnStream:
    """The kernel module with `stream=` bound: a layer calls `k.conv2d_forward(...)` as it
    would on the CPU, and the launch goes on the step's stream."""

    def __init__(self, kernels, stream):
        self._kernels, self._stream = kernels, stream

    def __getattr__(self, name):
        return functools.partial(getattr(self._kernels, name), stream=self._stream)


class _DeviceMemory:
    """Where the graph's buffers go (pserver.models.graph.PlanBuffers): device memory, made on
    the step's stream."""

    def __init__(self, stream):
        self.stream = stream

    def empty(self, shape, dtype):
        return cuda.device_array(shape, dtype, stream=self.stream)

    def put(self, a: np.ndarray):
        return cuda.to_device(a, stream=self.stream)


class _DeviceState:
    """One thread's stream, flat weight and gradient vectors (device + pinned host twins)."""

    def __init__(self, model: CudaModel):
        p = model.layout.total
        self.stream = cuda.stream()
        self.ops = DeviceOps(self.stream)       # the graph's ops, on this stream
        self.w_host = cuda.pinned_array(p, np.float32)
        self.g_host = cuda.pinned_array(p, np.float32)
        self.loss_host = cuda.pinned_array(1, np.float64)
        self.w = cuda.device_array(p, np.float32)
        self.g = cuda.device_array(p, np.float32)
        # Views into the flat device vectors, as Layout.views gives on the host, per layer by
        # short name: the kernels write each tensor's gradient in place, so the flat gradient
        # needs no gathering.
        self.layer_params = model.host._per_layer(model.layout.views(self.w))
        self.layer_grads = model.host._per_layer(model.layout.views(self.g))
        self._batches: dict[int, _Batch] = {}

    def upload_weights(self, w: np.ndarray) -> None:
        np.copyto(self.w_host, w)
        self.w.copy_to_device(self.w_host, stream=self.stream)

    def batch(self, model: CudaModel, n: int) -> "_Batch":
        if n not in self._batches:
            if len(self._batches) >= _MAX_CACHED_BATCH_SIZES:
                self._batches.clear()
            self._batches[n] = _Batch(model, n, self.stream)
        return self._batches[n]


class _Batch:
    """Device buffers for batch size n: input, labels, the graph's (each layer's output, its
    d loss / d output and scratch, made as the host model's are, in device memory), the loss;
    pinned staging for the input, labels and the outputs (and, for a loss on the host, the
    outputs' d loss / d output)."""

    def __init__(self, model: CudaModel, n: int, stream):
        ydtype = np.int32 if model.task == "classification" else np.float32
        shape = (n, *model.host.input_shape)
        self.x_host = cuda.pinned_array(shape, np.float32)
        self.y_host = cuda.pinned_array(n, ydtype)
        self.outs_host = [cuda.pinned_array((n, *out), np.float32) for out in model.host._shapes[1:]]
        self._dlosses_host: list | None = None
        self.x = cuda.device_array(shape, np.float32, stream=stream)
        # Several inputs travel packed side by side (Functional.pack); each gets its own buffer,
        # filled from its columns of x on the device at upload.
        self.inputs = [self.x] if len(model.host._inputs) == 1 else [
            cuda.device_array((n, *t.shape[1:]), np.float32, stream=stream) for t in model.host._inputs]
        self.y = cuda.device_array(n, ydtype, stream=stream)
        # Scratch as the layer asks for it (zeros stay zeros: a bias-less layer's bias); the
        # d loss / d output buffers are made at the first training step of this size
        # (evaluation needs none: for the CNN at 4096 images they are hundreds of MB).
        self.graph = ModelBuffers(model.host, n, np.float32, _DeviceMemory(stream))
        self.op_buffers: dict[bool, list] = {True: [], False: []}   # the ops' outputs, per pass kind
        self.row_loss = cuda.device_array(n, np.float32, stream=stream)
        self.loss = cuda.device_array(1, np.float64, stream=stream)
        # Training steps of this size: whether one ran (it made the buffers a graph needs), and
        # the step graph (None: not tried yet; False: its capture failed, so steps stay eager).
        self.trained = False
        self.step_graph: StepGraph | None | bool = None

    @property
    def dlosses_host(self) -> list:
        """Pinned arrays where the host's loss writes d loss / d each output (made when first
        asked for: a loss on the device needs none)."""
        if self._dlosses_host is None:
            self._dlosses_host = [cuda.pinned_array(o.shape, np.float32) for o in self.outs_host]
        return self._dlosses_host

    def outputs_to_host(self, outs: list, stream) -> list:
        """The outputs' device arrays queued for copying into outs_host, which it returns (read
        them after the stream's wait)."""
        for dev, host in zip(outs, self.outs_host, strict=True):
            dev.copy_to_host(host, stream=stream)
        return self.outs_host

    def upload(self, x: np.ndarray, *, stream) -> None:
        """x alone to the device (no labels: evaluation and a loss on the host read them there)."""
        self.stage(x)
        self.upload_staged(stream, labels=False)

    def stage(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        """x (and y, for a loss on the device) into the pinned buffers that the device copies
        read."""
        np.copyto(self.x_host, x)
        if y is not None:
            np.copyto(self.y_host, y)

    def upload_staged(self, stream, labels: bool = True) -> None:
        self.x.copy_to_device(self.x_host, stream=stream)
        start = 0
        for part in self.inputs if len(self.inputs) > 1 else ():
            cols = part.reshape(part.shape[0], part.size // part.shape[0])
            columns_from(self.x, start, cols, stream=stream)
            start += cols.shape[1]
        if labels:
            self.y.copy_to_device(self.y_host, stream=stream)


class StepGraph:
    """A training step captured from a stream as a CUDA graph and replayed with one launch.

    Every device buffer the step touches stays where it was at the capture (the step's buffers
    are made once per batch size, and its ops' outputs reuse theirs: DeviceOps.begin); memory
    allocated while capturing (a kernel's scratch) is kept here, as the graph holds its address.
    A step that cannot be captured (an operation a capture refuses) gives False, and its steps
    run eagerly."""

    def __init__(self, graph, executable, kept: list) -> None:
        self._executable, self._kept = executable, kept
        # Destroyed with its batch's buffers; not at the interpreter's exit, where the context
        # may be gone before it (the driver frees a process's graphs as it ends).
        weakref.finalize(self, _destroy_graph, graph, executable).atexit = False

    @classmethod
    def capture(cls, stream, enqueue) -> "StepGraph | bool":
        """`enqueue()`'s work on `stream`, captured and instantiated; False, with a warning, where
        the capture fails (the steps then launch their kernels one by one)."""
        from numba.cuda.cudadrv.driver import binding, driver

        ctx, kept, me = cuda.current_context(), cuda_gemm.workspaces(), threading.get_ident()
        allocate = ctx.memalloc

        def keep(size):                         # this thread's allocations (the context is shared)
            pointer = allocate(size)
            if threading.get_ident() == me:
                kept.append(pointer)
            return pointer

        handle = binding.CUstream(int(stream.handle))
        relaxed = binding.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        failure, graph = None, None
        with cuda.defer_cleanup():              # no memory freed while capturing
            ctx.memalloc = keep
            try:
                driver.cuStreamBeginCapture(handle, relaxed)
            except Exception as e:              # noqa: BLE001
                failure = e
            else:
                try:
                    enqueue()
                except Exception as e:          # noqa: BLE001 -- an operation the capture refused
                    failure = e
                err, graph = binding.cuStreamEndCapture(handle)
                if err != binding.CUresult.CUDA_SUCCESS:
                    failure, graph = failure or f"cuStreamEndCapture: {err.name}", None
            finally:
                del ctx.memalloc
        if graph is not None and failure is not None:   # a part of a step: never run it
            binding.cuGraphDestroy(graph)
        if failure is None:
            try:
                return cls(graph, driver.cuGraphInstantiate(graph, 0), kept)
            except Exception as e:              # noqa: BLE001
                binding.cuGraphDestroy(graph)
                failure = e
        warnings.warn(f"a CUDA step graph could not be captured ({failure}); this batch size's "
                      f"steps launch their kernels one by one", RuntimeWarning, stacklevel=3)
        return False

    def launch(self, stream) -> None:
        from numba.cuda.cudadrv.driver import binding, driver

        driver.cuGraphLaunch(self._executable, binding.CUstream(int(stream.handle)))


def _destroy_graph(graph, executable) -> None:
    from numba.cuda.cudadrv.driver import binding

    binding.cuGraphExecDestroy(executable)
    binding.cuGraphDestroy(graph)


__all__ = ["CudaModel", "StepGraph"]
