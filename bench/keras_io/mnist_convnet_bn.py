"""keras.io's "Simple MNIST convnet" (mnist_convnet) with a BatchNormalization after each
convolution and the three callbacks keras.io's examples train with, written here: Conv2D(32, 3,
relu), BatchNormalization, MaxPooling2D(2), Conv2D(64, 3, relu), BatchNormalization,
MaxPooling2D(2), Flatten, Dropout(0.5), Dense(10, softmax); categorical cross-entropy, Adam,
batch 128, validation_split=0.1, the example's 15 epochs; ModelCheckpoint (the best val_loss's
model, to a .keras file), EarlyStopping (val_loss, patience 3) and ReduceLROnPlateau (val_loss,
halved after 2 epochs without improvement, down to 1e-4). The final model's test accuracy on
MNIST's 10,000 test images is printed, as the example prints it.

$KERAS_IO_EPOCHS cuts the epochs and $KERAS_IO_SAMPLES the data (_ours.load_mnist) alike on both
sides, for the 2-core box. MNIST: $PSERVER_MNIST_DIR.
"""

import os
import tempfile
import time

import numpy as np
from _ours import SEED, load_mnist, seed

import pserver.keras as keras
from pserver.keras import layers

seed(keras)

num_classes, input_shape = 10, (28, 28, 1)
(x_train, y_train), (x_test, y_test) = load_mnist()
x_train = np.expand_dims(x_train.astype("float32") / 255, -1)
x_test = np.expand_dims(x_test.astype("float32") / 255, -1)
y_train = keras.utils.to_categorical(y_train, num_classes)
y_test = keras.utils.to_categorical(y_test, num_classes)
print(x_train.shape[0], "train samples,", x_test.shape[0], "test samples")

model = keras.Sequential(
    [
        keras.Input(shape=input_shape),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.BatchNormalization(),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.BatchNormalization(),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ]
)
model.summary()

epochs = int(os.environ.get("KERAS_IO_EPOCHS") or 15)
checkpoint = os.path.join(tempfile.gettempdir(), f"mnist_convnet_bn-{os.getpid()}-{SEED}.keras")
callbacks = [
    keras.callbacks.ModelCheckpoint(checkpoint, save_best_only=True, monitor="val_loss"),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, verbose=1),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2, min_lr=0.0001, verbose=1),
]
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
start = time.perf_counter()
history = model.fit(x_train, y_train, batch_size=128, epochs=epochs, validation_split=0.1,
                    callbacks=callbacks)
print(f"Fit: {time.perf_counter() - start:.2f} s")
print("Epochs run:", len(history.history["loss"]))
score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])
if os.path.exists(checkpoint):         # the chief's (pserver's other workers write none)
    os.remove(checkpoint)
