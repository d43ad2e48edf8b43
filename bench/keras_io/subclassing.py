"""Layers and a model of one's own by subclassing, as keras.io's guide "Making new layers and models
via subclassing" teaches them, written here: `Linear` makes its weights in `build`, once the input's
width is known (both drawn from random_normal), `MLPBlock` composes three of them with relus, and
`MNISTModel`, a subclassed keras.Model, classifies MNIST digits with them (the block's one unit
beside the hidden layer it reads). Adam(1e-3), 2 epochs, batch 64, then the test accuracy.

compare.py runs it under `pserver run` and on Keras 3 (its two import lines swapped);
tests/e2e/test_keras_io.py runs it on a few hundred samples.
"""

import time

import pserver.keras as keras
from pserver.keras import ops

from _ours import load_mnist, seed

seed(keras)


class Linear(keras.layers.Layer):
    """inputs @ w + b, with w and b made at the first call."""

    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        width = input_shape[-1]
        self.w = self.add_weight(shape=(width, self.units), initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class MLPBlock(keras.layers.Layer):
    """32 -> relu -> 32 -> relu -> 1, layers held by a layer."""

    def __init__(self):
        super().__init__()
        self.linear_1, self.linear_2, self.linear_3 = Linear(32), Linear(32), Linear(1)

    def call(self, inputs):
        h = keras.activations.relu(self.linear_1(inputs))
        h = keras.activations.relu(self.linear_2(h))
        return self.linear_3(h)


class MNISTModel(keras.Model):
    def __init__(self, num_classes=10):
        super().__init__()
        self.block_1 = Linear(64)
        self.block_2 = MLPBlock()
        self.classifier = Linear(num_classes)

    def call(self, inputs):
        hidden = keras.activations.relu(self.block_1(inputs))
        return self.classifier(ops.concatenate([hidden, self.block_2(hidden)], axis=-1))


(train_images, y_train), (test_images, y_test) = load_mnist()
x_train = train_images.reshape(-1, 784).astype("float32") / 255
x_test = test_images.reshape(-1, 784).astype("float32") / 255

model = MNISTModel()
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
start = time.perf_counter()
model.fit(x_train, y_train, epochs=2, batch_size=64, verbose=2)
fit_s = time.perf_counter() - start
print(f"Fit: {fit_s:.2f} s, {2 * len(x_train) / fit_s:.0f} samples/s")
test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", test_loss)
print("Test accuracy:", test_accuracy)
