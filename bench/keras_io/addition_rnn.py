"""keras.io's "Sequence to sequence learning for performing number addition" (addition_rnn), its
data, model and training written here: questions "a+b" of up to 3-digit numbers, reversed and
padded to 7 characters, one-hot over "0123456789+ "; answers padded to 4; an LSTM(128) encoder,
RepeatVector(4), an LSTM(128, return_sequences=True) decoder and a softmax Dense(12) on every
step; categorical cross-entropy, Adam, batch 32, one `fit` of one epoch per iteration, each
followed by the example's 10 predictions. The data is generated as the example does (NumPy's
global generator, seeded by set_random_seed), 90% to train and 10% to validate.

The example's 50,000 questions and 29 iterations are cut alike on both sides for the 2-core box:
TRAINING_SIZE and ITERATIONS below ($KERAS_IO_SAMPLES and $KERAS_IO_EPOCHS override them). The
validation accuracy (per character, Keras's "accuracy") is printed as "Test accuracy".
"""

import os
import time

import numpy as np
from _ours import seed

import pserver.keras as keras
from pserver.keras import layers

seed(keras)

TRAINING_SIZE = int(os.environ.get("KERAS_IO_SAMPLES") or 50000)
ITERATIONS = int(os.environ.get("KERAS_IO_EPOCHS") or 29)     # the example: range(1, 30)
DIGITS = 3
REVERSE = True
MAXLEN = DIGITS + 1 + DIGITS


class CharacterTable:
    """Characters to one-hot rows and back."""

    def __init__(self, chars):
        self.chars = sorted(set(chars))
        self.char_indices = {c: i for i, c in enumerate(self.chars)}
        self.indices_char = dict(enumerate(self.chars))

    def encode(self, text, num_rows):
        x = np.zeros((num_rows, len(self.chars)))
        for i, c in enumerate(text):
            x[i, self.char_indices[c]] = 1
        return x

    def decode(self, x, calc_argmax=True):
        if calc_argmax:
            x = x.argmax(axis=-1)
        return "".join(self.indices_char[i] for i in x)


chars = "0123456789+ "
ctable = CharacterTable(chars)


def number():
    return int("".join(np.random.choice(list("0123456789")) for _ in range(np.random.randint(1, DIGITS + 1))))


questions, expected, seen = [], [], set()
while len(questions) < TRAINING_SIZE:
    a, b = number(), number()
    key = tuple(sorted((a, b)))          # each pair once, a+b and b+a alike
    if key in seen:
        continue
    seen.add(key)
    q = f"{a}+{b}"
    query = q + " " * (MAXLEN - len(q))
    answer = str(a + b)
    answer += " " * (DIGITS + 1 - len(answer))
    questions.append(query[::-1] if REVERSE else query)
    expected.append(answer)
print("Total questions:", len(questions))

x = np.zeros((len(questions), MAXLEN, len(chars)), dtype=bool)
y = np.zeros((len(questions), DIGITS + 1, len(chars)), dtype=bool)
for i, sentence in enumerate(questions):
    x[i] = ctable.encode(sentence, MAXLEN)
for i, sentence in enumerate(expected):
    y[i] = ctable.encode(sentence, DIGITS + 1)
indices = np.arange(len(y))
np.random.shuffle(indices)
x, y = x[indices], y[indices]
split_at = len(x) - len(x) // 10
(x_train, x_val), (y_train, y_val) = (x[:split_at], x[split_at:]), (y[:split_at], y[split_at:])
print("Training Data:", x_train.shape, y_train.shape)
print("Validation Data:", x_val.shape, y_val.shape)

model = keras.Sequential()
model.add(layers.LSTM(128, input_shape=(MAXLEN, len(chars))))
model.add(layers.RepeatVector(DIGITS + 1))
model.add(layers.LSTM(128, return_sequences=True))
model.add(layers.Dense(len(chars), activation="softmax"))
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.summary()

start = time.perf_counter()
for iteration in range(1, ITERATIONS + 1):
    print("\nIteration", iteration)
    model.fit(x_train, y_train, batch_size=32, epochs=1, validation_data=(x_val, y_val))
    for _ in range(10):                   # the example's look at 10 validation questions
        ind = np.random.randint(0, len(x_val))
        rowx, rowy = x_val[np.array([ind])], y_val[np.array([ind])]
        preds = np.argmax(model.predict(rowx, verbose=0), axis=-1)
        q, correct = ctable.decode(rowx[0]), ctable.decode(rowy[0])
        guess = ctable.decode(preds[0], calc_argmax=False)
        print("Q", q[::-1] if REVERSE else q, "T", correct, ("☑ " if correct == guess else "☒ ") + guess)
print(f"Fit: {time.perf_counter() - start:.2f} s")
val_loss, val_accuracy = model.evaluate(x_val, y_val, verbose=0)
print("Test loss:", val_loss)
print("Test accuracy:", val_accuracy)
