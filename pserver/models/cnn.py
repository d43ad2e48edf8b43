"""The reference CNN: the Keras model of TensorFlow's parameter-server training tutorial.

    tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation='relu'),
        tf.keras.layers.Dense(10)])
    loss SparseCategoricalCrossentropy(from_logits=True)

Keras's defaults throughout: glorot_uniform kernels, zero biases, 'valid' padding.
"""

from __future__ import annotations

from pserver.layers import Conv2D, Dense, Flatten, MaxPooling2D
from pserver.models.sequential import Sequential


def cnn(input_shape: tuple[int, ...] = (28, 28, 1), num_classes: int = 10) -> Sequential:
    return Sequential([
        Conv2D(32, 3, activation="relu", input_shape=input_shape),
        MaxPooling2D(),
        Flatten(),
        Dense(64, activation="relu"),
        Dense(num_classes)], name="cnn")
