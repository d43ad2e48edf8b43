"""Models with several outputs (keras.Model(inputs, [a, b]) or {"a": a, "b": b}): the total
loss's gradient against central finite differences, Keras 3's compile arguments and log names,
the labels packed per sample, save and load, and the refusals that name the model."""

from __future__ import annotations

import numpy as np
import pytest

import pserver.keras as keras
from pserver.errors import ConfigError, DataError
from pserver.keras import layers
from pserver.models.functional import Functional
from pserver.ops.core import Symbolic
from tests.support.gradients import assert_fd


def two_heads(kind: str):
    """A shared trunk fanning out to two outputs. kind: "softmax+mse" (a fused softmax head
    and a linear regression head), "sigmoid+softmax" (two fused heads), "chained" (output a
    also feeds output b's layer), "op" (one output made by an op, not a layer)."""
    x = Symbolic((None, 5), name="x")
    trunk = layers.Dense(6, activation="tanh")(x)
    if kind == "softmax+mse":
        outs = [layers.Dense(3, activation="softmax")(trunk), layers.Dense(1)(trunk)]
        loss = ["sparse_categorical_crossentropy", "mse"]
    elif kind == "sigmoid+softmax":
        outs = [layers.Dense(1, activation="sigmoid")(trunk), layers.Dense(4, activation="softmax")(trunk)]
        loss = ["binary_crossentropy", "categorical_crossentropy"]
    elif kind == "chained":
        a = layers.Dense(3)(trunk)
        outs = [a, layers.Dense(1)(layers.concatenate([a, trunk]))]
        loss = ["sparse_categorical_crossentropy", "mse"]
    else:
        a = layers.Dense(3)(trunk)
        outs = [a, keras.ops.sum(keras.ops.tanh(a) * 2.0, axis=1, keepdims=True)]
        loss = ["sparse_categorical_crossentropy", "mse"]
    return Functional(x, outs), loss


LABELS = {"softmax+mse": lambda r, n: [r.integers(0, 3, n), r.normal(size=n)],
          "sigmoid+softmax": lambda r, n: [r.integers(0, 2, n), np.eye(4)[r.integers(0, 4, n)]],
          "chained": lambda r, n: [r.integers(0, 3, n), r.normal(size=n)],
          "op": lambda r, n: [r.integers(0, 3, n), r.normal(size=n)]}


@pytest.mark.parametrize("kind", list(LABELS))
@pytest.mark.parametrize("weights", [None, [0.3, 2.0]])
def test_the_total_loss_s_gradient_equals_finite_differences(kind, weights):
    """Catches: an output's dloss not seeded (or seeded twice), a loss weight applied to the
    loss but not its gradient, a fused softmax/sigmoid on the wrong head, an output that also
    feeds another layer losing one of its two gradients (its dout overwritten)."""
    model, loss = two_heads(kind)
    model.compile(loss=loss, loss_weights=weights)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 5))
    y = model.loss.labels(LABELS[kind](rng, 6))
    assert y.shape == (6, 2)
    assert_fd(model, x, y)


def test_the_total_is_the_weighted_sum_of_each_output_s_own_loss():
    """Catches: a total that is not sum(w_j * loss_j), or per-output logs that are weighted."""
    model, loss = two_heads("softmax+mse")
    rng = np.random.default_rng(0)
    model.compile(loss=loss)
    x, y = rng.normal(size=(8, 5)), model.loss.labels(LABELS["softmax+mse"](rng, 8))
    w = model.init_params(1).astype(np.float64)
    alone = []
    for j in range(2):
        model.compile(loss=loss, loss_weights=[1.0 if i == j else 0.0 for i in range(2)])
        alone.append(model.loss_and_grad(w, x, y, np.zeros_like(w)))
    model.compile(loss=loss, loss_weights=[0.25, 3.0], metrics=[["accuracy"], ["r2"]])
    total = model.loss_and_grad(w, x, y, np.zeros_like(w))
    assert total == pytest.approx(0.25 * alone[0] + 3.0 * alone[1], rel=1e-12)
    ev = model.evaluate(w, x, y)
    assert list(ev)[:1] == ["loss"] and ev["loss"] == pytest.approx(total, rel=1e-12)
    names = model.output_names
    assert ev[f"{names[0]}_loss"] == pytest.approx(alone[0], rel=1e-12)
    assert ev[f"{names[1]}_loss"] == pytest.approx(alone[1], rel=1e-12)
    assert model.metrics == [f"{names[0]}_loss", f"{names[1]}_loss", f"{names[0]}_accuracy", f"{names[1]}_r2"]


def small(dict_outputs: bool):
    x = keras.Input((4,), name="x")
    h = layers.Dense(16, activation="relu", name="trunk")(x)
    a = layers.Dense(3, activation="softmax", name="a")(h)
    b = layers.Dense(1, name="b")(h)
    return keras.Model(x, {"a": a, "b": b} if dict_outputs else [a, b])


def data(n=300, seed=0):
    rng = np.random.default_rng(seed)
    ya = rng.integers(0, 3, n)
    x = (rng.normal(0, 2, (3, 4))[ya] + rng.normal(0, 0.5, (n, 4))).astype(np.float32)
    yb = (x @ np.array([0.5, -1.0, 0.25, 0.0])).astype(np.float32)
    return x, ya, yb


@pytest.mark.parametrize("dict_outputs", [False, True])
def test_fit_evaluate_predict_and_history_use_keras_3_s_names_and_a_saved_model_loads(dict_outputs, tmp_path):
    """Catches: targets not travelling with their samples (rows sliced apart: no learning),
    History or evaluate keys other than Keras 3's, predict's probabilities or structure
    wrong, a multi-output file that does not load or loads another loss."""
    model = small(dict_outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.02),
                  loss={"a": "sparse_categorical_crossentropy", "b": "mse"} if dict_outputs
                  else ["sparse_categorical_crossentropy", "mse"],
                  loss_weights={"b": 0.5} if dict_outputs else [1.0, 0.5],
                  metrics={"a": "accuracy"} if dict_outputs else [["accuracy"], None])
    x, ya, yb = data()
    y = {"a": ya, "b": yb} if dict_outputs else [ya, yb]
    assert model.output_names == ["a", "b"]
    history = model.fit(x, y, batch_size=30, epochs=4, verbose=0, validation_split=0.2)
    assert list(history.history) == ["loss", "a_loss", "b_loss", "a_accuracy",
                                     "val_loss", "val_a_loss", "val_b_loss", "val_a_accuracy"]
    h = history.history
    assert h["a_accuracy"][-1] > 0.9 and h["b_loss"][-1] < h["b_loss"][0] / 2
    assert h["loss"][-1] == pytest.approx(h["a_loss"][-1] + 0.5 * h["b_loss"][-1], rel=1e-6)
    ev = model.evaluate(x, y, verbose=0)
    assert len(ev) == 4 and ev[0] == pytest.approx(ev[1] + 0.5 * ev[2], rel=1e-6)
    pred = model.predict(x)
    pa, pb = (pred["a"], pred["b"]) if dict_outputs else pred
    assert isinstance(pred, dict) == dict_outputs
    assert pa.shape == (300, 3) and np.allclose(pa.sum(axis=1), 1) and pb.shape == (300, 1)
    assert np.mean(pa.argmax(axis=1) == ya) == pytest.approx(ev[3])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.evaluate(x, y, verbose=0) == ev
    again = loaded.predict(x)
    assert all(np.array_equal(p, q) for p, q in zip(pred.values() if dict_outputs else pred,
                                                     again.values() if dict_outputs else again))


@pytest.mark.parametrize("compile_args, message", [
    ({"loss": ["mse"]}, "functional: compile: loss has 1 entries; the model has 2 outputs (a, b)"),
    ({"loss": {"a": "mse", "nope": "mse"}}, "functional: compile: loss names 'nope', which is not an output"),
    ({"loss": {"a": "sparse_categorical_crossentropy"}}, "compile: loss has no entry for the output 'b'"),
    ({"loss": "mse", "loss_weights": [1.0]}, "loss_weights has 1 entries; the model has 2 outputs"),
    ({"loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}, "metrics has 1 entries"),
    ({"loss": ["sparse_categorical_crossentropy", "mse"], "metrics": {"b": "accuracy"}},
     "the output 'b' (mean_squared_error) reports r2, not 'accuracy'"),
])
def test_compile_refuses_what_does_not_fit_the_outputs_in_one_line(compile_args, message):
    """Catches: a loss list of the wrong length or a dict with an unknown name accepted (a
    loss silently dropped or applied to the wrong output)."""
    model = small(False)
    with pytest.raises(ConfigError) as e:
        model.compile(optimizer="sgd", **compile_args)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("y, message", [
    (lambda ya, yb: [ya], "fit: functional: y has 1 arrays; the model has 2 outputs (a, b)"),
    (lambda ya, yb: {"a": ya}, "fit: functional: y has no output 'b'"),
    (lambda ya, yb: {"a": ya, "b": yb, "c": yb}, "y has an output 'c' the model does not have"),
    (lambda ya, yb: [ya, yb[:-1]], "functional: output 'b': y has shape (299,)"),
])
def test_fit_refuses_labels_that_miss_an_output_in_one_line(y, message):
    """Catches: a missing output's labels read from another column, or a KeyError deep inside."""
    model = small(False)
    model.compile(optimizer="sgd", loss=["sparse_categorical_crossentropy", "mse"])
    x, ya, yb = data()
    with pytest.raises(DataError) as e:
        model.fit(x, y(ya, yb), batch_size=30, verbose=0)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_label_out_of_range_names_its_output():
    model = small(False)
    model.compile(optimizer="sgd", loss=["sparse_categorical_crossentropy", "mse"])
    x, ya, yb = data()
    with pytest.raises(DataError, match=r"label out of range: y\[0\] = 3; the output 'a' "
                                        r"\(layer a \(Dense\)\)"):
        model.fit(x, [np.full_like(ya, 3), yb], batch_size=30, verbose=0)


def test_a_one_output_model_s_config_and_layout_are_unchanged_by_the_outputs_list():
    """Catches: a one-output model whose saved config changed key ("output" is what every
    file written before holds)."""
    x = Symbolic((None, 3), name="x")
    config = Functional(x, layers.Dense(2)(x)).get_config()
    assert "output" in config and "outputs" not in config and "output_names" not in config


def test_pserver_train_takes_several_outputs_labels_as_a_list_and_learns_both():
    """The plain path (pserver.train, no pserver.keras): catches labels not packed per sample
    before the worker slices its rows (a row's labels from another sample: no learning), or a
    y list read as one (2, n) array."""
    import pserver
    x, ya, yb = data(600)
    inp = Symbolic((None, 4), name="x")
    h = layers.Dense(16, activation="relu")(inp)
    model = Functional(inp, [layers.Dense(3)(h), layers.Dense(1)(h)])
    model.compile(loss=["sparse_categorical_crossentropy", "mse"], metrics=[["accuracy"], ["r2"]])
    names = model.output_names
    summary = pserver.train(model, x, [ya, yb], ps=1, validation_data=(x, {names[0]: ya, names[1]: yb}),
                            epochs=3, batch_size=32, optimizer="adam", lr=0.02)
    assert summary["test_loss"] < 0.2, summary


def test_an_output_whose_softmax_fuses_into_its_loss_and_feeds_another_layer_is_refused():
    """Catches: the other layer silently reading logits where Keras gives it probabilities
    (the fused output layer computes no softmax)."""
    x = Symbolic((None, 5), name="x")
    a = layers.Dense(3, activation="softmax", name="a")(x)
    model = Functional(x, [a, layers.Dense(1, name="b")(a)])
    model.compile(loss=["sparse_categorical_crossentropy", "mse"])
    with pytest.raises(ConfigError, match="functional: layer a .Dense. computes an output and feeds"):
        model.build()


# -- several outputs from a subclassed Model or a layer of your own, and outputs without a loss --


@keras.saving.register_keras_serializable()
class TwoHeads(keras.Model):
    """small()'s model subclassed: call returns its two outputs as a tuple or a dict."""

    def __init__(self, as_dict=False, **kwargs):
        super().__init__(**kwargs)
        self.as_dict = as_dict
        self.trunk = layers.Dense(16, activation="relu", name="trunk")
        self.a = layers.Dense(3, activation="softmax", name="a")
        self.b = layers.Dense(1, name="b")

    def call(self, inputs):
        h = self.trunk(inputs)
        return {"a": self.a(h), "b": self.b(h)} if self.as_dict else (self.a(h), self.b(h))


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_subclassed_model_returning_several_outputs_equals_the_functional_one(as_dict, tmp_path):
    """Catches: a call returning a tuple or dict refused; the outputs swapped or named otherwise;
    the call traced once per output (the same values, twice the steps); a saved file that loads
    as another class, loses an output or its loss."""
    x, ya, yb = data()
    y = {"a": ya, "b": yb} if as_dict else [ya, yb]
    compiled = dict(loss={"a": "sparse_categorical_crossentropy", "b": "mse"} if as_dict
                    else ["sparse_categorical_crossentropy", "mse"],
                    metrics={"a": ["accuracy"]} if as_dict else [["accuracy"], []])
    sub, fun = TwoHeads(as_dict=as_dict), small(as_dict)
    for model in (sub, fun):
        model.compile(optimizer=keras.optimizers.SGD(0.1), **compiled)
    sub.build((None, 4))
    assert sub.output_names == fun.output_names == ["a", "b"]
    assert sub._core.layout.describe() == fun._core.layout.describe()
    assert len(sub._core._plan(True).steps) == len(fun._core._plan(True).steps)
    fun.set_weights(sub.get_weights())
    ps, pf = sub.predict(x), fun.predict(x)
    assert isinstance(ps, dict) == as_dict
    assert all(np.array_equal(a, b) for a, b in zip(*(p.values() if as_dict else p for p in (ps, pf))))
    assert sub.evaluate(x, y, verbose=0) == fun.evaluate(x, y, verbose=0)
    hs = sub.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0).history
    hf = fun.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0).history
    assert hs == hf and list(hs) == ["loss", "a_loss", "b_loss", "a_accuracy"]
    assert all(np.array_equal(a, b) for a, b in zip(sub.get_weights(), fun.get_weights()))
    sub.save(tmp_path / "two.keras")
    again = keras.models.load_model(tmp_path / "two.keras")
    assert type(again) is TwoHeads and again.evaluate(x, y, verbose=0) == sub.evaluate(x, y, verbose=0)


def test_a_layer_of_your_own_may_return_several_tensors_each_with_its_gradient(tmp_path):
    """A layer whose call returns (scaled, shifted), read by two branches of a Functional model:
    the total loss's gradient against finite differences, and the graph saved and rebuilt.
    Catches: only the first output wired (the second reading nothing, or the first again)."""

    @keras.saving.register_keras_serializable()
    class Split(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

        def call(self, inputs):
            return inputs * self.w, keras.ops.tanh(inputs) - self.w

    inp = keras.Input((4,), name="x")
    scaled, shifted = Split()(inp)
    out = layers.Dense(3, name="out")(layers.concatenate([layers.Dense(2)(scaled), shifted]))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, ya, _ = data(40)
    assert_fd(model._core, x.astype(np.float64), ya)
    rng = np.random.default_rng(3)
    model.set_weights([rng.normal(size=w.shape) for w in model.get_weights()])
    model.save(tmp_path / "split.keras")
    again = keras.models.load_model(tmp_path / "split.keras")
    assert np.array_equal(again.predict(x), model.predict(x))
    w, k1, b1, k2, b2 = model.get_weights()          # Split's weight first: the model by hand
    logits = np.concatenate([(x * w) @ k1 + b1, np.tanh(x) - w], axis=1) @ k2 + b2
    assert np.allclose(model._core.predict(model._weights(), x), logits, rtol=1e-5, atol=1e-6)


def test_a_call_that_returns_other_outputs_in_training_is_refused_in_one_line():
    class Sometimes(keras.layers.Layer):
        def call(self, inputs, training=None):
            return (inputs, inputs * 2.0) if training else inputs

    inp = keras.Input((4,))
    model = keras.Model(inp, layers.Dense(3)(Sometimes()(inp)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, ya, _ = data(40)
    with pytest.raises(ConfigError) as e:
        model.fit(x, ya, verbose=0)
    assert "call returned a tuple of 2 with training=True, one tensor before" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("y", [lambda ya, yb: [ya, yb], lambda ya, yb: [ya, None], lambda ya, yb: {"a": ya}])
def test_an_output_compiled_with_loss_none_is_predicted_and_never_trained_toward(y):
    """Keras's loss=[..., None]: the model's loss is output a's alone (the one-output model's, for
    the same weights), the logs Keras 3's (no per-output loss for a single one), b's own layer
    never moves, b's labels not needed, b still predicted. Catches: b's loss or gradient counted,
    b's labels demanded, or b dropped from predict."""
    x, ya, yb = data()
    model = small(False)
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss=["sparse_categorical_crossentropy", None],
                  metrics=[["accuracy"], []])
    before = model.get_weights()
    history = model.fit(x, y(ya, yb), batch_size=30, epochs=3, verbose=0)
    assert list(history.history) == ["loss", "a_accuracy"]
    after = model.get_weights()
    assert np.array_equal(before[4], after[4]) and np.array_equal(before[5], after[5])     # b's kernel, bias
    assert not np.array_equal(before[0], after[0])
    loss, accuracy = model.evaluate(x, y(ya, yb), verbose=0)
    pa, pb = model.predict(x)
    trunk = np.maximum(x @ after[0] + after[1], 0)
    assert np.allclose(pb, trunk @ after[4] + after[5], rtol=1e-4, atol=1e-5)
    assert np.allclose(pa.sum(axis=1), 1) and accuracy == pytest.approx(np.mean(pa.argmax(axis=1) == ya))
    assert loss == pytest.approx(-np.mean(np.log(pa[np.arange(len(ya)), ya])), rel=1e-4)
    assert accuracy > 0.9


def test_loss_none_among_three_outputs_logs_the_two_trained_and_loads_again(tmp_path):
    x, ya, yb = data()
    inp = keras.Input((4,), name="x")
    h = layers.Dense(16, activation="relu", name="trunk")(inp)
    model = keras.Model(inp, {"a": layers.Dense(3, activation="softmax", name="a")(h),
                              "b": layers.Dense(1, name="b")(h), "c": layers.Dense(2, name="c")(h)})
    model.compile(optimizer="adam", loss={"a": "sparse_categorical_crossentropy", "b": "mse", "c": None})
    history = model.fit(x, {"a": ya, "b": yb}, batch_size=30, epochs=1, verbose=0)
    assert list(history.history) == ["loss", "a_loss", "b_loss"]
    ev = model.evaluate(x, {"a": ya, "b": yb}, verbose=0, return_dict=True)
    assert ev["loss"] == pytest.approx(ev["a_loss"] + ev["b_loss"], rel=1e-6)
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    assert again.evaluate(x, {"a": ya, "b": yb}, verbose=0, return_dict=True) == ev
    assert again.predict(x)["c"].shape == (300, 2)


@pytest.mark.parametrize("compile_args, message", [
    ({"loss": [None, None]}, "functional: compile: every output's loss is None: nothing to train toward"),
    ({"loss": ["sparse_categorical_crossentropy", None], "metrics": [None, ["r2"]]},
     "compile: metrics: the output 'b' has no loss (None), so no labels to measure it against"),
])
def test_loss_none_refusals_are_one_line(compile_args, message):
    model = small(False)
    with pytest.raises(ConfigError) as e:
        model.compile(optimizer="sgd", **compile_args)
    assert message in str(e.value) and "\n" not in str(e.value)
