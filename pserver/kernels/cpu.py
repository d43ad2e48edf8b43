"""Model math as numba CPU kernels; `pserver.kernels.reference` is the NumPy twin.

All kernels write into caller-owned buffers (the model preallocates them per batch size), so a
training step allocates nothing here. Inputs are C-contiguous; float32 is what the models use.

Matrix products go through `np.dot(a, b, out)`, which numba lowers to BLAS gemm (scipy's
cython_blas). A transposed view of a C-contiguous array (`x.T`, `W.T`) is typed as an F-contiguous
array, and numba hands it to gemm with the transpose flag: no copy, and measured as fast as the
untransposed product. Only a non-contiguous ('A' layout) operand, such as a strided slice, makes
numba copy it first (with a NumbaPerformanceWarning). numba only switches on BLAS when scipy is
installed, hence the dependency.

`nogil=True` lets a worker overlap a step with gRPC I/O in another thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def dense_forward(x, W, b, out, relu):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    np.dot(x, W, out)
    n, o = out.shape
    for i in range(n):
        for j in range(o):
            v = out[i, j] + b[j]
            # `v < 0` (not `not v > 0`) keeps NaN, as np.maximum does in the twin.
            if relu and v < 0:
                v = 0
            out[i, j] = v


@njit(cache=True, nogil=True)
def dense_param_grads(x, dz, dW, db):
    """dW[:] = x.T @ dz, db[:] = dz summed over the batch. For a first layer: no input grad."""
    np.dot(x.T, dz, dW)
    db[:] = 0
    # Row by row, so the reads are contiguous (the twin's dz.sum(0) adds rows in this order too).
    for i in range(dz.shape[0]):
        for j in range(dz.shape[1]):
            db[j] += dz[i, j]


@njit(cache=True, nogil=True)
def relu_backward(dx, a):
    """dx *= (a > 0) in place; a is the ReLU's output (or its input: same sign)."""
    for i in range(dx.shape[0]):
        for j in range(dx.shape[1]):
            if not a[i, j] > 0:
                dx[i, j] = 0


@njit(cache=True, nogil=True)
def dense_backward(x, W, dz, dW, db, dx, relu):
    """dense_param_grads, plus dx[:] = dz @ W.T, masked by (x > 0) if `relu`.

    `relu` says x is the output of a ReLU; then x > 0 exactly where the pre-activation was,
    so the ReLU's backward fuses here with no extra buffer.
    """
    dense_param_grads(x, dz, dW, db)
    np.dot(dz, W.T, dx)
    if relu:
        relu_backward(dx, x)


@njit(cache=True, nogil=True)
def softmax_xent(logits, y, dlogits):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n.

    logits (n, k), y (n,) int labels in [0, k), dlogits (n, k). Rows are shifted by their
    max before exp, so large logits do not overflow.
    """
    n, k = logits.shape
    inv_n = 1.0 / n
    total = 0.0
    for i in range(n):
        label = y[i]
        # numba does not bounds-check: a bad label would write outside dlogits.
        if label < 0 or label >= k:
            raise ValueError("softmax_xent: label out of range [0, num_classes)")
        m = logits[i].max()
        s = 0.0  # float64: a sum of k exps
        for j in range(k):
            e = np.exp(logits[i, j] - m)
            dlogits[i, j] = e
            s += e
        total += np.log(s) - (logits[i, label] - m)
        scale = inv_n / s
        for j in range(k):
            dlogits[i, j] *= scale
        dlogits[i, label] -= inv_n
    return total * inv_n


@njit(cache=True, nogil=True)
def mse(pred, y, dpred):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n. pred, dpred (n, 1), y (n,)."""
    if pred.shape[1] != 1:
        raise ValueError("mse: pred must have one column")
    n = pred.shape[0]
    total = 0.0
    for i in range(n):
        r = pred[i, 0] - y[i]
        dpred[i, 0] = r / n
        total += np.float64(r) * r
    return 0.5 * total / n
