"""keras.optimizers.schedules and the optimizers' clipping: each schedule's rate is Keras's
formula (written here from keras/src/optimizers/schedules/learning_rate_schedule.py, Keras
3.15.1), reaches the shards as their --lr-schedule and is what a shard applies at its step;
clipvalue on the shards' aggregated gradient, clipnorm and global_clipnorm on each worker's
(docs/semantics.md). Each test names the bug it catches."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pserver.keras as keras
from pserver.config import ServerConfig
from pserver.errors import ConfigError
from pserver.keras import layers
from pserver.optim import make_optimizer
from pserver.optim.clip import clip_by_global_norm, clip_by_norm, gradient_clip
from pserver.optim.schedule import parse_schedule
from tests.support.pushes import push_all
from tests.support.shards import one_shard

S = keras.optimizers.schedules
steps = st.integers(0, 10_000)
rates = st.floats(1e-5, 1.0)


# -- Keras's formulas, from its source ----------------------------------------------------------

def keras_exponential(step, initial, decay_steps, decay_rate, staircase):
    p = step / decay_steps
    return initial * decay_rate ** (math.floor(p) if staircase else p)


def keras_inverse_time(step, initial, decay_steps, decay_rate, staircase):
    p = step / decay_steps
    return initial / (1 + decay_rate * (math.floor(p) if staircase else p))


def keras_piecewise(step, boundaries, values):
    out = (step <= boundaries[0]) * values[0] + (step > boundaries[-1]) * values[-1]
    for low, high, v in zip(boundaries[:-1], boundaries[1:], values[1:-1]):
        out += (low < step <= high) * v
    return out


def keras_cosine(step, initial, decay_steps, alpha, warmup_target, warmup_steps):
    def decay(s, lr):
        return lr * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * s / decay_steps)) + alpha)
    if warmup_target is None:
        return decay(min(step, decay_steps), initial)
    s = min(step, decay_steps + warmup_steps)
    if s < warmup_steps:
        return (warmup_target - initial) * s / warmup_steps + initial
    return decay(s - warmup_steps, warmup_target)


def close(a, b):
    return a == pytest.approx(b, rel=1e-9, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(steps, rates, st.floats(0.5, 5000), st.floats(0.0, 1.0), st.booleans())
def test_exponential_and_inverse_time_are_keras_s_formulas(step, lr, decay_steps, decay_rate, staircase):
    """Catches: staircase flooring the wrong thing, step / decay_steps inverted, a shard
    schedule that drops the staircase flag on its way (the spec's round trip)."""
    for cls, formula in ((S.ExponentialDecay, keras_exponential), (S.InverseTimeDecay, keras_inverse_time)):
        schedule = cls(lr, decay_steps, decay_rate, staircase)
        assert close(schedule(step), formula(step, lr, decay_steps, decay_rate, staircase))
        base, rule = schedule.on_shards()
        assert parse_schedule(rule.spec) == rule and base == lr


@settings(max_examples=60, deadline=None)
@given(steps, st.lists(st.integers(0, 5000), min_size=1, max_size=5, unique=True),
       st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), st.floats(0.01, 1.0))
def test_piecewise_is_keras_s_formula(step, boundaries, values, top):
    """Catches: a boundary step given the next value (Keras's is `step <= boundary`), values
    off by one, the multipliers not scaled back by the shards' lr."""
    boundaries = sorted(boundaries)
    values = [top] + values[:len(boundaries)]
    schedule = S.PiecewiseConstantDecay(boundaries, values)
    for t in (step, *boundaries, *(b + 1 for b in boundaries)):
        assert close(schedule(t), keras_piecewise(t, boundaries, values))
    base, rule = schedule.on_shards()
    assert parse_schedule(rule.spec) == rule and base == max(values)


@settings(max_examples=60, deadline=None)
@given(steps, rates, st.integers(1, 5000), st.floats(0.0, 1.0),
       st.one_of(st.none(), st.floats(1e-4, 1.0)), st.integers(0, 500))
def test_cosine_with_and_without_warmup_is_keras_s_formula(step, lr, decay_steps, alpha, target, warmup):
    """Catches: the warmup's start (initial_learning_rate, even 0) lost, the decay counted from
    step 0 rather than the warmup's end, no floor at alpha after decay_steps."""
    for initial in (lr, 0.0) if target is not None else (lr,):
        schedule = S.CosineDecay(initial, decay_steps, alpha, warmup_target=target, warmup_steps=warmup)
        for t in (step, warmup, warmup + decay_steps, 0):
            assert close(schedule(t), keras_cosine(t, initial, decay_steps, alpha, target, warmup))
        base, rule = schedule.on_shards()
        assert parse_schedule(rule.spec) == rule


def test_the_old_cosine_spec_keeps_its_meaning():
    """Catches: the extended cosine (ALPHA, warmup) changing what `cosine:TOTAL` did."""
    old = parse_schedule("cosine:10")
    assert [old(t) for t in (0, 10, 50)] == [1.0, 0.0, 0.0] and close(old(5), 0.5)


@pytest.mark.parametrize("spec", ["exponential:0,0.5", "exponential:10", "exponential:10,0.5,stairs",
                                  "inverse_time:10,-1", "piecewise:1,10", "piecewise:1,10,0.5,5,0.1",
                                  "piecewise:1,x,0.5", "piecewise:-1,3,1", "cosine:10,0.1,5",
                                  "cosine:10,0.1,-1,0", "cosine:10,1.5"])
def test_bad_keras_specs_are_refused_quoting_them(spec):
    with pytest.raises(ConfigError, match="--lr-schedule: bad schedule"):
        parse_schedule(spec)


# -- the shards run them --------------------------------------------------------------------

def test_a_shard_applies_the_rate_at_its_step():
    """Catches: the schedule not reaching the shard (ServerConfig.lr_schedule), or evaluated at
    the step after (1-based) or at the worker's clock rather than the shard's version."""
    schedule = S.PiecewiseConstantDecay([1, 2], [0.5, 0.25, 0.125])
    base, rule = schedule.on_shards()
    shard = one_shard(3, 1, mode="sync", optimizer="sgd", lr=base, lr_schedule=rule.spec)
    g, w = np.array([1.0, -2.0, 4.0], np.float32), np.zeros(3)
    for t in range(4):
        push_all([shard], 0, [t], g)
        w -= schedule(t) * g
        np.testing.assert_allclose(shard.store.params, w, rtol=1e-6)


def test_keras_optimizer_with_a_schedule_gives_the_shards_lr_and_spec():
    """Catches: a schedule given as a settings value a shard cannot take, or a model file that
    loses it (load_model's optimizer back at a constant rate)."""
    opt = keras.optimizers.SGD(S.ExponentialDecay(0.1, 100, 0.5, staircase=True), clipvalue=0.5)
    assert opt.settings() == {"optimizer": "sgd", "lr": 0.1, "lr_schedule": "exponential:100.0,0.5,staircase",
                              "clipvalue": 0.5}
    cfg = ServerConfig(**opt.settings())
    assert cfg.training_settings(1)["lr_schedule"] == "exponential:100.0,0.5,staircase"
    again = keras.optimizers.from_settings(json.loads(json.dumps(opt.get_config())))
    assert type(again.learning_rate) is S.ExponentialDecay and again.settings() == opt.settings()
    assert again.learning_rate.get_config() == opt.learning_rate.get_config()


def test_a_schedule_of_your_own_is_refused_in_one_line():
    """Catches: a user's LearningRateSchedule taken at its first value (or silently ignored)."""
    class Halving(S.LearningRateSchedule):
        def __call__(self, step):
            return 0.1 / (step + 1)

        def get_config(self):
            return {}
    with pytest.raises(ConfigError, match="a LearningRateSchedule of your own cannot run on the shards"):
        keras.optimizers.Adam(learning_rate=Halving())
    with pytest.raises(ConfigError, match="learning_rate must be a number or a schedule"):
        keras.optimizers.Adam(learning_rate=lambda step: 0.1)


@pytest.mark.parametrize("make, message", [
    (lambda: S.ExponentialDecay(0.1, 0, 0.5), "decay_steps must be > 0"),
    (lambda: S.PiecewiseConstantDecay([10], [0.1]), "one more value than boundaries"),
    (lambda: S.PiecewiseConstantDecay([10, 5], [0.1, 0.2, 0.3]), "boundaries must increase"),
    (lambda: S.CosineDecay(0.1, 10.5), "decay_steps must be an integer > 0"),
    (lambda: S.CosineDecay(0.0, 10), "initial_learning_rate must be a number > 0"),
])
def test_bad_schedule_arguments_are_refused_naming_them(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# -- clipping -------------------------------------------------------------------------------

def keras_clip_by_norm(g, c):          # base_optimizer._clip_by_norm
    norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
    return g * c / max(norm, c) if norm > 0 else g


def keras_clip_by_global_norm(gs, c):  # base_optimizer.clip_by_global_norm
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))
    return [g * c * min(1 / norm, 1 / c) for g in gs]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.01, 10.0), st.floats(0.01, 10.0))
def test_norm_clips_are_keras_s_formulas_per_tensor_and_over_all(seed, scale, c):
    """Catches: clipnorm over the whole gradient (Keras's is per tensor), global_clipnorm per
    tensor, a frozen tensor counted in the norm or scaled."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(12) * scale).astype(np.float32)
    ranges = [(0, 4), (4, 5), (8, 12)]                 # [5, 8): a frozen tensor, left as it is
    one = g.copy()
    clip_by_norm(one, ranges, c)
    for a, b in ranges:
        np.testing.assert_allclose(one[a:b], keras_clip_by_norm(g[a:b], c), rtol=1e-6)
    every = g.copy()
    clip_by_global_norm(every, ranges, c)
    for (a, b), want in zip(ranges, keras_clip_by_global_norm([g[a:b] for a, b in ranges], c)):
        np.testing.assert_allclose(every[a:b], want, rtol=1e-6)
    assert np.array_equal(one[5:8], g[5:8]) and np.array_equal(every[5:8], g[5:8])
    assert gradient_clip(ranges) is None


def test_clipvalue_clips_the_aggregated_gradient_on_the_shard():
    """Catches: clipvalue applied to each push (the mean of [3] and [-1] clipped is 0.5; each
    clipped, then averaged, 0), or not applied (a step of 1)."""
    shard = one_shard(1, 2, mode="sync", optimizer="sgd", lr=1.0, clipvalue=0.5)
    push_all([shard], 0, [0], np.array([3.0], np.float32))
    push_all([shard], 1, [0], np.array([-1.0], np.float32))
    assert shard.store.params[0] == pytest.approx(-0.5)
    opt = make_optimizer("adam", 3, lr=0.1, clipvalue=0.25)
    w, g = np.zeros(3, np.float32), np.array([-9.0, 0.1, 9.0], np.float32)
    opt.step(w, g, 0)
    assert g[0] == -9.0                                 # the caller's gradient left as it was


def test_keras_refuses_what_keras_refuses():
    """Catches: two clipping modes at once (Keras: only one), a clip of 0 or below."""
    with pytest.raises(ConfigError, match="only one of clipnorm, clipvalue and global_clipnorm"):
        keras.optimizers.Adam(clipnorm=1.0, global_clipnorm=1.0)
    with pytest.raises(ConfigError, match="clipnorm must be a number > 0"):
        keras.optimizers.SGD(clipnorm=-1)
    with pytest.raises(ConfigError, match="--clipvalue"):
        make_optimizer("sgd", 1, lr=0.1, clipvalue=-1)


def regression(n=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    return x, (x @ np.array([[4.0], [-3.0], [2.0]], np.float32) + 5).astype(np.float32)


@pytest.mark.parametrize("clip", [dict(clipnorm=0.3), dict(global_clipnorm=0.3), dict(clipvalue=0.05)])
def test_fit_with_a_schedule_and_a_clip_is_keras_s_update(clip):
    """Keras's SGD in one worker, step by step in NumPy: w -= rate(t) * clip(g). Catches a fit
    that drops the schedule or the clip on the way to the shards or the worker loop."""
    x, y = regression()
    schedule = S.InverseTimeDecay(0.1, 1, 0.5)
    model = keras.Sequential([keras.Input(shape=(3,)), layers.Dense(2), layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule, **clip), loss="mse")
    w = np.concatenate([a.ravel() for a in model.get_weights()]).astype(np.float32)
    core, ranges = model._core, list(model._core.layout.offsets().values())
    for t in range(3):
        g = np.empty_like(w)
        core.loss_and_grad(w, x, y, g)
        if "clipvalue" in clip:
            g = np.clip(g, -0.05, 0.05)
        else:
            gradient_clip(ranges, **clip)(g)
        w = w - np.float32(schedule(t)) * g
    model.fit(x, y, batch_size=len(x), epochs=3, shuffle=False, verbose=0)
    have = np.concatenate([a.ravel() for a in model.get_weights()])
    np.testing.assert_allclose(have, w, rtol=1e-5, atol=1e-6)
