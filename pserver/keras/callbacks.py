"""Keras's callbacks as the training loop calls them (pserver.worker.loop).

The loop calls a CallbackList at each step's and epoch's end; `stop_training` set by any
callback ends the run after that epoch. History (always there, as in Keras) keeps the
per-epoch logs: `loss` (and the compiled metrics) averaged over every worker's batches of the
epoch, and `val_*`, the chief's evaluation of the validation data at the epoch's end. On a
cluster every worker's callbacks get the chief's logs, and a stop decided on the chief stops
every worker after that epoch (docs/guide/keras.md).

Keras's built-ins by its names, arguments and defaults: EarlyStopping, ModelCheckpoint,
TerminateOnNaN, CSVLogger, LambdaCallback, ReduceLROnPlateau, LearningRateScheduler. Each decides
on the logs it gets, which on a cluster are the chief's, so the chief's decision is every
worker's; a file is the chief's to write (the other workers write nothing), and a learning rate
a callback sets is the chief's to set on the shards (CallbackList.lr_change). `self.model`'s
weights at an epoch's end are the ones the worker pulled after the epoch's last step
(docs/semantics.md says which version that is per mode). BackupAndRestore maps onto the shards'
checkpoints (`pserver run --checkpoint-dir`); TensorBoard writes the epoch logs as event files.
"""

from __future__ import annotations

import collections.abc
import csv
import math
import os
import sys
import time
import warnings

import numpy as np

from pserver.errors import ConfigError
from pserver.keras import cluster
from pserver.keras._names import missing as _missing
from pserver.models.metrics import values_of
from pserver.observe.telemetry import EpochScalars


class Callback:
    """Keras's base class: override the hooks you need; `self.model` is the Keras model."""

    def __init__(self):
        self.model = None
        self.params: dict = {}

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def on_train_begin(self, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_batch_begin(self, batch, logs=None): pass
    def on_train_batch_end(self, batch, logs=None): pass


class History(Callback):
    """`.history`: {"loss": [...], "accuracy": [...], "val_loss": [...], ...}; `.epoch`: [0, 1, ...]."""

    def __init__(self):
        super().__init__()
        self.history: dict[str, list] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


class EpochLine(Callback):
    """What Keras prints with verbose=2: `Epoch 3/15` then `N/N - 12s - loss: ... - val_...`,
    to the stdout of when it was made (fit's quiet modes redirect pserver's own lines only)."""

    def __init__(self):
        super().__init__()
        self._out = sys.stdout

    def on_epoch_begin(self, epoch, logs=None):
        self._started = time.monotonic()
        print(f"Epoch {epoch + 1}/{self.params.get('epochs')}", file=self._out, flush=True)

    def on_epoch_end(self, epoch, logs=None):
        shown = " - ".join(f"{k}: {v:.4f}" for k, v in (logs or {}).items())
        steps = self.params.get("steps")
        print(f"{steps}/{steps} - {time.monotonic() - self._started:.0f}s - {shown}", file=self._out,
              flush=True)


def _chief() -> bool:
    """Whether this process writes the files of a cluster's callbacks: the chief (rank 0), or a
    script run plainly."""
    place = cluster.current()
    return place is None or place.rank == 0


# Keras's metrics that grow as a model improves ("auto" mode maximizes them); a loss shrinks.
_GROWING = ("accuracy", "auc", "r2")     # compile's names (pserver.models.metrics)


class _Monitor(Callback):
    """Keras's MonitorCallback: a quantity of the epoch logs, watched for improvement (`best`)."""

    def __init__(self, monitor="val_loss", mode="auto", baseline=None, min_delta=0):
        super().__init__()
        if mode not in ("auto", "min", "max"):     # Keras warns and takes "auto"; pserver refuses
            raise ConfigError(f"{type(self).__name__}: mode={mode!r} is unknown: give 'auto', 'min' or 'max'")
        self.monitor, self.mode, self.best, self.min_delta = monitor, mode, baseline, abs(min_delta)
        self.monitor_op = None
        self._out = sys.stdout      # as EpochLine: fit's quiet modes redirect pserver's own lines only

    def _set_monitor_op(self) -> None:
        """min or max; "auto" from the name, as Keras: a loss is minimized, a compiled metric that
        grows (accuracy, auc, r2; a Metric object by its direction: precision up, mse down)
        maximized, one that shrinks minimized, anything else refused (Keras's ValueError)."""
        name = self.monitor.removeprefix("val_")
        core = getattr(self.model, "_core", None)
        metrics = getattr(core, "metrics", None) or ()
        direction = {m.name: m.direction for m in getattr(core, "metric_objects", None) or ()}.get(name)
        grows = direction == "up" or any(name == m or name.endswith(f"_{m}")
                                         for m in metrics if m in _GROWING)
        if self.mode == "max" or (self.mode == "auto" and grows):
            self.monitor_op = max
        elif self.mode == "min" or name == "loss" or name.endswith("_loss") or direction == "down":
            self.monitor_op = min
        else:
            raise ConfigError(f"{type(self).__name__} callback received monitor={self.monitor}, but pserver "
                              "(as Keras) cannot tell whether that metric should be maximized or minimized: "
                              "pass mode='max' or mode='min'")

    def _is_improvement(self, value, reference) -> bool:
        """Better than `reference` by more than min_delta (Keras's rule: by exactly min_delta
        is not enough); anything is better than no reference."""
        if reference is None:
            return True
        if self.monitor_op is min:
            return value + self.min_delta < reference
        return value - self.min_delta > reference


class EarlyStopping(_Monitor):
    """Stops the run when `monitor` stops improving, by Keras's rule: after `patience` epochs
    without an improvement of more than `min_delta` (from `start_from_epoch` on; with a
    `baseline`, an epoch must beat it too). On a cluster every worker stops after the same
    epoch: the chief's decision, on its logs. restore_best_weights=True (Keras's rule: the best
    epoch's weights at the end, whether it stopped or not): each worker keeps the weights it
    pulled at the best epoch's end, and at the end of fit the chief writes its copy to the shards
    (pserver.worker.loop.assign_restored; the optimizer's state kept) and every other worker
    pulls it, so a later fit, save or evaluate on any worker sees them. Refused at fit for a
    model with sparse tables (their rows cannot be copied at every epoch's end)."""

    def __init__(self, monitor="val_loss", min_delta=0, patience=0, verbose=0, mode="auto", baseline=None,
                 restore_best_weights=False, start_from_epoch=0):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience, self.verbose, self.baseline = patience, verbose, baseline
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best_weights = None

    def _check_fit(self) -> None:
        if self.restore_best_weights and getattr(self.model, "_sparse", bool)():
            names = ", ".join(t.name for t in self.model._core.sparse_tables)
            raise ConfigError(f"EarlyStopping: restore_best_weights=True is not supported for a model with "
                              f"sparse tables ({names}: their rows are not copied at each epoch's end); "
                              "use ModelCheckpoint(save_best_only=True) and keras.models.load_model")

    def on_train_begin(self, logs=None):
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best, self.best_weights = None, None
        self._set_monitor_op()

    def on_epoch_end(self, epoch, logs=None):
        current = _monitored(self.monitor, logs, "Early stopping")
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:     # Keras's: the first is the best
            self.best_weights, self.best_epoch = self.model.get_weights(), epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", file=self._out, flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.",
                      file=self._out, flush=True)
            self.model.set_weights(self.best_weights)


def _monitored(monitor: str, logs, what: str):
    """The monitored value, or None with Keras's warning when the logs lack it."""
    value = (logs or {}).get(monitor)
    if value is None:
        warnings.warn(f"{what} conditioned on metric `{monitor}` which is not available. Available metrics "
                      f"are: {','.join(logs or {})}", stacklevel=3)
    return value


class ModelCheckpoint(_Monitor):
    """Saves the model (model.save, or model.save_weights with save_weights_only=True) at each
    epoch's end, or only when `monitor` improved (save_best_only), to `filepath` formatted with
    the epoch (1-based) and the epoch's logs: "ckpt-{epoch:02d}-{val_loss:.2f}.keras". The
    chief writes it, from the weights it pulled after the epoch's last step; the other workers
    write nothing. save_freq: "epoch" only (a number of batches is refused)."""

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False, save_weights_only=False,
                 mode="auto", save_freq="epoch", initial_value_threshold=None):
        super().__init__(monitor, mode, initial_value_threshold)
        self.filepath, self.verbose = os.fspath(filepath), verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.save_freq = save_freq
        if isinstance(save_freq, int) and not isinstance(save_freq, bool):
            raise ConfigError(f"ModelCheckpoint: save_freq={save_freq!r} is not supported by pserver: the "
                              "chief saves at epoch ends (save_freq='epoch')")
        if save_freq != "epoch":
            raise ConfigError(f"ModelCheckpoint: unrecognized save_freq: {save_freq!r}; expected 'epoch'")
        ending = (".weights.h5",) if save_weights_only else (".keras", ".h5")
        if not self.filepath.endswith(ending):
            raise ConfigError(f"ModelCheckpoint: filepath={self.filepath!r} must end in "
                              f"{' or '.join(ending)}{' with save_weights_only=True' * save_weights_only} "
                              "(as Keras)")

    def on_train_begin(self, logs=None):
        self._set_monitor_op()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except KeyError as e:
            raise ConfigError(f"ModelCheckpoint: cannot format filepath {self.filepath!r}: the epoch logs "
                              f"have no {e} (they have {', '.join(logs)})") from None
        if not self._should_save(epoch, logs, path):
            return
        if _chief():
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            save = self.model.save_weights if self.save_weights_only else self.model.save
            save(path, overwrite=True)
        if self.verbose > 0:
            print(f"Epoch {epoch + 1}: finished saving model to {path}", file=self._out, flush=True)

    def _should_save(self, epoch: int, logs: dict, path: str) -> bool:
        if not self.save_best_only:
            return True
        current = logs.get(self.monitor)
        if current is None:           # Keras saves then, with a warning
            warnings.warn(f"Can save best model only with {self.monitor} available.", stacklevel=3)
            return True
        if not self._is_improvement(current, self.best):
            if self.verbose > 0:
                print(f"Epoch {epoch + 1}: {self.monitor} did not improve from {self.best:.5f}",
                      file=self._out, flush=True)
            return False
        if self.verbose > 0:
            best = "None" if self.best is None else f"{self.best:.5f}"
            print(f"Epoch {epoch + 1}: {self.monitor} improved from {best} to {current:.5f}, saving model "
                  f"to {path}", file=self._out, flush=True)
        self.best = current
        return True


class TerminateOnNaN(Callback):
    """Stops the run at a NaN or infinite loss. On a cluster the whole cluster stops, after the
    epoch in which it came (Keras stops after the batch): each worker checks its own batches'
    loss, and at the epoch's end the epoch's loss over every worker's batches, which the chief's
    decision stops every worker on. raise_error=True raises RuntimeError in the worker that saw it
    at once (under pserver run that worker fails, and so does the run). A non-finite gradient
    never gets that far: the shards refuse its push (InvalidArgument naming it), which fails the
    run first."""

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = raise_error
        self._out = sys.stdout

    def on_train_batch_end(self, batch, logs=None):
        self._check((logs or {}).get("loss"), f"batch {batch}")

    def on_epoch_end(self, epoch, logs=None):
        self._check((logs or {}).get("loss"), f"epoch {epoch + 1}")

    def _check(self, loss, where: str) -> None:
        if loss is None or math.isfinite(loss):
            return
        if self.raise_error:
            raise RuntimeError(f"NaN or Inf loss encountered at {where}. Loss value: {loss}. Terminating "
                               "training immediately.")
        if self.model.stop_training:          # said once
            return
        print(f"{where[0].upper()}{where[1:]}: Invalid loss, terminating training", file=self._out,
              flush=True)
        self.model.stop_training = True


class CSVLogger(Callback):
    """Each epoch's logs as a row of `filename` ("epoch" then the keys sorted, as Keras), the
    file overwritten or, with append=True, added to. On a cluster the chief writes it (its logs
    are every worker's); the other workers write nothing."""

    def __init__(self, filename, separator=",", append=False):
        super().__init__()
        self.sep, self.filename, self.append = separator, os.fspath(filename), append
        self.keys: list[str] = []
        self.writer = self.csv_file = None

    def on_train_begin(self, logs=None):
        if not _chief():
            return
        header = not (self.append and os.path.exists(self.filename) and os.path.getsize(self.filename))
        self.csv_file = open(self.filename, "a" if self.append else "w", newline="")
        self.append_header, self.writer = header, None

    def on_epoch_end(self, epoch, logs=None):
        if self.csv_file is None:
            return
        logs = logs or {}
        if self.writer is None:
            self._start(logs)
        self.writer.writerow({"epoch": epoch, **{k: _cell(logs.get(k, "NA")) for k in self.keys}})
        self.csv_file.flush()

    def _start(self, logs: dict) -> None:
        """Keras's columns: the first epoch's keys sorted, with val_ ones when it has none."""
        self.keys = sorted(logs)
        if self.keys and not any(k.startswith("val_") for k in self.keys):
            self.keys += [f"val_{k}" for k in self.keys]
        dialect = type("Dialect", (csv.excel,), {"delimiter": self.sep})
        self.writer = csv.DictWriter(self.csv_file, fieldnames=["epoch", *self.keys], dialect=dialect)
        if self.append_header:
            self.writer.writeheader()

    def on_train_end(self, logs=None):
        if self.csv_file is not None:
            self.csv_file.close()
        self.csv_file = self.writer = None


def _cell(value):
    """Keras's: a string as it is, a sequence as "[a, b]", a number as it is."""
    if isinstance(value, str) or not isinstance(value, collections.abc.Iterable):
        return value
    return f'"[{", ".join(map(str, value))}]"'


class LambdaCallback(Callback):
    """A callback of functions: LambdaCallback(on_epoch_end=lambda epoch, logs: ...), as Keras
    (each hook's arguments as Callback's; other keyword arguments become attributes)."""

    def __init__(self, on_epoch_begin=None, on_epoch_end=None, on_train_begin=None, on_train_end=None,
                 on_train_batch_begin=None, on_train_batch_end=None, **kwargs):
        super().__init__()
        self.__dict__.update(kwargs)
        hooks = dict(on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end, on_train_begin=on_train_begin,
                     on_train_end=on_train_end, on_train_batch_begin=on_train_batch_begin,
                     on_train_batch_end=on_train_batch_end)
        self.__dict__.update({name: f for name, f in hooks.items() if f is not None})


class _Refused:
    """A Keras callback pserver cannot honour on a cluster: one line at construction, naming
    what to use instead (`instead`)."""
    instead = ""

    def __init__(self, *args, **kwargs):
        raise ConfigError(f"keras.callbacks.{type(self).__name__} is not supported by pserver: "
                          f"{self.instead}")


class ReduceLROnPlateau(_Monitor):
    """Keras's rule: after `patience` epochs without an improvement of `monitor` by more than
    `min_delta`, the learning rate times `factor` (not below `min_lr`), then `cooldown` epochs
    without counting. On a cluster every worker decides alike on the chief's logs, and the chief
    sets the rate on the shards before its next step (in sync every shard takes it at the same
    step: docs/semantics.md)."""

    def __init__(self, monitor="val_loss", factor=0.1, patience=10, verbose=0, mode="auto", min_delta=1e-4,
                 cooldown=0, min_lr=0.0, **kwargs):
        if kwargs:
            raise ConfigError(f"ReduceLROnPlateau: unexpected argument {sorted(kwargs)[0]!r}")
        super().__init__(monitor, mode, min_delta=min_delta)
        if factor >= 1.0:
            raise ConfigError(f"ReduceLROnPlateau does not support a factor >= 1.0. Received factor={factor}")
        self.factor, self.min_lr, self.patience, self.verbose = factor, min_lr, patience, verbose
        self.cooldown, self.cooldown_counter, self.wait = cooldown, 0, 0

    def on_train_begin(self, logs=None):
        self.best, self.cooldown_counter, self.wait = None, 0, 0

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor_op is None:
            self._set_monitor_op()
        logs = logs if logs is not None else {}
        logs["learning_rate"] = _learning_rate(self.model, "ReduceLROnPlateau")
        current = logs.get(self.monitor)
        if current is None:
            print(f"ReduceLROnPlateau: learning rate reduction is conditioned on metric `{self.monitor}` "
                  f"which is not available. Available metrics are: {','.join(logs)}.", file=self._out)
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._is_improvement(current, self.best):
            self.best, self.wait = current, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience and self._reduce(epoch):
                self.cooldown_counter, self.wait = self.cooldown, 0

    def _reduce(self, epoch) -> bool:
        old = _learning_rate(self.model, "ReduceLROnPlateau")
        if not old > np.float32(self.min_lr):
            return False
        self.model.optimizer.learning_rate = max(old * self.factor, self.min_lr)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to "
                  f"{self.model.optimizer.learning_rate}.", file=self._out)
        return True


class LearningRateScheduler(Callback):
    """Keras's: at each epoch's beginning the rate is `schedule(epoch, lr)` (or `schedule(epoch)`);
    on a cluster the chief sets it on the shards before the epoch's first step."""

    def __init__(self, schedule, verbose=0):
        super().__init__()
        if not callable(schedule):
            raise ConfigError(f"LearningRateScheduler: schedule must be a function, got {schedule!r}")
        self.schedule, self.verbose = schedule, verbose
        self._out = sys.stdout

    def on_epoch_begin(self, epoch, logs=None):
        lr = _learning_rate(self.model, "LearningRateScheduler")
        try:
            lr = self.schedule(epoch, lr)
        except TypeError:            # Keras's old form: schedule(epoch)
            lr = self.schedule(epoch)
        if not isinstance(lr, (float, np.floating)):
            raise ConfigError(f"The output of the `schedule` function should be a float. Got: {lr}")
        self.model.optimizer.learning_rate = float(lr)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {float(lr)}.",
                  file=self._out)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _learning_rate(self.model, "LearningRateScheduler")


def _learning_rate(model, who: str) -> float:
    """The compiled optimizer's learning rate as a number (a schedule's cannot be set: Keras refuses too)."""
    lr = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
        raise ConfigError(f"{who}: the optimizer's learning_rate is {lr!r}, not a number it can change "
                          "(a learning-rate schedule sets the rate itself)")
    return float(lr)


class BackupAndRestore(Callback):
    """Keras's BackupAndRestore mapped onto pserver's checkpoints: under `pserver run
    --checkpoint-dir DIR` the shards checkpoint at every epoch's end (weights, optimizer state,
    the data coordinator's epoch), and the command started again after a crash with `--restore
    DIR` added resumes from the last one: the same weights, the epochs left, numbered on.
    `backup_dir` is not written (the shards' DIR is the backup); save_freq: "epoch" only; the
    checkpoints are kept at the end (delete_checkpoint=True does not delete them: a finished run
    started again trains nothing, `--no-resume` starts it over). Anywhere else (a script run
    plainly, no --checkpoint-dir) fit refuses it in one line."""

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True):
        super().__init__()
        if save_freq != "epoch":
            raise ConfigError(f"BackupAndRestore: save_freq={save_freq!r} is not supported by pserver: the "
                              "shards checkpoint at epoch ends (save_freq='epoch')")
        self.backup_dir, self.save_freq = os.fspath(backup_dir), save_freq
        self.double_checkpoint, self.delete_checkpoint = double_checkpoint, delete_checkpoint

    def _check_fit(self) -> None:
        if cluster.checkpoint_dir() is None:
            raise ConfigError("BackupAndRestore: pserver backs up on its shards' checkpoints: run the "
                              "script under `pserver run --ps N --workers M --checkpoint-dir DIR -- python "
                              "script.py` (started again with --restore DIR added, it resumes from the "
                              "last epoch's end)")


class TensorBoard(Callback):
    """Keras's TensorBoard callback for the epoch logs: the chief writes each epoch's scalars as
    event files (pserver.observe.telemetry.EpochScalars, Keras's layout: log_dir/train with
    epoch_loss, epoch_accuracy, ..., log_dir/validation with the val_ ones), the other workers
    write nothing. The graph is not written (write_graph is taken and ignored); histograms,
    images, profiling, embeddings and per-batch scalars are refused in one line."""

    def __init__(self, log_dir="logs", histogram_freq=0, write_graph=True, write_images=False,
                 write_steps_per_second=False, update_freq="epoch", profile_batch=0, embeddings_freq=0,
                 embeddings_metadata=None):
        super().__init__()
        unsupported = {"histogram_freq": histogram_freq, "write_images": write_images,
                       "write_steps_per_second": write_steps_per_second, "profile_batch": profile_batch,
                       "embeddings_freq": embeddings_freq, "embeddings_metadata": embeddings_metadata,
                       "update_freq": None if update_freq == "epoch" else update_freq}
        given = [k for k, v in unsupported.items() if v not in (0, False, None)]
        if given:
            raise ConfigError(f"TensorBoard: {given[0]}={unsupported[given[0]]!r} is not supported by "
                              "pserver: it writes the epoch logs' scalars (pserver launch --tensorboard DIR "
                              "writes "
                              "training curves per step)")
        self.log_dir, self.write_graph = os.fspath(log_dir), write_graph
        self._writer = None

    def on_train_begin(self, logs=None):
        if _chief():
            self._writer = EpochScalars(self.log_dir)

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is not None:
            self._writer.write(epoch, logs or {})

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
        self._writer = None


class CallbackList:
    """The callbacks of one fit, as the loop sees them: it turns the loop's step and epoch
    reports into Keras's logs (the epoch's mean loss and accuracy over every worker's batches, as
    tf.distribute's fit gives; val_* from the chief's evaluation) and hands them on. `weights`
    holds the final weights (`on_weights`)."""

    def __init__(self, callbacks, model, params: dict, metrics: list[str], offset: int = 0,
                 validation: bool = True):
        self.callbacks = list(callbacks)
        self.model, self.metrics, self.offset, self.validation = model, metrics, offset, validation
        for c in self.callbacks:
            c.set_model(model)
            c.set_params(params)
            getattr(c, "_check_fit", lambda: None)()     # what fit refuses (EarlyStopping's restore)
        self.weights = None
        # Weights a callback set at the end (EarlyStopping's restore): the chief writes them to
        # the shards and every worker pulls them (pserver.worker.loop.assign_restored)
        self.restored = None
        self.shard_settings: dict | None = None       # what the shards must run (fit sets it)
        # On a cluster every worker's callbacks take the chief's epoch logs and stop decision (the
        # loop shares them through shard 0: pserver.worker.loop.chief_logs); epoch_logs: the last.
        self.shares_logs = True
        self._lr = getattr(getattr(model, "optimizer", None), "learning_rate", None)
        # What pserver's own lines call the chief's evaluation set; None: fit has none (the loop
        # evaluates a placeholder sample, which no line shows)
        self.held_out = "validation" if validation else None
        self.epoch_logs: dict = {}

    @property
    def stop_training(self) -> bool:
        return bool(getattr(self.model, "stop_training", False))

    def on_train_begin(self, logs=None):
        self.model.stop_training = False
        for c in self.callbacks:
            c.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._loss = self._correct = self._seen = 0.0
        self._sums: dict[str, float] = {}      # several outputs: each one's loss and accuracy
        self._metric_sums = np.zeros(0)        # the compiled Metric objects' (pserver.models.metrics)
        for c in self.callbacks:
            c.on_epoch_begin(epoch + self.offset, logs)

    def on_train_batch_end(self, batch, logs=None):
        n = logs["size"]
        self._loss += logs["loss"] * n
        self._seen += n
        self._correct += getattr(self.model._core, "batch_correct", 0)
        for k, v in getattr(self.model._core, "batch_sums", {}).items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        measured = getattr(self.model._core, "batch_metric_sums", ())
        self._metric_sums = self._metric_sums + measured if self._metric_sums.size else \
            np.array(measured, np.float64)
        out = {"loss": self._loss / self._seen}
        if "accuracy" in self.metrics:
            out["accuracy"] = self._correct / self._seen
        out.update({k: v / self._seen for k, v in self._sums.items()})
        out.update(self._metric_values(self._metric_sums))
        for c in self.callbacks:
            c.on_train_batch_end(batch, out)

    def on_epoch_end(self, epoch, logs=None):
        shared = (logs or {}).get("shared")
        if shared is not None:     # another worker than the chief: the chief's logs (the loop's chief_logs)
            out = dict(shared)
        else:
            out = self._own_logs(logs)
        self.epoch_logs = dict(out)        # what the chief gives every worker (before callbacks add to it)
        for c in self.callbacks:
            c.on_epoch_end(epoch + self.offset, out)
        if shared is not None:     # a stop is the chief's decision: every worker stops after the epoch
            self.model.stop_training = bool(logs.get("stop_training"))

    def _own_logs(self, logs) -> dict:
        # Keras's: over every worker's batches of the epoch, which shard 0 summed from their pushes
        # (logs["trained"], with data leases); else this worker's own.
        trained = (logs or {}).get("trained")
        if trained and trained["samples"]:
            loss, correct, seen = trained["loss_sum"], trained["correct"], trained["samples"]
            sums = np.asarray(trained.get("metric_sums", ()), np.float64)
        else:
            loss, correct, seen, sums = self._loss, self._correct, self._seen, self._metric_sums
        out = {"loss": loss / max(seen, 1)}
        if "accuracy" in self.metrics:
            out["accuracy"] = correct / max(seen, 1)
        out.update(self._metric_values(sums))
        # Several outputs: each one's loss and accuracy over this worker's own batches (the
        # shards sum only the total's).
        out.update({k: v / max(self._seen, 1) for k, v in self._sums.items()})
        if self.validation and logs and "loss" in logs:     # the chief's evaluation
            out["val_loss"] = logs["loss"]
            out.update({f"val_{m}": logs[m] for m in self.metrics if m in logs})
        return out

    def on_train_end(self, logs=None):
        held = self.model._w
        for c in self.callbacks:
            c.on_train_end(logs)
        if self.model._w is not held:      # a callback set them (EarlyStopping's restore): they stay
            self.restored = self.model._w

    def _metric_values(self, sums: np.ndarray) -> dict:
        """The compiled Metric objects' values from their summed state (none before any batch)."""
        objects = getattr(self.model._core, "metric_objects", [])
        if not objects or sums.size != sum(m.size() for m in objects):
            return {}
        return values_of(objects, sums)

    def lr_change(self) -> float | None:
        """The optimizer's learning rate when a callback changed it since the last call (the chief
        then sets it on the shards: pserver.worker.loop.follow_lr), else None."""
        lr = getattr(getattr(self.model, "optimizer", None), "learning_rate", None)
        if lr == self._lr or isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
            return None
        self._lr = lr
        return float(lr)

    def on_weights(self, w):
        """The weights this worker pulled after an epoch's last step (the loop hands them before
        on_epoch_end, and at the end): the model's, as a Keras model's weights are live in fit,
        so that a callback's model.get_weights() or model.save() takes them. At the end they are
        the shards' final ones: those a callback set at its end (`restored`) once the chief wrote
        them there."""
        self.weights = w.copy()
        self.model._w = self.weights


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Callback", "History", "CallbackList", "EarlyStopping", "ModelCheckpoint", "TerminateOnNaN",
           "CSVLogger", "LambdaCallback", "ReduceLROnPlateau", "LearningRateScheduler", "BackupAndRestore",
           "TensorBoard"]
