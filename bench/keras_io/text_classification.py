"""keras.io's "Text classification from scratch" (text_classification_from_scratch), its
vectorization, model and training written here: a TextVectorization layer (20,000 tokens,
int output, sequences of 500) adapted on the training texts; Embedding(20000, 128), Dropout(0.5),
two Conv1D(128, 7, valid, relu, strides 3), GlobalMaxPooling1D, Dense(128, relu), Dropout(0.5),
a sigmoid Dense(1); binary cross-entropy, Adam, batch 32, 3 epochs with 20% of the training
reviews to validate; the test set evaluated after.

What differs from the example: IMDB cannot be downloaded here, so _ours.synthetic_imdb_text
(raw text reviews of synthetic_imdb's word ids, the same counts; how it is made is in its
docstring) takes the place of aclImdb's files, as NumPy arrays of strings (the example's
tf.data datasets from text_dataset_from_directory: our split is a fixed shuffle, 20% to
validate); TextVectorization uses Keras's default standardization (lower case, punctuation
stripped; the example's own also strips "<br />", which the synthetic texts do not hold, and
is written in tf.strings, which pserver does not run); the texts are vectorized by calling the
layer on the arrays (the example's "option 2"). The end-to-end model of strings is left out.
$KERAS_IO_SAMPLES cuts the reviews (train and test alike) and $KERAS_IO_EPOCHS the epochs,
alike on both sides.
"""

import os
import time

import numpy as np
from _ours import seed, synthetic_imdb_text

import pserver.keras as keras
from pserver.keras import layers

seed(keras)

(texts, labels), (test_texts, test_labels) = synthetic_imdb_text()
order = np.random.default_rng(1337).permutation(len(texts))       # the example's split seed
cut = len(texts) - len(texts) // 5
train_texts, train_labels = texts[order[:cut]], labels[order[:cut]]
val_texts, val_labels = texts[order[cut:]], labels[order[cut:]]
print(f"{len(train_texts)} training, {len(val_texts)} validation and {len(test_texts)} test reviews")

max_features = 20000
embedding_dim = 128
sequence_length = 500

vectorize_layer = keras.layers.TextVectorization(
    max_tokens=max_features,
    output_mode="int",
    output_sequence_length=sequence_length,
)
vectorize_layer.adapt(train_texts)
x_train = np.asarray(vectorize_layer(train_texts))
x_val = np.asarray(vectorize_layer(val_texts))
x_test = np.asarray(vectorize_layer(test_texts))

inputs = keras.Input(shape=(None,), dtype="int64")
x = layers.Embedding(max_features, embedding_dim)(inputs)
x = layers.Dropout(0.5)(x)
x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
x = layers.GlobalMaxPooling1D()(x)
x = layers.Dense(128, activation="relu")(x)
x = layers.Dropout(0.5)(x)
predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
model = keras.Model(inputs, predictions)
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])

epochs = int(os.environ.get("KERAS_IO_EPOCHS") or 3)
start = time.perf_counter()
model.fit(x_train, train_labels, batch_size=32, validation_data=(x_val, val_labels), epochs=epochs)
print(f"Fit: {time.perf_counter() - start:.2f} s")
test_loss, test_accuracy = model.evaluate(x_test, test_labels, verbose=0)
print("Test loss:", test_loss)
print("Test accuracy:", test_accuracy)
