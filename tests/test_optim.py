"""Each optimizer against its formula, written out step by step in float64 Python."""
import math

import numpy as np
import pytest

from raftps import optim
from raftps.errors import InvalidOptimizer

RNG = np.random.default_rng(1)
P0 = RNG.standard_normal(5)
GRADS = [RNG.standard_normal(5) for _ in range(6)]


def run(spec, dtype=np.float64):
    spec = optim.normalize(spec)
    p = P0.astype(dtype)
    state = optim.init_state(spec, p)
    for g in GRADS:
        p, state = optim.step(spec, p, g.astype(dtype), state)
    return p


def reference(update):
    out = []
    for i in range(5):
        p, mem = float(P0[i]), {}
        for t, g in enumerate(GRADS, 1):
            p = update(p, float(g[i]), mem, t)
        out.append(p)
    return np.array(out)


def test_sgd_with_weight_decay():
    def update(p, g, mem, t):
        return p - 0.1 * (g + 0.01 * p)
    assert np.allclose(run({"name": "sgd", "lr": 0.1, "weight_decay": 0.01}), reference(update), rtol=0, atol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum(nesterov):
    def update(p, g, mem, t):
        v = 0.9 * mem.get("v", 0.0) + g
        mem["v"] = v
        return p - 0.05 * ((g + 0.9 * v) if nesterov else v)
    got = run({"name": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": nesterov})
    assert np.allclose(got, reference(update), rtol=0, atol=1e-12)


def test_adagrad_with_initial_accumulator():
    def update(p, g, mem, t):
        mem["a"] = mem.get("a", 0.1) + g * g
        return p - 0.5 * g / (math.sqrt(mem["a"]) + 1e-10)
    got = run({"name": "adagrad", "lr": 0.5, "initial_accumulator": 0.1})
    assert np.allclose(got, reference(update), rtol=0, atol=1e-12)


def test_adam_bias_correction():
    b1, b2 = 0.9, 0.999

    def update(p, g, mem, t):
        mem["m"] = b1 * mem.get("m", 0.0) + (1 - b1) * g
        mem["v"] = b2 * mem.get("v", 0.0) + (1 - b2) * g * g
        m_hat = mem["m"] / (1 - b1 ** t)
        v_hat = mem["v"] / (1 - b2 ** t)
        return p - 0.01 * m_hat / (math.sqrt(v_hat) + 1e-8)
    assert np.allclose(run({"name": "adam", "lr": 0.01}), reference(update), rtol=0, atol=1e-12)


def test_float32_stays_float32_and_inputs_are_not_mutated():
    spec = optim.normalize({"name": "adam", "lr": 0.01})
    p = P0.astype(np.float32)
    before = p.copy()
    state = optim.init_state(spec, p)
    new, new_state = optim.step(spec, p, GRADS[0].astype(np.float32), state)
    assert new.dtype == np.float32 and new_state["m"].dtype == np.float32
    assert np.array_equal(p, before) and not state["m"].any()


@pytest.mark.parametrize("spec, message", [
    ({"name": "rmsprop", "lr": 0.1}, "unknown optimizer"),
    ({"name": "sgd"}, "needs 'lr'"),
    ({"name": "sgd", "lr": -1}, "must be > 0"),
    ({"name": "sgd", "lr": float("nan")}, "finite"),
    ({"name": "sgd", "lr": "0.1"}, "finite number"),
    ({"name": "momentum", "lr": 0.1, "momentum": 1.0}, r"in \[0, 1\)"),
    ({"name": "sgd", "lr": 0.1, "betas": 3}, "no parameter"),
    ({"name": "momentum", "lr": 0.1, "nesterov": 1}, "true or false"),
    ("sgd", "must be a dict"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(InvalidOptimizer, match=message):
        optim.normalize(spec, "w")
