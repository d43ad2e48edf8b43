"""keras.metrics with a state of sums (pserver.models.metrics): each against Keras 3's value on
small cases (computed with Keras 3.15.1 in development, hard-coded here), properties over random
data (hypothesis), and compile/fit/evaluate/save with them in one process. The cluster's exact
epoch logs over two workers: tests/e2e/test_keras_metrics_run.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pserver import keras
from pserver.errors import ConfigError
from pserver.models import metrics as M

FAST = settings(max_examples=30, deadline=None)

Y = np.array([0, 1, 1, 0, 1, 0.0])
P = np.array([0.1, 0.6, 0.4, 0.7, 0.9, 0.3]).reshape(-1, 1)
P3 = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
Y3 = np.array([1, 2, 0, 1])
YH = np.array([[0, 1], [1, 0], [1, 1]])
PH = np.array([[0.2, 0.7], [0.5, 0.6], [0.9, 0.1]])


def _result(metric, y, p) -> float:
    metric.update_state(y, p)
    return metric.result()


@pytest.mark.parametrize("metric, y, p, keras_value", [
    (M.AUC(), Y, P, 0.7777777910232544),
    (M.AUC(curve="PR"), Y, P, 0.7689509391784668),
    (M.AUC(num_thresholds=3), Y, P, 0.6666666269302368),
    (M.AUC(num_thresholds=5, curve="PR"), Y, P, 0.8007864952087402),
    (M.Precision(), Y, P, 2 / 3),
    (M.Recall(), Y, P, 2 / 3),
    (M.Precision(thresholds=0.35), Y, P, 0.75),
    (M.MeanSquaredError(), Y, P, 0.18666666746139526),
    (M.RootMeanSquaredError(), Y, P, 0.43204939365386963),
    (M.MeanAbsoluteError(), Y, P, 0.36666667461395264),
    (M.SparseTopKCategoricalAccuracy(k=2), Y3, P3, 0.75),      # a tie at the k-th counts as in
    (M.TopKCategoricalAccuracy(k=1), np.eye(3)[Y3], P3, 0.25),
    (M.Precision(top_k=1), Y3, P3, 0.25),
    (M.Recall(class_id=2), Y3, P3, 1.0),
    (M.Precision(class_id=0), Y3, P3, 0.0),                      # no true positive: divide_no_nan
    (M.TruePositives(), Y, P, 2.0),
    (M.TruePositives(thresholds=0.35), Y, P, 3.0),
    (M.FalsePositives(), Y, P, 1.0),
    (M.TrueNegatives(), Y, P, 2.0),
    (M.FalseNegatives(), Y, P, 1.0),
    (M.FalseNegatives(thresholds=[0.35]), Y, P, 0.0),
    (M.TruePositives(), YH, PH, 2.0),                            # every element of a one-hot row
    (M.FalsePositives(), YH, PH, 1.0),
    (M.TrueNegatives(), YH, PH, 1.0),
    (M.FalseNegatives(), YH, PH, 2.0),
])
def test_each_metric_equals_keras_s_value(metric, y, p, keras_value):
    """Catches a formula off Keras's: AUC's thresholds or its PR interpolation, > against >=, a
    top-k tie broken the other way, a class_id or top_k filter on the wrong axis."""
    assert _result(metric, y, p) == pytest.approx(keras_value, rel=1e-6, abs=1e-7)


binary = st.integers(2, 40).flatmap(lambda n: st.tuples(
    hnp.arrays(np.float64, n, elements=st.floats(0, 1)),
    hnp.arrays(np.int64, n, elements=st.integers(0, 1))))


@FAST
@given(binary, st.integers(1, 39))
def test_the_sums_of_two_parts_give_the_metric_of_the_whole(data, cut):
    """What shard 0 relies on: a state is sums over samples, so two workers' states added are the
    state of all their samples. Catches a state that is a mean (or a ratio) of its batch."""
    p, y = data
    cut = min(cut, len(p) - 1)
    for make in (M.AUC, lambda: M.AUC(curve="PR"), M.Precision, M.Recall, M.MeanSquaredError,
                 M.RootMeanSquaredError, M.TruePositives, M.FalsePositives, M.TrueNegatives,
                 M.FalseNegatives):
        m = make()
        pc = p.reshape(-1, 1)
        added = m.sums(pc[:cut], y[:cut]) + m.sums(pc[cut:], y[cut:])
        assert m.value(added) == pytest.approx(m.value(m.sums(pc, y)), abs=1e-12)


@FAST
@given(binary)
def test_a_perfect_prediction_scores_one_and_the_reverse_zero(data):
    """Precision, recall and AUC of the labels themselves are 1 (when both classes are there);
    of their reverse, 0; the squared errors of a perfect prediction are 0."""
    _, y = data
    if y.min() == y.max():
        return
    right, wrong = y.astype(np.float64).reshape(-1, 1), 1.0 - y.reshape(-1, 1)
    for make in (M.Precision, M.Recall, M.AUC, lambda: M.AUC(curve="PR")):
        assert _result(make(), y, right) == pytest.approx(1.0)
    for make in (M.Precision, M.Recall, M.AUC):
        assert _result(make(), y, wrong) == pytest.approx(0.0)
    assert _result(M.MeanSquaredError(), y, right) == 0.0


@FAST
@given(st.integers(2, 6).flatmap(lambda c: st.tuples(
    hnp.arrays(np.float64, (12, c), elements=st.floats(0, 1)),
    hnp.arrays(np.int64, 12, elements=st.integers(0, c - 1)))),
    st.integers(1, 6))
def test_top_k_is_the_rank_of_the_true_class(data, k):
    """In the top k when fewer than k classes score strictly higher (TensorFlow's in_top_k); all
    in when k is the number of classes."""
    p, y = data
    above = (p > p[np.arange(12), y][:, None]).sum(axis=1)
    assert _result(M.SparseTopKCategoricalAccuracy(k=k), y, p) == pytest.approx(np.mean(above < k))
    if k >= p.shape[1]:
        assert _result(M.SparseTopKCategoricalAccuracy(k=k), y, p) == 1.0


def test_reset_state_forgets_and_a_metric_keeps_adding_batches():
    m = M.Precision()
    m.update_state(Y[:3], P[:3])
    m.update_state(Y[3:], P[3:])
    assert m.result() == pytest.approx(2 / 3)
    m.reset_state()
    assert m.result() == 0.0


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    return model


def test_compile_fit_evaluate_and_load_report_the_metrics_by_keras_s_names(tmp_path):
    """evaluate's metrics equal the metric objects on predict's outputs (probabilities: the fused
    sigmoid applied); fit's logs have them and their val_ twins; a saved model reports the same
    after load_model. Catches metrics on logits, a lost name, a config that loses an argument."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = (x[:, 0] > 0.2).astype("float32")
    model = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.Precision(thresholds=0.4), "recall",
                           keras.metrics.AUC(num_thresholds=20, name="auc20"), "mse"])
    h = model.fit(x, y, batch_size=32, epochs=2, verbose=0, validation_data=(x, y))
    assert {"precision", "recall", "auc20", "mse", "val_precision", "val_auc20"} <= set(h.history)
    ev = model.evaluate(x, y, verbose=0, return_dict=True)
    p = model.predict(x, verbose=0)
    for m in (M.Precision(thresholds=0.4), M.Recall(), M.AUC(num_thresholds=20), M.MeanSquaredError()):
        key = {"auc": "auc20", "mean_squared_error": "mse"}.get(m.name, m.name)
        assert ev[key] == pytest.approx(_result(m, y, p), abs=1e-6), key
    model.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras").evaluate(x, y, verbose=0, return_dict=True)
    assert again == pytest.approx(ev)


@pytest.mark.parametrize("metrics, message", [
    (["precison"], r"'precison' is not supported"),
    ([keras.metrics.Precision(), "precision"], r"two metrics log as 'precision': give one a name="),
    (keras.metrics.Recall(), r"give a list of names"),
])
def test_what_compile_refuses_it_says_in_one_line(metrics, message):
    model = _model()
    with pytest.raises(ConfigError, match=message) as e:
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=metrics)
        model.build()
    assert "\n" not in str(e.value)


def test_arguments_keras_s_logs_cannot_hold_are_refused():
    with pytest.raises(ConfigError, match="give one threshold"):
        M.Precision(thresholds=[0.3, 0.5])
    with pytest.raises(ConfigError, match="multi_label"):
        M.AUC(multi_label=True)


def test_a_model_with_sparse_tables_logs_its_metric_objects(monkeypatch):
    """A model with sparse tables trains and evaluates apart (pserver.models.sparse_graph): its
    compiled Metric objects are counted there too, in fit's logs and evaluate's, and evaluate's
    precision is the one its predictions give. Catches: the metric refused or never logged, or
    counted on the wrong outputs (logits where the probabilities are meant)."""
    from pserver.launch.run import SEED
    monkeypatch.setenv(SEED, "0")                 # set_random_seed sets it: undone after the test
    layers = keras.layers
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (256, 3))
    y = (ids[:, 0] % 2).astype(np.float32)
    model = keras.Sequential([keras.Input(shape=(3,), dtype="int64"), layers.Embedding(None, 4, sparse=True),
                              layers.Flatten(), layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["precision"])
    history = model.fit(ids, y, epochs=2, batch_size=32, verbose=0)
    assert len(history.history["precision"]) == 2
    logs = model.evaluate(ids, y, verbose=0, return_dict=True)
    said = model.predict(ids, verbose=0)[:, 0] > 0.5
    assert logs["precision"] == pytest.approx((said & (y == 1)).sum() / said.sum(), rel=1e-9)


@pytest.mark.parametrize("monitor, op", [("val_precision", max), ("auc20", max), ("val_mse", min),
                                         ("root_mean_squared_error", min)])
def test_auto_monitoring_follows_each_metric_s_direction(monitor, op):
    """Keras's _direction: precision and AUC grow, errors shrink. Catches: an error maximized, or
    "auto" refusing a compiled metric it can tell the direction of."""
    model = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["precision", keras.metrics.AUC(name="auc20"), "mse",
                           keras.metrics.RootMeanSquaredError()])
    es = keras.callbacks.EarlyStopping(monitor=monitor)
    es.set_model(model)
    es.on_train_begin()
    assert es.monitor_op is op


@FAST
@given(binary, st.floats(0, 1))
def test_the_four_counts_cover_every_element_once(data, threshold):
    """Catches a count off by the threshold's side (>= for >) or an element counted in two cells:
    tp + fp + tn + fn is every element, tp + fn the positives, and they agree with Precision's and
    Recall's state."""
    p, y = data
    pc = p.reshape(-1, 1)
    tp, fp, tn, fn = (float(make(thresholds=threshold).sums(pc, y)[0]) for make in
                      (M.TruePositives, M.FalsePositives, M.TrueNegatives, M.FalseNegatives))
    assert tp + fp + tn + fn == len(p) and tp + fn == y.sum()
    assert tp + fp == np.count_nonzero(p > threshold)
    assert [tp, fp] == list(M.Precision(thresholds=threshold).sums(pc, y))


def test_counts_log_by_keras_s_names_and_auto_monitoring_refuses_them():
    """Keras's names ("true_positives" as a string too) and its refusal of "auto" for a metric of
    no direction. Catches a count monitored as growing (EarlyStopping on false_positives)."""
    model = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["true_positives", keras.metrics.FalsePositives()])
    assert [m.name for m in model._core.metric_objects] == ["true_positives", "false_positives"]
    for monitor in ("val_false_positives", "true_positives"):
        es = keras.callbacks.EarlyStopping(monitor=monitor)
        es.set_model(model)
        with pytest.raises(ConfigError, match="cannot tell whether that metric should be maximized"):
            es.on_train_begin()
    es = keras.callbacks.EarlyStopping(monitor="val_false_positives", mode="min")
    es.set_model(model)
    es.on_train_begin()
    assert es.monitor_op is min


def test_a_metric_of_one_s_own_with_sums_and_value_logs_and_one_with_update_state_is_refused():
    """The guide's metric of one's own (docs/guide/keras.md): its sums go through fit and evaluate
    as a compiled metric's. Catches: one with only Keras's update_state/result failing deep in fit
    with no word of what to define (it did), instead of one line at compile."""
    class MeanPrediction(keras.metrics.Metric):
        def sums(self, pred, y):
            return np.array([pred.mean(axis=1).sum(), len(pred)])

        def value(self, sums):
            return sums[0] / max(sums[1], 1)

    class KerasStyle(keras.metrics.Metric):
        def update_state(self, y_true, y_pred, sample_weight=None):
            pass

        def result(self):
            return 0.0

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64).astype(np.float32)
    model = _model()
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=[MeanPrediction(name="mean_pred")])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert logs["mean_pred"] == pytest.approx(float(model.predict(x, verbose=0).mean()), rel=1e-5)
    with pytest.raises(ConfigError, match=r"^compile: metrics: KerasStyle does not define sums\(pred, y\) "
                                          r"and value\(sums\)") as e:
        _model().compile(optimizer="adam", loss="binary_crossentropy", metrics=[KerasStyle()])
    assert "\n" not in str(e.value)
