"""keras.io's "Convolutional Autoencoder For Image Denoising" (autoencoder), its model and training
written here: MNIST scaled to [0, 1], a noisy copy (Gaussian noise of 0.4, clipped to [0, 1]);
an encoder of two Conv2D(32, 3, relu, same) each with MaxPooling2D(2, same), a decoder of two
Conv2D(32, 3, relu, same) each with UpSampling2D(2) and a Conv2D(1, 3, sigmoid, same); Adam and
binary cross-entropy, batch 128, shuffled; fitted first to reproduce the clean images (the
example: 50 epochs), then to denoise the noisy ones (100 epochs), the test set as validation data.
The example's plots are left out. The validation loss of the denoising fit (noisy test images
against clean ones) is printed as "Test loss".

The example's 50 + 100 epochs over 60,000 images are cut alike on both sides for the 2-core box:
EPOCHS below ($KERAS_IO_EPOCHS) for each of the two fits, and $KERAS_IO_SAMPLES (_ours.load_mnist)
for the images. MNIST: $PSERVER_MNIST_DIR.
"""

import os
import time

import numpy as np
from _ours import load_mnist, seed

import pserver.keras as keras
from pserver.keras.layers import Conv2D, Input, MaxPooling2D, UpSampling2D
from pserver.keras.models import Model

seed(keras)

EPOCHS = int(os.environ.get("KERAS_IO_EPOCHS") or 0)       # 0: the example's 50 and 100


def preprocess(dataset):
    return np.reshape(dataset.astype("float32") / 255.0, (len(dataset), 28, 28, 1))


def noise(dataset):
    noisy = dataset + 0.4 * np.random.normal(loc=0.0, scale=1.0, size=dataset.shape)
    return np.clip(noisy, 0.0, 1.0)


(train_dataset, _), (test_dataset, _) = load_mnist()
train_dataset, test_dataset = preprocess(train_dataset), preprocess(test_dataset)
noisy_train_dataset, noisy_test_dataset = noise(train_dataset), noise(test_dataset)

image = Input(shape=(28, 28, 1))
x = Conv2D(32, (3, 3), activation="relu", padding="same")(image)
x = MaxPooling2D((2, 2), padding="same")(x)
x = Conv2D(32, (3, 3), activation="relu", padding="same")(x)
x = MaxPooling2D((2, 2), padding="same")(x)
x = Conv2D(32, (3, 3), activation="relu", padding="same")(x)
x = UpSampling2D((2, 2))(x)
x = Conv2D(32, (3, 3), activation="relu", padding="same")(x)
x = UpSampling2D((2, 2))(x)
x = Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)

autoencoder = Model(image, x)
autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
autoencoder.summary()

start = time.perf_counter()
autoencoder.fit(x=train_dataset, y=train_dataset, epochs=EPOCHS or 50, batch_size=128, shuffle=True,
                validation_data=(test_dataset, test_dataset))
predictions = autoencoder.predict(test_dataset)
autoencoder.fit(x=noisy_train_dataset, y=train_dataset, epochs=EPOCHS or 100, batch_size=128, shuffle=True,
                validation_data=(noisy_test_dataset, test_dataset))
print(f"Fit: {time.perf_counter() - start:.2f} s")
predictions = autoencoder.predict(noisy_test_dataset)
print("Test loss:", autoencoder.evaluate(noisy_test_dataset, test_dataset, verbose=0))
