"""Every CUDA kernel compiles for a real GPU (PTX for sm_90), with no GPU needed.

The simulator runs kernels as Python, so it cannot catch what only the CUDA compiler rejects
(a shared-array shape that is not a compile-time constant, a type that does not unify, an
accidental float64). This compiles each kernel with the signatures the models launch it with.
It needs numba-cuda with NVVM (`pip install 'numba-cuda[cu12]'`, about 500 MB, so not in the
test extra) and no NUMBA_ENABLE_CUDASIM; it is not collected by the default test run:

    python -m pytest -q tests/cuda_sim/check_ptx.py
"""

from __future__ import annotations

import numba.cuda.dispatcher as dispatcher
import pytest
from numba import cuda, types

from pserver.kernels import cuda as K
from pserver.kernels import cuda_gemm as G
from pserver.kernels import cuda_graph as GR

f32_2d = types.Array(types.float32, 2, "C")
f32_1d = types.Array(types.float32, 1, "C")
f64_1d = types.Array(types.float64, 1, "C")
i32_1d = types.Array(types.int32, 1, "C")
f32_3d = types.Array(types.float32, 3, "C")
f32_4d = types.Array(types.float32, 4, "C")
i32_4d = types.Array(types.int32, 4, "C")
i64_2d = types.Array(types.int64, 2, "C")
i64 = types.int64
i64_1d = types.Array(types.int64, 1, "C")
i32_2d = types.Array(types.int32, 2, "C")
RANKS = types.UniTuple(types.int64, GR.RANK)
# stride_h, stride_w, pad_top, pad_left; pool_h, pool_w before them for pooling.
PLACE = (i64,) * 4
POOL = (i64,) * 6

SIGNATURES = {
    "matmul_bias_relu": (K.matmul_bias_relu, (f32_2d, f32_2d, f32_1d, f32_2d, types.boolean)),
    "relu_backward_kernel": (K.relu_backward_kernel, (f32_2d, f32_2d)),
    "column_sum_kernel": (K.column_sum_kernel, (f32_2d, f32_1d)),
    "softmax_xent_rows": (K.softmax_xent_rows, (f32_2d, i32_1d, f32_2d, f32_1d)),
    "mse_rows": (K.mse_rows, (f32_2d, f32_1d, f32_2d, f32_1d)),
    "scaled_sum_kernel": (K.scaled_sum_kernel, (f32_1d, types.float64, f64_1d)),
    "conv2d_forward_kernel": (K.conv2d_forward_kernel,
                              (f32_4d, f32_4d, f32_1d, f32_4d, *PLACE, types.boolean)),
    "conv2d_dw_kernel": (K.conv2d_dw_kernel, (f32_4d, f32_4d, f32_4d, *PLACE)),
    "conv2d_dx_kernel": (K.conv2d_dx_kernel, (f32_4d, f32_4d, f32_4d, *PLACE)),
    "maxpool2d_forward_kernel": (K.maxpool2d_forward_kernel, (f32_4d, f32_4d, i32_4d, *POOL)),
    "maxpool2d_backward_kernel": (K.maxpool2d_backward_kernel, (f32_4d, i32_4d, f32_4d)),
    "avgpool2d_forward_kernel": (K.avgpool2d_forward_kernel, (f32_4d, f32_4d, *POOL)),
    "avgpool2d_backward_kernel": (K.avgpool2d_backward_kernel, (f32_4d, f32_4d, *POOL)),
    "activation_forward_kernel": (K.activation_forward_kernel, (i64, f32_1d, f32_1d)),
    "activation_backward_kernel": (K.activation_backward_kernel, (i64, f32_1d, f32_1d, f32_1d)),
    "dropout_forward_kernel": (K.dropout_forward_kernel,
                               (f32_1d, f32_1d, f32_1d, types.uint64, types.float32, types.uint64)),
    "multiply_kernel": (K.multiply_kernel, (f32_1d, f32_1d, f32_1d)),
    "fill_kernel": (K.fill_kernel, (f32_1d, types.float32)),
    "embedding_forward_kernel": (K.embedding_forward_kernel, (i64_2d, f32_2d, f32_3d)),
    "embedding_backward_kernel": (K.embedding_backward_kernel, (i64_2d, f32_3d, f32_2d)),
    "sigmoid_bce_rows": (K.sigmoid_bce_rows, (f32_1d, f32_1d, f32_1d, f32_1d)),
    "split_sum_kernel": (G.split_sum_kernel, (f32_3d, f32_2d, f32_1d)),
    # pserver.kernels.cuda_graph: shapes and strides as tuples of RANK ints
    "binary_kernel": (GR.binary_kernel, (i64, f32_1d, f32_1d, f32_1d, *(RANKS,) * 3)),
    "binary_grad_kernel": (GR.binary_grad_kernel, (i64, i64, *(f32_1d,) * 5, *(RANKS,) * 3)),
    "sum_to_kernel": (GR.sum_to_kernel, (f32_1d, f32_1d, RANKS, RANKS, types.float32)),
    "broadcast_kernel": (GR.broadcast_kernel, (f32_1d, f32_1d, RANKS, RANKS, types.float32)),
    "scale_kernel": (GR.scale_kernel, (f32_1d, types.float32, f32_1d)),
    "extreme_step_kernel": (GR.extreme_step_kernel, (types.boolean, f32_1d, types.int32, f32_1d, i32_1d)),
    "select_grad_kernel": (GR.select_grad_kernel, (f32_1d, i32_1d, types.int32, f32_1d)),
    "graph_columns_kernel": (GR.columns_kernel, (f32_2d, f32_2d, i64, types.boolean)),
    "global_avgpool_kernel": (GR.global_avgpool_kernel, (f32_3d, f32_2d)),
    "global_maxpool_kernel": (GR.global_maxpool_kernel, (f32_3d, f32_2d, i32_2d)),
    "global_pool_backward_kernel": (GR.global_pool_backward_kernel, (f32_2d, i32_2d, f32_3d, types.boolean)),
    "unary_kernel": (GR.unary_kernel, (i64, f32_1d, f32_1d)),
    "unary_grad_kernel": (GR.unary_grad_kernel, (i64, *(f32_1d,) * 4)),
    "clip_kernel": (GR.clip_kernel, (f32_1d, types.float32, types.float32, f32_1d)),
    "clip_grad_kernel": (GR.clip_grad_kernel, (f32_1d, f32_1d, types.float32, types.float32, f32_1d)),
    "where_kernel": (GR.where_kernel, (*(f32_1d,) * 4, *(RANKS,) * 4)),
    "where_grad_kernel": (GR.where_grad_kernel, (*(f32_1d,) * 3, RANKS, RANKS, types.boolean)),
    "ids_kernel": (GR.ids_kernel, (f32_1d, i64_1d, types.boolean, types.float32)),
    "layer_norm_rows_kernel": (GR.layer_norm_rows_kernel, (f32_2d, f32_1d, f32_1d, types.boolean,
                                                           types.boolean, types.float32, *(f32_2d,) * 3)),
    "layer_norm_params_kernel": (GR.layer_norm_params_kernel,
                                 (f32_2d, f32_2d, f32_1d, f32_1d, types.boolean, types.boolean)),
    "layer_norm_dx_kernel": (GR.layer_norm_dx_kernel, (*(f32_2d,) * 3, f32_1d, types.boolean, f32_2d)),
    "batch_norm_moments_kernel": (GR.batch_norm_moments_kernel, (f32_2d, f32_1d, f32_1d)),
    "batch_norm_apply_kernel": (GR.batch_norm_apply_kernel, (f32_2d, *(f32_1d,) * 4, types.boolean,
                                                             types.boolean, types.float32, f32_2d, f32_1d,
                                                             f32_2d)),
    "batch_norm_sums_kernel": (GR.batch_norm_sums_kernel, (f32_2d, f32_2d, f32_1d, types.boolean, f32_1d,
                                                           f32_1d, types.boolean, types.boolean, f32_2d)),
    "batch_norm_dx_kernel": (GR.batch_norm_dx_kernel, (f32_2d, f32_2d, f32_1d, f32_1d, types.boolean, f32_2d,
                                                       types.boolean, f32_2d)),
    "batch_norm_statistics_kernel": (GR.batch_norm_statistics_kernel, (f32_1d,) * 5),
    "batched_matmul_kernel": (GR.batched_matmul_kernel, (*(f32_3d,) * 3, types.boolean, types.boolean)),
    "window_kernel": (GR.window_kernel, (f32_4d, f32_4d, i64, i64, types.boolean)),
    "deviation_kernel": (GR.deviation_kernel, (f32_1d, types.float32, f32_1d)),
    "gather_kernel": (GR.gather_kernel, (f32_1d, i64_1d, f32_1d)),
    "scatter_add_kernel": (GR.scatter_add_kernel, (f32_1d, i64_1d, f32_1d)),
    "one_hot_kernel": (GR.one_hot_kernel, (f32_1d, i64, f32_1d)),
    "softmax_rows_kernel": (GR.softmax_rows_kernel, (f32_2d, f32_2d, types.boolean)),
    "softmax_rows_grad_kernel": (GR.softmax_rows_grad_kernel, (*(f32_2d,) * 3, types.boolean)),
    "extreme_to_kernel": (GR.extreme_to_kernel, (f32_1d, f32_1d, RANKS, RANKS, types.boolean)),
    "extreme_to_grad_kernel": (GR.extreme_to_grad_kernel, (*(f32_1d,) * 4, RANKS, RANKS)),
    **{f"matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}": (k, (f32_2d, f32_2d, f32_2d))
       for (ta, tb), k in K.MATMUL.items()},
    **{f"blocked_{name}_matmul_{'t' if ta else 'n'}{'t' if tb else 'n'}": (k, (f32_2d, f32_2d, f32_2d))
       for name, (_, forms, _) in K.BLOCKED_VARIANTS.items() for (ta, tb), k in forms.items()},
    **{f"blocked_{name}_dense": (dense, (f32_2d, f32_2d, f32_1d, f32_2d, types.boolean))
       for name, (_, _, dense) in K.BLOCKED_VARIANTS.items()},
}


# bar.sync count by kernel-name prefix (others have none): a tree over REDUCE_THREADS = 128
# partial sums meets log2(128) = 7 barriers.
BARRIERS = {"matmul": 2, "blocked": 2, "column": 1, "scaled": 7, "conv2d_dw": 7}


class _NoGpu:
    # A device function asks the current device for its compute capability; there is none.
    compute_capability = (9, 0)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_compiles_to_ptx(name, monkeypatch):
    assert not cuda.config.ENABLE_CUDASIM, "the simulator compiles nothing: unset NUMBA_ENABLE_CUDASIM"
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _NoGpu(), raising=False)
    kernel, sig = SIGNATURES[name]
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    barriers = ptx.count("bar.sync")
    assert barriers == next((n for prefix, n in BARRIERS.items() if name.startswith(prefix)), 0)
    if name != "scaled_sum_kernel":   # the loss reduction sums in float64 on purpose
        assert ".f64" not in ptx, f"{name} does float64 arithmetic"
    if name.startswith("blocked"):
        # The register-blocked products keep each thread's block of C in registers: a loop
        # the compiler did not unroll would leave it in local memory, several times slower.
        assert ".local" not in ptx, f"{name} keeps an array in local memory"
        tile = K.BLOCKED_VARIANTS[name.split("_")[1]][0]
        per_thread = (tile // K.BLOCKED_THREADS) ** 2
        assert ptx.count("fma.rn.f32") >= per_thread, \
            f"{name}: the {per_thread} multiply-adds per k are not unrolled"


def test_the_compiler_check_passes_with_this_numpy():
    from pserver.kernels.device import Device, check_compiler
    check_compiler(Device("cuda", 0))


# -- pserver.kernels.cuda_gemm: the implicit-GEMM convolutions and the product's variants -------

_GEO = types.UniTuple(types.int64, 12)
_GEMM_TAIL = (_GEO, types.boolean, i64, i64)
# form -> (A's operand, B's operand, epilogue, columns the launcher sizes the tile for, arrays)
_GEMM_FORMS = {
    "matmul": (G._PLAIN_A[False], G._PLAIN_B[False], G.PLAIN, 4096, (f32_2d, f32_2d, f32_2d, f32_2d)),
    "forward": (G.conv_patches, G._PLAIN_B[False], G.BIAS, 64, (f32_4d, f32_2d, f32_2d, f32_1d)),
    "input_grad": (G.conv_windows, G.conv_filters_t, G.PLAIN, 32, (f32_4d, f32_3d, f32_2d, f32_4d)),
    "weight_grad": (G.conv_patches_t, G._PLAIN_B[False], G.SPLIT, 64, (f32_4d, f32_2d, f32_3d, f32_1d)),
}
# Every variant's product, and every form of the convolutions' default and of one contig variant.
_GEMM_CASES = sorted({(v, "matmul") for v in G.VARIANTS} |
                     {(v, f) for v in (G.CONV_DEFAULT, "g64k16dc") for f in _GEMM_FORMS})


@pytest.mark.parametrize("variant, form", _GEMM_CASES)
def test_gemm_kernels_compile_to_ptx(variant, form, monkeypatch):
    assert not cuda.config.ENABLE_CUDASIM, "the simulator compiles nothing: unset NUMBA_ENABLE_CUDASIM"
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _NoGpu(), raising=False)
    v = G.VARIANTS[variant]
    a_op, b_op, epilogue, cols, arrays = _GEMM_FORMS[form]
    bn = v.width(cols)
    kernel = v.kernel(a_op, b_op, epilogue, bn)
    ptx, _ = cuda.compile_ptx(kernel.py_func, (*arrays, *_GEMM_TAIL), cc=(9, 0), launch_bounds=v.bounds)
    assert ".f64" not in ptx and ".local" not in ptx, f"{variant} {form}: float64 or local memory"
    tm, tn = v.bm // G.THREADS, bn // G.THREADS
    assert ptx.count("fma.rn.f32") >= tm * tn, f"{variant} {form}: the multiply-adds are not unrolled"
    # One barrier per strip with two shared strips (the loop runs two strips a turn: 2, plus
    # one before it), two with one.
    assert ptx.count("bar.sync") == (3 if v.dbuf else 2)
    if v.contig and bn % 64 == 0:
        # Runs of 4 read with 128-bit shared loads only: a shared strip named by a run-time
        # index once split them into scalar and 64-bit loads (the compiler lost the alignment).
        assert ptx.count("ld.shared.v4.f32") >= tm // 4 + tn // 4
        assert "ld.shared.f32" not in ptx and "ld.shared.v2.f32" not in ptx
    if form in ("forward", "weight_grad"):
        # Index arithmetic in 32 bits (div.u32): a 64-bit division is a long subroutine, and
        # these decode pixels and taps in the loops. (The input gradient's strided case,
        # never the stride-1 one, divides in 64 bits.)
        assert not any(op in ptx for op in ("div.s64", "rem.s64", "div.u64", "rem.u64"))
