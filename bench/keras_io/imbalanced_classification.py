"""keras.io's "Imbalanced classification: credit card fraud detection"
(imbalanced_classification), its preparation, model and training written here: the last 20% of
the transactions to validate, each feature standardized with the training rows' mean and
standard deviation; Dense(256, relu) x 3 with Dropout(0.3) after the second and third, a
sigmoid Dense(1); binary cross-entropy, Adam 1e-2, batch 2048, 30 epochs, class weights
1 / (count of the class) and the metrics FalseNegatives, FalsePositives, TrueNegatives,
TruePositives, Precision and Recall; ModelCheckpoint at each epoch's end.

creditcard.csv cannot be downloaded here: _ours.synthetic_creditcard (the same shapes: 284,807
transactions of 30 features, 492 frauds; how it is made is in its docstring) takes its place.
The example prints no single result; here the validation set's accuracy ((TP + TN) / all, from
the compiled counts) is printed as "Test accuracy", with its precision, recall and counts.
$KERAS_IO_EPOCHS cuts the epochs alike on both sides. The checkpoints go to a temporary
directory, removed after.
"""

import os
import shutil
import tempfile
import time

import numpy as np
from _ours import seed, synthetic_creditcard

import pserver.keras as keras

seed(keras)

features, targets = synthetic_creditcard()
print("features.shape:", features.shape)
print("targets.shape:", targets.shape)

num_val_samples = int(len(features) * 0.2)
train_features, train_targets = features[:-num_val_samples], targets[:-num_val_samples]
val_features, val_targets = features[-num_val_samples:], targets[-num_val_samples:]
print("Number of training samples:", len(train_features))
print("Number of validation samples:", len(val_features))

counts = np.bincount(train_targets[:, 0])
print("Number of positive samples in training data: {} ({:.2f}% of total)".format(
    counts[1], 100 * float(counts[1]) / len(train_targets)))
weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]

mean = np.mean(train_features, axis=0)
train_features -= mean
val_features -= mean
std = np.std(train_features, axis=0)
train_features /= std
val_features /= std

model = keras.Sequential(
    [
        keras.Input(shape=train_features.shape[1:]),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
)
model.summary()

metrics = [
    keras.metrics.FalseNegatives(name="fn"),
    keras.metrics.FalsePositives(name="fp"),
    keras.metrics.TrueNegatives(name="tn"),
    keras.metrics.TruePositives(name="tp"),
    keras.metrics.Precision(name="precision"),
    keras.metrics.Recall(name="recall"),
]
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)

checkpoints = tempfile.mkdtemp(prefix="fraud-")
callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "fraud_model_at_epoch_{epoch}.keras"))]
class_weight = {0: weight_for_0, 1: weight_for_1}

start = time.perf_counter()
model.fit(
    train_features,
    train_targets,
    batch_size=2048,
    epochs=int(os.environ.get("KERAS_IO_EPOCHS") or 30),
    verbose=2,
    callbacks=callbacks,
    validation_data=(val_features, val_targets),
    class_weight=class_weight,
)
print(f"Fit: {time.perf_counter() - start:.2f} s")
shutil.rmtree(checkpoints, ignore_errors=True)

got = model.evaluate(val_features, val_targets, verbose=0, return_dict=True)
print(f"Validation: {got['tp']:.0f} frauds found, {got['fn']:.0f} missed, {got['fp']:.0f} legitimate flagged "
      f"(of {len(val_targets)})")
print("Test precision:", got["precision"])
print("Test recall:", got["recall"])
print("Test accuracy:", (got["tp"] + got["tn"]) / (got["tp"] + got["tn"] + got["fp"] + got["fn"]))
