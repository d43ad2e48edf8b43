"""FeatureCross and DotInteraction (Keras-RS's DCN-v2 and DLRM interaction layers,
pserver.layers.interaction): forward against float64 NumPy twins written from Keras-RS's source
(keras_rs/src/layers/feature_interaction/feature_cross.py and dot_interaction.py) for every
option, gradients of small Functional models against central finite differences, save/load and
config round trips, refusals, and a small DCN trained with compile/fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.keras import layers
from pserver.layers import LAYERS, DotInteraction, FeatureCross
from tests.support.gradients import assert_fd

FAST = settings(max_examples=25, deadline=None)
ACTIVATIONS = ["linear", "relu", "sigmoid", "tanh", "softmax"]


# -- the twins: Keras-RS's formulas in float64 ------------------------------------------------------

def _act(name, z):
    if name == "relu":
        return np.maximum(z, 0)
    if name == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if name == "tanh":
        return np.tanh(z)
    if name == "softmax":
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return z


def cross_twin(x0, x, w, projection_dim, diag_scale, use_bias, pre_activation):
    """feature_cross.py's call: output = dense(down_proj_dense(x) or x), the activation inside
    dense (after its bias); + diag_scale * x if diag_scale; return x0 * output + x."""
    h = x if projection_dim is None else np.einsum("...i,ij->...j", x, w["down_proj_dense/kernel"])
    out = np.einsum("...i,ij->...j", h, w["dense/kernel"])
    if use_bias:
        out = out + w["dense/bias"]
    out = _act(pre_activation, out)
    if diag_scale:
        out = out + diag_scale * x
    return x0 * out + x


def dot_twin(features, self_interaction, skip_gather):
    """dot_interaction.py's call: the (F, F) matrix of dot products; with skip_gather, times the
    lower-triangle mask (k = 0 with self_interaction, else -1), flattened; else its entries
    i * F + j for i in range(F), j in range(i (+1 with self_interaction)), in that order."""
    f = len(features)
    m = np.einsum("nid,njd->nij", np.stack(features, 1), np.stack(features, 1))
    if skip_gather:
        mask = np.array([[j <= i - (0 if self_interaction else 1) for j in range(f)] for i in range(f)])
        return (m * mask).reshape(len(m), f * f)
    picked = [m[:, i, j] for i in range(f) for j in range(i + 1 if self_interaction else i)]
    return np.stack(picked, 1)


def cross_model(dim, steps, two_inputs, **options):
    """keras.Model of one FeatureCross on (steps, dim) inputs (steps 0: (dim,)): x0 alone, or x0
    and x."""
    shape = (steps, dim) if steps else (dim,)
    inputs = [keras.Input(shape=shape) for _ in range(2 if two_inputs else 1)]
    out = FeatureCross(**options)(*inputs)
    return keras.Model(inputs if two_inputs else inputs[0], out)


def weights64(model, seed):
    """A random float64 weight vector for the model, and its views by the layout's names."""
    core = model._core.use_backend("reference")
    w = np.random.default_rng(seed).normal(0, 0.5, core.layout.total)
    return core, w, core.layout.views(w)


# -- forward against the twins ----------------------------------------------------------------------

@FAST
@given(n=st.integers(1, 4), dim=st.integers(1, 6), steps=st.sampled_from([0, 0, 3]),
       projection_dim=st.one_of(st.none(), st.integers(1, 4)),
       diag_scale=st.sampled_from([None, 0.0, 0.7, 2]), use_bias=st.booleans(),
       pre_activation=st.sampled_from([None, *ACTIVATIONS]), two_inputs=st.booleans(),
       seed=st.integers(0, 2**16))
def test_feature_cross_equals_keras_rs_formula(n, dim, steps, projection_dim, diag_scale, use_bias,
                                              pre_activation, two_inputs, seed):
    """Catches: the activation applied after diag_scale * x is added (or to the whole output), the
    bias missing or added before the down-projection, diag_scale scaling x0 instead of x, x0 and x
    swapped, the residual x dropped, a low-rank form with a bias on U or V's shape transposed."""
    model = cross_model(dim, steps, two_inputs, projection_dim=projection_dim, diag_scale=diag_scale,
                        use_bias=use_bias, pre_activation=pre_activation)
    core, w, views = weights64(model, seed)
    names = {k.split("/", 1)[1]: v for k, v in views.items()}
    assert sorted(names) == sorted(["dense/kernel"] + ["dense/bias"] * use_bias
                                   + ["down_proj_dense/kernel"] * (projection_dim is not None))
    rng = np.random.default_rng(seed + 1)
    shape = (n, steps, dim) if steps else (n, dim)
    x0 = rng.normal(size=shape)
    x = rng.normal(size=shape) if two_inputs else x0
    got = core.predict(w, core.pack([x0, x]) if two_inputs else x0)
    # diag_scale is a float32 constant of the traced graph, as in a Keras float32 model
    scale = None if diag_scale is None else float(np.float32(diag_scale))
    expected = cross_twin(x0, x, names, projection_dim, scale, use_bias, pre_activation or "linear")
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_feature_cross_pre_activation_applies_before_diag_scale_and_the_residual():
    """Pinned by hand (dim 1, W = 1, bias = -2, relu, diag_scale 3): relu(x - 2) + 3x, times x0, plus x.
    Catches the order that a random test could let through at a kink."""
    model = cross_model(1, 0, True, diag_scale=3.0, pre_activation="relu")
    core, w, views = weights64(model, 0)
    views["feature_cross/dense/kernel"][...] = 1.0
    views["feature_cross/dense/bias"][...] = -2.0
    x0, x = np.array([[2.0], [-1.0]]), np.array([[5.0], [1.0]])
    got = core.predict(w, core.pack([x0, x]))
    np.testing.assert_allclose(got, [[2 * (3 + 15) + 5], [-1 * (0 + 3) + 1]])


@FAST
@given(n=st.integers(1, 4), f=st.integers(1, 6), dim=st.integers(1, 5), self_interaction=st.booleans(),
       skip_gather=st.booleans(), seed=st.integers(0, 2**16))
def test_dot_interaction_equals_keras_rs_formula(n, f, dim, self_interaction, skip_gather, seed):
    """On arrays (computed now) and in a model (float64, the reference backend). Catches: the
    upper triangle's row-major order (from 4 features it differs from Keras-RS's lower triangle),
    the diagonal kept or dropped against self_interaction, skip_gather's mask on the wrong side."""
    f = max(f, 1 if self_interaction else 2)
    rng = np.random.default_rng(seed)
    features = [rng.normal(size=(n, dim)) for _ in range(f)]
    expected = dot_twin(features, self_interaction, skip_gather)
    width = f * f if skip_gather else (f * (f + 1) if self_interaction else f * (f - 1)) // 2
    assert expected.shape == (n, width)
    options = dict(self_interaction=self_interaction, skip_gather=skip_gather)
    np.testing.assert_allclose(DotInteraction(**options)(features), expected, rtol=1e-12)
    # in a model: a layer has no weights of its own, so the features pass one Dense whose kernel is I
    inputs = [keras.Input(shape=(dim,)) for _ in range(f)]
    identity = layers.Dense(dim, use_bias=False)
    model = keras.Model(inputs, DotInteraction(**options)([identity(x) for x in inputs]))
    assert model._core.output_shape == (width,)
    core, w, views = weights64(model, seed)
    views["dense/kernel"][...] = np.eye(dim)
    np.testing.assert_allclose(core.predict(w, core.pack(features) if f > 1 else features[0]), expected,
                               rtol=1e-12)


def test_dot_interaction_order_pinned():
    """Four features e_k = (k + 1) * ones(1): Keras-RS's order is (1,0), (2,0), (2,1), (3,0), (3,1),
    (3,2), so products 2, 3, 6, 4, 8, 12 (the upper triangle row by row would give 2, 3, 4, 6, 8, 12)."""
    features = [np.full((1, 1), k + 1.0) for k in range(4)]
    np.testing.assert_array_equal(DotInteraction()(features), [[2, 3, 6, 4, 8, 12]])
    np.testing.assert_array_equal(DotInteraction(self_interaction=True)(features),
                                  [[1, 2, 4, 3, 6, 9, 4, 8, 12, 16]])
    np.testing.assert_array_equal(DotInteraction(skip_gather=True)(features[:3]),
                                  [[0, 0, 0, 2, 0, 0, 3, 6, 0]])


# -- gradients against finite differences -------------------------------------------------------------

@pytest.mark.parametrize("pre_activation", ACTIVATIONS)
def test_a_dcn_s_gradient_equals_finite_differences(pre_activation):
    """Two crosses (full rank, then low rank called with x0 and x), a shared Dense before them so
    that the gradient must flow through both of a cross's inputs. Catches a wrong VJP of any term:
    x0's and x's gradients not both reaching the Dense, the low-rank kernels' gradients, the bias's."""
    inp = keras.Input(shape=(3,))
    x0 = layers.Dense(4, activation="tanh")(inp)
    x1 = FeatureCross(diag_scale=0.5, pre_activation=pre_activation)(x0)
    x2 = FeatureCross(projection_dim=2, diag_scale=0.3, pre_activation=pre_activation)(x0, x1)
    model = keras.Model(inp, layers.Dense(1)(x2))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(1)
    assert_fd(model._core.use_backend("reference"), rng.normal(size=(5, 3)), rng.normal(size=(5, 1)))


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("skip_gather", [False, True])
def test_a_dlrm_interaction_s_gradient_equals_finite_differences(self_interaction, skip_gather):
    """Catches: the dot products' VJP sending each product's gradient to one of its two features
    only, a masked (zeroed) product still passing gradient, the gather's gradient misplaced."""
    inputs = [keras.Input(shape=(3,)) for _ in range(4)]
    embedded = [layers.Dense(2)(x) for x in inputs]
    top = DotInteraction(self_interaction=self_interaction, skip_gather=skip_gather)(embedded)
    model = keras.Model(inputs, layers.Dense(1)(layers.concatenate([top, embedded[0]])))
    model.compile(optimizer="sgd", loss="mse")
    core = model._core.use_backend("reference")
    rng = np.random.default_rng(2)
    x = core.pack([rng.normal(size=(5, 3)) for _ in inputs])
    assert_fd(core, x, rng.normal(size=(5, 1)))


def test_feature_cross_s_regularizers_are_keras_rs_s():
    """kernel_regularizer on both kernels (Keras-RS passes it to both Dense sublayers),
    bias_regularizer on the bias: the penalty the model adds to the loss. Catches a regularizer
    lost (add_weight takes none) or put on the wrong weight."""
    inp = keras.Input(shape=(4,))
    cross = FeatureCross(projection_dim=2, kernel_regularizer=keras.regularizers.L2(0.1),
                         bias_regularizer=keras.regularizers.L1(0.2))
    model = keras.Model(inp, layers.Dense(1)(cross(inp)))
    again = keras.Input(shape=(4,))
    plain = keras.Model(again, layers.Dense(1)(FeatureCross(projection_dim=2)(again)))
    for m in (model, plain):
        m.compile(optimizer="sgd", loss="mse")
    core, w, views = weights64(model, 3)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 1))
    penalty = (0.1 * (np.sum(views["feature_cross/down_proj_dense/kernel"] ** 2)
                      + np.sum(views["feature_cross/dense/kernel"] ** 2))
               + 0.2 * np.sum(np.abs(views["feature_cross/dense/bias"])))
    with_reg = core.loss_and_grad(w, x, y, np.zeros_like(w))
    without = plain._core.use_backend("reference").loss_and_grad(w, x, y, np.zeros_like(w))
    assert with_reg - without == pytest.approx(penalty, rel=1e-9)
    assert_fd(core, x, y, seed=3)


# -- saving, configs ---------------------------------------------------------------------------------

def test_a_model_with_both_layers_is_saved_and_loaded_with_the_same_predictions(tmp_path):
    """Catches: a layer not rebuilt by name, a cross's second input (x) not saved with the graph,
    an option lost on reload (another formula), weights in another order."""
    dense_in, ids = keras.Input(shape=(5,), name="dense"), keras.Input(shape=(3,), dtype="int32", name="ids")
    emb = layers.Embedding(7, 5)(ids)                          # (3, 5): three sparse features
    bottom = layers.Dense(5, activation="relu")(dense_in)
    parts = [bottom] + [layers.Flatten()(emb[:, i:i + 1, :]) for i in range(3)]
    top = DotInteraction(self_interaction=True)(parts)
    x0 = layers.concatenate([bottom, layers.Flatten()(emb)])
    x1 = FeatureCross(projection_dim=3, diag_scale=0.2, pre_activation=keras.activations.tanh,
                      kernel_regularizer="l2")(x0)
    x2 = FeatureCross(use_bias=False, bias_initializer="ones")(x0, x1)
    model = keras.Model({"dense": dense_in, "ids": ids},
                        layers.Dense(1, activation="sigmoid")(layers.concatenate([x2, top])))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    rng = np.random.default_rng(4)
    x = {"dense": rng.normal(size=(32, 5)).astype(np.float32), "ids": rng.integers(0, 7, (32, 3))}
    model.fit(x, rng.integers(0, 2, (32, 1)), batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "m.npz")
    again = keras.models.load_model(tmp_path / "m.npz")
    assert again._core.layout.describe() == model._core.layout.describe()
    assert np.array_equal(again.predict(x), model.predict(x))
    rebuilt = keras.Model.from_config(model.get_config())
    assert rebuilt.get_config() == model.get_config()


@pytest.mark.parametrize("cls, options", [
    (FeatureCross, dict(projection_dim=3, diag_scale=1.5, use_bias=False, pre_activation="sigmoid",
                        kernel_initializer="he_uniform", bias_initializer="ones",
                        kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02), bias_regularizer="l1",
                        name="cross")),
    (FeatureCross, dict(diag_scale=None, pre_activation=keras.activations.relu)),
    (DotInteraction, dict(self_interaction=True, skip_gather=True, name="dot")),
])
def test_get_config_and_from_config_keep_every_argument(cls, options):
    """Catches: an argument dropped or reset to its default by get_config/from_config (a reloaded
    model with another formula), a pre_activation function not saved by its name."""
    layer = cls(**options)
    config = json.loads(json.dumps(layer.get_config()))
    again = cls.from_config(config)
    assert again.get_config() == config
    for k, v in options.items():
        mine, theirs = getattr(layer, k, None), getattr(again, k, None)
        if k == "pre_activation":
            assert config[k] == theirs == (v if isinstance(v, str) else v.__name__)
        elif k.endswith("_regularizer"):
            assert type(theirs) is type(mine) and theirs.get_config() == mine.get_config(), k
        elif k.endswith("_initializer"):
            assert config[k] == v and type(theirs) is type(mine) and vars(theirs) == vars(mine), k
        else:
            assert theirs == mine == v, k
    assert LAYERS.get(cls.__name__) is cls


def test_keras_rs_defaults():
    """Keras-RS's signatures: FeatureCross(projection_dim=None, diag_scale=0.0, use_bias=True,
    pre_activation=None, kernel_initializer="glorot_uniform", bias_initializer="zeros", ...),
    DotInteraction(self_interaction=False, skip_gather=False). Catches a default changed."""
    config = FeatureCross().get_config()
    assert {k: config[k] for k in ("projection_dim", "diag_scale", "use_bias", "pre_activation",
                                   "kernel_initializer", "bias_initializer", "kernel_regularizer",
                                   "bias_regularizer")} == {
        "projection_dim": None, "diag_scale": 0.0, "use_bias": True, "pre_activation": "linear",
        "kernel_initializer": "glorot_uniform", "bias_initializer": "zeros", "kernel_regularizer": None,
        "bias_regularizer": None}
    config = DotInteraction().get_config()
    assert (config["self_interaction"], config["skip_gather"]) == (False, False)


# -- refusals ------------------------------------------------------------------------------------------

def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


@pytest.mark.parametrize("options, message", [
    (dict(projection_dim=0), "FeatureCross: projection_dim must be a positive integer, got 0"),
    (dict(projection_dim=2.5), "FeatureCross: projection_dim must be a positive integer, got 2.5"),
    (dict(diag_scale=-0.1), "FeatureCross: diag_scale must be a number >= 0 (or None), got -0.1"),
    (dict(pre_activation="gelu"), "FeatureCross: pre_activation='gelu' is not supported; give one of linear, "
                                  "relu, sigmoid, tanh, softmax or None"),
    (dict(kernel_initializer="nope"), "FeatureCross: kernel_initializer: unknown initializer 'nope'"),
    (dict(bias_regularizer="l3"), "FeatureCross: bias_regularizer: 'l3' is not supported"),
])
def test_feature_cross_refuses_bad_arguments(options, message):
    with pytest.raises(ConfigError) as e:
        FeatureCross(**options)
    assert _one_line(e).startswith(message)


def test_feature_cross_refuses_inputs_of_two_shapes():
    with pytest.raises(ConfigError) as e:
        FeatureCross()(keras.Input(shape=(4,)), keras.Input(shape=(5,)))
    assert _one_line(e) == ("layer feature_cross (FeatureCross): x0 and x must have the same shape, got x0 "
                            "(4,) and x (5,)")


@pytest.mark.parametrize("inputs, message", [
    (lambda: keras.Input(shape=(4,)), "takes a list of (batch, dim) feature tensors, got Symbolic"),
    (lambda: [keras.Input(shape=(4,))], "takes at least 2 features (without self_interaction), got 1"),
    (lambda: [keras.Input(shape=(4,)), keras.Input(shape=(3,))],
     "every feature must be (batch, dim) of one dim; feature 1 is (3,), feature 0 (4,)"),
    (lambda: [keras.Input(shape=(2, 4)), keras.Input(shape=(2, 4))],
     "every feature must be (batch, dim) of one dim; feature 0 is (2, 4), feature 0 (2, 4)"),
    (lambda: np.ones((3, 4)), "takes a list of (batch, dim) feature tensors, got ndarray"),
])
def test_dot_interaction_refuses_what_is_not_a_list_of_one_shape(inputs, message):
    with pytest.raises(ConfigError) as e:
        DotInteraction()(inputs())
    assert _one_line(e) == f"layer dot_interaction (DotInteraction): {message}"


# -- training -------------------------------------------------------------------------------------------

def test_a_small_dcn_trains_with_fit():
    """Embedding -> concatenate -> FeatureCross x2 -> Dense on labels that are a feature cross
    (the sign of a product of two dense features, flipped by one id's parity). Catches a layer
    whose weights do not move in training or whose gradient points the wrong way."""
    rng = np.random.default_rng(5)
    n = 2000
    ids = rng.integers(0, 8, (n, 2))
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    y = ((dense[:, 0] * dense[:, 1] > 0) ^ (ids[:, 0] % 2 == 1)).astype(np.int64)[:, None]
    i_ids, i_dense = keras.Input(shape=(2,), dtype="int32", name="ids"), keras.Input(shape=(3,), name="dense")
    x0 = layers.concatenate([layers.Flatten()(layers.Embedding(8, 4)(i_ids)), i_dense])
    x1 = FeatureCross(diag_scale=0.1)(x0)
    x2 = FeatureCross(projection_dim=4)(x0, x1)
    model = keras.Model({"ids": i_ids, "dense": i_dense}, layers.Dense(1, activation="sigmoid")(x2))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit({"ids": ids, "dense": dense}, y, batch_size=64, epochs=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert model.evaluate({"ids": ids, "dense": dense}, y, verbose=0)[1] > 0.85
