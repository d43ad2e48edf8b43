"""FM(): the second-order term of a factorization machine (Rendle, 2010) over the fields' embeddings.

Input (fields, k), one k-dim embedding per field; output (1,), the sum over field pairs of
their dot products, <v_f, v_g> for f < g. It has no weights: the factors are the embeddings.
"""

from __future__ import annotations

from pserver.layers.base import Layer


class FM(Layer):
    kind = "fm"

    def output_shape_for(self, input_shape):
        self.expect_rank(input_shape, 2, "embeddings (fields, k)")
        return (1,)

    def forward(self, k, p, x, out, s, run):
        k.fm_forward(x, out)

    def backward(self, k, p, g, x, out, dout, dx, s):
        if dx is not None:
            k.fm_backward(x, dout, dx)
