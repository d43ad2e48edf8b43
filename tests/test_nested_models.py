"""A keras.Model(inputs, outputs) called as a layer (the Functional API guide's "all models are
callable, just like layers"): its layers called again in the enclosing graph, one set of
weights for both models, as in Keras."""

from __future__ import annotations

import numpy as np
import pytest

import pserver.keras as keras
from pserver.errors import ConfigError
from pserver.keras import layers
from pserver.keras.cluster import SEED


def guide_autoencoder():
    """The guide's encoder and decoder, and the autoencoder made by calling them."""
    encoder_input = keras.Input(shape=(28, 28, 1), name="original_img")
    x = layers.Conv2D(16, 3, activation="relu")(encoder_input)
    x = layers.Conv2D(32, 3, activation="relu")(x)
    x = layers.MaxPooling2D(3)(x)
    x = layers.Conv2D(32, 3, activation="relu")(x)
    x = layers.Conv2D(16, 3, activation="relu")(x)
    encoder = keras.Model(encoder_input, layers.GlobalMaxPooling2D()(x), name="encoder")
    decoder_input = keras.Input(shape=(16,), name="encoded_img")
    x = layers.Reshape((4, 4, 1))(decoder_input)
    x = layers.Conv2DTranspose(16, 3, activation="relu")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu")(x)
    x = layers.UpSampling2D(3)(x)
    x = layers.Conv2DTranspose(16, 3, activation="relu")(x)
    decoder = keras.Model(decoder_input, layers.Conv2DTranspose(1, 3, activation="relu")(x), name="decoder")
    autoencoder_input = keras.Input(shape=(28, 28, 1), name="img")
    autoencoder = keras.Model(autoencoder_input, decoder(encoder(autoencoder_input)), name="autoencoder")
    return encoder, decoder, autoencoder


def test_the_guide_s_autoencoder_of_two_models_has_their_layers_and_shares_their_weights(monkeypatch):
    """Catches a model called as a layer that copies its layers (the encoder would not see the
    autoencoder's training) or drops one (the guide's summary counts 28,241 parameters), and an
    autoencoder that starts from weights of its own rather than the encoder's."""
    monkeypatch.setenv(SEED, "0")
    keras.utils.set_random_seed(1)
    encoder, decoder, autoencoder = guide_autoencoder()
    assert autoencoder.count_params() == 28241
    assert autoencoder.count_params() == encoder.count_params() + decoder.count_params()
    x = np.random.default_rng(0).random((16, 28, 28, 1)).astype(np.float32)
    first = encoder.predict(x, verbose=0)                  # the encoder's weights made first
    n = len(encoder.get_weights())
    for a, b in zip(autoencoder.get_weights()[:n], encoder.get_weights()):
        np.testing.assert_array_equal(a, b)
    autoencoder.compile(optimizer="adam", loss="mse")
    autoencoder.fit(x, x, epochs=1, batch_size=8, verbose=0)
    for a, b in zip(autoencoder.get_weights(), encoder.get_weights() + decoder.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(encoder.predict(x, verbose=0), first)
    np.testing.assert_allclose(decoder.predict(encoder.predict(x, verbose=0), verbose=0),
                               autoencoder.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def member(seed: int) -> keras.Model:
    inputs = keras.Input(shape=(6,))
    return keras.Model(inputs, layers.Dense(1)(layers.Dense(4, activation="relu")(inputs)))


def test_an_ensemble_of_models_whose_layers_share_names_is_the_mean_of_its_members(tmp_path, monkeypatch):
    """The guide's ensembling: three models whose layers are each named dense and dense_1 in
    their model. Catches weights named twice in the layout (the models' names clash), a member
    that cannot predict alone after being called (its layers renamed under it), and an ensemble
    that is not the mean of its members."""
    monkeypatch.setenv(SEED, "0")
    members = [member(i) for i in range(3)]
    inputs = keras.Input(shape=(6,))
    ensemble = keras.Model(inputs, layers.average([m(inputs) for m in members]))
    names = [t.name for t in ensemble._core.layout.tensors]
    assert len(set(names)) == len(names) == 12, names
    ensemble.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(2).normal(size=(64, 6)).astype(np.float32)
    ensemble.fit(x, x[:, :1], epochs=2, verbose=0)
    alone = np.mean([m.predict(x, verbose=0) for m in members], axis=0)
    np.testing.assert_allclose(ensemble.predict(x, verbose=0), alone, rtol=1e-5, atol=1e-6)
    assert [layer.name for layer in members[1].layers] == ["dense", "dense_1"]
    ensemble.save(tmp_path / "e.keras")
    assert [layer.get_config()["name"] for layer in members[1].layers] == ["dense", "dense_1"]
    again = keras.models.load_model(tmp_path / "e.keras")
    np.testing.assert_array_equal(again.predict(x, verbose=0), ensemble.predict(x, verbose=0))


def test_training_false_on_a_called_model_keeps_its_dropout_off_in_training():
    """Keras's base_model(x, training=False): the model's layers run as in inference while the
    enclosing model trains. Catches a `training` not passed to the layers called again: with
    Dropout(0.9) on, the training loss would differ from the inference one."""
    inner_in = keras.Input(shape=(8,))
    base = keras.Model(inner_in, layers.Dropout(0.9)(layers.Dense(8)(inner_in)))
    x = np.random.default_rng(3).normal(size=(32, 8)).astype(np.float32)
    y = np.ones((32, 1), np.float32)
    losses = []
    for training in (False, None):
        inputs = keras.Input(shape=(8,))
        model = keras.Model(inputs, layers.Dense(1)(base(inputs, training=training)))
        model.compile(optimizer="sgd", loss="mse")
        core, w = model._core, model._weights()
        grad = np.zeros_like(w)
        losses.append((core.loss_and_grad(w, x, y, grad, seed=1), model.evaluate(x, y, verbose=0)))
    (off_train, off_eval), (on_train, on_eval) = losses
    assert off_train == pytest.approx(off_eval, rel=1e-6)
    assert on_train != pytest.approx(on_eval, rel=1e-3)


def test_models_of_unknown_length_inside_and_outside():
    """An Input of unknown length on either side of the call: the outer call is recorded and
    made at the first data; the inner model is made for the shape it is called on."""
    x = np.random.default_rng(4).integers(1, 50, size=(8, 5))
    inner_in = keras.Input(shape=(None,), dtype="int64")
    inner = keras.Model(inner_in, layers.GlobalAveragePooling1D()(layers.Embedding(50, 3)(inner_in)))
    fixed = keras.Input(shape=(5,), dtype="int64")
    outer = keras.Model(fixed, layers.Dense(1)(inner(fixed)))
    assert outer.predict(x, verbose=0).shape == (8, 1)
    unknown = keras.Input(shape=(None,), dtype="int64")
    inner2_in = keras.Input(shape=(5,), dtype="int64")
    inner2 = keras.Model(inner2_in, layers.Flatten()(layers.Embedding(50, 2)(inner2_in)))
    outer2 = keras.Model(unknown, layers.Dense(1)(inner2(unknown)))
    assert outer2.predict(x, verbose=0).shape == (8, 1)


def test_a_model_called_on_what_it_does_not_take_says_so_in_one_line():
    inputs = keras.Input(shape=(6,), name="features")
    model = keras.Model(inputs, layers.Dense(1)(inputs))
    cases = [(lambda: model(keras.Input(shape=(5,))),
              "input 'features' takes (None, 6), called on (None, 5)"),
             (lambda: model([keras.Input(shape=(6,)), keras.Input(shape=(6,))]),
              "takes 1 input(s), the call has 2"),
             (lambda: model({"other": keras.Input(shape=(6,))}), "the call has no input 'features'"),
             (lambda: model(keras.Input(shape=(6,)), mask=None), "takes no argument 'mask'")]
    for call, message in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value)


def test_a_feature_extractor_from_layers_outputs_shares_the_trained_weights(monkeypatch):
    """The guide's "extract and reuse nodes": keras.Model(inputs=model.input, outputs=[layer.output
    ...]). Catches an output that is not the layer's first call's, a model.input that is not the
    model's Input, get_layer finding the wrong layer, and an extractor that does not see the
    weights its model was trained to."""
    monkeypatch.setenv(SEED, "0")
    inputs = keras.Input(shape=(12,), name="features")
    hidden = layers.Dense(8, activation="relu", name="hidden")(inputs)
    logits = layers.Dense(3, name="logits")(layers.Dense(5, activation="tanh")(hidden))
    model = keras.Model(inputs, logits)
    assert model.input is inputs and model.inputs == [inputs] and model.output is logits
    assert model.outputs == [logits]
    assert model.get_layer("hidden").output is hidden and model.get_layer(index=-1).name == "logits"
    assert model.get_layer("hidden").input is inputs
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(5).normal(size=(48, 12)).astype(np.float32)
    model.fit(x, np.arange(48) % 3, epochs=2, verbose=0)
    extractor = keras.Model(inputs=model.input, outputs=[layer.output for layer in model.layers])
    feats = extractor.predict(x, verbose=0)
    assert [f.shape for f in feats] == [(48, 8), (48, 5), (48, 3)]
    np.testing.assert_allclose(feats[-1], model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    kernel, bias = model.get_weights()[:2]
    np.testing.assert_allclose(feats[0], np.maximum(x @ kernel + bias, 0), rtol=1e-5, atol=1e-6)


def test_inputs_and_outputs_that_do_not_exist_are_refused_in_one_line():
    class Sub(keras.Model):
        def call(self, x):
            return x
    cases = [(lambda: layers.Dense(2).output, "has no output: it was not called"),
             (lambda: Sub().inputs, "a subclassed Model has no inputs of its own"),
             (lambda: member(0).get_layer("nope"), "no layer 'nope' (the model's: dense, dense_1)"),
             (lambda: member(0).get_layer(index=5), "index 5: the model has 2 layers"),
             (lambda: member(0).get_layer(), "give a name or an index")]
    for call, message in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_sequential_s_inputs_and_a_layer_s_output_make_a_feature_extractor():
    """The Sequential guide's feature extraction: keras.Model(inputs=model.inputs,
    outputs=model.get_layer(...).output) on a Sequential built from keras.Input. Catches a
    Sequential without inputs, or an output that is not its layer's in the built graph."""
    model = keras.Sequential([keras.Input(shape=(6,)), layers.Dense(5, activation="relu", name="hidden"),
                              layers.Dense(2)])
    extractor = keras.Model(inputs=model.inputs, outputs=model.get_layer("hidden").output)
    x = np.random.default_rng(6).normal(size=(7, 6)).astype(np.float32)
    kernel, bias = model.get_weights()[:2]
    np.testing.assert_allclose(extractor.predict(x, verbose=0), np.maximum(x @ kernel + bias, 0),
                               rtol=1e-5, atol=1e-6)
    assert model.input.shape == (None, 6) and model.output.shape == (None, 2)
