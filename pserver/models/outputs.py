"""Several outputs: keras.Model(inputs, [a, b]) or keras.Model(inputs, {"a": a, "b": b}).

As Keras's compile: `loss` is one for every output, a list in output order or a dict by output
name (an entry None: that output is predicted and never trained toward, its labels not needed);
`loss_weights` a list or a dict (1 for an output not named); `metrics` a list per output (a name,
a list of names or None each) or a dict by name. The model's loss is the weighted sum of each
output's mean loss; its logs are `loss`, then `<output>_loss` for each output with a loss
(unweighted; only where two or more have one, as Keras 3), then `<output>_<metric>` (Keras 3's
names).

Labels travel as one array, as several inputs do: each output's labels, one value per sample
once its loss's `labels` has read them (a class, a 0/1 label, a target), are a column of an
(n, outputs) array, so a worker slices rows of y like any y; `Heads.split` takes them apart.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.models import losses, metrics
from pserver.models.losses import Loss
from pserver.models.metrics import check_metrics


class Heads(Loss):
    """The loss of a model with several outputs: each output's Loss, weighted and summed."""

    name = "heads"
    task = "multi"       # each output's loss has its own

    def __init__(self, names: list[str], each: list[Loss], weights: list[float], metrics: list[list[str]],
                 where: str, sorted_metrics: bool = False):
        self.names, self.losses, self.weights, self.metrics = names, each, weights, metrics
        self.where, self.sorted_metrics = where, sorted_metrics

    @classmethod
    def compiled(cls, names: list[str], loss, loss_weights, metrics, where: str,
                 sorted_metrics: bool = False) -> "Heads":
        """compile's arguments for outputs `names`; ConfigError naming the model (`where`) and
        what is wrong. `sorted_metrics`: dict outputs, whose metrics Keras logs by sorted name."""
        each = [losses.NoLoss() if x is None else losses.get(x)
                for x in _per_output(names, loss, "loss", where, None)]
        if all(isinstance(x, losses.NoLoss) for x in each):
            raise ConfigError(f"{where}: compile: every output's loss is None: nothing to train toward")
        weights = [_weight(w, where) for w in _per_output(names, loss_weights, "loss_weights", where, 1.0)]
        named = [check_metrics([m] if isinstance(m, str) else m)
                 for m in _per_output(names, metrics, "metrics", where, None)]
        for name, loss_j, ms in zip(names, each, named):
            if ms and isinstance(loss_j, losses.NoLoss):
                raise ConfigError(f"{where}: compile: metrics: the output {name!r} has no loss (None), "
                                  "so no labels to measure it against; give it a loss, or no metrics")
            bad = [m for m in ms if m not in _reports(loss_j)]
            if bad:
                raise ConfigError(f"{where}: compile: metrics: the output {name!r} ({loss_j.name}) reports "
                                  f"{' and '.join(sorted(_reports(loss_j)))}, not {bad[0]!r}")
        return cls(names, each, weights, named, where, sorted_metrics)

    def get_config(self) -> dict:
        return {"name": self.name, "outputs": list(self.names),
                "losses": [x.get_config() for x in self.losses], "weights": list(self.weights),
                "metrics": [list(m) for m in self.metrics],
                "sorted_metrics": self.sorted_metrics}

    @classmethod
    def from_config(cls, config: dict, where: str) -> "Heads":
        return cls(list(config["outputs"]), [losses.get(x) for x in config["losses"]],
                   [float(w) for w in config["weights"]], [list(m) for m in config["metrics"]], where,
                   bool(config.get("sorted_metrics")))

    # -- names ----------------------------------------------------------------------------------

    def log_names(self) -> list[str]:
        """Keras 3's logs after `loss`: each output's loss, then each output's metrics."""
        order = sorted(range(len(self.names)), key=self.names.__getitem__) if self.sorted_metrics \
            else range(len(self.names))
        return ([f"{self.names[j]}_loss" for j in self._logged_losses()]
                + [f"{self.names[j]}_{m}" for j in order for m in self.metrics[j]])

    def loss_logs(self, values: list[float]) -> dict:
        """Each output's own loss in the logs, from one value per output (_logged_losses)."""
        return {f"{self.names[j]}_loss": values[j] for j in self._logged_losses()}

    def _logged_losses(self) -> list[int]:
        """The outputs whose own loss is logged (`<output>_loss`): those with a loss, where two or
        more have one (Keras 3 logs none for a single one)."""
        trained = [j for j, loss in enumerate(self.losses) if not isinstance(loss, losses.NoLoss)]
        return trained if len(trained) > 1 else []

    # -- labels ---------------------------------------------------------------------------------

    def label_dtype(self, dtype):
        return np.dtype(dtype)        # classes are exact in float32 up to 2**24

    def labels(self, y) -> np.ndarray:
        """y (a list in output order, or a dict by name) as one (n, outputs) float array; an
        array already so (a worker's rows) as it is. ValueError naming what does not fit."""
        if not isinstance(y, (list, tuple, dict)):
            y = np.asarray(y)
            if y.ndim == 2 and y.shape[1] == len(self.names) and y.dtype.kind == "f":
                return y
            raise ValueError(f"{self.where}: y has shape {y.shape}; give one array per output, a list "
                             f"or a dict by name ({', '.join(self.names)}), or (as an .npz file's y) one "
                             f"float array with a column per output, ({len(y)}, {len(self.names)})")
        given = [(loss, yj, isinstance(loss, losses.NoLoss))
                 for loss, yj in zip(self.losses, self._in_order(y))]
        n = next(len(np.asarray(yj)) for _, yj, none in given if not none)   # no loss: labels not needed
        cols = [np.zeros(n, np.float32) if none else np.asarray(loss.labels(yj)) for loss, yj, none in given]
        for name, c in zip(self.names, cols):
            if c.ndim != 1 or len(c) != len(cols[0]):
                raise ValueError(f"{self.where}: output {name!r}: y has shape {c.shape}; it takes one "
                                 f"label per sample, ({len(cols[0])},)")
        dtype = np.result_type(np.float32, *[c.dtype for c in cols if c.dtype.kind == "f"])
        return np.stack(cols, axis=1).astype(dtype)

    def _in_order(self, y) -> list:
        """Each output's labels from a list or a dict; ValueError naming a missing one."""
        if isinstance(y, dict):
            missing = [k for k, loss in zip(self.names, self.losses)
                       if k not in y and not isinstance(loss, losses.NoLoss)]
            unknown = [k for k in y if k not in self.names]
            if missing or unknown:
                raise ValueError(f"{self.where}: y has no output {missing[0]!r}" if missing else
                                 f"{self.where}: y has an output {unknown[0]!r} the model does not have"
                                 f" (its outputs: {', '.join(self.names)})")
            return [y.get(k) for k in self.names]
        if len(y) != len(self.names):
            raise ValueError(f"{self.where}: y has {len(y)} arrays; the model has {len(self.names)} "
                             f"outputs ({', '.join(self.names)})")
        return list(y)

    def split(self, y: np.ndarray, dtype) -> list[np.ndarray]:
        """Each output's labels from the (n, outputs) array, as its loss takes them."""
        return [np.ascontiguousarray(y[:, j], loss.label_dtype(dtype)) for j, loss in enumerate(self.losses)]

    # -- the loss -------------------------------------------------------------------------------

    def __call__(self, k, outs: list, y: np.ndarray, douts: list) -> float:
        """The weighted sum of each output's mean loss; each gradient (weighted) into its dout.
        `self.last` holds each output's own (unweighted) mean loss."""
        self.last = []
        total = 0.0
        for loss, w, out, yj, dout in zip(self.losses, self.weights, outs, self.split(y, outs[0].dtype),
                                          douts, strict=True):
            value = float(loss(k, out, yj, dout))
            if w != 1.0:
                dout *= dout.dtype.type(w)
            self.last.append(value)
            total += w * value
        return total

    def logs(self, each: list[dict]) -> dict:
        """The model's evaluation from each output's ({"loss", "accuracy", ...}): Keras's names."""
        out = {"loss": sum(w * e["loss"] for w, e in zip(self.weights, each) if e)}
        out.update(self.loss_logs([e.get("loss") for e in each]))
        for name, e in zip(self.names, each):
            out.update({f"{name}_{k}": v for k, v in e.items() if k != "loss"})
        return out


def _per_output(names: list[str], spec, what: str, where: str, default) -> list:
    """compile's `spec` for each output: one for all, a list in order, a dict by name."""
    if isinstance(spec, dict):
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ConfigError(f"{where}: compile: {what} names {unknown[0]!r}, which is not an output "
                              f"(the outputs: {', '.join(names)})")
        if what == "loss" and len(spec) != len(names):
            missing = next(n for n in names if n not in spec)
            raise ConfigError(f"{where}: compile: loss has no entry for the output {missing!r}")
        return [spec.get(n, default) for n in names]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(names):
            raise ConfigError(f"{where}: compile: {what} has {len(spec)} entries; the model has "
                              f"{len(names)} outputs ({', '.join(names)})")
        return list(spec)
    if spec is None:
        return [default] * len(names)
    if what == "metrics":          # one name for several outputs: Keras refuses it too
        raise ConfigError(f"{where}: compile: metrics={spec!r}: give a list per output or a dict by "
                          f"output name ({', '.join(names)})")
    return [spec] * len(names)


def chunk_scores(k, loss: losses.Loss, out: np.ndarray, y: np.ndarray, sample_weight=None) -> tuple:
    """One output's sums over a chunk: (loss x samples, samples right or squared error, the
    scores of a one-logit output for AUC or None). Sample weights weigh the loss only: Keras's
    compiled `metrics` are unweighted (its `weighted_metrics` are not supported)."""
    if loss.task == "none":                         # an output without a loss: nothing to score
        return 0.0, 0, None
    # The loss also writes a gradient: a small scratch array, so evaluation never
    # allocates the per-layer gradient buffers (at 4096 images, hundreds of MB).
    total = losses.weighted(loss, k, out, y, np.empty_like(out), sample_weight) * out.shape[0]
    rows = out.reshape(-1, out.shape[-1])           # an output with steps: each element a row
    if loss.task == "regression":
        return total, float(np.sum((rows[:, 0].astype(np.float64) - y.reshape(-1)) ** 2)), None
    if loss.task == "retrieval":                    # the loss alone: no sample is right on its own
        return total, 0, None
    return total, metrics.accuracy(out, y), rows[:, 0].copy() if rows.shape[1] == 1 else None


def scores(loss: losses.Loss, parts: list, y: np.ndarray) -> dict:
    """One output's evaluation from its chunks' sums: loss plus accuracy (and AUC for one
    logit), or r2."""
    loss_sum, total, n = 0.0, 0, len(y)
    for part_loss, count, _ in parts:          # in chunk order: the sums of one thread's loop
        loss_sum += part_loss
        total += count
    if loss.task == "regression":
        return {"loss": loss_sum / n, "r2": metrics.r2(total, y)}
    if loss.task == "retrieval":
        return {"loss": loss_sum / n}
    if loss.task == "none":
        return {}
    result = {"loss": loss_sum / n, "accuracy": total / n}
    scores = [p[2] for p in parts if p[2] is not None]
    if scores:
        result["auc"] = metrics.auc(np.concatenate(scores), y.reshape(-1))
    return result


def _reports(loss: Loss) -> set[str]:
    """The metrics evaluation computes for an output with this loss."""
    if loss.task == "regression":
        return {"r2"}
    if loss.task in ("retrieval", "none"):
        return set()
    return {"accuracy", "auc"} if isinstance(loss, losses.BinaryCrossentropy) else {"accuracy"}


def _weight(w, where: str) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
        raise ConfigError(f"{where}: compile: loss_weights: {w!r} is not a number >= 0")
    return float(w)


__all__ = ["Heads"]
