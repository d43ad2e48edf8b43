"""How a model, its data and its device are built from a worker's config: the one place every
command that builds them goes through (`pserver worker` and `launch`'s check before anything
starts, `pserver export` and `pserver evaluate`), so that what a flag means for the model or the
data (a model's task, its sparse tables' options) is said once.
"""

from __future__ import annotations

import dataclasses

from pserver.config import WorkerConfig
from pserver.data import Dataset, Stream, load_dataset
from pserver.errors import ConfigError, DataError
from pserver.kernels.device import parse_device, select
from pserver.models import make_model, task_of
from pserver.models.ctr import CTR_MODELS


def build(cfg: WorkerConfig):
    """Device, dataset and model for this worker (the chief and the others build the same).

    A user's model (--model FILE.py:FUNCTION) is built for the dataset's sample shape and
    number of classes; then the data is checked against the model, before any training.
    """
    device = select(parse_device(cfg.device))   # before the model: it binds to this device
    ds = load_data(cfg)
    model = model_for(cfg, ds, device.backend)
    return device, fit_data(model, ds), model


def model_for(cfg: WorkerConfig, ds, backend: str = "reference"):
    """The model `cfg` names, for the dataset's samples and classes, with its sparse tables'
    options; `backend`: the kernels it computes with."""
    options = table_options(cfg)
    if options and getattr(ds, "sizes", None):      # multi-hot Criteo records: each field a list
        options["multi_hot"] = ds.sizes
    return make_model(cfg.model, ds.sample_shape, ds.num_classes, hidden=cfg.hidden, **options,
                      backend=backend)


def table_options(cfg: WorkerConfig) -> dict:
    """The sparse-table flags, for the models that have sparse tables."""
    if cfg.model not in CTR_MODELS:
        return {}
    from pserver.sparse.optim import parse_params
    return dict(embedding_dim=cfg.embedding_dim, optimizer=cfg.row_optimizer, lr=cfg.row_lr,
                optimizer_params=parse_params(cfg.row_params),
                min_count=cfg.min_count, max_rows=cfg.max_rows, ttl_steps=cfg.ttl_steps, seed=cfg.seed,
                row_dtype=cfg.row_dtype, state_dtype=cfg.state_dtype)


def load_data(cfg: WorkerConfig) -> Dataset:
    """The dataset `cfg` names, with the targets its model's task takes."""
    return load_dataset(cfg.dataset, data_dir=cfg.data_dir, seed=cfg.seed, task=task_of(cfg.model),
                        samples=cfg.samples, test_samples=cfg.test_samples, features=cfg.features,
                        classes=cfg.classes, scale_uint8=cfg.scale_uint8)


def check_model_and_data(cfg: WorkerConfig):
    """What every worker would find wrong with the data (a dataset name, a directory, a
    file, a batch larger than a worker's slice) or the model (a mistake in a model file, a
    model that does not fit the data), found once, before anything starts: as a ConfigError,
    which `pserver launch` exits 2 with. The model is built as the workers build it, with
    the NumPy kernels (nothing is compiled for it). Returns the model (launch checks the
    checkpoints it restores against its layout)."""
    try:   # quietly: the workers say what they do with the data
        ds = load_data(dataclasses.replace(cfg, scale_uint8="none"))
        ds.steps(cfg.num_workers, cfg.batch_size)
        model = model_for(cfg, ds)
        fit_data(model, ds)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return model


def fit_data(model, ds: Dataset | Stream) -> Dataset | Stream:
    """The dataset as the model takes it: float targets for a regression loss, samples
    reshaped to the model's input, everything checked (DataError naming layer and shapes).
    A model without `check_data` (a user's protocol object) gets the data as it is; a
    Stream's batches are checked by the model as they come, its test set here."""
    return ds.fit(model)
