"""Keras's names around a model, over pserver: `import pserver.keras as keras` and
`from pserver.keras import layers` in place of Keras's imports.

    keras.Input, keras.Sequential, keras.Model(inputs, outputs), keras.layers.*, keras.ops,
    keras.activations,
    keras.optimizers.{Adam, AdamW, SGD, RMSprop, Adagrad}, keras.optimizers.schedules.*,
    keras.regularizers.{L1, L2, L1L2},
    keras.losses.*, keras.metrics.*,
    keras.callbacks.{Callback, History, EarlyStopping, ModelCheckpoint, CSVLogger, TerminateOnNaN,
    LambdaCallback, ReduceLROnPlateau, LearningRateScheduler, BackupAndRestore, TensorBoard},
    keras.utils.to_categorical,
    keras.datasets.mnist.load_data(), keras.models.load_model, keras.saving.register_keras_serializable

A script runs plainly (fit trains on shards it starts in its process) or under `pserver run
--ps N --workers M -- python script.py` (each worker joins the cluster). docs/guide/keras.md
has the table of what is supported.
"""

from pserver.keras import (
    activations,
    callbacks,
    datasets,
    layers,
    losses,
    metrics,
    models,
    ops,
    optimizers,
    regularizers,
    saving,
    utils,
)
from pserver.keras._names import missing as _missing
from pserver.keras.models import Input, Model, Sequential

__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Input", "Sequential", "Model", "layers", "models", "optimizers", "losses", "callbacks", "utils",
           "datasets", "saving", "ops", "activations", "regularizers",
           "metrics"]
