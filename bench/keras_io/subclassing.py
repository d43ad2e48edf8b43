# keras.io's guide "Making new layers and models via subclassing",
# https://keras.io/guides/making_new_layers_and_models_via_subclassing/ (keras-team/keras-io,
# guides/making_new_layers_and_models_via_subclassing.py, by fchollet; Apache License 2.0): its
# `Linear` layer (the version that creates its weights in `build`) and its `MLPBlock`, as the
# Keras 3 revision of the guide writes them, with only the import lines changed to pserver's:
# `import keras` -> `import pserver.keras as keras`, `from keras import ops` -> `from pserver.keras
# import ops`. Checked against the two stored revisions of the guide's source (last modified
# 2020/04/13 and 2023/03/16, both TensorFlow 2): the classes, their arguments, units and
# initializers are the same line for line; the only differences are tf.matmul -> ops.matmul and
# tf.nn.relu -> keras.activations.relu, the Keras 3 port's backend-free calls. The guide trains neither on
# MNIST: the blocks marked "ours" (a subclassed keras.Model of those layers, in the shape of the
# guide's `ResNet(keras.Model)` sketch, and the smallest MNIST compile/fit/evaluate, with the
# guide's end-to-end example's optimizer, epochs and batch size) are not the guide's.
# bench/keras_io/compare.py runs it under `pserver run` and on Keras 3 (the imports swapped back);
# tests/e2e/test_keras_io.py runs it on a few hundred samples.
"""
Title: Making new layers and models via subclassing
Author: [fchollet](https://twitter.com/fchollet)
Description: Complete guide to writing `Layer` and `Model` objects from scratch.
"""

"""
## Setup
"""

import pserver.keras as keras
from pserver.keras import ops

# --- ours: the seed, a sample limit for quick checks, MNIST from its IDX files (_ours.py) -----
import time

from _ours import load_mnist, seed

seed(keras)
# --- end of ours --------------------------------------------------------------------------------

"""
## Best practice: deferring weight creation until the shape of the inputs is known
"""


class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1], self.units),
            initializer="random_normal",
            trainable=True,
        )
        self.b = self.add_weight(
            shape=(self.units,), initializer="random_normal", trainable=True
        )

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


"""
## Layers are recursively composable
"""


class MLPBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(32)
        self.linear_2 = Linear(32)
        self.linear_3 = Linear(1)

    def call(self, inputs):
        x = self.linear_1(inputs)
        x = keras.activations.relu(x)
        x = self.linear_2(x)
        x = keras.activations.relu(x)
        return self.linear_3(x)


# --- ours: a subclassed keras.Model of the guide's layers, trained with compile/fit on MNIST ----
# MLPBlock ends in one unit, so it feeds the classifier beside the hidden layer it reads.
class MNISTModel(keras.Model):
    def __init__(self, num_classes=10):
        super().__init__()
        self.block_1 = Linear(64)
        self.block_2 = MLPBlock()
        self.classifier = Linear(num_classes)

    def call(self, inputs):
        x = keras.activations.relu(self.block_1(inputs))
        return self.classifier(ops.concatenate([x, self.block_2(x)], axis=-1))


(x_train, y_train), (x_test, y_test) = load_mnist()
x_train = x_train.reshape(-1, 784).astype("float32") / 255
x_test = x_test.reshape(-1, 784).astype("float32") / 255

model = MNISTModel()
model.compile(
    optimizer=keras.optimizers.Adam(learning_rate=1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
start = time.perf_counter()
model.fit(x_train, y_train, epochs=2, batch_size=64, verbose=2)
fit_s = time.perf_counter() - start
print(f"Fit: {fit_s:.2f} s, {2 * len(x_train) / fit_s:.0f} samples/s")
score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])
# --- end of ours --------------------------------------------------------------------------------
