# keras.io's example "Text classification with Transformer",
# https://keras.io/examples/nlp/text_classification_with_transformer/ (keras-team/keras-io,
# examples/nlp/text_classification_with_transformer.py, by Apoorv Nandan; Apache License 2.0),
# verbatim, with only the import lines changed to pserver's (`import keras` -> `import
# pserver.keras as keras`, `from keras import ops` and `from keras import layers` -> `from
# pserver.keras import ops, layers`) and the dataset: IMDB cannot be downloaded here, so a
# shape-identical synthetic stand-in (_ours.synthetic_imdb: 25,000 + 25,000 reviews of word ids
# below vocab_size, a sentiment in cue words), each changed line marked "ours". The blocks
# marked "ours" at the end print the fit's time and the validation accuracy ("Test accuracy").
# bench/keras_io/compare.py runs it under `pserver run` and on Keras 3 (the imports swapped back).
"""
Title: Text classification with Transformer
Author: [Apoorv Nandan](https://twitter.com/NandanApoorv)
Description: Implement a Transformer block as a Keras layer and use it for text classification.
"""

"""
## Setup
"""

import pserver.keras as keras
from pserver.keras import ops, layers

# --- ours: the seed and the synthetic IMDB (_ours.py) -------------------------------------------
import time

from _ours import seed, synthetic_imdb

seed(keras)
# --- end of ours --------------------------------------------------------------------------------

"""
## Implement a Transformer block as a layer
"""


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


"""
## Implement embedding layer

Two seperate embedding layers, one for tokens, one for token index (positions).
"""


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


"""
## Download and prepare dataset
"""

vocab_size = 20000  # Only consider the top 20k words
maxlen = 200  # Only consider the first 200 words of each movie review
(x_train, y_train), (x_val, y_val) = synthetic_imdb(num_words=vocab_size)  # ours
print(len(x_train), "Training sequences")
print(len(x_val), "Validation sequences")
x_train = keras.utils.pad_sequences(x_train, maxlen=maxlen)
x_val = keras.utils.pad_sequences(x_val, maxlen=maxlen)

"""
## Create classifier model using transformer layer

Transformer layer outputs one vector for each time step of our input sequence.
Here, we take the mean across all time steps and
use a feed forward network on top of it to classify text.
"""


embed_dim = 32  # Embedding size for each token
num_heads = 2  # Number of attention heads
ff_dim = 32  # Hidden layer size in feed forward network inside transformer

inputs = layers.Input(shape=(maxlen,))
embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
x = embedding_layer(inputs)
transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
x = transformer_block(x)
x = layers.GlobalAveragePooling1D()(x)
x = layers.Dropout(0.1)(x)
x = layers.Dense(20, activation="relu")(x)
x = layers.Dropout(0.1)(x)
outputs = layers.Dense(2, activation="softmax")(x)

model = keras.Model(inputs=inputs, outputs=outputs)


"""
## Train and Evaluate
"""

model.compile(
    optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
)
start = time.perf_counter()  # ours
history = model.fit(
    x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val)
)

# --- ours: the fit's time and the validation accuracy (the example prints neither) -------------
fit_s = time.perf_counter() - start
print(f"Fit: {fit_s:.2f} s")
score = model.evaluate(x_val, y_val, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])
# --- end of ours --------------------------------------------------------------------------------
