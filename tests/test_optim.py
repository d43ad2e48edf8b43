"""Optimizers: numba kernels against NumPy twins, against hand-computed updates, and errors."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba.core.registry import CPUDispatcher

from pserver.errors import ConfigError
from pserver.optim import OPTIMIZERS, adagrad, adam, adamw, make_optimizer, momentum, rmsprop, sgd
from pserver.optim.schedule import parse_schedule

FAST = settings(max_examples=25, deadline=None)

sizes = st.integers(1, 300)
seeds = st.integers(0, 2**32 - 1)
schedules = st.sampled_from(["constant", "step:2,0.5", "warmup:3", "cosine:4"])
lrs = st.floats(1e-4, 1.0)
decays = st.sampled_from([0.0, 1e-4, 0.1])


def run_both(name, size, seed, steps, **kw):
    """The same gradients through the numba and the numpy backend; returns both optimizers
    and both weight vectors."""
    rng = np.random.default_rng(seed)
    opts = [make_optimizer(name, size, backend=b, **kw) for b in ("numba", "numpy")]
    w0 = rng.standard_normal(size).astype(np.float32)
    ws = [w0.copy(), w0.copy()]
    for t in range(steps):
        g = rng.standard_normal(size).astype(np.float32)
        for opt, w in zip(opts, ws):
            opt.step(w, g, t)
    return opts, ws


def assert_twins_agree(opts, ws):
    np.testing.assert_allclose(ws[0], ws[1], rtol=1e-5, atol=1e-6)
    assert opts[0].state.keys() == opts[1].state.keys()
    for k in opts[0].state:
        np.testing.assert_allclose(opts[0].state[k], opts[1].state[k], rtol=1e-5, atol=1e-6)


# -- numba == numpy ------------------------------------------------------------------------

@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, decays, schedules)
def test_sgd_twins(size, seed, steps, lr, wd, schedule):
    assert_twins_agree(*run_both("sgd", size, seed, steps, lr=lr, weight_decay=wd,
                                 schedule=schedule))


@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, decays, st.floats(0.0, 0.99), st.booleans())
def test_momentum_twins(size, seed, steps, lr, wd, mu, nesterov):
    assert_twins_agree(*run_both("momentum", size, seed, steps, lr=lr, weight_decay=wd,
                                 momentum=mu, nesterov=nesterov))


@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, decays, st.floats(0.0, 0.99),
       st.floats(0.9, 0.9999), st.sampled_from([1e-8, 1e-6, 1e-3]), schedules)
def test_adam_twins(size, seed, steps, lr, wd, b1, b2, eps, schedule):
    assert_twins_agree(*run_both("adam", size, seed, steps, lr=lr, weight_decay=wd, beta1=b1,
                                 beta2=b2, eps=eps, schedule=schedule))


@pytest.mark.parametrize("rule", [sgd, momentum, adam, adamw, rmsprop, adagrad],
                         ids=["sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad"])
def test_kernels_are_nogil_serial_numba(rule):
    assert isinstance(rule.update, CPUDispatcher)
    opts = rule.update.targetoptions
    # nogil: Hogwild threads run them at once; no parallel=True: numba's workqueue layer
    # aborts when entered from several threads.
    assert opts.get("nogil") and not opts.get("parallel")
    assert type(rule.update._cache).__name__ == "FunctionCache"   # cache=True: no recompiles
    # error_model="numpy": a division with no zero check, so the loop vectorizes (6-22x for the
    # rules that divide: bench/optim_kernels.py)
    assert opts.get("error_model") == "numpy"


def test_a_zero_divisor_gives_what_numpy_gives_not_an_exception():
    """Catches numba's default error model coming back: adagrad's kernel, given eps = 0 (the
    class refuses that; the kernel trusts its caller) and a zero gradient and accumulator,
    divides 0 by 0, and must give NaN as its twin does, rather than raise ZeroDivisionError."""
    out = {}
    for name in ("update", "update_numpy"):
        w, acc = np.ones(3, np.float32), np.array([0, 1, 0], np.float32)
        with np.errstate(invalid="ignore"):                 # the twin's 0 / 0, as asked
            getattr(adagrad, name)(w, np.array([0, 1, 0], np.float32), acc, 0.1, 0.0, 0.0)
        out[name] = w
    np.testing.assert_array_equal(out["update"], out["update_numpy"])
    assert np.isnan(out["update"][[0, 2]]).all() and np.isfinite(out["update"][1])


# -- against hand-computed updates ---------------------------------------------------------

@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_sgd_by_hand(backend):
    opt = make_optimizer("sgd", 3, lr=0.5, weight_decay=0.1, backend=backend)
    w, g = np.array([1.0, -2.0, 0.0], np.float32), np.array([0.2, 0.4, -1.0], np.float32)
    opt.step(w, g, 0)
    np.testing.assert_allclose(w, [1 - 0.5 * (0.2 + 0.1), -2 - 0.5 * (0.4 - 0.2), 0.5], rtol=1e-6)
    assert opt.state == {}


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_by_hand(backend, nesterov):
    lr, mu, g1, g2 = 0.1, 0.9, 1.0, -0.5
    opt = make_optimizer("momentum", 1, lr=lr, momentum=mu, nesterov=nesterov, backend=backend)
    w = np.zeros(1, np.float32)
    opt.step(w, np.float32([g1]), 0)
    opt.step(w, np.float32([g2]), 1)
    v1, v2 = g1, mu * g1 + g2
    want = -lr * ((g1 + mu * v1) + (g2 + mu * v2)) if nesterov else -lr * (v1 + v2)
    assert w[0] == pytest.approx(want, rel=1e-6)
    assert opt.state["v"][0] == pytest.approx(v2, rel=1e-6)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_adam_bias_correction_at_t0(backend):
    """With the correction the first step is lr * g / (|g| + eps), about lr * sign(g); without
    it, it would be lr * (1 - b1) / sqrt(1 - b2) ~ 3.16 lr."""
    opt = make_optimizer("adam", 4, lr=0.01, backend=backend)
    w, g = np.zeros(4, np.float32), np.array([3.0, -0.2, 1e-3, 50.0], np.float32)
    opt.step(w, g, 0)
    np.testing.assert_allclose(w, -0.01 * g / (np.abs(g) + 1e-8), rtol=1e-5)
    np.testing.assert_allclose(opt.state["m"], 0.1 * g, rtol=1e-6)
    np.testing.assert_allclose(opt.state["v"], 0.001 * g.astype(np.float64) ** 2, rtol=1e-5)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_adam_second_step_by_hand(backend):
    b1, b2, lr, eps, gs = 0.9, 0.999, 0.1, 1e-8, (1.0, 3.0)
    opt = make_optimizer("adam", 1, lr=lr, backend=backend)
    w = np.zeros(1, np.float32)
    m = v = want = 0.0
    for t, g in enumerate(gs):
        opt.step(w, np.float32([g]), t)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        want -= lr * (m / (1 - b1 ** (t + 1))) / (math.sqrt(v / (1 - b2 ** (t + 1))) + eps)
    assert w[0] == pytest.approx(want, rel=1e-5)


def test_adam_kernels_refuse_t0():
    # t counts updates including this one: t = 0 would divide by 1 - beta**0 = 0.
    w = np.zeros(2, np.float32)
    for f in (adam.update, adam.update_numpy):
        with pytest.raises(ValueError, match="t >= 1"):
            f(w, w.copy(), w.copy(), w.copy(), 0.1, 0.9, 0.999, 1e-8, 0, 0.0)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_step_checks_sizes_and_dtypes(name, backend):
    opt = make_optimizer(name, 4, lr=0.1, backend=backend)
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"g is float32\[3\], needs float32\[4\]"):
        opt.step(w, np.zeros(3, np.float32), 0)
    with pytest.raises(ValueError, match=r"g is float64"):
        opt.step(w, np.zeros(4), 0)
    assert not w.any()


def test_kernels_check_sizes_themselves():
    # numba does not bounds-check, so the kernels do: a short g must not be read past its end.
    w, short = np.zeros(5, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="differ in size"):
        sgd.update(w, short, 0.1, 0.0)
    with pytest.raises(ValueError, match="differ in size"):
        momentum.update(w, w.copy(), short, 0.1, 0.9, False, 0.0)
    with pytest.raises(ValueError, match="differ in size"):
        adam.update(w, w.copy(), w.copy(), short, 0.1, 0.9, 0.999, 1e-8, 1, 0.0)
    with pytest.raises(ValueError, match="differ in size"):
        adamw.update(w, w.copy(), w.copy(), short, 0.1, 0.9, 0.999, 1e-7, 1, 0.004)
    with pytest.raises(ValueError, match="differ in size"):
        adagrad.update(w, w.copy(), short, 0.1, 1e-7, 0.0)
    empty = np.zeros(0, np.float32)      # rmsprop: an array its settings keep must be full size
    for mo, a, mu, centered in ((short, empty, 0.9, False), (empty, short, 0.0, True)):
        with pytest.raises(ValueError, match="differ in size"):
            rmsprop.update(w, w.copy(), w.copy(), mo, a, 0.1, 0.9, mu, 1e-7, centered, 0.0)


def test_schedule_scales_lr():
    opt = make_optimizer("sgd", 1, lr=1.0, schedule="step:2,0.5")
    w = np.zeros(1, np.float32)
    deltas = []
    for t in range(5):
        before = float(w[0])
        opt.step(w, np.float32([-1.0]), t)
        deltas.append(float(w[0]) - before)
    assert deltas == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_hogwild_threads_share_arrays():
    """Several threads step the same arrays at once (async mode does this on purpose); it must
    neither crash nor deadlock, and every element moves by at least one thread's updates."""
    opt = make_optimizer("sgd", 100_000, lr=1.0)
    w, g = np.zeros(100_000, np.float32), np.full(100_000, -1.0, np.float32)

    def run():
        for t in range(20):
            opt.step(w, g, t)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.min() >= 20 and w.max() <= 80


# -- state ----------------------------------------------------------------------------------

def test_load_state_round_trip():
    (a, _), (w_a, _) = run_both("adam", 10, 0, 3, lr=0.01)
    b = make_optimizer("adam", 10, lr=0.01)
    arrays = {k: v.copy() for k, v in a.state.items()}
    held = b.state["m"]
    b.load_state(arrays)
    assert b.state["m"] is held   # refilled in place, not replaced
    w_b, g = w_a.copy(), np.linspace(-1, 1, 10, dtype=np.float32)
    a.step(w_a, g, 3)
    b.step(w_b, g, 3)
    np.testing.assert_array_equal(w_a, w_b)


def test_load_state_validation():
    opt = make_optimizer("momentum", 4, lr=0.1)
    with pytest.raises(ConfigError,
                       match=r"momentum keeps \['v'\], the checkpoint has \['m', 'v'\]"):
        opt.load_state({"m": np.zeros(4, np.float32), "v": np.zeros(4, np.float32)})
    with pytest.raises(ConfigError, match=r"'v' is float32\[5\], needs float32\[4\]"):
        opt.load_state({"v": np.zeros(5, np.float32)})
    with pytest.raises(ConfigError, match=r"'v' is int64"):
        opt.load_state({"v": np.zeros(4, np.int64)})
    with pytest.raises(ConfigError, match="sgd keeps"):
        make_optimizer("sgd", 4, lr=0.1).load_state({"v": np.zeros(4, np.float32)})
    make_optimizer("sgd", 4, lr=0.1).load_state({})
    assert not opt.state["v"].any()   # nothing half-loaded


# -- schedules ------------------------------------------------------------------------------

def test_schedule_values():
    assert [parse_schedule("constant")(t) for t in (0, 10**6)] == [1.0, 1.0]
    step = parse_schedule("step:10,0.5")
    assert [step(t) for t in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    warm = parse_schedule("warmup:4")
    assert [warm(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = parse_schedule(" cosine:10 ")
    assert cos(0) == 1.0 and cos(5) == pytest.approx(0.5) and cos(10) == 0.0 and cos(99) == 0.0
    assert cos(2) > cos(3) > cos(7)


@pytest.mark.parametrize("spec", ["", "linear", "constant:3", "step:10", "step:0,0.5",
                                  "step:10,0", "step:10,2", "step:x,0.5", "step:1.5,0.5",
                                  "warmup:0", "warmup:-2", "warmup:", "cosine:nan", "cosine:1,2",
                                  "step:10,nan"])
def test_bad_schedules(spec):
    with pytest.raises(ConfigError, match="--lr-schedule: bad schedule " + re.escape(repr(spec))):
        parse_schedule(spec)


# -- make_optimizer errors ------------------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [
    (dict(name="lion"),
     "--optimizer: unknown optimizer 'lion'; choose one of sgd, momentum, adam, adamw, rmsprop, adagrad"),
    (dict(lr=0.0), "--lr: must be a number > 0, got 0.0"),
    (dict(lr=-1), "--lr: must be a number > 0, got -1"),
    (dict(lr=float("nan")), "--lr"),
    (dict(lr="fast"), "--lr"),
    (dict(name="momentum", momentum=1.0), r"--momentum: must be in \[0, 1\), got 1.0"),
    (dict(name="momentum", momentum=-0.1), "--momentum"),
    (dict(name="adam", beta1=1.0), "--beta1"),
    (dict(name="adam", beta2=1.5), "--beta2"),
    (dict(name="adam", eps=0.0), "--eps"),
    (dict(weight_decay=-1e-4), "--weight-decay"),
    (dict(name="adam", nesterov=True), "--nesterov: applies to --optimizer momentum only"),
    (dict(schedule="cosine:0"), "--lr-schedule"),
    (dict(backend="cuda"), "optimizer backend"),
])
def test_make_optimizer_errors(kw, flag):
    args = dict(name="sgd", size=4, lr=0.1) | kw
    with pytest.raises(ConfigError, match=flag):
        make_optimizer(args.pop("name"), args.pop("size"), **args)


def test_make_optimizer_builds_each():
    for name in OPTIMIZERS:
        opt = make_optimizer(name, 0 if name == "sgd" else 3, lr=1e-3)
        assert opt.name == name and opt.backend == "numba"
    assert sorted(make_optimizer("adam", 3, lr=1e-3).state) == ["m", "v"]
    assert sorted(make_optimizer("momentum", 3, lr=1e-3).state) == ["v"]


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad"])
def test_parallel_pieces_equal_one_call_bit_for_bit(name, monkeypatch):
    """Large steps run in pieces on several threads; the result must not change."""
    import pserver.optim as optim
    size = optim.PARALLEL_MIN_ELEMENTS + 12345
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    results = []
    for cpus in (1, 3):
        monkeypatch.setattr(optim.os, "cpu_count", lambda: cpus)
        opt, w = make_optimizer(name, size, lr=0.01), w0.copy()
        for t, g in enumerate(grads):
            opt.step(w, g, t)
        results.append((w, {k: v.copy() for k, v in opt.state.items()}))
    assert results[0][0].tobytes() == results[1][0].tobytes()
    for k in results[0][1]:
        assert results[0][1][k].tobytes() == results[1][1][k].tobytes()


@FAST
@given(st.sampled_from(["sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad"]), sizes, seeds,
       st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=4), st.integers(1, 4),
       st.sampled_from(["numba", "numpy"]))
def test_frozen_ranges_and_their_state_never_change_and_the_rest_steps_as_alone(name, size, seed, spans,
                                                                                 steps, backend):
    """Non-trainable weights (Optimizer.freeze): every element in a frozen range keeps its value and
    its state through every step, whatever the rule (adamw's decay, momentum's velocity), and every
    other element ends bit for bit as a step over the whole vector leaves it. Fails if a frozen
    element moves, if one range too many or too few is skipped at an edge, or if the pieces are
    misaligned with their state."""
    frozen = sorted((min(a, size), min(a + n, size)) for a, n in spans)
    merged: list[tuple[int, int]] = []
    for a, b in frozen:                    # sorted, disjoint, as a shard's layout gives them
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        elif b > a:
            merged.append((a, b))
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(size).astype(np.float32)
    whole, part = (make_optimizer(name, size, lr=0.01, weight_decay=0.01, backend=backend) for _ in range(2))
    part.freeze(merged)
    ws = [w0.copy(), w0.copy()]
    for t in range(steps):
        g = rng.standard_normal(size).astype(np.float32)
        whole.step(ws[0], g, t)
        part.step(ws[1], g, t)
    mask = np.zeros(size, bool)
    for a, b in merged:
        mask[a:b] = True
    assert ws[1][mask].tobytes() == w0[mask].tobytes()
    assert ws[1][~mask].tobytes() == ws[0][~mask].tobytes()
    fresh = make_optimizer(name, size, lr=0.01, weight_decay=0.01, backend=backend).state
    for k, v in part.state.items():
        assert v[mask].tobytes() == fresh[k][mask].tobytes()
        assert v[~mask].tobytes() == whole.state[k][~mask].tobytes()


# -- Keras's rules: rmsprop, adamw, adagrad --------------------------------------------------
# Each against an independent float64 transcription of Keras 3's update_step (keras/src/
# optimizers/rmsprop.py, adamw.py via adam.py and base_optimizer._apply_weight_decay, adagrad.py).

def keras_rmsprop(w, grads, lr, rho=0.9, mu=0.0, eps=1e-7, centered=False):
    w, v, mo, a = w.astype(np.float64), 0.0, 0.0, 0.0
    for g in grads:
        g = g.astype(np.float64)
        v = rho * v + (1 - rho) * np.square(g)
        if centered:
            a = rho * a + (1 - rho) * g
            denominator = v - np.square(a) + eps
        else:
            denominator = v + eps
        increment = lr * g / np.sqrt(denominator)
        if mu > 0:
            mo = mu * mo + increment
            w = w - mo
        else:
            w = w - increment
    return w


def keras_adamw(w, grads, lr, wd=0.004, b1=0.9, b2=0.999, eps=1e-7):
    w, m, v = w.astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        w = w - w * wd * lr                            # _apply_weight_decay, before the step
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        m = m + (g - m) * (1 - b1)
        v = v + (np.square(g) - v) * (1 - b2)
        w = w - m * alpha / (np.sqrt(v) + eps)
    return w


def keras_adagrad(w, grads, lr, initial=0.1, eps=1e-7):
    w, acc = w.astype(np.float64), initial
    for g in grads:
        g = g.astype(np.float64)
        acc = acc + np.square(g)
        w = w - lr * g / np.sqrt(acc + eps)
    return w


def steps_of(name, w0, grads, **kw):
    opt, w = make_optimizer(name, w0.size, **kw), w0.copy()
    for t, g in enumerate(grads):
        opt.step(w, g, t)
    return w, opt


def draws(seed, size, steps):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(size).astype(np.float32),
            [rng.standard_normal(size).astype(np.float32) for _ in range(steps)])


rhos, mus = st.floats(0.5, 0.99), st.sampled_from([0.0, 0.5, 0.9])


def assert_bit_for_bit(opts, ws):
    """The kernel and its twin do the same float32 operations in the same order (no fastmath,
    no reassociation), so they agree exactly, state included."""
    assert ws[0].tobytes() == ws[1].tobytes()
    for k in opts[0].state:
        assert opts[0].state[k].tobytes() == opts[1].state[k].tobytes(), k


@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, decays, rhos, mus, st.booleans(), schedules)
def test_rmsprop_twins(size, seed, steps, lr, wd, rho, mu, centered, schedule):
    assert_bit_for_bit(*run_both("rmsprop", size, seed, steps, lr=lr, weight_decay=wd, rho=rho,
                                 momentum=mu, centered=centered, schedule=schedule))


@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, st.sampled_from([0.0, 0.004, 0.1]),
       st.floats(0.0, 0.99), st.floats(0.9, 0.9999), schedules)
def test_adamw_twins(size, seed, steps, lr, wd, b1, b2, schedule):
    assert_bit_for_bit(*run_both("adamw", size, seed, steps, lr=lr, weight_decay=wd, beta1=b1,
                                 beta2=b2, schedule=schedule))


@FAST
@given(sizes, seeds, st.integers(1, 5), lrs, decays, st.sampled_from([0.0, 0.1, 1.0]), schedules)
def test_adagrad_twins(size, seed, steps, lr, wd, initial, schedule):
    assert_bit_for_bit(*run_both("adagrad", size, seed, steps, lr=lr, weight_decay=wd,
                                 initial_accumulator=initial, schedule=schedule))


# float32 against float64 over a few steps: a few ulps of float32 per step, relative to the
# move; a wrong constant (eps outside the root, 1 - rho swapped, the decay after the step, no
# bias correction) is off by far more.
KERAS_TOL = dict(rtol=2e-5, atol=1e-6)


@FAST
@given(seeds, st.integers(1, 6), st.floats(1e-3, 0.1), rhos, mus, st.booleans(),
       st.sampled_from([1e-7, 1e-3]))
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_rmsprop_is_keras_rule(backend, seed, steps, lr, rho, mu, centered, eps):
    w0, grads = draws(seed, 64, steps)
    w, _ = steps_of("rmsprop", w0, grads, lr=lr, rho=rho, momentum=mu, centered=centered, eps=eps,
                    backend=backend)
    np.testing.assert_allclose(w, keras_rmsprop(w0, grads, lr, rho, mu, eps, centered), **KERAS_TOL)


@FAST
@given(seeds, st.integers(1, 6), st.floats(1e-3, 0.1), st.sampled_from([0.0, 0.004, 0.5]),
       st.floats(0.5, 0.95), st.floats(0.9, 0.9999))
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_adamw_is_keras_rule(backend, seed, steps, lr, wd, b1, b2):
    w0, grads = draws(seed, 64, steps)
    w, _ = steps_of("adamw", w0, grads, lr=lr, weight_decay=wd, beta1=b1, beta2=b2, backend=backend)
    np.testing.assert_allclose(w, keras_adamw(w0, grads, lr, wd, b1, b2), **KERAS_TOL)


@FAST
@given(seeds, st.integers(1, 6), st.floats(1e-3, 0.5), st.sampled_from([0.0, 0.1, 1.0]))
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_adagrad_is_keras_rule(backend, seed, steps, lr, initial):
    w0, grads = draws(seed, 64, steps)
    w, _ = steps_of("adagrad", w0, grads, lr=lr, initial_accumulator=initial, backend=backend)
    np.testing.assert_allclose(w, keras_adagrad(w0, grads, lr, initial), **KERAS_TOL)


def test_rmsprop_matches_the_example_in_keras_docstring():
    """keras.optimizers.RMSprop's own example: lr 0.1, var 10, loss var^2 / 2, one step gives
    9.683772. Catches a missing (1 - rho) or lr, or v starting at g^2 rather than 0."""
    w, _ = steps_of("rmsprop", np.float32([10.0]), [np.float32([10.0])], lr=0.1)
    assert w[0] == pytest.approx(9.683772, abs=1e-6)


def test_defaults_are_keras_s():
    """Catches a shared flag's default leaking across optimizers (momentum's 0.9 into rmsprop,
    adam's eps 1e-8, weight decay 0 for adamw)."""
    r = make_optimizer("rmsprop", 3, lr=1e-3)
    assert (r.rho, r.momentum, r.eps, r.centered, r.weight_decay) == (0.9, 0.0, 1e-7, False, 0.0)
    w = make_optimizer("adamw", 3, lr=1e-3)
    assert (w.beta1, w.beta2, w.eps, w.weight_decay) == (0.9, 0.999, 1e-7, 0.004)
    a = make_optimizer("adagrad", 3, lr=1e-3)
    assert (a.initial_accumulator, a.eps, a.weight_decay) == (0.1, 1e-7, 0.0)
    assert a.state["accumulator"].tolist() == pytest.approx([0.1] * 3)      # starts there, not at 0
    # and the older rules keep theirs
    assert make_optimizer("momentum", 3, lr=1e-3).momentum == 0.9
    adam_ = make_optimizer("adam", 3, lr=1e-3)
    assert (adam_.eps, adam_.weight_decay) == (1e-8, 0.0)


def test_rmsprop_keeps_only_the_state_its_settings_use():
    assert list(make_optimizer("rmsprop", 3, lr=1e-3).state) == ["velocity"]
    both = make_optimizer("rmsprop", 3, lr=1e-3, momentum=0.5, centered=True)
    assert sorted(both.state) == ["average_gradient", "momentum", "velocity"]
    with pytest.raises(ConfigError, match=r"rmsprop keeps \['velocity'\], the checkpoint has .*"
                                          r"another --momentum \(0 or not\) or --centered"):
        make_optimizer("rmsprop", 3, lr=1e-3).load_state({k: v.copy() for k, v in both.state.items()})


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_adamw_decay_is_decoupled(backend):
    """A zero gradient still shrinks w by lr * wd * w per step (the decay never enters m and v);
    adam's coupled weight decay instead moves w by about lr per step (g' / sqrt(v') ~ 1)."""
    lr, wd, w0 = 0.01, 0.5, np.float32([2.0, -4.0, 0.0])
    w, opt = steps_of("adamw", w0, [np.zeros(3, np.float32)] * 3, lr=lr, weight_decay=wd, backend=backend)
    np.testing.assert_allclose(w, w0 * (1 - lr * wd) ** 3, rtol=1e-6)
    assert not opt.state["m"].any() and not opt.state["v"].any()
    coupled, _ = steps_of("adam", w0, [np.zeros(3, np.float32)] * 3, lr=lr, weight_decay=wd, backend=backend)
    np.testing.assert_allclose(coupled[:2], w0[:2] - 3 * lr * np.sign(w0[:2]), rtol=1e-3)


def test_adamw_decay_takes_the_scheduled_lr():
    """Keras decays by the learning rate of the step (a schedule's value), as it steps."""
    w, _ = steps_of("adamw", np.float32([1.0]), [np.float32([0.0])] * 3, lr=0.1, weight_decay=1.0,
                    schedule="step:1,0.5")
    assert w[0] == pytest.approx((1 - 0.1) * (1 - 0.05) * (1 - 0.025), rel=1e-6)


@pytest.mark.parametrize("kw, flag", [
    (dict(name="rmsprop", rho=1.0), r"--rho: must be in \[0, 1\), got 1.0"),
    (dict(name="rmsprop", rho=-0.1), "--rho"),
    (dict(name="rmsprop", eps=-1e-7), "--eps: must be a number > 0, got -1e-07"),
    (dict(name="rmsprop", momentum=1.0), "--momentum"),
    (dict(name="rmsprop", nesterov=True), "--nesterov: applies to --optimizer momentum only"),
    (dict(name="adagrad", eps=-1e-7), "--eps"),
    (dict(name="adagrad", initial_accumulator=-0.1), "--initial-accumulator: must be a number >= 0"),
    (dict(name="adamw", eps=0.0), "--eps"),
    (dict(name="adamw", beta2=1.0), "--beta2"),
    (dict(name="adamw", weight_decay=-0.004), "--weight-decay"),
])
def test_keras_rules_refuse_bad_values_naming_the_flag(kw, flag):
    args = dict(size=4, lr=0.1) | kw
    with pytest.raises(ConfigError, match=flag):
        make_optimizer(args.pop("name"), args.pop("size"), **args)
