"""Layers with Keras's names, arguments and defaults (channels-last images, glorot_uniform
kernels, zero biases). Each kind is one module; `Sequential` (pserver.models) stacks them.

    Dense(units, activation=None, use_bias=True)
    Conv2D(filters, kernel_size, strides=1, padding='valid', activation=None)
    Conv1D(filters, kernel_size, strides=1, padding='valid' (or 'same', 'causal'), activation=None)
    Conv2DTranspose(filters, kernel_size, strides=1, padding='valid', activation=None)
    DepthwiseConv2D(kernel_size, strides=1, padding='valid', depth_multiplier=1, activation=None)
    SeparableConv2D(filters, kernel_size, strides=1, padding='valid', depth_multiplier=1, activation=None)
    MultiHeadAttention(num_heads, key_dim, value_dim=None, use_bias=True, output_shape=None):
              mha(query, value, key=None, attention_mask=None, use_causal_mask=False)
    ZeroPadding1D/2D(padding), Cropping1D/2D(cropping), UpSampling1D/2D(size)
    MaxPooling2D(pool_size=2, strides=None, padding='valid'), AveragePooling2D(...)
    Flatten(), Dropout(rate), Embedding(input_dim, output_dim)
    LayerNormalization(axis=-1, epsilon=1e-3, center=True, scale=True)
    GroupNormalization(groups=32, axis=-1, epsilon=1e-3, center=True, scale=True)
    BatchNormalization(axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True): its moving
              statistics live on the shards (docs/semantics.md)
    Rescaling(scale, offset=0.0)
    SimpleRNN(units), LSTM(units), GRU(units) (return_sequences, return_state, go_backwards),
              Bidirectional(layer, merge_mode='concat'): Keras's weights, fused kernels
    Normalization(axis=-1, mean=None, variance=None, invert=False), adapt(data)
    Resizing(height, width, interpolation='bilinear'), CenterCrop(height, width)
    RandomFlip, RandomRotation, RandomZoom, RandomTranslation, RandomContrast: augmentation in
              training only, seeded per worker and step (docs/semantics.md)
    Embedding(None, output_dim, sparse=True, optimizer='adagrad', lr=0.05, min_count=0,
              max_rows=0, ttl_steps=0, row_dtype='float32', state_dtype='float32'): a table of
              unbounded ids on the shards (row_dtype float16 or bfloat16: compact rows)
    FM(): a factorization machine's pairwise term over (fields, k) embeddings
    FeatureCross(projection_dim=None, diag_scale=0.0, ...), DotInteraction(self_interaction=False,
              skip_gather=False): Keras-RS's DCN-v2 and DLRM interaction layers
    DINAttention(hidden_units=(80, 40), activation='sigmoid', normalize=None, mask_zero=False,
              padding_id=None): DIN's target attention, din([query, keys, ids])
    Add(), Subtract(), Multiply(), Average(), Maximum(), Minimum(), Concatenate(axis=-1),
    Dot(axes), and add([a, b]), concatenate([a, b]), ...: merge layers, called on a list
    GlobalAveragePooling1D/2D(), GlobalMaxPooling1D/2D(), Activation(name), ReLU(), Reshape(shape),
    Permute(dims), RepeatVector(n)

Called on keras.Input(...) tensors, layers build a graph (pserver.models.Functional). A user's
layer subclasses pserver.layers.traced.TracedLayer (pserver.keras.layers.Layer); Lambda(function)
(pserver.layers.traced) is a function of ops as a layer (a model file names its function, or holds
a lambda's code: pserver.layers.saving).

Activations: None (linear), 'relu', 'sigmoid', 'tanh'. Any layer takes `input_shape=` (without
the batch dimension) and `name=`.
"""

from pserver.errors import ConfigError
from pserver.layers.activation import Activation, ReLU
from pserver.layers.attention import MultiHeadAttention
from pserver.layers.augmentation import (
    RandomContrast,
    RandomFlip,
    RandomRotation,
    RandomTranslation,
    RandomZoom,
)
from pserver.layers.base import Layer, Pass, Weight
from pserver.layers.conv import Conv1D, Conv2D, Conv2DTranspose, DepthwiseConv2D, SeparableConv2D
from pserver.layers.dense import Dense
from pserver.layers.dropout import Dropout
from pserver.layers.embedding import Embedding
from pserver.layers.fm import FM
from pserver.layers.image import CenterCrop, Resizing
from pserver.layers.initializers import Initializer, RandomUniform, VarianceScaling, Zeros
from pserver.layers.interaction import DotInteraction, FeatureCross
from pserver.layers.masking import Masking
from pserver.layers.merge import (
    Add,
    Average,
    Concatenate,
    Dot,
    Maximum,
    Minimum,
    Multiply,
    Subtract,
    add,
    average,
    concatenate,
    dot,
    maximum,
    minimum,
    multiply,
    subtract,
)
from pserver.layers.normalization import BatchNormalization, GroupNormalization, LayerNormalization
from pserver.layers.pooling import (
    AveragePooling2D,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    MaxPooling2D,
)
from pserver.layers.preprocessing import Normalization, Rescaling
from pserver.layers.recurrent import GRU, LSTM, Bidirectional, SimpleRNN
from pserver.layers.reshape import Flatten, Permute, RepeatVector, Reshape
from pserver.layers.saving import custom_object, is_json
from pserver.layers.sequence import DINAttention
from pserver.layers.spatial import (
    Cropping1D,
    Cropping2D,
    UpSampling1D,
    UpSampling2D,
    ZeroPadding1D,
    ZeroPadding2D,
)
from pserver.layers.text import IntegerLookup, StringLookup, TextVectorization
from pserver.layers.traced import Lambda
from pserver.registry import Registry

# The layers by their Keras class names, for the docs' table (a model names the classes).
LAYERS = Registry("layer", "layer")
LAYERS.add("Dense", "units outputs from all inputs: x @ kernel + bias, then the activation", Dense)
LAYERS.add("Conv2D", "2-D convolution over channels-last images (strides, 'valid' or 'same' padding)", Conv2D)
LAYERS.add("Conv1D", "1-D convolution over (steps, channels) sequences ('valid', 'same' or 'causal' "
           "padding)", Conv1D)
LAYERS.add("Conv2DTranspose", "the transpose of a Conv2D (its input gradient): up-sampling by strides, "
           "learned", Conv2DTranspose)
LAYERS.add("DepthwiseConv2D", "each channel convolved with its own depth_multiplier kernels", DepthwiseConv2D)
LAYERS.add("ZeroPadding1D", "zeros before and after a sequence's steps", ZeroPadding1D)
LAYERS.add("ZeroPadding2D", "rows and columns of zeros around an image", ZeroPadding2D)
LAYERS.add("Cropping1D", "steps cut from a sequence's start and end", Cropping1D)
LAYERS.add("Cropping2D", "rows and columns cut from an image's edges", Cropping2D)
LAYERS.add("UpSampling1D", "each step repeated size times", UpSampling1D)
LAYERS.add("UpSampling2D", "each pixel repeated size times down and across ('nearest')", UpSampling2D)
LAYERS.add("MaxPooling2D", "the largest value of each pool_size window", MaxPooling2D)
LAYERS.add("AveragePooling2D", "the mean of each pool_size window", AveragePooling2D)
LAYERS.add("Flatten", "a sample's values as one vector", Flatten)
LAYERS.add("Dropout", "in training, zeroes each value with probability rate, scales the rest by "
           "1/(1-rate)", Dropout)
LAYERS.add("Embedding", "a row per id: a dense table, or with sparse=True a table of unbounded ids on the "
           "shards", Embedding)
LAYERS.add("FM", "a factorization machine's pairwise term over (fields, k) embeddings", FM)
LAYERS.add("Add", "the sum of its inputs (one shape)", Add)
LAYERS.add("Subtract", "its first input minus its second", Subtract)
LAYERS.add("Multiply", "the element-wise product of its inputs", Multiply)
LAYERS.add("Average", "the element-wise mean of its inputs", Average)
LAYERS.add("Maximum", "the element-wise maximum of its inputs", Maximum)
LAYERS.add("Minimum", "the element-wise minimum of its inputs", Minimum)
LAYERS.add("Concatenate", "its inputs side by side along axis (default -1)", Concatenate)
LAYERS.add("Dot", "the batched dot product of two inputs along axes", Dot)
LAYERS.add("GlobalAveragePooling1D", "the mean over a sequence's steps, per channel", GlobalAveragePooling1D)
LAYERS.add("GlobalAveragePooling2D", "the mean over an image's positions, per channel",
           GlobalAveragePooling2D)
LAYERS.add("GlobalMaxPooling1D", "the largest value over a sequence's steps, per channel",
           GlobalMaxPooling1D)
LAYERS.add("GlobalMaxPooling2D", "the largest value over an image's positions, per channel",
           GlobalMaxPooling2D)
LAYERS.add("Activation", "an activation by name (relu, sigmoid, tanh; softmax on the output)", Activation)
LAYERS.add("ReLU", "max(x, 0), Keras's ReLU layer at its defaults", ReLU)
LAYERS.add("Reshape", "each sample to target_shape (a view)", Reshape)
LAYERS.add("Permute", "a sample's axes reordered (dims from 1)", Permute)
LAYERS.add("RepeatVector", "a vector repeated n times: (features,) to (n, features)", RepeatVector)
LAYERS.add("LayerNormalization", "each sample standardized over axis, then gamma * x + beta",
           LayerNormalization)
LAYERS.add("BatchNormalization", "standardized per channel with the batch's moments in training, the moving "
           "ones (a table on the shards) at inference; then gamma * x + beta", BatchNormalization)
LAYERS.add("Rescaling", "x * scale + offset", Rescaling)
LAYERS.add("SimpleRNN", "a recurrent layer: h = activation(x_t @ kernel + h' @ recurrent_kernel + bias)",
           SimpleRNN)
LAYERS.add("LSTM", "a long short-term memory layer (gates i, f, c, o), Keras's weights", LSTM)
LAYERS.add("GRU", "a gated recurrent unit layer (gates z, r, h; reset_after=True), Keras's weights", GRU)
LAYERS.add("Bidirectional", "a recurrent layer and its go_backwards copy, outputs merged", Bidirectional)
LAYERS.add("Normalization", "(x - mean) / sqrt(variance) per index of axis, the statistics given or learned "
           "by adapt(data)", Normalization)
LAYERS.add("Resizing", "each image resized to (height, width), bilinear or nearest", Resizing)
LAYERS.add("CenterCrop", "each image's centred (height, width) window", CenterCrop)
LAYERS.add("RandomFlip", "in training, each image flipped with probability 1/2", RandomFlip)
LAYERS.add("RandomRotation", "in training, each image rotated by a random angle", RandomRotation)
LAYERS.add("RandomZoom", "in training, each image zoomed in or out by a random factor", RandomZoom)
LAYERS.add("RandomTranslation", "in training, each image shifted by a random fraction of its size",
           RandomTranslation)
LAYERS.add("RandomContrast", "in training, each image's contrast scaled by a random factor", RandomContrast)
LAYERS.add("Masking", "a sequence's steps whose features all equal mask_value: zeros, and masked for "
           "the recurrent layers, attention and GlobalAveragePooling1D after it", Masking)
LAYERS.add("Lambda", "function(inputs) written with keras.ops, as a layer; a lambda loads with "
           "safe_mode=False only", Lambda)
LAYERS.add("StringLookup", "strings to vocabulary indices (or one_hot, multi_hot, count, tf_idf); runs on "
           "the data before the model", StringLookup)
LAYERS.add("IntegerLookup", "integers to vocabulary indices (or their encodings); runs on the data before "
           "the model", IntegerLookup)
LAYERS.add("TextVectorization", "strings standardized, split into tokens and looked up; runs on the data "
           "before the model", TextVectorization)
LAYERS.add("MultiHeadAttention", "softmax(q k^T / sqrt(key_dim)) v per head over (steps, dim) sequences, "
           "called as mha(query, value, key=None, attention_mask=None, use_causal_mask=False)",
           MultiHeadAttention)
LAYERS.add("GroupNormalization", "each sample standardized per group of channels, then gamma * x + beta",
           GroupNormalization)
LAYERS.add("SeparableConv2D", "a DepthwiseConv2D, then a 1x1 Conv2D to filters", SeparableConv2D)
LAYERS.add("FeatureCross", "Keras-RS's DCN-v2 cross: x0 * (x @ W + bias + diag_scale * x) + x", FeatureCross)
LAYERS.add("DotInteraction", "Keras-RS's DLRM interaction: the features' pairwise dot products",
           DotInteraction)
LAYERS.add("DINAttention", "DIN's target attention: a candidate's weighted sum of a sequence's embeddings, "
           "called as din([query, keys, ids]) (padding ids weigh 0)", DINAttention)

# A user's layer classes, by class name (pserver.keras.saving.register_keras_serializable), so that
# a saved model that names one is built again in a process that defined it.
USER_LAYERS = Registry("user layer", "register_keras_serializable")


def serialize(layer, model: str) -> dict:
    """{"class_name", "config"} of `layer` (a user's class also records "registered_name" and
    "module", for the error of a process that lacks it); ConfigError, naming the layer, for a
    class that no registry names or a config that is not JSON: a file could not build it again."""
    cls = layer.saved_class()
    name = cls.__name__
    known = LAYERS if name in LAYERS else USER_LAYERS
    if name not in known or known.get(name) is not cls:
        raise ConfigError(f"{model}: {layer.label} is of class {cls.__qualname__}, which is not built in: "
                          f"register it with @pserver.keras.saving.register_keras_serializable() so that a "
                          "saved model can be built again")
    config = layer.get_config()
    bad = next((k for k, v in config.items() if not is_json(v)), None)
    if bad is not None:
        raise ConfigError(f"{model}: {layer.label}: its config holds {bad}={config[bad]!r}, which is not a "
                          f"JSON value: give {name} a get_config (and from_config) that a file can hold, as "
                          "in Keras")
    entry = {"class_name": name, "config": config}
    if not layer.trainable:
        entry["trainable"] = False
    if known is USER_LAYERS:
        entry.update(registered_name=USER_LAYERS.summary(name), module=cls.__module__)
    return entry


def deserialize(entry: dict):
    """The layer (or a registered keras.Model subclass) `entry` describes, its class from
    load_model's custom_objects, else built in, else registered; ConfigError naming the layer,
    its class and how to register it when this process does not know the class."""
    name = entry["class_name"]
    given = custom_object(name, entry.get("registered_name"))
    if given is not None:
        return _trainable(given.from_config(entry["config"]), entry)
    if name not in LAYERS and name not in USER_LAYERS:
        config = entry.get("config")
        layer = config.get("name") if isinstance(config, dict) else None
        saved = (f" (saved as {entry.get('registered_name') or name} of module {entry['module']})"
                 if entry.get("module") else "")
        raise ConfigError(f"layer {layer or '?'}: class {name!r} is neither built in nor registered in this "
                          f"process{saved}: import the code that defines it, decorated with "
                          "@keras.saving.register_keras_serializable(), before loading")
    cls = LAYERS.get(name) if name in LAYERS else USER_LAYERS.get(name)
    return _trainable(cls.from_config(entry["config"]), entry)


def _trainable(layer, entry: dict):
    """A layer saved frozen comes back frozen (its flag is in the entry, not the constructor's config)."""
    if entry.get("trainable") is False:
        layer.trainable = False
    return layer


__all__ = ["LAYERS", "USER_LAYERS", "serialize", "deserialize", "Lambda",
           "Layer", "Weight", "Pass", "Dense", "Conv2D", "Conv1D", "Conv2DTranspose", "DepthwiseConv2D",
           "MaxPooling2D", "AveragePooling2D", "ZeroPadding1D", "ZeroPadding2D", "Cropping1D", "Cropping2D",
           "UpSampling1D", "UpSampling2D",
           "Flatten", "Dropout", "Embedding", "FM", "Initializer", "VarianceScaling", "RandomUniform",
           "Zeros", "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate", "Dot",
           "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
           "Activation", "ReLU", "Reshape", "Permute", "RepeatVector", "LayerNormalization",
           "BatchNormalization",
           "Rescaling", "SimpleRNN", "LSTM", "GRU", "Bidirectional", "Normalization", "Resizing",
           "CenterCrop", "RandomFlip", "RandomRotation", "RandomZoom", "RandomTranslation", "RandomContrast",
           "add", "subtract", "multiply", "average", "maximum", "minimum", "concatenate", "dot",
           "StringLookup", "IntegerLookup", "TextVectorization",
           "MultiHeadAttention", "GroupNormalization", "SeparableConv2D", "FeatureCross", "DotInteraction",
           "DINAttention", "Masking"]
