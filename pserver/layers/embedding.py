"""Embedding(input_dim, output_dim): integer ids (n, length) -> rows of a dense table
(n, length, output_dim). The table is a dense tensor of the layout like any other."""

from __future__ import annotations

import numpy as np

from pserver.layers import initializers
from pserver.layers.base import Layer, Weight, positive_int


class Embedding(Layer):
    kind = "embedding"
    takes_ids = True     # its input is integer ids, not float features

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer="uniform",
                 input_length: int | None = None, **kwargs):
        if input_length is not None and "input_shape" not in kwargs:
            kwargs["input_shape"] = (input_length,)
        super().__init__(**kwargs)
        self.input_dim = positive_int("Embedding", "input_dim", input_dim)
        self.output_dim = positive_int("Embedding", "output_dim", output_dim)
        self.embeddings_initializer = initializers.get(embeddings_initializer,
                                                       "Embedding: embeddings_initializer")

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 1, "ids (length,)")
        return (input_shape[0], self.output_dim)

    def weights(self):
        return [Weight("embeddings", (self.input_dim, self.output_dim), self.embeddings_initializer)]

    def scratch(self, n, dtype):
        return {"ids": np.empty((n, *self.input_shape), np.int64)}

    def check_ids(self, x: np.ndarray) -> None:
        """Ids outside [0, input_dim) would read another row, or outside the table."""
        if x.size and (x.min() < 0 or x.max() >= self.input_dim or not np.all(x == np.floor(x))):
            bad = (x < 0) | (x >= self.input_dim) | (x != np.floor(x))
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{self.label}: id {x[first].item()!r} at {first} is not an integer in "
                            f"[0, input_dim={self.input_dim})")

    def forward(self, k, p, x, out, s, run):
        self.check_ids(x)
        np.copyto(s["ids"], x, casting="unsafe")
        k.embedding_forward(s["ids"], p["embeddings"], out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        k.embedding_backward(s["ids"], dout, g["embeddings"])
