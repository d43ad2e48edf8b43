"""pserver.keras.callbacks' built-ins against Keras 3's rules: the same logs in, the same stop
epoch, best value, files and rows out. Keras's answers were computed once with Keras 3.15.1
(keras.callbacks.* driven by hand with these logs) and each is derived by hand in its test's
docstring. Fits run on real in-process shards; `pserver run` is tests/e2e/test_keras_callbacks.py."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import pserver.keras as keras
from pserver.errors import ConfigError
from pserver.keras import layers


def blobs(n=600, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, d))
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(size=(n, d))).astype(np.float32), y


def small_model(classes=3, d=6):
    return keras.Sequential([keras.Input(shape=(d,)), layers.Dense(8, activation="relu"),
                             layers.Dense(classes, activation="softmax")])


def compiled(metrics=("accuracy",)):
    model = small_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=list(metrics))
    return model


def drive(callback, model, key, values) -> int | None:
    """The epochs' logs {key: value} through `callback` as fit would; the epoch it stopped after."""
    callback.set_model(model)
    model.stop_training = False
    callback.on_train_begin()
    for epoch, value in enumerate(values):
        callback.on_epoch_begin(epoch)
        callback.on_epoch_end(epoch, {key: value, "loss": value} if key != "loss" else {key: value})
        if model.stop_training:
            return epoch
    return None


# -- EarlyStopping's rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("key, values, kwargs, stop, best", [
    # best 1.0 (first); 0.9 + 0.05 < 1.0: best 0.9; 0.88 + 0.05 and 0.86 + 0.05 are not below 0.9:
    # wait 1, then 2 >= patience: stop after epoch 3 (Keras: 3, best 0.9).
    ("val_loss", [1.0, 0.9, 0.88, 0.86, 0.7, 0.69], dict(patience=2, min_delta=0.05), 3, 0.9),
    # "auto" maximizes accuracy. Each of 0.5, 0.6, 0.7 improves but stays under the baseline 0.8, so
    # wait grows (1, 2, 3) without a stop (an improvement returns first); 0.85 beats it: wait 0;
    # 0.84 does not improve: wait 1 >= 1, stop after epoch 4 (Keras: 4, best 0.85).
    ("val_accuracy", [0.5, 0.6, 0.7, 0.85, 0.84], dict(patience=1, baseline=0.8), 4, 0.85),
    # Epochs 0 and 1 not watched; 3 is the best; 3.5 is not below it: stop after epoch 3 (Keras: 3, 3).
    ("loss", [5, 4, 3, 3.5], dict(start_from_epoch=2), 3, 3),
    # mode="max" on a loss: 2 > 1 improves, 1.5 does not: stop after epoch 2 (Keras: 2, 2).
    ("loss", [1, 2, 1.5], dict(mode="max"), 2, 2),
    # 0.5 improves on 1.0 by exactly min_delta: not an improvement (Keras: less(0.5 + 0.5, 1.0) is
    # False), so patience 0 stops after epoch 1, best still 1.0.
    ("val_loss", [1.0, 0.5], dict(min_delta=0.5), 1, 1.0),
    # Never worse: no stop (Keras: None).
    ("val_loss", [3, 2, 1], dict(), None, 1),
])
def test_early_stopping_stops_after_keras_s_epoch_with_keras_s_best(key, values, kwargs, stop, best):
    """Catches: min_delta not required strictly, the baseline resetting the wait (or not), an
    improvement that still counts towards patience, start_from_epoch off by one, "auto" minimizing
    accuracy."""
    es = keras.callbacks.EarlyStopping(monitor=key, **kwargs)
    assert drive(es, compiled(), key, values) == stop
    assert es.best == best and es.stopped_epoch == (stop or 0)


def test_early_stopping_s_auto_mode_refuses_a_metric_of_unknown_direction_and_an_unknown_mode():
    """As Keras's ValueError (at train begin here, before any training); Keras warns and takes
    "auto" for an unknown mode: pserver refuses it (a run unlike the one asked for)."""
    es = keras.callbacks.EarlyStopping(monitor="val_foo")
    es.set_model(compiled())
    with pytest.raises(ConfigError, match="monitor=val_foo.*mode='max' or mode='min'"):
        es.on_train_begin()
    with pytest.raises(ConfigError, match="mode='maximum' is unknown: give 'auto', 'min' or 'max'"):
        keras.callbacks.EarlyStopping(mode="maximum")


def test_a_monitor_missing_from_the_logs_warns_as_keras_and_does_not_stop():
    es = keras.callbacks.EarlyStopping(monitor="val_loss")
    model = compiled()
    with pytest.warns(UserWarning, match="`val_loss` which is not available. Available metrics are: loss"):
        assert drive(es, model, "loss", [1.0, 2.0, 3.0]) is None


# -- ModelCheckpoint -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, files", [
    # Every epoch's file, named by Keras's formatting of the epoch (1-based) and its logs.
    (dict(), ["m-01-1.00.keras", "m-02-0.80.keras", "m-03-0.90.keras", "m-04-0.70.keras"]),
    # Only improvements: 1.0 (first), 0.8, 0.7 (Keras: m-01, m-02, m-04).
    (dict(save_best_only=True), ["m-01-1.00.keras", "m-02-0.80.keras", "m-04-0.70.keras"]),
    # initial_value_threshold 0.85 is the first best: 1.0 does not beat it (Keras: m-02, m-04).
    (dict(save_best_only=True, initial_value_threshold=0.85), ["m-02-0.80.keras", "m-04-0.70.keras"]),
    # mode="max" on val_loss: 1.0 then nothing beats it (Keras's rule, the direction forced).
    (dict(save_best_only=True, mode="max"), ["m-01-1.00.keras"]),
])
def test_model_checkpoint_writes_keras_s_files(tmp_path, kwargs, files):
    """Catches: the epoch 0-based in the name, save_best_only saving a worse epoch, the threshold
    ignored, mode ignored."""
    model = compiled()
    ck = keras.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch:02d}-{val_loss:.2f}.keras"), **kwargs)
    drive(ck, model, "val_loss", [1.0, 0.8, 0.9, 0.7])
    assert sorted(os.listdir(tmp_path)) == files


def test_model_checkpoint_s_file_loads_back_as_the_model_at_that_epoch(tmp_path):
    """A whole fit on its own shards: the last epoch's file (load_model) and the weights-only file
    (load_weights) hold the model's weights after fit. Catches: the initial weights saved (the
    callback's model not given the epoch's), a weights file load_weights cannot read."""
    x, y = blobs(200)
    model = compiled()
    whole = keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.keras"))
    weights = keras.callbacks.ModelCheckpoint(tmp_path / "w.weights.h5", save_weights_only=True)
    before = model.get_weights()
    h = model.fit(x, y, batch_size=20, epochs=2, verbose=0, validation_split=0.2, callbacks=[whole, weights])
    final = model.get_weights()
    assert not all(np.array_equal(a, b) for a, b in zip(before, final))
    loaded = keras.models.load_model(tmp_path / "e2.keras")
    assert all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), final))
    val_loss = loaded.evaluate(x[160:], y[160:], verbose=0)[0]
    assert val_loss == pytest.approx(h.history["val_loss"][-1], rel=1e-4)
    other = compiled()
    other.load_weights(tmp_path / "w.weights.h5")
    assert all(np.array_equal(a, b) for a, b in zip(other.get_weights(), final))


@pytest.mark.parametrize("make, named", [
    (lambda: keras.callbacks.ModelCheckpoint("m.h5", save_weights_only=True), "must end in .weights.h5"),
    (lambda: keras.callbacks.ModelCheckpoint("m.pserver"), "must end in .keras or .h5"),
    (lambda: keras.callbacks.ModelCheckpoint("m.keras", save_freq=100), "save_freq=100 is not supported"),
    (lambda: keras.callbacks.ModelCheckpoint("m.keras", save_freq="step"), "unrecognized save_freq"),
    (lambda: keras.callbacks.ModelCheckpoint("m.keras", mode="up"), "mode='up' is unknown"),
    (lambda: keras.callbacks.ReduceLROnPlateau(factor=1.0), "does not support a factor >= 1.0"),
    (lambda: keras.callbacks.ReduceLROnPlateau(epsilon=0.1), "unexpected argument 'epsilon'"),
    (lambda: keras.callbacks.LearningRateScheduler(0.1), "schedule must be a function"),
    (lambda: keras.callbacks.BackupAndRestore("b", save_freq=10), "save_freq=10 is not supported"),
    (lambda: keras.callbacks.TensorBoard(histogram_freq=1), "histogram_freq=1 is not supported by pserver"),
    (lambda: keras.callbacks.TensorBoard(profile_batch=(2, 4)), r"profile_batch=\(2, 4\) is not supported"),
])
def test_what_pserver_cannot_honour_is_refused_in_one_line_at_construction(make, named):
    """Catches: an argument accepted and ignored, a callback that would run and change nothing."""
    with pytest.raises(ConfigError, match=named) as e:
        make()
    assert "\n" not in str(e.value)


def test_restore_best_weights_leaves_the_best_epoch_s_weights_even_without_a_stop(tmp_path):
    """Keras's rule in a plain run: at the end the model holds the weights of the epoch whose
    monitored value was best (here the largest val_loss, epoch 0, with mode="max"), though the
    patience never ran out; model.save writes them. Catches: the final weights kept (the loop's last
    on_weights winning over the restore), the weights of the wrong epoch, a restore only on a stop."""
    x, y = blobs(192)
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(
        (logs["val_loss"], model.get_weights())))
    model = compiled()
    es = keras.callbacks.EarlyStopping(mode="max", patience=10, restore_best_weights=True)
    model.fit(x, y, epochs=3, verbose=0, validation_data=(x, y), callbacks=[record, es])
    best = max(range(3), key=lambda e: seen[e][0])
    assert es.stopped_epoch == 0 and best == es.best_epoch == 0
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), seen[best][1]))
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), seen[-1][1]))
    model.save(tmp_path / "m.keras")
    saved = keras.models.load_model(tmp_path / "m.keras").get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(saved, seen[best][1]))


def test_restore_best_weights_with_sparse_tables_is_refused_at_fit_in_one_line():
    """Their rows are not copied at each epoch's end: a restore would set back the dense weights
    only. Catches: the restore accepted and the model left half restored."""
    model = keras.Sequential([keras.Input(shape=(3,), dtype="int64"), layers.Embedding(None, 4, sparse=True),
                              layers.Flatten(), layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy")
    es = keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True)
    with pytest.raises(ConfigError, match=r"restore_best_weights=True is not supported for a model with "
                                          r"sparse tables \(embedding") as e:
        model.fit(np.zeros((8, 3), np.int64), np.zeros(8, np.float32), epochs=1, verbose=0, callbacks=[es])
    assert "\n" not in str(e.value)


def test_backup_and_restore_is_refused_at_fit_without_pserver_run_s_checkpoints():
    """A plain script has no shards' checkpoints to resume from: fit says where they are."""
    x, y = blobs(64)
    with pytest.raises(ConfigError, match=r"BackupAndRestore: .*--checkpoint-dir DIR") as e:
        compiled().fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.BackupAndRestore("b")])
    assert "\n" not in str(e.value)


def test_tensorboard_writes_the_epoch_logs_as_keras_lays_them_out(tmp_path):
    """log_dir/train holds epoch_loss and epoch_accuracy per epoch, log_dir/validation the val_
    ones without the prefix, at steps 0, 1. Catches: a val_ scalar in train, a missing epoch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    x, y = blobs(128)
    h = compiled().fit(x, y, epochs=2, verbose=0, validation_data=(x, y),
                       callbacks=[keras.callbacks.TensorBoard(tmp_path / "tb")])
    for part, prefix in (("train", ""), ("validation", "val_")):
        acc = EventAccumulator(str(tmp_path / "tb" / part))
        acc.Reload()
        assert sorted(acc.Tags()["scalars"]) == ["epoch_accuracy", "epoch_loss"]
        for name in ("loss", "accuracy"):
            events = acc.Scalars(f"epoch_{name}")
            assert [e.step for e in events] == [0, 1]
            assert [e.value for e in events] == pytest.approx(h.history[prefix + name], rel=1e-6)


def test_a_model_checkpoint_filepath_naming_a_missing_log_is_one_line():
    ck = keras.callbacks.ModelCheckpoint("m-{val_acc:.2f}.keras")
    ck.set_model(compiled())
    ck.on_train_begin()
    with pytest.raises(ConfigError, match="the epoch logs have no 'val_acc'"):
        ck.on_epoch_end(0, {"loss": 1.0})


# -- CSVLogger, TerminateOnNaN, LambdaCallback ---------------------------------------------------------

def test_csv_logger_writes_keras_s_rows_and_appends_without_a_second_header(tmp_path):
    """Keras's file: "epoch" then the first epoch's keys sorted, with val_ columns ("NA") when
    the logs have none; append=True adds rows under the existing header. Catches: unsorted or
    missing columns, a second header, a 1-based epoch."""
    path = tmp_path / "log.csv"
    model = compiled()
    for append, rows in ((False, [(0, 0.5, 0.25), (1, 0.25, 0.5)]), (True, [(0, 0.125, 0.75)])):
        log = keras.callbacks.CSVLogger(path, separator=";", append=append)
        log.set_model(model)
        log.on_train_begin()
        for epoch, loss, acc in rows:
            log.on_epoch_end(epoch, {"loss": loss, "accuracy": acc})
        log.on_train_end()
    assert path.read_text() == ("epoch;accuracy;loss;val_accuracy;val_loss\n0;0.25;0.5;NA;NA\n"
                                "1;0.5;0.25;NA;NA\n0;0.75;0.125;NA;NA\n")


def test_terminate_on_nan_stops_at_a_nan_batch_or_epoch_loss():
    """A NaN of this worker's batches, or the epoch's loss over every worker's (on the chief: the
    cluster's decision). Catches: an inf let through, the epoch's loss not checked."""
    model = compiled()
    t = keras.callbacks.TerminateOnNaN()
    t.set_model(model)
    model.stop_training = False
    t.on_train_batch_end(0, {"loss": 1.0})
    assert not model.stop_training
    t.on_train_batch_end(1, {"loss": math.inf})
    assert model.stop_training
    model.stop_training = False
    t.on_epoch_end(0, {"loss": math.nan})
    assert model.stop_training
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 2"):
        keras.callbacks.TerminateOnNaN(raise_error=True).on_train_batch_end(2, {"loss": math.nan})


def test_lambda_callback_calls_its_functions_and_early_stopping_ends_a_fit():
    """Catches: a LambdaCallback hook not called, EarlyStopping's stop not ending the fit."""
    x, y = blobs(200)
    seen = []
    model = keras.Sequential([keras.Input(shape=(6,)), layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    cb = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, sorted(logs))),
                                        on_train_end=lambda logs: seen.append("end"), note="kept")
    es = keras.callbacks.EarlyStopping(monitor="loss", min_delta=100.0, patience=1)   # never enough
    h = model.fit(x, y, batch_size=20, epochs=6, verbose=0, callbacks=[cb, es])
    assert h.epoch == [0, 1] and es.stopped_epoch == 1 and cb.note == "kept"
    assert seen == [(0, ["loss"]), (1, ["loss"]), "end"]


def _compiled(lr=1.0):
    model = keras.Sequential([keras.Input(shape=(1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def _rates(callback, losses) -> list[float]:
    model = _compiled()
    callback.set_model(model)
    callback.on_train_begin()
    out = []
    for epoch, loss in enumerate(losses):
        callback.on_epoch_end(epoch, {"val_loss": loss})
        out.append(round(float(model.optimizer.learning_rate), 8))
    return out


def test_reduce_lr_on_plateau_follows_keras_s_rule():
    """The rates after each epoch equal Keras 3.15.1's for the same val_loss (computed once with
    its ReduceLROnPlateau). First: patience 2 -> halved after epoch 3 (0.95, 0.91 do not beat
    0.9), cooldown 1 skips epoch 4's count, halved again after epoch 5, then min_lr 0.2 floors
    0.125, and 0.2 is not above float32(0.2), so not reduced again. Second: min_delta 1e-4 and
    patience 1 cut 1.0 four times, 0.99995 not counting as better than 1.0 by 1e-4. Catches a
    cooldown, min_delta or min_lr rule off by one."""
    rlr = keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=2, cooldown=1, min_lr=0.2)
    assert _rates(rlr, [1.0, 0.9, 0.95, 0.91, 0.92, 0.93, 0.5, 0.6, 0.7, 0.8]) == \
        [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2, 0.2]
    rlr = keras.callbacks.ReduceLROnPlateau(factor=0.1, patience=1)
    assert _rates(rlr, [1.0, 1.0, 1.0, 1.0, 0.99995, 0.9]) == [1.0, 0.1, 0.01, 0.001, 0.0001, 0.0001]


def test_learning_rate_scheduler_takes_either_form_and_the_list_reports_each_change_once():
    """schedule(epoch, lr) and schedule(epoch) set the rate at each epoch's beginning, logged as
    learning_rate at its end; CallbackList.lr_change gives a changed rate once (the chief sends
    it to the shards once). Catches a change sent every epoch or never."""
    model = _compiled(0.5)
    two = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch else lr)
    hooks = keras.callbacks.CallbackList([two], model, {}, [])
    seen = []
    for epoch in range(3):
        two.on_epoch_begin(epoch)
        seen.append(hooks.lr_change())
        logs = {}
        two.on_epoch_end(epoch, logs)
        assert logs["learning_rate"] == model.optimizer.learning_rate
    assert seen == [None, 0.25, 0.125]
    one = keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 * (epoch + 1))
    one.set_model(model)
    one.on_epoch_begin(2)
    assert model.optimizer.learning_rate == pytest.approx(0.3)
    bad = keras.callbacks.LearningRateScheduler(lambda epoch: 1)
    bad.set_model(model)
    with pytest.raises(ConfigError, match="should be a float. Got: 1"):
        bad.on_epoch_begin(0)
