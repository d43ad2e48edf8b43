"""A small MNIST convnet in the Keras API, the model of keras.io's "Simple MNIST convnet" example
(two 3x3 convolutions with max pooling, dropout 0.5, a softmax over the 10 digits; Adam, batch 128,
15 epochs, the last tenth of the training set held out), written here for pserver.keras.

Run it plainly (one worker, a shard in this process), or on a cluster:

    pserver run --ps 2 --workers 4 -- python bench/keras_mnist_convnet.py

A Keras script needs only its imports changed to run so: this one's are pserver's. MNIST is read
from $PSERVER_MNIST_DIR, else the cache (downloaded there once). bench/keras_convnet.py runs this
file for several seeds; tests/e2e/test_keras.py for 2 epochs (its `epochs = 15` line changed).
"""

import numpy as np

import pserver.keras as keras
from pserver.keras import layers

CLASSES = 10

(train_images, train_digits), (test_images, test_digits) = keras.datasets.mnist.load_data()


def prepared(images):
    """uint8 images (n, 28, 28) as float32 in [0, 1] with a channel axis: (n, 28, 28, 1)."""
    return (images.astype("float32") / 255)[..., np.newaxis]


x_train, x_test = prepared(train_images), prepared(test_images)
y_train = keras.utils.to_categorical(train_digits, CLASSES)
y_test = keras.utils.to_categorical(test_digits, CLASSES)
print(f"{len(x_train)} training images of {x_train.shape[1:]}, {len(x_test)} test images")

model = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Flatten(),
    layers.Dropout(0.5),
    layers.Dense(CLASSES, activation="softmax"),
])
model.summary()

epochs = 15
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=128, epochs=epochs, validation_split=0.1)

test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", test_loss)
print("Test accuracy:", test_accuracy)
