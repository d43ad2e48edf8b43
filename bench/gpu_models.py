"""Models for `pserver launch --model bench/gpu_models.py:NAME --device cuda|cpu` in
bench/gpu_check.sh's end-to-end step (issue 52): graphs built with the Functional API, so the GPU
run goes through the model core's CUDA path (pserver.models.cuda.CudaModel) and not a model
whose layers were each written for the device.

toy_resnet is the architecture of keras.io's guide "The Functional API" (its section "A toy
ResNet model": two residual blocks joined by `layers.add`), as bench/keras_io/toy_resnet.py
builds it, with a sparse categorical cross-entropy on logits (labels as digits, which the
launch datasets give) in place of the guide's one-hot labels.
"""

import pserver.keras as keras
from pserver.keras import layers


def _conv(filters, padding="valid"):
    return layers.Conv2D(filters, 3, activation="relu", padding=padding)


def toy_resnet(input_shape=(28, 28, 1), num_classes=10):
    inputs = keras.Input(shape=tuple(input_shape), name="img")
    h = _conv(32)(inputs)
    h = _conv(64)(h)
    block_input = layers.MaxPooling2D(3)(h)
    for _ in range(2):
        h = _conv(64, "same")(block_input)
        h = _conv(64, "same")(h)
        block_input = layers.add([h, block_input])
    h = _conv(64)(block_input)
    h = layers.GlobalAveragePooling2D()(h)
    h = layers.Dense(256, activation="relu")(h)
    h = layers.Dropout(0.5)(h)
    model = keras.Model(inputs, layers.Dense(num_classes)(h), name="toy_resnet")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
