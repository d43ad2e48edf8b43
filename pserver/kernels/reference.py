"""Model math in plain NumPy: the twin that every compiled kernel is tested against.

Same names, signatures and in-place contracts as `pserver.kernels.cpu`, so a model is written
once against either module. These work for any float dtype (the model tests check gradients in
float64 through this module); the compiled kernels are built and timed for float32.
"""

from __future__ import annotations

import numpy as np


def dense_forward(x, W, b, out, relu):
    """out[:] = x @ W + b, then ReLU in place if `relu`. x (n, i), W (i, o), b (o,), out (n, o)."""
    np.dot(x, W, out=out)
    out += b
    if relu:
        # np.maximum keeps NaN, as the compiled kernel does, so a blow-up stays visible.
        np.maximum(out, 0, out=out)


def dense_param_grads(x, dz, dW, db):
    """dW[:] = x.T @ dz, db[:] = dz summed over the batch. For a first layer: no input grad."""
    np.dot(x.T, dz, out=dW)
    dz.sum(axis=0, out=db)


def dense_backward(x, W, dz, dW, db, dx, relu):
    """dense_param_grads, plus dx[:] = dz @ W.T, masked by (x > 0) if `relu`.

    `relu` says x is the output of a ReLU; then x > 0 exactly where the pre-activation was,
    so the ReLU's backward fuses here with no extra buffer.
    """
    dense_param_grads(x, dz, dW, db)
    np.dot(dz, W.T, out=dx)
    if relu:
        relu_backward(dx, x)


def relu_backward(dx, a):
    """dx *= (a > 0) in place; a is the ReLU's output (or its input: same sign)."""
    dx[~(a > 0)] = 0


def softmax_xent(logits, y, dlogits):
    """Mean cross-entropy over the batch; dlogits[:] = (softmax - onehot(y)) / n.

    logits (n, k), y (n,) int labels in [0, k), dlogits (n, k). Rows are shifted by their
    max before exp, so large logits do not overflow.
    """
    n, k = logits.shape
    if n and (y.min() < 0 or y.max() >= k):
        raise ValueError("softmax_xent: label out of range [0, num_classes)")
    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=dlogits)
    s = dlogits.sum(axis=1, dtype=np.float64)
    rows = np.arange(n)
    loss = float(np.sum(np.log(s) - z[rows, y]) / n)
    dlogits *= (1.0 / (n * s))[:, None].astype(dlogits.dtype)
    dlogits[rows, y] -= dlogits.dtype.type(1.0 / n)
    return loss


def mse(pred, y, dpred):
    """0.5 * mean((pred[:, 0] - y)^2); dpred[:] = (pred - y) / n. pred, dpred (n, 1), y (n,)."""
    if pred.shape[1] != 1:
        raise ValueError("mse: pred must have one column")
    n = pred.shape[0]
    r = pred[:, 0] - y
    dpred[:, 0] = r / dpred.dtype.type(n)
    return float(0.5 * np.sum(r.astype(np.float64) ** 2) / n)


# -- twins of the CUDA kernels that have no CPU counterpart above ---------------------------

def matmul(a, b, out, trans_a=False, trans_b=False):
    """out[:] = op(a) @ op(b), op transposing its operand when the flag is set."""
    np.dot(a.T if trans_a else a, b.T if trans_b else b, out=out)


def column_sum(a, out):
    """out[:] = a summed over its rows (a bias gradient: dz summed over the batch)."""
    a.sum(axis=0, out=out)


def scaled_sum(values, scale) -> float:
    """scale * sum(values), summed in float64: the loss reduction over per-row terms."""
    return float(scale * np.sum(values, dtype=np.float64))
