"""pserver: a parameter server for data-parallel training, with Keras-style models.

    import pserver
    from pserver.layers import Conv2D, Dense, Flatten, MaxPooling2D

    model = pserver.Sequential([
        Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
        MaxPooling2D(), Flatten(), Dense(64, activation="relu"), Dense(10)])
    summary = pserver.train(model, x, y, ps=2, optimizer="adam", lr=1e-3, epochs=2)

`serve` starts a shard in this process, `train` runs a worker against shards (addresses, or a
number of shards to start here); the `pserver` command line runs the same functions.
`train(..., save="model.npz")` writes the trained model; `load_model` reads it back and
`predict` runs it.
"""

from pserver import signals

signals.quiet_interrupt_while_loading()  # the `pserver` command: a Ctrl-C now is one line, exit 130

from pserver.api import (
    Cluster,
    SavedModel,
    Server,
    evaluate_files,
    ingest,
    launch_cluster,
    load_model,
    predict,
    serve,
    serve_model,
    start_cluster,
    train,
)
from pserver.data import Dataset, Stream, load_dataset
from pserver.errors import ConfigError, DataError, PServerError, RpcError
from pserver.layers import AveragePooling2D, Conv2D, Dense, Dropout, Embedding, Flatten, Layer, MaxPooling2D
from pserver.models import Model, Sequential, make_model
from pserver.models.losses import BinaryCrossentropy, MeanSquaredError, SparseCategoricalCrossentropy

__version__ = "0.1.0"

__all__ = [
    # models and layers
    "Sequential", "Model", "make_model", "Layer", "Dense", "Conv2D", "MaxPooling2D",
    "AveragePooling2D", "Flatten", "Dropout", "Embedding",
    "SparseCategoricalCrossentropy", "BinaryCrossentropy", "MeanSquaredError",
    # running
    "serve", "serve_model", "ingest", "train", "launch_cluster", "start_cluster", "Cluster", "Server",
    "load_model",
    "predict",
    "SavedModel", "evaluate_files",
    # data
    "Dataset", "Stream", "load_dataset",
    # errors
    "PServerError", "ConfigError", "DataError", "RpcError",
    "__version__",
]
