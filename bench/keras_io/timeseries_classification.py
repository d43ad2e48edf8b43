"""keras.io's "Timeseries classification from scratch" (timeseries_classification_from_scratch),
its model and training written here: a fully convolutional network of three Conv1D(64, 3, same),
each followed by BatchNormalization and ReLU, GlobalAveragePooling1D and a softmax Dense(2);
sparse categorical cross-entropy, Adam, batch 32, validation_split=0.2 of the shuffled training
set; ModelCheckpoint (save_best_only on val_loss), ReduceLROnPlateau (val_loss, factor 0.5,
patience 20, min_lr 1e-4) and EarlyStopping (val_loss, patience 50); then the best checkpoint
is loaded and its accuracy on the test set printed, as the example does.

What differs from the example: FordA cannot be downloaded here, so _ours.synthetic_forda (the
same shapes: 3,601 + 1,320 z-normalized series of 500 steps, labels -1/1; how it is made is
in its docstring) takes its place; the checkpoint is a .keras file, not .h5 (the Keras side's
venv has no h5py); the plots are left out; the accuracy is computed with NumPy rather than
scikit-learn's accuracy_score (the same number). The example's 500 epochs are cut alike on both
sides for the 2-core box: EPOCHS below ($KERAS_IO_EPOCHS).
"""

import os
import tempfile
import time

import numpy as np
from _ours import SEED, seed, synthetic_forda

import pserver.keras as keras

seed(keras)

(x_train, y_train), (x_test, y_test) = synthetic_forda()
x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))
num_classes = len(np.unique(y_train))
idx = np.random.permutation(len(x_train))
x_train, y_train = x_train[idx], y_train[idx]
y_train[y_train == -1] = 0
y_test[y_test == -1] = 0


def make_model(input_shape):
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)
    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
    return keras.models.Model(inputs=input_layer, outputs=output_layer)


model = make_model(input_shape=x_train.shape[1:])

epochs = int(os.environ.get("KERAS_IO_EPOCHS") or 500)
batch_size = 32
best = os.path.join(tempfile.gettempdir(), f"forda_best_model-{SEED}.keras")
if os.path.exists(best):
    os.remove(best)
callbacks = [
    keras.callbacks.ModelCheckpoint(best, save_best_only=True, monitor="val_loss"),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
]
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
start = time.perf_counter()
history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                    validation_split=0.2, verbose=1)
print(f"Fit: {time.perf_counter() - start:.2f} s")

model = keras.models.load_model(best)
y_pred = model.predict(x_test).argmax(axis=1)
print("Test accuracy:", float(np.mean(y_pred == y_test)))
