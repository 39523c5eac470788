"""Optimizers applied inside the replicated state machine: a spec's validation (``normalize``,
``with_hyperparameters``: a push's hyperparameters over the stored spec) and the dispatch of
``init_state``, ``step`` and ``check_applicable`` to the optimizer the spec names.

Each optimizer is one object in raftps/optimizers/ (one module each): its parameters, state and
step live there. Every step is pure: it returns new arrays and never mutates its inputs, so a
reader holding the previous arrays keeps a consistent view (copy-on-write). Only + - * / and sqrt
are used, hyperparameters are cast to the tensor's dtype, and Adam's beta^t are Python floats
multiplied once per step (never ``np.power``): each of these is correctly rounded in IEEE 754,
so every replica computes the same bits from the same log.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from raftps.errors import InvalidOptimizer
from raftps.optimizers import NO_CONTEXT, OPTIMIZERS, Context
from raftps.optimizers.adarevision import gradient_sum_at

__all__ = ["SPECS", "STEP_HYPERPARAMETERS", "Context", "NO_CONTEXT", "normalize", "with_hyperparameters",
           "init_state", "step", "check_applicable", "gradient_sum_at", "adarevision_step"]

# name -> {parameter: (default, check)}; a default of None means required. Each optimizer's own
# module in raftps/optimizers/ declares its parameters; this is the one table of them all.
SPECS: dict[str, dict[str, tuple[Any, tuple]]] = {name: o.params for name, o in OPTIMIZERS.items()}

# What a push may set for one step over the tensor's stored spec (a torch param group's current
# lr, betas, ...: an LR scheduler's value reaches every replica in the log entry).
STEP_HYPERPARAMETERS = ("lr", "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps")


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
    """The optimizer state of a new tensor ``param`` under ``spec`` (normalized)."""
    return OPTIMIZERS[spec["name"]].init_state(spec, param)


def step(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
         ctx: Context = NO_CONTEXT) -> tuple[np.ndarray, dict]:
    """One update: returns (new param, new state). ``grad`` has param's shape and dtype."""
    if np.ndim(param) == 0:      # a scalar parameter: see _step_0d
        return _step_0d(spec, param, grad, state, ctx)
    return OPTIMIZERS[spec["name"]].step(spec, param, grad, state, ctx)


def _step_0d(spec: dict, param: np.ndarray, grad: np.ndarray, state: dict, ctx: Context) -> tuple[np.ndarray, dict]:
    """The step of a 0-d tensor (``nn.Parameter(torch.tensor(1.0))``), taken on 1-element views:
    numpy arithmetic on 0-d arrays gives numpy scalars, which the store cannot freeze or keep.
    The same operations on the same values: the same bits."""
    def one(v: Any) -> Any:
        return np.reshape(v, (1,)) if isinstance(v, (np.ndarray, np.generic)) and np.ndim(v) == 0 else v

    def back(v: Any) -> Any:
        return np.reshape(v, ()) if isinstance(v, np.ndarray) and v.shape == (1,) else v
    new, new_state = OPTIMIZERS[spec["name"]].step(spec, one(param), one(grad), {k: one(v) for k, v in state.items()}, ctx)
    return back(new), {k: back(v) for k, v in new_state.items()}


def check_applicable(spec: dict, state: dict, ctx: Context) -> None:
    """Raise what ``step`` would raise for this context, before any tensor of a push is updated
    (a push of several tensors applies whole or not at all)."""
    OPTIMIZERS[spec["name"]].check_applicable(spec, state, ctx)


# AdaRevision's pieces under their old names (raftps/optimizers/adarevision.py).
adarevision_step = OPTIMIZERS["adarevision"].step
