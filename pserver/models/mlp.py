"""Multi-layer perceptron: Dense + ReLU layers, then a linear Dense to the logits.

The default, 784-256-256-10, is the MNIST network of the design (about 270k parameters). Its
kernels start He-normal into the ReLUs (std sqrt(2/fan_in) keeps the activations' scale) and
LeCun-normal into the logits (so the first loss is near log(k)), untruncated.
"""

from __future__ import annotations

from pserver.layers import Dense, VarianceScaling
from pserver.models.sequential import Sequential


def he():
    return VarianceScaling(2.0, "fan_in", "untruncated_normal")


def lecun():
    return VarianceScaling(1.0, "fan_in", "untruncated_normal")


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (256, 256)) -> Sequential:
    layers = [Dense(h, activation="relu", kernel_initializer=he()) for h in hidden]
    layers.append(Dense(num_classes, kernel_initializer=lecun()))
    return Sequential(layers, input_shape=input_shape, name="mlp")
