"""Plain SGD: param - lr * grad (torch.optim.SGD with momentum 0)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raftps.optimizers.base import (MAXIMIZE, NON_NEGATIVE, POSITIVE, STALENESS_AWARE, Context, Optimizer, new_like, prepare,
                                    torch_common)

# The options of a torch.optim.SGD param group besides the spec's names (momentum.py reads them).
SGD_OPTIONS = frozenset({"momentum", "dampening", "nesterov"})


class SGD(Optimizer):
    name = "sgd"
    params = {"lr": (None, POSITIVE), "weight_decay": (0.0, NON_NEGATIVE), "maximize": MAXIMIZE,
              "staleness_aware": STALENESS_AWARE}
    torch_class = "SGD"
    torch_options = SGD_OPTIONS

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        p = prepare(spec, param, grad, state, ctx)
        new = np.multiply(p.grad, p.lr, out=new_like(param))     # param - lr * grad
        return np.subtract(p.param, new, out=new), state

    def runs_torch_group(self, base: str, group: dict, number: Callable[[dict, str], float]) -> bool:
        return base == "SGD" and number(group, "momentum") == 0

    def spec_from_torch(self, group: dict, number: Callable[[dict, str], float]) -> dict:
        return {"name": "sgd"}

    def torch_group(self, spec: dict) -> dict:
        return {**torch_common(spec), "momentum": 0.0, "dampening": spec.get("dampening", 0.0),
                "nesterov": spec.get("nesterov", False)}

    def to_torch_state(self, spec: dict, state: dict) -> dict[str, Any]:
        return {}

    def torch_state_keys(self, spec: dict, torch_state: dict) -> set[str]:
        return set()

    def from_torch_state(self, spec: dict, torch_state: dict, array: Callable[[str], np.ndarray], steps: int,
                         like: np.ndarray) -> dict[str, Any]:
        return {}


OPTIMIZERS = (SGD(),)
