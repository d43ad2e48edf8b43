"""A toy residual network in the Functional API: the model and training of keras.io's guide "The
Functional API", section "A toy ResNet model" (two blocks whose input is added to their output
with `layers.add`), written here, on MNIST (28x28x1) where the guide takes CIFAR-10, which cannot
be downloaded here. As the guide: RMSprop(1e-3) on logits, the first 1000 training samples, 1
epoch, a fifth held out; then the test accuracy, which the guide does not print.

compare.py runs it under `pserver run` and on Keras 3 (its two import lines swapped); its
--train-samples and --epochs rewrite the fit's two slices of the first 1000 samples and its
epochs line below (each must appear once in this file). tests/e2e/test_keras_io.py runs it on a
few hundred samples.
"""

import time

import numpy as np
import pserver.keras as keras
from pserver.keras import layers

from _ours import load_mnist, seed

seed(keras)


def conv(filters, padding="valid"):
    return layers.Conv2D(filters, 3, activation="relu", padding=padding)


def residual(block_input):
    """Two same-size 3x3 convolutions, their output added to the block's input."""
    h = conv(64, "same")(block_input)
    h = conv(64, "same")(h)
    return layers.add([h, block_input])


inputs = keras.Input(shape=(28, 28, 1), name="img")
h = conv(32)(inputs)
h = conv(64)(h)
h = layers.MaxPooling2D(3)(h)
h = residual(h)
h = residual(h)
h = conv(64)(h)
h = layers.GlobalAveragePooling2D()(h)
h = layers.Dense(256, activation="relu")(h)
h = layers.Dropout(0.5)(h)
model = keras.Model(inputs, layers.Dense(10)(h), name="toy_resnet")
model.summary()

(train_images, train_digits), (test_images, test_digits) = load_mnist()
x_train = train_images[..., np.newaxis].astype("float32") / 255.0
x_test = test_images[..., np.newaxis].astype("float32") / 255.0
y_train = keras.utils.to_categorical(train_digits, 10)
y_test = keras.utils.to_categorical(test_digits, 10)

model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
              loss=keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["acc"])
start = time.perf_counter()
model.fit(
    x_train[:1000],
    y_train[:1000],
    batch_size=64,
    epochs=1,
    validation_split=0.2,
)
print(f"Fit: {time.perf_counter() - start:.2f} s")
test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", test_loss)
print("Test accuracy:", test_accuracy)
