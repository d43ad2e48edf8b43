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
