"""keras.layers: pserver's layers by Keras's names (pserver.layers), Input, and Layer, the class
a user's layer subclasses (build with add_weight, call with pserver.keras.ops: traced)."""

from pserver.keras._names import missing as _missing
from pserver.keras.models import Input
from pserver.layers import (
    FM,
    Activation,
    Add,
    Average,
    AveragePooling2D,
    BatchNormalization,
    Concatenate,
    Conv1D,
    Conv2D,
    Conv2DTranspose,
    Cropping1D,
    Cropping2D,
    Dense,
    DepthwiseConv2D,
    Dot,
    Dropout,
    Embedding,
    Flatten,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    GroupNormalization,
    LayerNormalization,
    Maximum,
    MaxPooling2D,
    Minimum,
    MultiHeadAttention,
    Multiply,
    Permute,
    RepeatVector,
    Rescaling,
    Reshape,
    SeparableConv2D,
    Subtract,
    UpSampling1D,
    UpSampling2D,
    ZeroPadding1D,
    ZeroPadding2D,
    add,
    average,
    concatenate,
    dot,
    maximum,
    minimum,
    multiply,
    subtract,
)
from pserver.layers.traced import Lambda
from pserver.layers.traced import TracedLayer as Layer

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Input", "Layer", "Dense", "Conv2D", "MaxPooling2D", "AveragePooling2D", "Flatten", "Dropout",
           "Embedding", "FM", "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate",
           "Dot", "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalMaxPooling1D",
           "GlobalMaxPooling2D", "Activation", "Reshape", "Permute", "RepeatVector", "Lambda",
           "Conv1D", "Conv2DTranspose", "DepthwiseConv2D", "ZeroPadding1D", "ZeroPadding2D", "Cropping1D",
           "Cropping2D", "UpSampling1D", "UpSampling2D",
           "LayerNormalization", "BatchNormalization", "Rescaling",
           "add", "subtract", "multiply", "average", "maximum", "minimum", "concatenate", "dot",
           "MultiHeadAttention", "GroupNormalization", "SeparableConv2D"]
