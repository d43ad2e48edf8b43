"""Keras 3's outputs under masks, for tests/test_masking.py's KERAS table: Embedding(10, d,
mask_zero=True) on fixed ids, then the layer named, with the i-th weight 0.5 sin(0.7 j + i) over
its elements j in Keras's weight order. Prints one JSON object, name -> output rounded to 6 places.

    bench/tf_baseline/.venv/bin/python bench/tf_baseline/keras_masks.py
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

L = keras.layers
IDS = np.array([[1, 2, 3, 0, 0], [0, 0, 4, 5, 6], [7, 0, 8, 0, 9]])


def attention(e):
    """Self-attention on the masked sequence, added back and averaged over the kept steps."""
    return L.GlobalAveragePooling1D()(L.Add()([e, L.MultiHeadAttention(num_heads=2, key_dim=2)(e, e)]))


CASES = {
    "lstm": (3, lambda e: L.LSTM(2, return_sequences=True)(e)),
    "gru_back": (3, lambda e: L.GRU(2, return_sequences=True, go_backwards=True)(e)),
    "rnn_last": (3, lambda e: L.SimpleRNN(2)(e)),
    "bi_lstm_seq": (3, lambda e: L.Bidirectional(L.LSTM(2, return_sequences=True))(e)),
    "gap": (3, lambda e: L.GlobalAveragePooling1D()(e)),
    "attention": (4, attention),
}


def main():
    out = {}
    for name, (dim, head) in CASES.items():
        inp = keras.Input((5,), dtype="int32")
        model = keras.Model(inp, head(L.Embedding(10, dim, mask_zero=True)(inp)))
        model.set_weights([(0.5 * np.sin(np.arange(w.size) * 0.7 + i)).reshape(w.shape).astype(np.float32)
                           for i, w in enumerate(model.get_weights())])
        out[name] = np.round(model.predict(IDS, verbose=0), 6).tolist()
    print(json.dumps({"keras": keras.__version__, **out}))


if __name__ == "__main__":
    main()
