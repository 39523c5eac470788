"""torch.optim <-> the store: which store optimizer runs a torch param group, the hyperparameters
a step carries, and optimizer state in both forms.

The store runs torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize), Adam and
AdamW (amsgrad, maximize) and Adagrad (without lr_decay). Anything else is refused here, before
any I/O, with the list of what is supported; ``mode="diloco"`` runs any torch optimizer locally.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raftps import optim
from raftps.optimizers import OPTIMIZERS

SUPPORTED = ("SGD", "Adam", "AdamW", "Adagrad")
# Group options that change nothing the store computes (how torch would have run the step).
_IGNORED = {"foreach", "fused", "capturable", "params", "initial_lr", "name"}
_REFUSED_IF_SET = {"differentiable": False, "lr_decay": 0}


def store_spec(torch_class: type, group: dict) -> dict:
    """The store optimizer spec that runs ``group`` of a ``torch_class`` optimizer (normalized),
    or ValueError naming what the store cannot run."""
    name = torch_class.__name__
    mro = torch_class.__mro__
    at = next((i for i, c in enumerate(mro)
               if c.__name__ in SUPPORTED and c.__module__.startswith("torch.optim")), None)
    if at is None:
        raise ValueError(f"the store runs torch.optim.{', '.join(SUPPORTED)} (and their options); {name} is not "
                         "one of them: wrap one of those, or use mode='diloco', where any torch optimizer runs "
                         "locally")
    base = mro[at].__name__
    # a subclass's own step() would never run: the store applies the base class's update
    own_step = next((c.__name__ for c in mro[:at] if "step" in vars(c)), None)
    if own_step is not None:
        raise ValueError(f"{own_step} defines its own step(), which the store cannot run (it would apply "
                         f"torch.optim.{base}'s update instead); wrap torch.optim.{base} itself, or use "
                         "mode='diloco', where the torch optimizer's own step runs locally")
    for key, allowed in _REFUSED_IF_SET.items():
        if key in group and group[key] != allowed:
            raise ValueError(f"{name}: option {key}={group[key]!r} is not supported by the store (only {allowed!r})")
    lr = _number(group, "lr")
    spec: dict[str, Any] = {"lr": lr, "weight_decay": _number(group, "weight_decay"),
                            "maximize": bool(group.get("maximize", False))}
    runs_as = next(o for o in OPTIMIZERS.values() if o.runs_torch_group(base, group, _number))
    spec.update(runs_as.spec_from_torch(group, _number))
    torch_options = set().union(*(o.torch_options for o in OPTIMIZERS.values()))    # e.g. betas, nesterov
    known = set(spec) | _IGNORED | set(_REFUSED_IF_SET) | torch_options
    unknown = sorted(set(group) - known)
    if unknown:
        raise ValueError(f"{name}: param group option(s) {unknown} are not supported by the store")
    return optim.normalize({**spec, "lr": lr or 1.0}, f"{name} param group") | {"lr": lr}


def stored_spec(torch_class: type, group: dict) -> dict:
    """The spec a tensor is created with: ``store_spec`` at the group's base lr (an LR
    scheduler's ``initial_lr`` where one is attached: its first lr may be 0 during a warm-up)."""
    spec = store_spec(torch_class, group)
    lr = _number(group, "initial_lr") if "initial_lr" in group else spec["lr"]
    if not lr > 0:
        raise ValueError(f"{torch_class.__name__}: lr must be > 0 to create the store's tensors, got {lr}")
    return {**spec, "lr": lr}


def step_hyperparameters(spec: dict, stored: dict) -> dict:
    """What one step carries for a tensor whose stored spec is ``stored``, now that its group
    says ``spec``: the step hyperparameters that differ (none while a group keeps its values, so
    a constant-lr job sends nothing extra). Raises ValueError if an option that only the stored
    spec can hold (nesterov, amsgrad, the optimizer itself) changed."""
    fixed = [k for k in stored if k not in optim.STEP_HYPERPARAMETERS and k != "staleness_aware"   # raftps's, not torch's
             and spec.get(k) != stored[k]]
    if fixed:
        raise ValueError(f"param group option(s) {fixed} changed from {[stored[k] for k in fixed]} to "
                         f"{[spec.get(k) for k in fixed]}: the store keeps them per tensor from its first step; "
                         "only " + ", ".join(optim.STEP_HYPERPARAMETERS) + " may change during training")
    return {k: spec[k] for k in optim.STEP_HYPERPARAMETERS if k in stored and spec[k] != stored[k]}


def _number(group: dict, key: str) -> float:
    value = group[key]
    if isinstance(value, torch.Tensor):
        value = value.item()
    return float(value)


# ---- optimizer state -----------------------------------------------------------------------

def to_torch_state(spec: dict, state: dict) -> dict[str, torch.Tensor]:
    """One parameter's store state as torch's optimizer keeps it ({} where torch keeps nothing
    yet: before the first step, or plain SGD)."""
    name = spec["name"]
    if OPTIMIZERS[name].torch_class is None:
        raise ValueError(f"optimizer {name!r} keeps state torch has no form for; export it with `raftps export`")
    return {key: torch.tensor(value) if isinstance(value, float) else _tensor(value)     # a float: torch's step
            for key, value in OPTIMIZERS[name].to_torch_state(spec, state).items()}


def to_store_state(spec: dict, torch_state: dict, like: np.ndarray, what: str) -> dict[str, Any]:
    """A torch state (one parameter's entry of a state_dict) as the store keeps it, for a tensor
    like ``like`` (shape and dtype), or ValueError naming what does not fit."""
    name = spec["name"]

    def array(key: str) -> np.ndarray:
        value = torch_state.get(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}: state {key!r} is missing (a {name} state has {sorted(expected)})")
        if tuple(value.shape) != like.shape:
            raise ValueError(f"{what}: state {key!r} has shape {tuple(value.shape)}, the parameter {like.shape}")
        return value.detach().to(device="cpu", dtype=_torch_dtype(like.dtype)).contiguous().numpy().copy()

    steps = int(torch_state["step"].item() if isinstance(torch_state.get("step"), torch.Tensor)
                else torch_state.get("step", 0))
    if OPTIMIZERS[name].torch_class is None:
        raise ValueError(f"{what}: the store's {name!r} state cannot be loaded from a torch state_dict")
    expected = OPTIMIZERS[name].torch_state_keys(spec, torch_state)
    out = OPTIMIZERS[name].from_torch_state(spec, torch_state, array, steps, like)
    extra = sorted(set(torch_state) - expected)
    if extra:
        raise ValueError(f"{what}: state {extra} is not part of a {name} state (it has {sorted(expected)})")
    if steps < 0:
        raise ValueError(f"{what}: step {steps} is negative")
    return out


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))          # a writeable copy: the store's arrays are frozen


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.float64 if dtype == np.float64 else torch.float32
