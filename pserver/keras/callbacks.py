"""Keras's callbacks as the training loop calls them (pserver.worker.loop).

The loop calls a CallbackList at each step's and epoch's end; `stop_training` set by any
callback ends the run after that epoch. History (always there, as in Keras) keeps the
per-epoch logs: `loss` (and the compiled metrics) averaged over every worker's batches of the
epoch, and `val_*`, the chief's evaluation of the validation data at the epoch's end. On a
cluster every worker's callbacks get the chief's logs, and a stop decided on the chief stops
every worker after that epoch (docs/guide/keras.md).
"""

from __future__ import annotations

import sys
import time

from pserver.keras._names import missing as _missing


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
        self.weights = None
        self.shard_settings: dict | None = None       # what the shards must run (fit sets it)
        # On a cluster every worker's callbacks take the chief's epoch logs and stop decision (the
        # loop shares them through shard 0: pserver.worker.loop.chief_logs); epoch_logs: the last.
        self.shares_logs = True
        self.held_out = "validation"       # what pserver's own lines call the chief's evaluation set
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
        for c in self.callbacks:
            c.on_epoch_begin(epoch + self.offset, logs)

    def on_train_batch_end(self, batch, logs=None):
        n = logs["size"]
        self._loss += logs["loss"] * n
        self._seen += n
        self._correct += getattr(self.model._core, "batch_correct", 0)
        for k, v in getattr(self.model._core, "batch_sums", {}).items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        out = {"loss": self._loss / self._seen}
        if "accuracy" in self.metrics:
            out["accuracy"] = self._correct / self._seen
        out.update({k: v / self._seen for k, v in self._sums.items()})
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
        else:
            loss, correct, seen = self._loss, self._correct, self._seen
        out = {"loss": loss / max(seen, 1)}
        if "accuracy" in self.metrics:
            out["accuracy"] = correct / max(seen, 1)
        # Several outputs: each one's loss and accuracy over this worker's own batches (the
        # shards sum only the total's).
        out.update({k: v / max(self._seen, 1) for k, v in self._sums.items()})
        if self.validation and logs and "loss" in logs:     # the chief's evaluation
            out["val_loss"] = logs["loss"]
            out.update({f"val_{m}": logs[m] for m in self.metrics if m in logs})
        return out

    def on_train_end(self, logs=None):
        for c in self.callbacks:
            c.on_train_end(logs)

    def on_weights(self, w):
        self.weights = w.copy()


__getattr__ = _missing(__name__)     # a Keras name pserver.keras lacks: one line naming it

__all__ = ["Callback", "History", "CallbackList"]
