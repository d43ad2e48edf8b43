"""A one-block Transformer text classifier, the model and training of keras.io's example "Text
classification with Transformer", written here: token and position embeddings added, one block
(2-head self-attention and a 32-unit feed-forward network, each with dropout 0.1, a residual
connection and a layer normalization), the mean over the 200 positions, a 20-unit relu layer and a
softmax over 2 classes; Adam, batch 32, 2 epochs. IMDB cannot be downloaded here: its
shape-identical synthetic stand-in (_ours.synthetic_imdb: 25,000 + 25,000 reviews of word ids
below 20,000, a sentiment in cue words) takes its place. The validation accuracy is printed as
"Test accuracy".

compare.py runs it under `pserver run` and on Keras 3 (its two import lines swapped).
"""

import time

import pserver.keras as keras
from pserver.keras import ops, layers

from _ours import seed, synthetic_imdb

seed(keras)

VOCABULARY, LENGTH = 20000, 200          # the 20,000 most frequent words; a review's first 200
WIDTH, HEADS, HIDDEN = 32, 2, 32          # embedding, attention heads, feed-forward units


class TransformerBlock(layers.Layer):
    """Self-attention then a feed-forward network, each added to its input and normalized."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attended = self.layernorm1(inputs + self.dropout1(self.att(inputs, inputs)))
        return self.layernorm2(attended + self.dropout2(self.ffn(attended)))


class TokenAndPositionEmbedding(layers.Layer):
    """Each id's embedding plus its position's."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


(x_train, y_train), (x_val, y_val) = synthetic_imdb(num_words=VOCABULARY)
print(f"{len(x_train)} training and {len(x_val)} validation reviews")
x_train = keras.utils.pad_sequences(x_train, maxlen=LENGTH)
x_val = keras.utils.pad_sequences(x_val, maxlen=LENGTH)

inputs = layers.Input(shape=(LENGTH,))
h = TokenAndPositionEmbedding(LENGTH, VOCABULARY, WIDTH)(inputs)
h = TransformerBlock(WIDTH, HEADS, HIDDEN)(h)
h = layers.GlobalAveragePooling1D()(h)
h = layers.Dropout(0.1)(h)
h = layers.Dense(20, activation="relu")(h)
h = layers.Dropout(0.1)(h)
model = keras.Model(inputs=inputs, outputs=layers.Dense(2, activation="softmax")(h))

model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
start = time.perf_counter()
model.fit(x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val))
print(f"Fit: {time.perf_counter() - start:.2f} s")
val_loss, val_accuracy = model.evaluate(x_val, y_val, verbose=0)
print("Test loss:", val_loss)
print("Test accuracy:", val_accuracy)
