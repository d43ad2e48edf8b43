"""Graphs by tracing (pserver.models.graph, pserver.models.Functional) and the layers for graphs.

Gradients are checked against central finite differences in float64 on the "reference" backend
(the NumPy twin of every kernel), and a Functional model of the seed models against the same
Sequential: loss and gradient for the same weights and batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import ops
from pserver.errors import ConfigError
from pserver.layers import (
    Activation,
    Concatenate,
    Conv2D,
    Dense,
    Dot,
    Dropout,
    Embedding,
    Flatten,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    GroupNormalization,
    Maximum,
    MaxPooling2D,
    Permute,
    RepeatVector,
    Reshape,
    add,
    average,
    concatenate,
    maximum,
    minimum,
    multiply,
    subtract,
)
from pserver.models import cnn, mlp, on_device
from pserver.models.functional import Functional
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_fd

# -- random graphs ---------------------------------------------------------------------------------

MERGES = [add, subtract, multiply, average, maximum, minimum]


@st.composite
def graphs(draw):
    """A random small graph over width-4 tensors: Dense layers (some called twice: shared
    weights), merges of two earlier tensors (fan-out), ops, a concatenation, then Dense(3)."""
    x = Symbolic((None, 4), name="x")
    tensors, dense = [x], []
    for _ in range(draw(st.integers(2, 6))):
        a = tensors[draw(st.integers(0, len(tensors) - 1))]
        kind = draw(st.sampled_from(["dense", "shared", "merge", "op"]))
        if kind == "shared" and dense:
            t = dense[draw(st.integers(0, len(dense) - 1))](a)
        elif kind == "merge":
            b = tensors[draw(st.integers(0, len(tensors) - 1))]
            t = draw(st.sampled_from(MERGES))([a, b])
        elif kind == "op":
            t = draw(st.sampled_from([lambda t: ops.tanh(t) * 1.5, lambda t: t * t - t,
                                      lambda t: ops.sigmoid(t) + ops.mean(t, axis=1, keepdims=True)]))(a)
        else:
            dense.append(Dense(4, activation=draw(st.sampled_from([None, "tanh", "sigmoid"]))))
            t = dense[-1](a)
        tensors.append(t)
    out = Dense(3)(concatenate([tensors[-1], tensors[draw(st.integers(0, len(tensors) - 1))]]))
    return x, out


@settings(max_examples=12, deadline=None)
@given(graphs(), st.integers(0, 2**16))
def test_random_graph_gradients_equal_finite_differences(graph, seed):
    """Catches: a gradient not summed where a tensor fans out, a shared layer's second use
    overwriting its first's weight gradient, a merge's or an op's backward wrong."""
    x, out = graph
    rng = np.random.default_rng(seed)
    assert_fd(Functional(x, out), rng.normal(size=(5, 4)), rng.integers(0, 3, 5), seed)


@pytest.mark.parametrize("layer, shape", [
    (Dot(axes=(2, 2)), [(3, 2), (4, 2)]), (Dot(axes=1), [(6,), (6,)]), (Dot(axes=(1, 1)), [(3, 2), (3, 4)]),
    (Concatenate(axis=1), [(2, 3), (1, 3)]), (Maximum(), [(6,), (6,)]),
    (GlobalAveragePooling1D(), [(3, 2)]), (GlobalMaxPooling1D(), [(3, 2)]),
    (GlobalAveragePooling2D(), [(2, 3, 2)]), (GlobalMaxPooling2D(keepdims=True), [(2, 3, 2)]),
    (Permute((2, 1)), [(3, 2)]), (RepeatVector(3), [(6,)]), (Reshape((3, -1)), [(6,)]),
    (Activation("tanh"), [(6,)]),
])
def test_each_graph_layer_s_backward_equals_finite_differences(layer, shape):
    """Catches: a wrong backward (a transposed Dot operand, a Permute's inverse, the max's
    routing) in any of the layers that exist for graphs."""
    x = Symbolic((None, 5), name="x")
    ins = [Reshape(s)(Dense(int(np.prod(s)), activation="tanh")(x)) for s in shape]
    out = Dense(2)(Flatten()(layer(ins if layer.takes_list else ins[0])))
    rng = np.random.default_rng(1)
    assert_fd(Functional(x, out), rng.normal(size=(4, 5)), rng.integers(0, 2, 4))


# -- the seed models ----------------------------------------------------------------------------

def functional_of(seq):
    """The same layers as `seq` (fresh ones of the same configs), called in a chain."""
    x = Symbolic((None, *seq.input_shape), name="x")
    h = x
    for layer in seq.layers:
        h = type(layer).from_config(layer.get_config())(h)
    return Functional(x, h, name=seq.name)


@pytest.mark.parametrize("make, shape", [(lambda: cnn(), (28, 28, 1)),
                                         (lambda: mlp((784,), 10, (32, 16)), (784,))])
def test_a_functional_seed_model_equals_its_sequential_loss_and_gradient(make, shape):
    """Catches: a graph that runs the fused layers otherwise than Sequential (buffers, the
    fused softmax, the dx a layer writes straight into the layer below's dout)."""
    seq = make()
    fun = functional_of(seq)
    assert fun.layout.describe() == seq.layout.describe()
    w = seq.init_params(7)
    rng = np.random.default_rng(2)
    x, y = rng.random((16, *shape), np.float32), rng.integers(0, 10, 16)
    g_seq, g_fun = np.zeros_like(w), np.zeros_like(w)
    assert abs(fun.loss_and_grad(w, x, y, g_fun) - seq.loss_and_grad(w, x, y, g_seq)) <= 1e-6
    assert np.linalg.norm(g_fun - g_seq) <= 1e-6 * np.linalg.norm(g_seq)
    assert np.array_equal(fun.predict(w, x), seq.predict(w, x))
    assert fun.evaluate(w, x, y) == seq.evaluate(w, x, y)
    assert fun.evaluate(w, x, y, batch_size=5, threads=2) == seq.evaluate(w, x, y, batch_size=5)


# -- calls, shapes, refusals ------------------------------------------------------------------------

def test_a_layer_called_twice_holds_one_set_of_weights_in_the_layout():
    """Catches: a shared layer's weights laid out twice (two copies drift apart in training)."""
    x = Symbolic((None, 3))
    d = Dense(3)
    model = Functional(x, Dense(2)(add([d(x), d(d(x))])))
    assert model.layout.describe() == ("dense/kernel[3, 3], dense/bias[3], "
                                       "dense_1/kernel[3, 2], dense_1/bias[2]")


def test_layers_without_weights_compute_on_arrays_and_layers_with_weights_refuse():
    """Catches: an eager call that computes something else than the graph would."""
    rng = np.random.default_rng(0)
    a, b = rng.random((2, 3, 4), np.float32)
    assert np.array_equal(add([a, b]), a + b)
    assert np.array_equal(concatenate([a, b], axis=1), np.concatenate([a, b], 1))
    seq = rng.random((2, 3, 4), np.float32)
    assert np.allclose(GlobalAveragePooling1D()(seq), seq.mean(axis=1))
    with pytest.raises(ConfigError, match=r"layer dense \(Dense\): has weights"):
        Dense(2, name="dense")(a)


def test_a_merge_of_mismatched_shapes_names_the_layer_and_the_shapes():
    x, y = Symbolic((None, 4)), Symbolic((None, 3))
    with pytest.raises(ConfigError, match=r"^layer add \(Add\): inputs of shapes \(4,\), \(3,\) do not"):
        add([x, y], name="add")
    with pytest.raises(ConfigError, match=r"layer cat \(Concatenate\): inputs of shapes \(2, 3\), \(2, 4\)"):
        Concatenate(axis=1, name="cat")([Symbolic((None, 2, 3)), Symbolic((None, 2, 4))])
    with pytest.raises(ConfigError, match=r"takes exactly 2 inputs, got 3"):
        subtract([x, x, x])


def test_a_layer_called_on_another_shape_is_refused_with_both_shapes():
    d = Dense(2, name="d")
    d(Symbolic((None, 4)))
    with pytest.raises(ConfigError, match=r"^layer d \(Dense\): built for input shape \(4,\), called again "
                                          r"on \(5,\)"):
        d(Symbolic((None, 5)))


def test_a_graph_refuses_an_input_it_does_not_use_and_a_tensor_it_was_not_given():
    """Catches: a model that silently trains on part of its inputs, or reads a stray tensor."""
    x, y = Symbolic((None, 4), name="x"), Symbolic((None, 4), name="y")
    out = Dense(2)(x)
    with pytest.raises(ConfigError, match="does not depend on the input <Symbolic y"):
        Functional([x, y], out)
    with pytest.raises(ConfigError, match="<Symbolic x .* is not one of the model's inputs"):
        Functional(y, Dense(2)(add([x, y])))


def test_a_layer_called_on_a_non_tensor_is_refused():
    with pytest.raises(ConfigError, match=r"called on str; call a layer on keras.Input"):
        Dense(2)("x")
    with pytest.raises(ConfigError, match=r"called on list among symbolic tensors|takes one tensor"):
        Dense(2)([Symbolic((None, 2)), [1, 2]])


def test_several_inputs_pack_side_by_side_and_a_dict_goes_by_name():
    """Catches: inputs given as a dict matched by position, or packed in another order than
    the model splits them."""
    a, b = Symbolic((None, 2), name="a"), Symbolic((None, 3), name="b")
    model = Functional([a, b], Dense(2)(concatenate([a, Dense(2)(b)])))
    rng = np.random.default_rng(0)
    xa, xb = rng.random((5, 2), np.float32), rng.random((5, 3), np.float32)
    w = model.init_params(0)
    assert np.array_equal(model.pack({"b": xb, "a": xa}), np.concatenate([xa, xb], axis=1))
    assert np.array_equal(model.predict(w, [xa, xb]), model.predict(w, {"b": xb, "a": xa}))
    with pytest.raises(ValueError, match="input 'b': x has shape \\(5, 4\\)"):
        model.pack([xa, rng.random((5, 4))])
    assert_fd(model, [xa.astype(np.float64), xb.astype(np.float64)], np.array([0, 1, 1, 0, 1]))


def test_a_conv_graph_with_a_residual_branch_trains_by_its_gradient():
    """Catches: a conv layer's kept im2col matrix used for another call's input (fan-out)."""
    x = Symbolic((None, 6, 6, 2))
    h = Conv2D(2, 3, padding="same", activation="tanh")(x)
    h = add([h, Conv2D(2, 3, padding="same")(h)])
    model = Functional(x, Dense(3)(Flatten()(h)))
    rng = np.random.default_rng(3)
    assert_fd(model, rng.normal(size=(2, 6, 6, 2)), np.array([0, 2]))


def test_an_op_with_several_outputs_takes_the_cotangent_of_each():
    """Catches: a multi-output op (split) planned as one output, or one part's gradient lost."""
    x = Symbolic((None, 3))
    a, b, c = ops.split(Dense(6, activation="tanh")(x), 3, axis=1)
    out = Dense(2)(concatenate([a * b, ops.exp(c)]))
    rng = np.random.default_rng(4)
    assert_fd(Functional(x, out), rng.normal(size=(4, 3)), np.array([0, 1, 1, 0]))


def test_integer_inputs_reach_a_dense_layer_as_floats_and_an_embedding_as_ids():
    """Catches: uint8 pixels handed to a float kernel, or ids rounded through float32."""
    pixels, ids = Symbolic((None, 3), "uint8"), Symbolic((None, 2), "int64")
    h = concatenate([Dense(2)(pixels), Flatten()(Embedding(2**20, 2)(ids))])
    model = Functional([pixels, ids], Dense(2)(h))
    w = model.init_params(0)
    x = [np.array([[1, 2, 3]], np.uint8), np.array([[2**20 - 1, 5]])]
    out = model.predict(w, x)
    views = model.layout.views(w)
    emb = views["embedding/embeddings"][[2**20 - 1, 5]].reshape(-1)
    dense = x[0].astype(np.float32) @ views["dense/kernel"] + views["dense/bias"]
    expected = np.concatenate([dense[0], emb]) @ views["dense_1/kernel"] + views["dense_1/bias"]
    assert np.allclose(out[0], expected, rtol=1e-5)
    from pserver.models import cuda_support
    cuda_support.check(model)     # a dense table runs on the GPU (tests/cuda_sim/check_graph_cuda.py)


def test_keras_ios_toy_resnet_passes_the_cuda_check():
    """Catches: a layer of keras.io's toy ResNet (bench/keras_io/toy_resnet.py, as built there on
    MNIST) missing from what runs on the GPU. The simulator runs a smaller one
    (tests/cuda_sim/check_graph_cuda.py)."""
    from pserver.models import cuda_support
    inputs = Symbolic((None, 28, 28, 1))
    x = Conv2D(64, 3, activation="relu")(Conv2D(32, 3, activation="relu")(inputs))
    block_1 = MaxPooling2D(3)(x)
    x = Conv2D(64, 3, activation="relu", padding="same")(block_1)
    block_2 = add([Conv2D(64, 3, activation="relu", padding="same")(x), block_1])
    x = Conv2D(64, 3, activation="relu", padding="same")(block_2)
    block_3 = add([Conv2D(64, 3, activation="relu", padding="same")(x), block_2])
    x = GlobalAveragePooling2D()(Conv2D(64, 3, activation="relu")(block_3))
    x = Dropout(0.5)(Dense(256, activation="relu")(x))
    cuda_support.check(Functional(inputs, Dense(10)(x)).build())


def test_a_sparse_embedding_is_refused_on_cuda_and_a_dense_one_runs():
    """Catches: a sparse table's lookup (rows pulled from the shards per batch) sent to the
    GPU's dense kernels, which would read a table that is not in the layout."""
    from pserver.models import cuda_support
    ids = Symbolic((None, 2), "int64")
    sparse = Functional({"ids": ids}, Dense(2)(Flatten()(Embedding(None, 2, sparse=True)(ids)))).build()
    with pytest.raises(ConfigError, match=r"; functional: layer embedding \(Embedding\) is sparse \(its "
                                          r"rows live on the shards; a dense table runs on the GPU\)\. Use "):
        cuda_support.check(sparse)
    cuda_support.check(Functional(ids, Dense(2)(Flatten()(Embedding(10, 2)(ids)))).build())


@pytest.mark.parametrize("make,why", [
    (lambda x: GroupNormalization(groups=1)(Dense(2)(x)),
     r"layer group_normalization \(GroupNormalization\) has no CUDA kernels"),
    (lambda x: ops.reshape(ops.stack([Dense(2)(x), Dense(2)(x)], axis=0)[:1], (-1, 2)) + Dense(2)(x),
     "op stack along the batch axis has no CUDA kernel"),
    (lambda x: Dense(2)(x) - ops.sum(Dense(2)(x), axis=0), "op sum over the batch axis has no CUDA kernel"),
    (lambda x: Dense(2)(x) - ops.max(Dense(2)(x), axis=0), "op max over the batch axis has no CUDA kernel"),
    (lambda x: ops.concatenate([Dense(2)(x), Dense(2)(x)], axis=0)[:1] * 0.0 + Dense(2)(x),
     "op concatenate along the batch axis has no CUDA kernel"),
    (lambda x: Flatten()(ops.one_hot(x, 3, axis=1)),
     "op one_hot along another axis than the last has no CUDA kernel"),
    (lambda x: Flatten()(ops.one_hot(x, 3, dtype="int32")),
     r"op one_hot to int32 has no CUDA kernel \(the GPU's tensors are float32\)"),
    (lambda x: ops.clip(Dense(2)(x), Dense(2)(x), 1.0),
     "op clip with bounds that are not numbers has no CUDA kernel"),
    (lambda x: ops.cast(ops.cast(Dense(2)(x), "int32"), "float32"),
     r"op cast to int32 has no CUDA kernel \(the GPU's tensors are float32\)"),
    (lambda x: ops.expand_dims(ops.take(Dense(4)(x), x[:, 0]), -1),
     r"op take with indices computed in the graph has no CUDA kernel \(constant indices have\)"),
    (lambda x: Flatten()(Embedding(2**24 + 1, 2)(x)),
     r"layer embedding \(Embedding\) has input_dim=16777217: a batch reaches the GPU as float32, which "
     "holds ids exactly up to 16777216"),
])
def test_a_graph_that_cannot_run_on_cuda_is_refused_in_one_line_before_numba_cuda(make, why):
    """Catches: a layer or op without CUDA kernels let through to fail mid-step on the device
    (or to run NumPy on device arrays). The check imports no numba.cuda, so it runs here."""
    x = Symbolic((None, 3))
    with pytest.raises(ConfigError, match=rf"^--device cuda: .*; functional: {why}\. Use --device cpu"):
        made = make(x)
        on_device(Functional(x, made if isinstance(made, list) else Dense(2)(made)), "cuda")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_the_graph_layers_compute_what_numpy_and_keras_say(n, a, b, d, seed):
    """Catches: a forward pass that its own backward agrees with but Keras's semantics do not
    (finite differences cannot see it): Dot's axes, Permute's order, which input Subtract
    takes from which, a pooling over the wrong axis."""
    rng = np.random.default_rng(seed)
    x, y, z = (rng.normal(size=(n, a, d)).astype(np.float32) for _ in range(3))
    u = rng.normal(size=(n, b, d)).astype(np.float32)
    assert np.allclose(add([x, y, z]), x + y + z, atol=1e-6)
    assert np.allclose(subtract([x, y]), x - y)
    assert np.allclose(multiply([x, y, z]), x * y * z, atol=1e-6)
    assert np.allclose(average([x, y]), (x + y) / 2)
    assert np.array_equal(maximum([x, y, z]), np.maximum(np.maximum(x, y), z))
    assert np.array_equal(minimum([x, y]), np.minimum(x, y))
    assert np.array_equal(concatenate([x, u], axis=1), np.concatenate([x, u], axis=1))
    assert np.allclose(Dot(axes=2)([x, u]), np.einsum("nad,nbd->nab", x, u), atol=1e-5)
    assert np.allclose(Dot(axes=(1, 1))([x, y]), np.einsum("nad,nae->nde", x, y), atol=1e-5)
    assert np.allclose(Dot(axes=1)([x[:, 0], y[:, 0]]), (x[:, 0] * y[:, 0]).sum(1, keepdims=True), atol=1e-5)
    assert np.array_equal(Permute((2, 1))(x), x.transpose(0, 2, 1))
    assert np.array_equal(RepeatVector(b)(x[:, 0]), np.repeat(x[:, :1], b, axis=1))
    assert np.allclose(GlobalAveragePooling1D()(x), x.mean(axis=1), atol=1e-6)
    assert np.array_equal(GlobalMaxPooling1D()(x), x.max(axis=1))
    image = rng.normal(size=(n, a, b, d)).astype(np.float32)
    assert np.array_equal(GlobalMaxPooling2D()(image), image.max(axis=(1, 2)))
    assert np.allclose(GlobalAveragePooling2D(keepdims=True)(image), image.mean(axis=(1, 2), keepdims=True),
                       atol=1e-6)


def test_an_id_outside_the_table_is_named_where_the_data_holds_it_padding_and_all():
    """Catches: the position counted among the ids left after dropping the padding (the first
    bad id of [[0, 0, 1], [2, 0, 7]] reported at (3,) rather than (1, 2))."""
    with pytest.raises(ValueError, match=r"^layer embedding \(Embedding\): id 7 at \(1, 2\) is not an "):
        Embedding(5, 2, mask_zero=True).check_ids(np.array([[0, 0, 1], [2, 0, 7]]))
    with pytest.raises(ValueError, match=r"id 1\.5 at \(0, 1\) is not an integer"):
        Embedding(5, 2).check_ids(np.array([[0, 1.5, 9]]))
    Embedding(5, 2, mask_zero=True).check_ids(np.array([[0, 0, 4]]))
