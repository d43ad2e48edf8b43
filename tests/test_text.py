"""StringLookup, IntegerLookup and TextVectorization (pserver.layers.text) against Keras 3's
results, and as the first layers of a model (pserver.models.functional.preprocess).

The expected vocabularies and outputs below were computed with Keras 3.15.1 (TensorFlow 2.18) on
the same inputs in development (/work/tfvenv), and hard-coded here: CI does not need Keras."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import keras
from pserver.errors import ConfigError
from pserver.keras import layers

TEXTS = np.array(["The cat sat on the mat.", "the dog, the cat!", "A b b c", "Zebra z z a"])


def test_text_vectorization_vocabulary_and_ids_are_keras_s():
    """By count, ties by token descending (z > cat > b > a), lower-cased, punctuation stripped,
    '' and [UNK] first, cut at max_tokens; ids padded with 0 to the longest. Verified against
    Keras. Catches ties in ascending order, a max_tokens that does not count the specials, a
    wrong padding or OOV index."""
    tv = layers.TextVectorization(max_tokens=8)
    tv.adapt(TEXTS)
    assert tv.get_vocabulary() == ["", "[UNK]", "the", "z", "cat", "b", "a", "zebra"]
    assert tv.vocabulary_size() == 8
    assert tv(TEXTS).tolist() == [[2, 4, 1, 1, 2, 1], [2, 1, 2, 4, 0, 0], [6, 5, 5, 1, 0, 0],
                                  [7, 3, 3, 6, 0, 0]]
    assert tv(TEXTS).dtype == np.int64


def test_text_vectorization_tf_idf_ngrams_and_ascii_only_as_keras():
    """tf_idf: count x log(1 + N / (1 + df)), the OOV slot the mean idf, no mask in the vocabulary;
    ngrams=2: unigrams then bigrams; tf.strings.lower and split act on ASCII only (É stays, \\xa0
    joins). Verified against Keras. Catches a natural-log idf without the 1+, n-grams interleaved,
    a Unicode lower() or str.split()."""
    tv = layers.TextVectorization(output_mode="tf_idf")
    tv.adapt(TEXTS)
    assert tv.get_vocabulary() == ["[UNK]", "the", "z", "cat", "b", "a", "zebra", "sat", "on", "mat", "dog",
                                   "c"]
    np.testing.assert_allclose(tv(TEXTS[:2]), [[0, 1.6946, 0, .8473, 0, 0, 0, 1.0986, 1.0986, 1.0986, 0, 0],
                                               [0, 1.6946, 0, .8473, 0, 0, 0, 0, 0, 0, 1.0986, 0]], atol=1e-4)
    tv = layers.TextVectorization(output_sequence_length=3, ngrams=2)
    tv.adapt(TEXTS)
    assert tv.get_vocabulary()[:8] == ["", "[UNK]", "the", "z", "the cat", "cat", "b", "a"]
    assert tv(TEXTS).tolist() == [[2, 5, 15], [2, 20, 2], [7, 6, 6], [9, 3, 3]]
    tv = layers.TextVectorization(ngrams=3)
    tv.adapt(np.array(["a b c d"]))
    assert tv(np.array(["a b c d", "b"])).tolist() == [[10, 7, 4, 2, 9, 6, 3, 8, 5],
                                                       [7, 0, 0, 0, 0, 0, 0, 0, 0]]
    tv = layers.TextVectorization(standardize="lower")
    tv.adapt(np.array(["ÉA éa Ab"]))
    assert tv.get_vocabulary() == ["", "[UNK]", "éa", "Éa", "ab"]
    tv = layers.TextVectorization()
    tv.adapt(np.array(["x\u00a0y  z\tw"]))
    assert tv.get_vocabulary() == ["", "[UNK]", "z", "x\xa0y", "w"]
    tv = layers.TextVectorization(split="character", standardize=None)
    tv.adapt(np.array(["Ab c", "éé"]))
    assert tv.get_vocabulary() == ["", "[UNK]", "é", "c", "b", "A", " "]


def test_lookups_as_keras():
    """StringLookup and IntegerLookup: adapt's order, the mask at 0, several OOV indices (ints
    by floormod), invert's mask and OOV tokens, and the encodings (the last axis a sample's;
    one_hot of an (n, 1) input is (n, depth)). Verified against Keras. Catches an OOV bucket not
    offset by the mask, a mask kept in a multi_hot vocabulary, counts where multi_hot caps at 1."""
    s = layers.StringLookup()
    s.adapt(np.array(["b", "a", "c", "a", "b", "d"]))
    assert s.get_vocabulary() == ["[UNK]", "b", "a", "d", "c"]
    assert s(np.array(["a", "zz", "d"])).tolist() == [2, 0, 3]
    s = layers.StringLookup(mask_token="", num_oov_indices=2, vocabulary=["x", "y"])
    assert s.get_vocabulary() == ["", "[UNK]", "[UNK]", "x", "y"]
    assert s(np.array(["", "x"])).tolist() == [0, 3]
    assert s(np.array(["q"]))[0] in (1, 2)            # Keras's bucket is FarmHash64's: a difference
    i = layers.IntegerLookup()
    i.adapt(np.array([5, 3, 5, 7, 3, 9]))
    assert i.get_vocabulary() == [-1, 5, 3, 9, 7]
    assert i(np.array([5, 9, 100])).tolist() == [1, 3, 0]
    assert layers.IntegerLookup(num_oov_indices=3, vocabulary=[10, 20])(np.array([10, 4, 5, 6, 7])).tolist() \
        == [3, 1, 2, 0, 1]
    i = layers.IntegerLookup(mask_token=0)
    i.adapt(np.array([[0, 3, 3, 4]]))
    assert i.get_vocabulary() == [0, -1, 3, 4] and i(np.array([[0, 3, 4, 9]])).tolist() == [[0, 2, 3, 1]]
    inverse = layers.IntegerLookup(invert=True, vocabulary=[7, 8], mask_token=0)
    assert inverse(np.array([0, 1, 2, 3])).tolist() == [0, -1, 7, 8]
    assert layers.StringLookup(vocabulary=["a", "b"], invert=True)(np.array([0, 1, 2, 5])).tolist() \
        == ["[UNK]", "a", "b", "[UNK]"]
    m = layers.StringLookup(vocabulary=["a", "b"], output_mode="multi_hot")
    assert m(np.array([["a", "b", "a"], ["q", "q", "b"]])).tolist() == [[0, 1, 1], [1, 0, 1]]
    m = layers.StringLookup(vocabulary=["a", "b"], output_mode="count", mask_token="")
    assert m.get_vocabulary() == ["[UNK]", "a", "b"]
    assert m(np.array([["a", "", "a"], ["q", "q", "b"]])).tolist() == [[0, 2, 0], [2, 0, 1]]
    one = layers.StringLookup(vocabulary=["a", "b"], output_mode="one_hot")
    assert one(np.array(["a", "q", "b"])).tolist() == [[0, 1, 0], [1, 0, 0], [0, 0, 1]]
    assert one(np.array([["a"], ["q"]])).shape == (2, 3)
    s = layers.StringLookup(output_mode="tf_idf")
    s.adapt(np.array([["a", "b"], ["a", "a"], ["c", "a"]]))
    assert s.get_vocabulary() == ["[UNK]", "a", "c", "b"]
    np.testing.assert_allclose(s.idf_weights, [0.7973991, 0.5596158, 0.91629076, 0.91629076], rtol=1e-6)
    s = layers.StringLookup(max_tokens=3, pad_to_max_tokens=True, output_mode="tf_idf", vocabulary=["a"],
                            idf_weights=[0.5])
    assert s(np.array([["a", "z"]])).tolist() == [[0.5, 0.5, 0.0]]


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.text(alphabet="abcxyz", min_size=1, max_size=4), min_size=1, max_size=30),
       queries=st.lists(st.text(alphabet="abcdxyz", max_size=4), min_size=1, max_size=20),
       oov=st.integers(0, 3), masked=st.booleans())
def test_lookup_then_invert_round_trips(tokens, queries, oov, masked):
    """Every in-vocabulary token comes back through invert; an OOV one lands in the OOV indices
    (right after the mask) and inverts to the OOV token; the mask token to 0 and back. Catches
    an off-by-one between lookup and invert, OOV indices overlapping the tokens'."""
    mask = "" if masked else None
    look = layers.StringLookup(num_oov_indices=max(oov, 1), mask_token=mask)
    look.adapt(np.array(tokens))
    back = layers.StringLookup(num_oov_indices=max(oov, 1), mask_token=mask, vocabulary=look.get_vocabulary(),
                               invert=True)
    ids = look(np.array(queries))
    known = set(tokens)
    start = 1 if masked else 0
    for q, i, t in zip(queries, ids.tolist(), back(ids).tolist()):
        if q in known:
            assert t == q and i >= start + max(oov, 1)
        elif masked and q == "":
            assert i == 0 and t == ""
        else:
            assert start <= i < start + max(oov, 1) and t == "[UNK]"


def test_refusals_are_one_line():
    """What pserver does not do is refused by name: a callable standardize, sparse and ragged
    outputs, a vocabulary file, a lookup called on a layer's output, an int TextVectorization in a
    model without output_sequence_length, a vocabulary changed after a model holding it is built."""
    with pytest.raises(ConfigError, match="callable standardize"):
        layers.TextVectorization(standardize=str.lower)
    with pytest.raises(ConfigError, match="sparse=True"):
        layers.StringLookup(sparse=True, output_mode="multi_hot")
    with pytest.raises(ConfigError, match="ragged=True"):
        layers.TextVectorization(ragged=True)
    with pytest.raises(ConfigError, match="vocabulary file"):
        layers.StringLookup(vocabulary="vocab.txt")
    with pytest.raises(ConfigError, match="output_sequence_length"):
        layers.TextVectorization(vocabulary=["a"])(keras.Input(shape=(1,), dtype="string"))
    x = keras.Input(shape=(3,))
    with pytest.raises(ConfigError, match="before the model"):
        keras.Model(x, layers.Dense(1)(layers.IntegerLookup(vocabulary=[1], output_mode="multi_hot")(
            layers.Dense(3)(x))))
    tv = layers.TextVectorization(vocabulary=["a", "b"], output_mode="multi_hot")
    inp = keras.Input(shape=(1,), dtype="string")
    model = keras.Model(inp, layers.Dense(2)(tv(inp)))
    tv.set_vocabulary(["a", "c"])               # same width, the model not built yet: allowed
    with pytest.raises(ConfigError, match="output width"):
        tv.set_vocabulary(["a", "b", "c"])
    model.summary(print_fn=lambda line: None)    # builds it
    with pytest.raises(ConfigError, match="part of the built model"):
        tv.adapt(np.array(["a b"]))


def test_config_keeps_the_vocabulary_and_it_is_in_the_layout_signature():
    """get_config holds the adapted vocabulary (and idf): from_config gives the same outputs. Two
    models alike but for their vocabularies have different layout signatures (a worker holding
    another vocabulary is refused at Register), equal ones the same; a model without text layers
    keeps the signature it had. Catches a config with vocabulary=None after adapt, a signature
    blind to the vocabulary."""
    tv = layers.TextVectorization(output_mode="tf_idf", max_tokens=6, pad_to_max_tokens=True)
    tv.adapt(TEXTS)
    again = layers.TextVectorization.from_config(tv.get_config())
    assert again.get_vocabulary() == tv.get_vocabulary()
    np.testing.assert_array_equal(again(TEXTS), tv(TEXTS))

    def signature(vocabulary):
        inp = keras.Input(shape=(1,), dtype="string")
        out = layers.Dense(2)(layers.TextVectorization(vocabulary=vocabulary, output_mode="count")(inp))
        return keras.Model(inp, out)._core.layout.signature()
    assert signature(["a", "b"]) == signature(["a", "b"]) != signature(["a", "c"])
    inp = keras.Input(shape=(3,))
    from pserver.models.layout import Layout
    plain = keras.Model(inp, layers.Dense(2)(inp))._core.layout
    assert plain.signature() == Layout(plain.tensors).signature()


def test_text_classification_from_scratch_trains_saves_and_loads(tmp_path):
    """keras.io's text_classification_from_scratch model, small: strings -> TextVectorization(int,
    output_sequence_length) -> Embedding -> Dropout -> Conv1D -> GlobalMaxPooling1D -> Dense,
    fit, evaluate and predict on raw strings; the file load_model reads holds the vocabulary
    (same predictions). Also the eager use (a dataset map's): the layer on arrays, then an int
    model. Catches strings reaching the loop, a vocabulary lost on save, ids not int."""
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(30)])
    y = rng.integers(0, 2, 96)
    x = np.array([" ".join([*rng.choice(words, 6), "good" if v else "bad", *rng.choice(words, 3)]) + "."
                  for v in y])
    vec = layers.TextVectorization(max_tokens=64, output_mode="int", output_sequence_length=12)
    vec.adapt(x)
    inputs = keras.Input(shape=(1,), dtype="string")
    h = layers.Embedding(64, 8)(vec(inputs))
    h = layers.Dropout(0.5)(h)
    h = layers.Conv1D(8, 3, padding="valid", activation="relu", strides=1)(h)
    h = layers.GlobalMaxPooling1D()(h)
    h = layers.Dense(8, activation="relu")(h)
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid", name="predictions")(h))
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(0.02), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert [layer.name for layer in model.layers][:2] == ["text_vectorization", "embedding"]
    loss, accuracy = model.evaluate(x, y, verbose=0)
    assert accuracy > 0.6
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].get_vocabulary() == vec.get_vocabulary()
    np.testing.assert_array_equal(loaded.predict(x[:5], verbose=0), model.predict(x[:5], verbose=0))
    ids = vec(x)                                  # eager, as in a dataset map
    assert ids.dtype == np.int64 and ids.shape == (96, 12)
    ids_in = keras.Input(shape=(12,), dtype="int64")
    int_model = keras.Model(ids_in, layers.Dense(1)(layers.Flatten()(layers.Embedding(64, 2)(ids_in))))
    int_model.compile(loss="mse", optimizer="sgd")
    int_model.fit(ids, y.astype("float32"), epochs=1, verbose=0)


def test_integer_lookup_in_a_model_looks_up_int64_values_before_any_float_cast():
    """IntegerLookup on a keras.Input(dtype="int64") runs on the raw values: ids beyond float32's
    exact range (2**24) are told apart (the data path casts x to float32 after the lookup only).
    Catches the lookup run inside the graph on float32 ids (10**12 and 10**12 + 1 are one float)."""
    big = 10**12
    inp = keras.Input(shape=(2,), dtype="int64")
    look = layers.IntegerLookup(vocabulary=[big, big + 1], output_mode="count")
    model = keras.Model(inp, layers.Dense(2, use_bias=False)(look(inp)))
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    model.set_weights([np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)])
    x = np.array([[big, big + 1], [big + 1, big + 1], [big, 7]], dtype=np.int64)
    np.testing.assert_array_equal(model.predict(x, verbose=0), [[1, 1], [0, 2], [1, 0]])


def test_a_sequential_starting_with_a_text_layer_builds_on_a_list_of_strings(tmp_path):
    """keras.Sequential([TextVectorization(...), Dense]) without an Input: built at the first data, a
    list of strings (one a sample), as Keras's; its file keeps the layer first with its vocabulary.
    Catches a deferred build on the strings' shape (), a Sequential config without its first layer."""
    x, y = ["good day", "bad day", "good", "bad night"] * 4, np.array([1, 0, 1, 0] * 4)
    vectorize = layers.TextVectorization(vocabulary=["good", "bad", "day"], output_mode="multi_hot")
    model = keras.Sequential([vectorize, layers.Dense(2)])
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [type(layer).__name__ for layer in model.layers] == ["TextVectorization", "Dense"]
    model.save(tmp_path / "s.keras")
    loaded = keras.models.load_model(tmp_path / "s.keras")
    assert loaded.layers[0].get_vocabulary() == ["[UNK]", "good", "bad", "day"]
    np.testing.assert_array_equal(loaded.predict(x[:4], verbose=0), model.predict(x[:4], verbose=0))
