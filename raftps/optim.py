"""Optimizers applied inside the replicated state machine.

Every function here is pure: it returns new arrays and never mutates its inputs, so a reader
holding the previous arrays keeps a consistent view (copy-on-write). Only + - * / and sqrt are
used, hyperparameters are cast to the tensor's dtype, and Adam's beta^t are Python floats
multiplied once per step (never ``np.power``): each of these is correctly rounded in IEEE 754,
so every replica computes the same bits from the same log.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidOptimizer, StaleBase

# name -> {parameter: (default, check)}; a default of None means required.
_POSITIVE = ("> 0", lambda x: x > 0)
_NON_NEGATIVE = (">= 0", lambda x: x >= 0)
_UNIT = ("in [0, 1)", lambda x: 0 <= x < 1)
_COUNT = ("an integer >= 1", lambda x: x >= 1)          # an int default marks an integer parameter
_STALENESS_AWARE = (False, None)                         # lr / max(1, tau): Zhang et al., IJCAI 2016

_MAXIMIZE = (False, None)                                # ascend: the gradient's sign flipped (torch's maximize)

SPECS: dict[str, dict[str, tuple[Any, tuple]]] = {
    "sgd": {"lr": (None, _POSITIVE), "weight_decay": (0.0, _NON_NEGATIVE), "maximize": _MAXIMIZE,
            "staleness_aware": _STALENESS_AWARE},
    # torch.optim.SGD with momentum > 0: the buffer starts as the first gradient, then
    # momentum * buffer + (1 - dampening) * grad
    "momentum": {"lr": (None, _POSITIVE), "momentum": (0.9, _UNIT), "dampening": (0.0, _UNIT),
                 "nesterov": (False, None), "weight_decay": (0.0, _NON_NEGATIVE), "maximize": _MAXIMIZE,
                 "staleness_aware": _STALENESS_AWARE},
    "adagrad": {"lr": (None, _POSITIVE), "eps": (1e-10, _POSITIVE),
                "initial_accumulator": (0.1, _NON_NEGATIVE), "weight_decay": (0.0, _NON_NEGATIVE),
                "maximize": _MAXIMIZE, "staleness_aware": _STALENESS_AWARE},
    "adam": {"lr": (None, _POSITIVE), "beta1": (0.9, _UNIT), "beta2": (0.999, _UNIT),
             "eps": (1e-8, _POSITIVE), "weight_decay": (0.0, _NON_NEGATIVE), "amsgrad": (False, None),
             "maximize": _MAXIMIZE, "staleness_aware": _STALENESS_AWARE},
    # Adam with decoupled weight decay (Loshchilov & Hutter 2019; torch.optim.AdamW): the
    # parameter is first multiplied by 1 - lr * weight_decay, then takes Adam's step.
    "adamw": {"lr": (None, _POSITIVE), "beta1": (0.9, _UNIT), "beta2": (0.999, _UNIT),
              "eps": (1e-8, _POSITIVE), "weight_decay": (0.01, _NON_NEGATIVE), "amsgrad": (False, None),
              "maximize": _MAXIMIZE, "staleness_aware": _STALENESS_AWARE},
    # McMahan & Streeter, NIPS 2014, Algorithm 2; lr is alpha, initial_accumulator is z = z' at
    # the start, window is how many past gradient sums the store keeps (see adarevision_step).
    "adarevision": {"lr": (None, _POSITIVE), "initial_accumulator": (0.1, _POSITIVE), "window": (64, _COUNT)},
    # EASGD's centre variable (Zhang, Choromanska, LeCun 2015): a push carries the elastic delta
    # alpha * (x_worker - x_centre) and the store adds it.
    "elastic": {},
}

# What a push may set for one step over the tensor's stored spec (a torch param group's current
# lr, betas, ...: an LR scheduler's value reaches every replica in the log entry).
STEP_HYPERPARAMETERS = ("lr", "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps")


@dataclass(frozen=True)
class Context:
    """What the state machine knows about the entry being applied, all of it from the log."""
    index: int = 0                 # Raft index of this entry
    base: int | None = None        # store version the pusher pulled (None: not given)
    staleness: int = 0             # updates to this tensor after ``base`` (0 without a base)


NO_CONTEXT = Context()


def normalize(spec: Any, tensor: str = "?") -> dict:
    """A complete, validated spec with every default filled in, or InvalidOptimizer."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidOptimizer(f"tensor {tensor!r}: optimizer must be a dict with a 'name' "
                               f"(one of {sorted(SPECS)}), got {spec!r}")
    name = spec["name"]
    if name not in SPECS:
        raise InvalidOptimizer(f"tensor {tensor!r}: unknown optimizer {name!r} (known: {sorted(SPECS)})")
    params = SPECS[name]
    unknown = sorted(map(repr, set(spec) - set(params) - {"name"}))
    if unknown:
        raise InvalidOptimizer(f"tensor {tensor!r}: optimizer {name!r} has no parameter(s) {', '.join(unknown)} "
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
        elif type(default) is int:
            if type(value) is not int or not check[1](value):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be {check[0]}, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be a finite number, got {value!r}")
            value = float(value)
            if not check[1](value):
                raise InvalidOptimizer(f"tensor {tensor!r}: {name}.{key} must be {check[0]}, got {value!r}")
        out[key] = value
    return out


def with_hyperparameters(spec: dict, hyper: Any, tensor: str = "?") -> dict:
    """The spec one step applies: the tensor's stored ``spec`` with the push's ``hyper`` (a map
    of STEP_HYPERPARAMETERS to numbers, or None) over it, validated like a stored spec."""
    if hyper is None:
        return spec
    if not isinstance(hyper, dict):
        raise InvalidOptimizer(f"tensor {tensor!r}: hyperparameters must be a map, got {type(hyper).__name__}")
    takes = [k for k in STEP_HYPERPARAMETERS if k in SPECS[spec["name"]]]
    refused = sorted(repr(k) for k in hyper if k not in takes)
    if refused:
        raise InvalidOptimizer(f"tensor {tensor!r}: a step of optimizer {spec['name']!r} cannot set "
                               f"{', '.join(refused)} (it may set {takes})")
    # Every tensor of a push usually carries the same values: validated once. The key holds each
    # value's type, since True == 1 == 1.0 in Python and only one of them is a valid lr: a cache
    # hit must give what a miss would on a replica that never saw the other (replicas diverge else).
    try:
        return dict(_merged(_key(spec), _key(hyper)))
    except InvalidOptimizer:
        pass          # raised again below, naming this tensor
    except TypeError:
        pass          # an unhashable value: normalize names it
    return dict(_merged_uncached(spec, hyper, tensor))


def _key(d: dict) -> tuple:
    return tuple(sorted((k, type(v).__name__, v) for k, v in d.items()))


@functools.lru_cache(maxsize=256)
def _merged(spec: tuple, hyper: tuple) -> tuple:
    return tuple(sorted(_merged_uncached({k: v for k, _, v in spec}, {k: v for k, _, v in hyper}, "?").items()))


def _merged_uncached(spec: dict, hyper: dict, tensor: str) -> dict:
    # lr 0 is a step (torch takes it: a warm-up's first lr), though no stored spec has it
    zero_lr = hyper.get("lr") == 0 and not isinstance(hyper.get("lr"), bool)
    out = normalize({**spec, **hyper, **({"lr": spec["lr"]} if zero_lr else {})}, tensor)
    return {**out, "lr": 0.0} if zero_lr else out


def init_state(spec: dict, param: np.ndarray) -> dict[str, Any]:
    name = spec["name"]
    if name == "momentum":
        return {"velocity": np.zeros_like(param), "step": 0}
    if name == "adagrad":
        return {"accumulator": np.full_like(param, spec["initial_accumulator"]), "step": 0}
    if name in ("adam", "adamw"):
        state = {"m": np.zeros_like(param), "v": np.zeros_like(param), "beta1_t": 1.0, "beta2_t": 1.0, "step": 0}
        if spec.get("amsgrad"):
            state["v_max"] = np.zeros_like(param)
        return state
    if name == "adarevision":
        z0 = np.full_like(param, spec["initial_accumulator"])
        # history: [[index, gradient sum after the update applied at that index], ...], oldest
        # first, at most `window` long; updates: how many updates were applied in all.
        return {"gbar": np.zeros_like(param), "z": z0, "z_max": z0, "history": [], "updates": 0}
    return {}


def step(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
         ctx: Context = NO_CONTEXT) -> tuple[np.ndarray, dict]:
    """One update: returns (new param, new state). ``grad`` has param's shape and dtype.

    The options added for torch's optimizers (maximize, dampening, amsgrad) are read with
    defaults, so a spec stored before they existed applies as it always did; ``step`` counts the
    updates for torch's state_dict (``step``) and never enters a formula except through
    dampening's first step."""
    name = spec["name"]
    if name == "elastic":
        return param + grad, state
    if name == "adarevision":
        return adarevision_step(spec, param, grad, state, ctx)
    t = param.dtype.type
    # The scalar is divided as a Python float, then cast once: the same bits on every replica.
    lr_float = spec["lr"] / max(1, ctx.staleness) if spec["staleness_aware"] else spec["lr"]
    lr = t(lr_float)
    if spec.get("maximize"):
        grad = np.negative(grad)                     # exact: a sign flip
    steps = state.get("step", 0) + 1
    if name == "adamw":
        if spec["weight_decay"]:                     # decoupled: param * (1 - lr * weight_decay)
            param = np.multiply(param, t(1.0 - lr_float * spec["weight_decay"]), out=_like(param))
    elif spec["weight_decay"]:
        decayed = np.multiply(param, t(spec["weight_decay"]), out=_like(param))
        grad = np.add(grad, decayed, out=decayed)    # grad + weight_decay * param
    # Each formula is evaluated in its textbook order, but into as few new arrays as it must
    # return (plus a scratch array or two): a new array per operation was half of Adam's apply
    # (python -m bench.optim_apply). The same IEEE operations on the same operands (a * b and
    # b * a are the same bits) give the same bits as the textbook expressions, which
    # tests/test_optim.py checks bit for bit: replicas of older and newer code never diverge.
    if name == "sgd":
        new = np.multiply(grad, lr, out=_like(param))     # param - lr * grad
        return np.subtract(param, new, out=new), state
    if name == "momentum":
        mu = t(spec["momentum"])
        dampening = spec.get("dampening", 0.0)
        if dampening and steps == 1:                 # torch's buffer starts as the first gradient
            velocity = np.copy(grad)
        else:
            velocity = np.multiply(state["velocity"], mu, out=_like(param))
            if dampening:
                scratch = np.multiply(grad, t(1.0 - dampening), out=_like(param))
                np.add(velocity, scratch, out=velocity)    # mu * velocity + (1 - dampening) * grad
            else:
                np.add(velocity, grad, out=velocity)       # mu * velocity + grad
        if spec["nesterov"]:
            new = np.multiply(velocity, mu, out=_like(param))
            np.add(grad, new, out=new)               # grad + mu * velocity
            np.multiply(new, lr, out=new)
        else:
            new = np.multiply(velocity, lr, out=_like(param))
        return np.subtract(param, new, out=new), {"velocity": velocity, "step": steps}
    if name == "adagrad":
        acc = np.multiply(grad, grad, out=_like(param))
        np.add(state["accumulator"], acc, out=acc)   # accumulator + grad * grad
        denominator = np.sqrt(acc, out=_like(param))
        np.add(denominator, t(spec["eps"]), out=denominator)
        new = np.multiply(grad, lr, out=_like(param))
        np.divide(new, denominator, out=new)         # lr * grad / (sqrt(acc) + eps)
        return np.subtract(param, new, out=new), {"accumulator": acc, "step": steps}
    if name in ("adam", "adamw"):
        b1, b2 = spec["beta1"], spec["beta2"]
        m = np.multiply(state["m"], t(b1), out=_like(param))
        scratch = np.multiply(grad, t(1.0 - b1), out=_like(param))
        np.add(m, scratch, out=m)                    # b1 * m + (1 - b1) * grad
        v = np.multiply(grad, grad, out=_like(param))
        np.multiply(v, t(1.0 - b2), out=v)
        np.multiply(state["v"], t(b2), out=scratch)
        np.add(scratch, v, out=v)                    # b2 * v + (1 - b2) * (grad * grad)
        # The bias corrections use the product of the betas applied so far: beta^t while the
        # betas are constant (within an ulp of torch's beta ** t), and well defined when a
        # scheduler changes them.
        beta1_t = state["beta1_t"] * b1
        beta2_t = state["beta2_t"] * b2
        new_state = {"m": m, "v": v, "beta1_t": beta1_t, "beta2_t": beta2_t, "step": steps}
        second = v
        if spec.get("amsgrad"):                      # the running maximum of v (torch's max_exp_avg_sq)
            second = new_state["v_max"] = np.maximum(state["v_max"], v, out=_like(param))
        new = np.divide(m, t(1.0 - beta1_t), out=scratch)        # m_hat
        denominator = np.divide(second, t(1.0 - beta2_t), out=_like(param))   # v_hat
        np.sqrt(denominator, out=denominator)
        np.add(denominator, t(spec["eps"]), out=denominator)
        np.multiply(new, lr, out=new)
        np.divide(new, denominator, out=new)         # lr * m_hat / (sqrt(v_hat) + eps)
        return np.subtract(param, new, out=new), new_state
    raise AssertionError(name)  # normalize() admits only the names above


def _like(param: np.ndarray) -> np.ndarray:
    """A new array for a result (an ndarray even for a 0-d tensor, so ``out=`` can take it)."""
    return np.empty_like(param)


def check_applicable(spec: dict, state: dict, ctx: Context) -> None:
    """Raise what ``step`` would raise for this context, before any tensor of a push is updated
    (a push of several tensors applies whole or not at all)."""
    if spec["name"] == "adarevision":
        gradient_sum_at(state, ctx.base)


def gradient_sum_at(state: dict, base: int | None) -> np.ndarray:
    """AdaRevision's g_old: the gradient sum the pusher saw, i.e. after the last update applied
    at an index <= ``base``. No base: the current sum (the push is treated as not delayed)."""
    if base is None:
        return state["gbar"]
    history = state["history"]
    for index, gbar in reversed(history):
        if index <= base:
            return gbar
    if state["updates"] == len(history):          # nothing evicted: base precedes every update
        return np.zeros_like(state["gbar"])
    oldest = history[0][0] if history else None
    raise StaleBase(f"base_version {base} is older than the {len(history)} gradient sums AdaRevision "
                    f"keeps (oldest at version {oldest}): pull again and recompute the gradient")


def adarevision_step(spec: dict, x: np.ndarray, g: np.ndarray, state: dict, ctx: Context) -> tuple[np.ndarray, dict]:
    """AdaRevision (McMahan & Streeter 2014, Algorithm 2), per coordinate, unconstrained:

        g_bck <- gbar - g_old            (gradients applied since the pusher read x)
        eta_old <- alpha / sqrt(z')
        z <- z + g^2 + 2 g g_bck
        z' <- max(z, z')
        eta <- alpha / sqrt(z')
        x <- x - eta g + (eta_old - eta) g_bck
        gbar <- gbar + g
    """
    t = x.dtype.type
    alpha = t(spec["lr"])
    g_bck = state["gbar"] - gradient_sum_at(state, ctx.base)
    eta_old = alpha / np.sqrt(state["z_max"])
    z = state["z"] + g * g + t(2.0) * g * g_bck
    z_max = np.maximum(z, state["z_max"])
    eta = alpha / np.sqrt(z_max)
    new = x - eta * g + (eta_old - eta) * g_bck
    gbar = state["gbar"] + g
    history = (state["history"] + [[ctx.index, gbar]])[-(spec["window"] + 1):]   # corrects tau <= window
    return new, {"gbar": gbar, "z": z, "z_max": z_max, "history": history, "updates": state["updates"] + 1}
