"""The Functional API and custom layers through pserver.keras: keras.Input, keras.Model(inputs,
outputs), a keras.layers.Layer subclass (add_weight, call with keras.ops), a subclassed
keras.Model; trained with fit run plainly (shards in this process)."""

from __future__ import annotations

import numpy as np
import pytest

import pserver.keras as keras
from pserver.errors import ConfigError
from pserver.keras import layers, ops
from tests.support.gradients import assert_fd


class Linear(keras.layers.Layer):
    """A layer of one's own that makes its weights at build (the pattern of keras.io's guide
    "Making new layers and models via subclassing")."""

    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                 trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class MLPBlock(keras.layers.Layer):
    """Layers held by a layer, tracked by the graph."""

    def __init__(self, units=3):
        super().__init__()
        self.linear_1 = Linear(8)
        self.linear_2 = Linear(units)

    def call(self, inputs):
        return self.linear_2(keras.activations.relu(self.linear_1(inputs)))


def blobs(n=600, d=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    return (rng.normal(0, 2, (classes, d))[y] + rng.normal(0, 1, (n, d))).astype(np.float32), y


def test_a_custom_linear_layer_in_a_functional_model_trains_with_fit():
    """Catches: a traced layer whose weights take no gradient (or the wrong one): the loss
    would not fall."""
    x, y = blobs()
    inp = keras.Input(shape=(8,))
    model = keras.Model(inp, layers.Dense(3, activation="softmax")(ops.relu(Linear(16)(inp))))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    assert [w.shape for w in model.get_weights()] == [(8, 16), (16,), (16, 3), (3,)]
    before = model.evaluate(x, y, verbose=0)[0]
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    loss, accuracy = model.evaluate(x, y, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0] and loss < 0.7 * before
    assert accuracy > 0.9
    assert np.allclose(model.predict(x[:4]).sum(axis=1), 1, atol=1e-5)


def test_a_nested_custom_layer_s_gradient_equals_finite_differences():
    """Catches: the weights of a layer used inside another layer's call left out of the layout,
    or their gradient not reaching grad_out."""
    inp = keras.Input(shape=(4,))
    model = keras.Model(inp, MLPBlock()(inp))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    core = model._core.use_backend("reference")
    assert core.layout.describe() == ("linear/variable[4, 8], linear/variable_1[8], "
                                      "linear_1/variable[8, 3], linear_1/variable_1[3]")
    rng = np.random.default_rng(0)
    assert_fd(core, rng.normal(size=(5, 4)), rng.integers(0, 3, 5))


class Halve(keras.layers.Layer):
    def call(self, inputs, training=None):
        return inputs * 0.5 if training else inputs       # control flow on the flag: traceable


def test_a_call_is_traced_once_per_training_value():
    """Catches: a graph traced once, so that training and inference compute the same thing."""
    inp = keras.Input(shape=(3,))
    model = keras.Model(inp, layers.Dense(2)(Halve()(inp)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    core, w = model._core, model._weights()
    x, y = np.random.default_rng(0).random((4, 3), np.float32), np.array([0, 1, 1, 0])
    training = core.loss_and_grad(w, x, y, np.zeros_like(w))
    assert training == pytest.approx(core.evaluate(w, x * 0.5, y)["loss"], rel=1e-6)
    assert training != pytest.approx(core.evaluate(w, x, y)["loss"], rel=1e-6)


class Branchy(keras.layers.Layer):
    def call(self, inputs):
        if ops.sum(inputs):
            return inputs
        return -inputs


def test_python_control_flow_on_a_tensor_is_refused_with_the_file_and_line():
    """Catches: a call traced down one branch, silently wrong for the other samples."""
    import inspect
    line = inspect.getsourcelines(Branchy.call)[1] + 1
    message = rf"^layer branchy \(Branchy\): call \(.*test_functional.py:{line}\): a symbolic tensor has no"
    with pytest.raises(ConfigError, match=message):
        Branchy()(keras.Input(shape=(2,)))


def test_an_op_on_a_non_tensor_inside_call_is_refused_naming_the_layer():
    class Stringy(keras.layers.Layer):
        def call(self, inputs):
            return ops.matmul(inputs, "w")

    with pytest.raises(ConfigError, match=r"^layer stringy \(Stringy\): call \(.*test_functional.py:\d+\): "
                                          r"an op's argument 'w' \(str\) is not a tensor"):
        Stringy()(keras.Input(shape=(2,)))


def test_a_merge_of_mismatched_shapes_is_refused_naming_the_layer_and_the_shapes():
    a, b = keras.Input(shape=(4,)), keras.Input(shape=(5,))
    with pytest.raises(ConfigError, match=r"layer concatenate \(Concatenate\): inputs of shapes "
                                          r"\(4, 2\), \(5, 2\) do not merge"):
        layers.concatenate([layers.Reshape((4, 2))(layers.Dense(8)(a)), layers.Reshape((5, 2))(
            layers.Dense(10)(b))], axis=-1, name="concatenate")


def test_a_sequential_with_a_layer_of_your_own_is_the_chain_s_graph():
    """Catches: a keras.Sequential that cannot hold a custom layer, or one whose graph differs
    from the same layers called in a chain."""
    x, y = blobs(n=200)
    seq = keras.Sequential([keras.Input(shape=(8,)), layers.Dense(16, activation="relu"), Linear(8),
                            layers.Lambda(ops.tanh), layers.Dense(3)])
    assert [type(layer).__name__ for layer in seq.layers] == ["Dense", "Linear", "Lambda", "Dense"]
    inp = keras.Input(shape=(8,))
    fun = keras.Model(inp, layers.Dense(3)(ops.tanh(Linear(8)(layers.Dense(16, activation="relu")(inp)))))
    assert [w.shape for w in seq.get_weights()] == [w.shape for w in fun.get_weights()]
    fun.set_weights(seq.get_weights())
    assert np.allclose(seq.predict(x), fun.predict(x))
    seq.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    seq.fit(x, y, batch_size=20, epochs=3, verbose=0)
    assert seq.evaluate(x, y, verbose=0)[1] > 0.9
    with pytest.raises(ConfigError, match="is built"):
        seq.add(layers.Dense(2))
    late = keras.Sequential([Linear(4), layers.Dense(2)])      # no input shape: traced at fit
    late.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    late.fit(x, y % 2, batch_size=20, epochs=1, verbose=0)
    assert [w.shape for w in late.get_weights()] == [(8, 4), (4,), (4, 2), (2,)]


def test_a_model_of_two_inputs_by_name_trains_and_predicts_from_a_dict():
    """Catches: dict inputs matched by position, ids cast to floats on their way in."""
    rng = np.random.default_rng(1)
    ids, dense = rng.integers(0, 5, (400, 1)), rng.normal(size=(400, 3)).astype(np.float32)
    y = ((ids[:, 0] % 2) ^ (dense[:, 0] > 0)).astype(np.int64)
    i_ids = keras.Input(shape=(1,), dtype="int32", name="ids")
    i_dense = keras.Input(shape=(3,), name="dense")
    h = layers.concatenate([layers.Flatten()(layers.Embedding(5, 4)(i_ids)), i_dense])
    model = keras.Model({"ids": i_ids, "dense": i_dense},
                        layers.Dense(2)(layers.Dense(16, activation="relu")(h)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit({"dense": dense, "ids": ids}, y, batch_size=40, epochs=6, verbose=0)
    assert model.evaluate({"ids": ids, "dense": dense}, y, verbose=0)[1] > 0.9
    assert np.array_equal(model.predict({"ids": ids, "dense": dense}), model.predict([ids, dense]))


class TwoLayerModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = MLPBlock(units=5)
        self.dense = layers.Dense(3)

    def call(self, inputs, training=None):
        return self.dense(ops.tanh(self.block(inputs)))


def test_a_subclassed_model_equals_the_same_model_written_functionally():
    """Catches: a subclassed model traced into another graph (other layout, other math) than
    the Functional one of the same layers."""
    x, y = blobs(n=64, d=6)
    sub = TwoLayerModel()
    sub.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    first = sub.predict(x)            # traced here, from x's shape
    inp = keras.Input(shape=(6,))
    fun = keras.Model(inp, layers.Dense(3)(ops.tanh(MLPBlock(units=5)(inp))))
    fun.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert sub._core.layout.describe() == fun._core.layout.describe()
    fun.set_weights(sub.get_weights())
    assert np.allclose(fun.predict(x), first, rtol=1e-6)
    assert sub.evaluate(x, y, verbose=0) == pytest.approx(fun.evaluate(x, y, verbose=0), rel=1e-6)
    sub.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.allclose(sub.predict(x), first)


@keras.saving.register_keras_serializable()
class Shifted(keras.layers.Layer):
    """A registered layer of your own, with weights and a constructor argument."""

    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal")

    def call(self, inputs):
        return ops.matmul(inputs, self.w) - 1.0


def test_a_functional_model_is_saved_and_loaded_with_its_graph_and_weights(tmp_path):
    """Catches: a graph rebuilt otherwise (an op's attrs, a constant, a shared layer, a slice,
    dict inputs, a layer of your own) than it was saved, or weights in another order."""
    import pserver
    a, b = keras.Input(shape=(4,), name="a"), keras.Input(shape=(3,), name="b")
    d = layers.Dense(5, activation="relu")
    h = layers.Dense(5)(layers.concatenate([ops.tanh(Shifted(5)(a)) * 2.0, b[:, :2]]))
    model = keras.Model({"a": a, "b": b}, layers.Dense(3, activation="softmax")(layers.add([d(h), d(d(h))])))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = {"a": rng.random((6, 4), np.float32), "b": rng.random((6, 3), np.float32)}
    model.save(tmp_path / "m.npz")
    again = keras.models.load_model(tmp_path / "m.npz")
    assert isinstance(again, keras.Model) and again.optimizer.settings()["lr"] == 0.01
    assert again._core.layout.describe() == model._core.layout.describe()
    assert np.array_equal(again.predict(x), model.predict(x))
    saved = pserver.load_model(str(tmp_path / "m.npz"))
    assert np.array_equal(saved.predict(model._core.pack(x)), model._core.predict(model._weights(),
                                                                                   model._core.pack(x)))


def test_a_sequential_with_a_layer_of_your_own_loads_as_a_sequential(tmp_path):
    """Catches: a keras.Sequential holding a layer of your own that saves as a graph and loads as
    a keras.Model (Keras gives a Sequential back), or with its weights in another order."""
    seq = keras.Sequential([keras.Input(shape=(4,)), layers.Dense(6, activation="relu"), Shifted(5),
                            layers.Dense(3)])
    seq.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(2).random((7, 4), np.float32)
    seq.save(tmp_path / "s.npz")
    again = keras.models.load_model(tmp_path / "s.npz")
    assert isinstance(again, keras.Sequential)
    assert [type(layer).__name__ for layer in again.layers] == ["Dense", "Shifted", "Dense"]
    assert np.array_equal(again.predict(x), seq.predict(x))


def test_what_a_file_cannot_build_again_is_refused_at_save(tmp_path):
    """Catches: a save that writes a file no load can build: an unregistered layer of your own
    or subclassed Model, a lambda that holds an object from around it, a subclassed Model whose
    __init__ took a layer and that defines no get_config (Keras refuses these too)."""
    inp = keras.Input(shape=(8,))
    model = keras.Model(inp, layers.Dense(3)(Linear(4)(inp)))
    with pytest.raises(ConfigError, match=r"layer linear \(Linear\) is of class Linear, which is not built "
                                          r"in: register it with @pserver.keras.saving.register_keras_"):
        model.save(tmp_path / "m.npz")
    sub = TwoLayerModel()
    sub.build((None, 6))
    with pytest.raises(ConfigError, match=r"two_layer_model: layer two_layer_model \(ModelCall\) is of class "
                                          r"TwoLayerModel, which is not built in: register it"):
        sub.save(tmp_path / "s.npz")
    scale = np.array(2.0, np.float32)
    model = keras.Model(inp, layers.Dense(3)(layers.Lambda(lambda t: t * float(scale))(inp)))
    with pytest.raises(ConfigError, match=r"layer lambda \(Lambda\): the lambda holds a value of type "
                                          "ndarray from around it"):
        model.save(tmp_path / "l.npz")

    @keras.saving.register_keras_serializable()
    class Wrapper(keras.Model):
        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner

        def call(self, inputs):
            return self.inner(inputs)

    wrapper = Wrapper(layers.Dense(3))
    wrapper.build((None, 6))
    with pytest.raises(ConfigError, match=r"wrapper: layer wrapper \(ModelCall\): its config holds "
                                          r"inner=Dense\(dense\), which is not a JSON value: give Wrapper a "
                                          "get_config"):
        wrapper.save(tmp_path / "w.npz")


def test_a_lambda_of_ops_computes_on_arrays_and_traces_on_tensors():
    """Catches: a Lambda that records nothing (its ops missing from the graph) or computes
    eagerly something else than its function."""
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    scale = layers.Lambda(lambda t: ops.exp(t) * 2.0)
    assert np.allclose(scale(x), np.exp(x) * 2)
    inp = keras.Input(shape=(4,))
    model = keras.Model(inp, layers.Dense(2)(layers.Lambda(lambda t: ops.exp(t) * 2.0)(inp)))
    core = model._core.use_backend("reference")
    assert [s.op.name for s in core._plan(False).steps if s.op is not None] == ["exp", "multiply"]


@keras.saving.register_keras_serializable()
class Scaled(keras.layers.Layer):
    def call(self, inputs, scale=1.0, shift=None):
        out = inputs * scale
        return out if shift is None else out + shift


def test_a_call_s_keyword_arguments_are_traced_with_it_and_a_built_in_layer_refuses_them():
    """Catches: keyword arguments dropped between the first call and the model's plan (the
    graph would compute call's defaults), or a tensor argument not wired into the graph."""
    a, b = keras.Input(shape=(2,)), keras.Input(shape=(2,))
    model = keras.Model([a, b], layers.Dense(2)(Scaled()(a, scale=3.0, shift=b)))
    xa, xb = np.random.default_rng(0).random((2, 4, 2), np.float32)
    w = model._weights()
    views = model._core.layout.views(w)
    expected = (3 * xa + xb) @ views["dense/kernel"] + views["dense/bias"]
    assert np.allclose(model.predict([xa, xb]), expected, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"layer dense \(Dense\): takes no argument 'scale'"):
        layers.Dense(2, name="dense")(a, scale=2)


@keras.saving.register_keras_serializable()
class Classifier(keras.Model):
    """A subclassed Model with constructor arguments and no get_config (Keras's automatic one),
    a layer of your own in it, and a training-dependent call."""

    def __init__(self, hidden=4, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.hidden = Shifted(hidden)
        self.dropout = layers.Dropout(0.5)
        self.out = layers.Dense(classes, activation="softmax")

    def call(self, inputs, training=None):
        return self.out(self.dropout(ops.relu(self.hidden(inputs)), training=training))


def test_a_subclassed_model_is_saved_and_loaded_as_its_class_with_its_weights(tmp_path):
    """Catches: a subclassed model refused at save; loaded as a plain keras.Model, rebuilt with
    its default arguments (another layout: refused) or with its weights in another order; a
    loaded model that cannot train on (its core without the training trace)."""
    import pserver
    x, y = blobs(n=64, d=6)
    model = Classifier(hidden=7, classes=3, name="clf")
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(2)
    model.build((None, 6))
    model.set_weights([rng.normal(size=w.shape) for w in model.get_weights()])
    model.save(tmp_path / "c.npz")
    again = keras.models.load_model(tmp_path / "c.npz")
    assert type(again) is Classifier and again.get_config() == {"name": "clf", "hidden": 7, "classes": 3}
    assert [w.shape for w in again.get_weights()] == [(6, 7), (7, 3), (3,)]
    assert all(np.array_equal(a, b) for a, b in zip(again.get_weights(), model.get_weights()))
    assert np.array_equal(again.predict(x), model.predict(x))
    assert again.optimizer.settings()["lr"] == 0.02
    core = pserver.load_model(str(tmp_path / "c.npz"))       # the core's loader builds it too
    assert np.array_equal(core.predict(x), model._core.predict(model._weights(), x))
    before = again.predict(x)
    again.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.allclose(again.predict(x), before)


@keras.saving.register_keras_serializable()
class ByName(keras.Model):
    """keras.io's DLRM example's form: layers held in a dict and a Sequential, and a call that reads
    its inputs from a dict by name (two id features and a float one)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding_layers = {"a": layers.Embedding(10, 3), "b": layers.Embedding(7, 3)}
        self.mlp = keras.Sequential([layers.Dense(5, activation="relu"), layers.Dense(1)])

    def call(self, inputs):
        c = ops.reshape(inputs["c"], (-1, 1))
        return self.mlp(ops.concatenate([self.embedding_layers["a"](inputs["a"]),
                                         self.embedding_layers["b"](inputs["b"]), c], axis=1))


def test_a_subclassed_model_on_a_dict_of_inputs_trains_saves_and_loads(tmp_path, monkeypatch):
    """Its call gets the dict (keys in order) when traced, and again when the saved graph is
    rebuilt; the layers in its dict are tracked (trainable reaches them). Catches the dict given
    as one tensor (call failed on inputs["a"]), or as a list when a file is loaded."""
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = {"a": rng.integers(0, 10, 128).astype("int32"), "b": rng.integers(0, 7, 128).astype("int32"),
         "c": rng.normal(size=128).astype("float32")}
    y = (x["a"] % 3 + x["b"] % 2 + x["c"]).astype("float32")
    model = ByName()
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    history = model.fit(x, y, epochs=15, batch_size=32, verbose=0)
    assert history.history["loss"][-1] < 0.1 * history.history["loss"][0]
    assert model.count_params() == 10 * 3 + 7 * 3 + 7 * 5 + 5 + 5 + 1
    model.save(tmp_path / "d.keras")
    again = keras.models.load_model(tmp_path / "d.keras")
    assert np.array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    model.trainable = False
    assert not any(layer.trainable for layer in model.embedding_layers.values())


@keras.saving.register_keras_serializable()
class Stack(keras.Model):
    """Its __init__ takes layers (not JSON): get_config and from_config of its own, over the
    base config, as Keras's guide writes them."""

    def __init__(self, blocks, **kwargs):
        super().__init__(**kwargs)
        self.blocks = list(blocks)

    def call(self, inputs):
        for block in self.blocks:
            inputs = block(inputs)
        return inputs

    def get_config(self):
        return {**super().get_config(), "widths": [block.units for block in self.blocks]}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls([layers.Dense(w) for w in config.pop("widths")], **config)


def test_a_subclassed_model_with_its_own_get_config_round_trips(tmp_path):
    """Catches: the base get_config adding (and refusing) __init__'s layers when the subclass
    overrides get_config, or a subclass's from_config passed over at load."""
    x = np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32)
    model = Stack([layers.Dense(5), layers.Dense(3)], name="stack")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    first = model.predict(x)
    model.save(tmp_path / "s.npz")
    again = keras.models.load_model(tmp_path / "s.npz")
    assert type(again) is Stack and again.get_config() == {"name": "stack", "widths": [5, 3]}
    assert np.array_equal(again.predict(x), first)


def test_a_subclassed_model_whose_config_does_not_rebuild_it_is_refused_at_load(tmp_path):
    """Catches: a get_config that drops an argument of __init__ loading as a TypeError traceback
    (or with a default in its place) instead of pserver's error naming the class."""
    from pserver.errors import ModelFileError

    @keras.saving.register_keras_serializable()
    class Forgetful(keras.Model):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(units)

        def call(self, inputs):
            return self.dense(inputs)

        def get_config(self):
            return {"name": self.name}

    model = Forgetful(3)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.build((None, 4))
    model.save(tmp_path / "f.npz")
    with pytest.raises(ModelFileError, match=r"f.npz: Forgetful: cannot be built again from its config "
                                             r"\{'name': 'forgetful'\}.*its get_config must give"):
        keras.models.load_model(tmp_path / "f.npz")


def test_a_lambda_is_saved_by_its_function_s_name_or_as_code_that_loads_only_unsafely(tmp_path):
    """Catches: a Lambda refused at save; a named function not found again; a lambda's code run
    at load in safe mode (Keras refuses it unless safe_mode=False), or its closure lost."""
    import pserver
    from pserver.errors import ModelFileError
    inp = keras.Input(shape=(4,))
    k = 3.0
    named = keras.Model(inp, layers.Dense(2)(layers.Lambda(ops.tanh)(inp)))
    coded = keras.Model(inp, layers.Dense(2)(layers.Lambda(lambda t: ops.square(t) * k)(inp)))
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    for name, model in (("named", named), ("coded", coded)):
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.save(tmp_path / f"{name}.npz")
    assert np.array_equal(keras.models.load_model(tmp_path / "named.npz").predict(x), named.predict(x))
    for load in (keras.models.load_model, lambda p: pserver.load_model(str(p))):
        with pytest.raises(ModelFileError, match=r"coded.npz: layer lambda \(Lambda\): its function is a "
                                                 r"Python lambda, saved as bytecode.*safe_mode=False"):
            load(tmp_path / "coded.npz")
    again = keras.models.load_model(tmp_path / "coded.npz", safe_mode=False)
    views = coded._core.layout.views(coded._weights())
    expected = (x * x * 3.0) @ views["dense/kernel"] + views["dense/bias"]
    assert np.allclose(again.predict(x), expected, rtol=1e-6)


def test_a_model_file_written_before_issue_48_still_loads():
    """tests/data/model-files/functional-before-issue-48.npz is model.save of commit 1025515:
    keras.Model(a, Dense(2)(ops.tanh(Shifted(3)(a)))), a of shape (4,), Shifted registered as
    here. Catches: a change to the file format (a key now required) that files already written
    fail, or their graph rebuilt otherwise."""
    import os

    import pserver
    path = os.path.join(os.path.dirname(__file__), "data", "model-files", "functional-before-issue-48.npz")
    with np.load(path) as z:
        w, kernel, bias = z["shifted/variable"], z["dense/kernel"], z["dense/bias"]
    x = np.random.default_rng(3).normal(size=(6, 4)).astype(np.float32)
    expected = np.tanh(x @ w - 1.0) @ kernel + bias
    again = keras.models.load_model(path)
    assert again.name == "older" and again.optimizer.settings()["lr"] == 0.01
    assert np.allclose(again.predict(x), expected, rtol=1e-5, atol=1e-6)
    assert np.allclose(pserver.load_model(path).predict(x), expected, rtol=1e-5, atol=1e-6)


def test_load_model_takes_custom_objects_before_the_registry(tmp_path):
    """Catches: Keras's custom_objects (keras.io scripts pass them) refused or passed over for
    the registered class, or a malformed one reported as the file's fault."""
    from pserver.errors import ModelFileError

    class Local(Shifted):
        """Not registered: known to this load only through custom_objects."""

    inp = keras.Input(shape=(4,))
    model = keras.Model(inp, layers.Dense(2)(Shifted(3)(inp)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.save(tmp_path / "m.npz")
    x = np.random.default_rng(5).normal(size=(3, 4)).astype(np.float32)
    again = keras.models.load_model(tmp_path / "m.npz", custom_objects={"Shifted": Local})
    assert [type(layer).__name__ for layer in again.layers] == ["Local", "Dense"]
    assert np.array_equal(again.predict(x), model.predict(x))
    with pytest.raises(ConfigError, match=r"load_model: custom_objects: give classes and functions by name, "
                                          r"got 'Shifted': 3") as e:
        keras.models.load_model(tmp_path / "m.npz", custom_objects={"Shifted": 3})
    assert not isinstance(e.value, ModelFileError)


@keras.saving.register_keras_serializable()
class FixedScale(keras.layers.Layer):
    """A layer with a weight training leaves as it is (add_weight(trainable=False)) beside one it trains."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 3), initializer="random_normal")
        self.scale = self.add_weight(shape=(3,), initializer="ones", trainable=False, name="scale")

    def call(self, inputs):
        return ops.matmul(inputs, self.w) * self.scale


def test_frozen_layers_and_non_trainable_weights_stay_as_they_are_through_fit_and_files(tmp_path):
    """A frozen Dense (layer.trainable = False) and a non-trainable weight of your own keep their
    values bit for bit through fit with AdamW (whose decay moves every weight it steps), while the
    rest trains; summary and trainable_weights count them; a saved frozen layer loads frozen.
    Fails if the flag does not reach the shards, if a frozen layer's weights are stepped, or if a
    file forgets it (a reloaded model would then train the layer)."""
    x, y = blobs(n=200)
    model = keras.Sequential([keras.Input(shape=(8,)), layers.Dense(16, activation="relu", name="base"),
                              FixedScale(), layers.Dense(3)])
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1),
                  loss="sparse_categorical_crossentropy")
    before = model.get_weights()
    assert [w.shape for w in model.non_trainable_weights] == [(8, 16), (16,), (3,)]
    assert len(model.trainable_weights) == 3 and "Non-trainable params: 147" in model.summary_text()
    model.fit(x, y, batch_size=20, epochs=2, verbose=0)
    moved = [not np.array_equal(a, b) for a, b in zip(before, model.get_weights())]
    assert moved == [False, False, True, False, True, True]
    model.save(tmp_path / "m.npz")
    again = keras.models.load_model(tmp_path / "m.npz")
    assert [layer.trainable for layer in again.layers] == [False, True, True]
    model.trainable = True
    assert model.non_trainable_weights[0].shape == (3,) and len(model.trainable_weights) == 5


def test_a_frozen_sparse_table_is_refused():
    ids = keras.Input(shape=(2,), dtype="int64")
    table = layers.Embedding(None, 4, sparse=True)
    model = keras.Model(ids, layers.Dense(2)(layers.Flatten()(table(ids))))
    table.trainable = False
    with pytest.raises(ConfigError, match=r"layer embedding \(Embedding\) is frozen .* dense layers only"):
        model._core.frozen_weights()


def test_a_frozen_base_is_not_differentiated_and_the_rest_gets_the_same_gradient():
    """Three Dense layers, the first two frozen: the backward pass stops at the head (the base's
    output needs no gradient) and the head's gradient is the unfrozen model's, the base's zero.
    A frozen layer between trainable ones still passes its gradient back: the first layer's is
    the unfrozen model's. Unfrozen again, every gradient is back. Fails if frozen weights are
    treated as needing no gradient in the wrong place (a frozen middle layer would cut the
    first layer's gradient) or if a changed flag is not seen (a stale plan)."""
    x, y = blobs(n=32)
    model = keras.Sequential([keras.Input(shape=(8,)), layers.Dense(6, activation="relu"),
                              layers.Dense(5, activation="relu"), layers.Dense(3)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    core = model._core
    w = model._weights()
    views = core.layout.views

    def grads() -> dict:
        g = np.zeros_like(w)
        core.loss_and_grad(w, x, y.astype(np.int32), g, seed=1)
        return {k: v.copy() for k, v in views(g).items()}

    full = grads()
    names = [t.name for t in core.layout.tensors]
    model.layers[0].trainable = model.layers[1].trainable = False
    base = grads()
    plan = core._plan(True)
    assert not plan.needs_grad[plan.steps[1].out]                  # the base's output: no backward
    for n in names:
        assert np.array_equal(base[n], full[n] if n.startswith(model.layers[2].name) else 0 * full[n]), n
    model.layers[0].trainable, model.layers[1].trainable = True, False
    middle = grads()                  # the frozen middle layer's own gradient: the shards drop it
    for n in names:
        if not n.startswith(model.layers[1].name + "/"):
            assert np.array_equal(middle[n], full[n]), n
    model.layers[1].trainable = True
    assert all(np.array_equal(v, full[k]) for k, v in grads().items())


def test_a_model_file_builder_may_return_a_keras_model(tmp_path):
    # Catches `--model FILE.py:FUNCTION` refusing a keras.Model ("lacks layout, init_params,
    # loss_and_grad"), or unwrapping it without the loss its compile gave.
    from pserver.models.functional import Functional
    from pserver.models.user import load_model
    path = tmp_path / "m.py"
    path.write_text(
        "import pserver.keras as keras\n"
        "from pserver.keras import layers\n"
        "def build(input_shape, num_classes):\n"
        "    inp = keras.Input(shape=input_shape)\n"
        "    h = layers.add([layers.Dense(4)(inp), layers.Dense(4)(inp)])\n"
        "    model = keras.Model(inp, layers.Dense(num_classes)(h))\n"
        "    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "    return model\n")
    model = load_model(f"{path}:build", (8,), 3)
    assert isinstance(model, Functional)
    assert model.loss.name == "sparse_categorical_crossentropy" and model.loss.from_logits
    x, y = blobs(n=32)
    w = model.init_params(0)
    grad = np.zeros_like(w)
    assert np.isfinite(model.loss_and_grad(w, x, y, grad)) and np.abs(grad).sum() > 0
