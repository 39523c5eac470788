"""Each optimizer against its formula, written out step by step in float64 Python."""
import math

import numpy as np
import pytest

from bench.optim_apply import textbook_step
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])      # the store's tensor dtypes
@pytest.mark.parametrize("shape", [(), (7,), (33, 65)])
@pytest.mark.parametrize("spec", [
    {"name": "sgd", "lr": 0.1}, {"name": "sgd", "lr": 0.3, "weight_decay": 0.01, "staleness_aware": True},
    {"name": "momentum", "lr": 0.05}, {"name": "momentum", "lr": 0.05, "nesterov": True, "weight_decay": 0.1},
    {"name": "adagrad", "lr": 0.5}, {"name": "adam", "lr": 0.01}, {"name": "adam", "lr": 3e-4, "beta2": 0.99,
                                                                    "weight_decay": 0.01, "staleness_aware": True},
    {"name": "sgd", "lr": 0.1, "maximize": True, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "dampening": 0.3, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "dampening": 0.1, "nesterov": True, "maximize": True},
    {"name": "adagrad", "lr": 0.5, "maximize": True, "weight_decay": 0.1},
    {"name": "adam", "lr": 0.01, "amsgrad": True}, {"name": "adamw", "lr": 0.01},
    {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "amsgrad": True, "maximize": True, "staleness_aware": True}])
def test_same_bits_as_the_textbook_expressions_and_inputs_untouched(spec, shape, dtype):
    """optim.step writes into fewer arrays than the textbook expressions (bench.optim_apply's
    baseline, what the store computed before): it must still give their bits, or replicas on
    older and newer code would diverge."""
    spec = optim.normalize(spec)
    rng = np.random.default_rng(len(shape) * 10 + np.dtype(dtype).itemsize)
    param = np.asarray(rng.standard_normal(shape) * 3, dtype)
    state = optim.init_state(spec, param)
    mine, theirs = (param, state), (param, state)
    for k in range(12):
        # gradients of very different scales: rounding, tiny and large values, exact zeros
        grad = np.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 3), dtype)
        grad[...] = np.where(rng.random(shape) < 0.1, 0, grad)
        ctx = optim.Context(index=k + 1, base=k, staleness=k % 3)
        given = [mine[0], grad] + [v for v in mine[1].values() if isinstance(v, np.ndarray)]
        before = [a.tobytes() for a in given]
        mine = optim.step(spec, mine[0], grad, mine[1], ctx)
        theirs = textbook_step(spec, theirs[0], grad, theirs[1], ctx)
        assert type(mine[0]) is np.ndarray and mine[0].dtype == dtype and mine[0].shape == shape
        assert mine[0].tobytes() == np.asarray(theirs[0]).tobytes(), f"step {k}: parameters differ"
        assert mine[1].keys() == theirs[1].keys()
        for key in mine[1]:
            assert np.asarray(mine[1][key]).tobytes() == np.asarray(theirs[1][key]).tobytes(), f"step {k}: {key} differs"
        # nothing the step was given changed (readers of the previous version hold those arrays)
        assert [a.tobytes() for a in given] == before, f"step {k}: an input was written"


# ---- Lion: one file (raftps/optimizers/lion.py), found by the registry -----------------------

def lion_run(spec, grads, param, dtype=np.float64):
    spec = optim.normalize({"name": "lion", **spec})
    p = np.array(param, dtype)
    state = optim.init_state(spec, p)
    for g in grads:
        p, state = optim.step(spec, p, np.array(g, dtype), state)
    return p, state


def test_lion_by_hand():
    """lr 0.1, beta1 0.9, beta2 0.99, worked out by hand: step 1's sign is the gradient's; at
    step 2 the last coordinate's gradient is negative but 0.9 * 0.02 - 0.1 * 0.01 > 0, so the
    momentum wins; at step 3 (zero gradient) the momentum alone moves every coordinate by lr."""
    grads = [[0.3, -0.1, 0.0, 2.0], [-0.2, -0.1, 0.5, -0.01], [0.0, 0.0, 0.0, 0.0]]
    p, state = lion_run({"lr": 0.1}, grads[:1], [1.0, -2.0, 0.5, 0.0])
    assert np.allclose(p, [0.9, -1.9, 0.5, -0.1], rtol=0, atol=1e-12)            # sign(0.1 g) = sign(g); 0 stays
    assert np.allclose(state["m"], [0.003, -0.001, 0.0, 0.02], rtol=0, atol=1e-15) and state["step"] == 1
    p, state = lion_run({"lr": 0.1}, grads[:2], [1.0, -2.0, 0.5, 0.0])
    assert np.allclose(p, [1.0, -1.8, 0.4, -0.2], rtol=0, atol=1e-12)             # c = -0.0173 -0.0109 0.05 0.017
    assert np.allclose(state["m"], [0.00097, -0.00199, 0.005, 0.0197], rtol=0, atol=1e-15)
    p, _ = lion_run({"lr": 0.1}, grads, [1.0, -2.0, 0.5, 0.0])
    assert np.allclose(p, [0.9, -1.7, 0.3, -0.3], rtol=0, atol=1e-12)


def test_lion_decoupled_weight_decay_maximize_and_float32():
    # p * (1 - 0.1 * 0.5) - 0.1 * sign(g): 0.95 - 0.1 and -1.9 + 0.1
    p, _ = lion_run({"lr": 0.1, "weight_decay": 0.5}, [[0.3, -0.1]], [1.0, -2.0])
    assert np.allclose(p, [0.85, -1.8], rtol=0, atol=1e-12)
    p, _ = lion_run({"lr": 0.1, "maximize": True}, [[0.3, -0.1, 0.0]], [1.0, -2.0, 0.5])
    assert np.allclose(p, [1.1, -2.1, 0.5], rtol=0, atol=1e-12)
    p, state = lion_run({"lr": 0.1}, [[0.3, -0.1]], [1.0, -2.0], np.float32)
    assert p.dtype == state["m"].dtype == np.float32 and np.allclose(p, [0.9, -1.9], atol=1e-6)
    with pytest.raises(InvalidOptimizer, match=r"lion.beta2 must be in \[0, 1\)"):
        optim.normalize({"name": "lion", "lr": 0.1, "beta2": 1.0}, "w")


def test_lion_row_sparse_push_steps_the_pushed_rows_only():
    """The store's row rule reads the optimizer's own ``rows``: a rows push of a lion tensor runs
    in the state machine and moves the pushed rows (and their momentum) alone."""
    from raftps.compress import encode_rows
    from raftps.store.machine import ROW_OPTIMIZERS
    from tests.test_machine import Log
    assert "lion" in ROW_OPTIMIZERS
    log = Log()
    init = np.array([[1.0, -2.0], [0.5, 0.0], [3.0, 3.0]], np.float32)
    assert "error" not in log("create", tensors={"emb": init}, optimizer={"emb": {"name": "lion", "lr": 0.1}})
    tensors, encoding = encode_rows("emb", np.array([0, 2]), np.array([[0.3, -0.1], [0.0, 2.0]], np.float32))
    assert "error" not in log("push", tensors=tensors, encoding=encoding)
    t = log.store.tensors["emb"]
    assert np.allclose(t.data, [[0.9, -1.9], [0.5, 0.0], [3.0, 2.9]], rtol=0, atol=1e-6)
    assert np.allclose(t.state["m"], [[0.003, -0.001], [0.0, 0.0], [0.0, 0.02]], rtol=0, atol=1e-9)


EXACT = {"multiply", "add", "subtract", "divide", "sqrt", "negative", "maximum", "greater", "less",   # correctly rounded
         "zeros_like", "full_like", "empty_like", "copy", "ndarray"}                                  # or no arithmetic


def test_every_optimizer_uses_only_exact_operations():
    """The house rule for the state machine, read off each optimizer's module: numpy's + - * / sqrt,
    comparisons and array makers only, and no ``**`` in a step (Adam's beta^t is a running product)."""
    import ast
    import os
    folder = os.path.join(os.path.dirname(os.path.abspath(optim.__file__)), "optimizers")
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "np" \
                    and node.attr not in EXACT:
                found.append(f"{name}:{node.lineno}: np.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{name}:{node.lineno}: imports {m}" for m in modules if m in ("math", "random", "time")]
            if isinstance(node, ast.FunctionDef) and node.name in ("step", "prepare", "init_state"):
                found += [f"{name}:{n.lineno}: ** in {node.name}" for n in ast.walk(node)
                          if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)]
    assert found == []
    assert "lion" in optim.SPECS                                # the registry found the new module
