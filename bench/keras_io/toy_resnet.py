# keras.io's guide "The Functional API", https://keras.io/guides/functional_api/ (keras-team/keras-io,
# guides/functional_api.py, by fchollet; Apache License 2.0): its section "A toy ResNet model",
# verbatim, with only the import lines changed to pserver's (`import keras` -> `import pserver.keras
# as keras`, `from keras import layers` -> `from pserver.keras import layers`) and the dataset:
# CIFAR-10 cannot be downloaded here, so MNIST (28x28x1) in its place, each changed line marked
# "ours". The guide trains on the first 1000 samples for 1 epoch and evaluates on nothing: the
# block marked "ours" at the end prints the test accuracy. `keras.utils.plot_model` is kept,
# commented out and marked: it needs pydot and graphviz (absent from the bench's Keras venv) and
# pserver.keras.utils has none. bench/keras_io/compare.py runs it under `pserver run` and on
# Keras 3 (the imports swapped back); tests/e2e/test_keras_io.py runs it on a few hundred samples.
"""
Title: The Functional API
Author: [fchollet](https://twitter.com/fchollet)
Description: Complete guide to the functional API.
"""

"""
## Setup
"""

import numpy as np
import pserver.keras as keras
from pserver.keras import layers

# --- ours: the seed, a sample limit for quick checks, MNIST from its IDX files (_ours.py) -----
import time

from _ours import load_mnist, seed

seed(keras)
# --- end of ours --------------------------------------------------------------------------------

"""
### A toy ResNet model

In addition to models with multiple inputs and outputs,
the functional API makes it easy to manipulate non-linear connectivity
topologies -- these are models with layers that are not connected sequentially,
which the `Sequential` API cannot handle.

A common use case for this is residual connections.
Let's build a toy ResNet model for CIFAR10 to demonstrate this:
"""

inputs = keras.Input(shape=(28, 28, 1), name="img")  # ours: MNIST's shape, was (32, 32, 3)
x = layers.Conv2D(32, 3, activation="relu")(inputs)
x = layers.Conv2D(64, 3, activation="relu")(x)
block_1_output = layers.MaxPooling2D(3)(x)

x = layers.Conv2D(64, 3, activation="relu", padding="same")(block_1_output)
x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
block_2_output = layers.add([x, block_1_output])

x = layers.Conv2D(64, 3, activation="relu", padding="same")(block_2_output)
x = layers.Conv2D(64, 3, activation="relu", padding="same")(x)
block_3_output = layers.add([x, block_2_output])

x = layers.Conv2D(64, 3, activation="relu")(block_3_output)
x = layers.GlobalAveragePooling2D()(x)
x = layers.Dense(256, activation="relu")(x)
x = layers.Dropout(0.5)(x)
outputs = layers.Dense(10)(x)

model = keras.Model(inputs, outputs, name="toy_resnet")
model.summary()

"""
Plot the model:
"""

# ours: commented out, see the header (pydot/graphviz absent; pserver.keras.utils has no plot_model)
# keras.utils.plot_model(model, "mini_resnet.png", show_shapes=True)

"""
Now train the model:
"""

# ours: MNIST from its files (and a channel axis), was keras.datasets.cifar10.load_data()
(x_train, y_train), (x_test, y_test) = load_mnist()
x_train, x_test = np.expand_dims(x_train, -1), np.expand_dims(x_test, -1)  # ours

x_train = x_train.astype("float32") / 255.0
x_test = x_test.astype("float32") / 255.0
y_train = keras.utils.to_categorical(y_train, 10)
y_test = keras.utils.to_categorical(y_test, 10)

model.compile(
    optimizer=keras.optimizers.RMSprop(1e-3),
    loss=keras.losses.CategoricalCrossentropy(from_logits=True),
    metrics=["acc"],
)
start = time.perf_counter()  # ours
# We restrict the data to the first 1000 samples so as to limit execution time
# on Colab. Try to train on the entire dataset until convergence!
model.fit(
    x_train[:1000],
    y_train[:1000],
    batch_size=64,
    epochs=1,
    validation_split=0.2,
)

# --- ours: the fit's time and the test accuracy (the guide prints neither) ----------------------
fit_s = time.perf_counter() - start
print(f"Fit: {fit_s:.2f} s")
score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])
# --- end of ours --------------------------------------------------------------------------------
