"""Multi-layer perceptron: dense layers with ReLU between them, softmax cross-entropy.

The default, 784-256-256-10, is the MNIST network of the design (about 270k parameters).
"""

from __future__ import annotations

from pserver.models.base import DenseModel


class MLP(DenseModel):
    """in_features -> hidden[0] -> ... -> num_classes; tensors w0,b0,w1,b1,..."""

    def __init__(self, in_features: int, num_classes: int, *,
                 hidden: tuple[int, ...] = (256, 256), backend: str = "cpu"):
        super().__init__("mlp", (in_features, *hidden, num_classes), "classification", backend)
        self.hidden = tuple(hidden)
