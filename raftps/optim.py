"""Optimizers applied inside the replicated state machine.

Every function here is pure: it returns new arrays and never mutates its inputs, so a reader
holding the previous arrays keeps a consistent view (copy-on-write). Only + - * / and sqrt are
used, hyperparameters are cast to the tensor's dtype, and Adam's beta^t are Python floats
multiplied once per step (never ``np.power``): each of these is correctly rounded in IEEE 754,
so every replica computes the same bits from the same log.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import InvalidOptimizer

# name -> {parameter: (default, check)}; a default of None means required.
_POSITIVE = ("> 0", lambda x: x > 0)
_NON_NEGATIVE = (">= 0", lambda x: x >= 0)
_UNIT = ("in [0, 1)", lambda x: 0 <= x < 1)

SPECS: dict[str, dict[str, tuple[Any, tuple]]] = {
    "sgd": {"lr": (None, _POSITIVE), "weight_decay": (0.0, _NON_NEGATIVE)},
    "momentum": {"lr": (None, _POSITIVE), "momentum": (0.9, _UNIT),
                 "nesterov": (False, None), "weight_decay": (0.0, _NON_NEGATIVE)},
    "adagrad": {"lr": (None, _POSITIVE), "eps": (1e-10, _POSITIVE),
                "initial_accumulator": (0.1, _NON_NEGATIVE), "weight_decay": (0.0, _NON_NEGATIVE)},
    "adam": {"lr": (None, _POSITIVE), "beta1": (0.9, _UNIT), "beta2": (0.999, _UNIT),
             "eps": (1e-8, _POSITIVE), "weight_decay": (0.0, _NON_NEGATIVE)},
}


def normalize(spec: Any, tensor: str = "?") -> dict:
    """A complete, validated spec with every default filled in, or InvalidOptimizer."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidOptimizer(f"tensor {tensor!r}: optimizer must be a dict with a 'name' "
                               f"(one of {sorted(SPECS)}), got {spec!r}")
    name = spec["name"]
    if name not in SPECS:
        raise InvalidOptimizer(f"tensor {tensor!r}: unknown optimizer {name!r} (known: {sorted(SPECS)})")
    params = SPECS[name]
    unknown = sorted(set(spec) - set(params) - {"name"})
    if unknown:
        raise InvalidOptimizer(f"tensor {tensor!r}: optimizer {name!r} has no parameter(s) {unknown} "
                               f"(it takes {sorted(params)})")
    out: dict[str, Any] = {"name": name}
    for key in sorted(params):
        default, check = params[key]
        value = spec.get(key, default)
        if value is None:
            raise InvalidOptimizer(f"tensor {tensor!r}: optimizer {name!r} needs {key!r}")
        if check is None:
            if not isinstance(value, bool):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be true or false, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be a finite number, got {value!r}")
            value = float(value)
            if not check[1](value):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be {check[0]}, got {value!r}")
        out[key] = value
    return out


def init_state(spec: dict, param: np.ndarray) -> dict[str, Any]:
    name = spec["name"]
    if name == "momentum":
        return {"velocity": np.zeros_like(param)}
    if name == "adagrad":
        return {"accumulator": np.full_like(param, spec["initial_accumulator"])}
    if name == "adam":
        return {"m": np.zeros_like(param), "v": np.zeros_like(param), "beta1_t": 1.0, "beta2_t": 1.0}
    return {}


def step(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict) -> tuple[np.ndarray, dict]:
    """One update: returns (new param, new state). ``grad`` has param's shape and dtype."""
    t = param.dtype.type
    lr = t(spec["lr"])
    if spec["weight_decay"]:
        grad = grad + t(spec["weight_decay"]) * param
    name = spec["name"]
    if name == "sgd":
        return param - lr * grad, state
    if name == "momentum":
        mu = t(spec["momentum"])
        velocity = mu * state["velocity"] + grad
        direction = grad + mu * velocity if spec["nesterov"] else velocity
        return param - lr * direction, {"velocity": velocity}
    if name == "adagrad":
        acc = state["accumulator"] + grad * grad
        return param - lr * grad / (np.sqrt(acc) + t(spec["eps"])), {"accumulator": acc}
    if name == "adam":
        b1, b2 = spec["beta1"], spec["beta2"]
        m = t(b1) * state["m"] + t(1.0 - b1) * grad
        v = t(b2) * state["v"] + t(1.0 - b2) * (grad * grad)
        beta1_t = state["beta1_t"] * b1
        beta2_t = state["beta2_t"] * b2
        m_hat = m / t(1.0 - beta1_t)
        v_hat = v / t(1.0 - beta2_t)
        new = param - lr * m_hat / (np.sqrt(v_hat) + t(spec["eps"]))
        return new, {"m": m, "v": v, "beta1_t": beta1_t, "beta2_t": beta2_t}
    raise AssertionError(name)  # normalize() admits only the names above
