"""Adagrad (torch.optim.Adagrad without lr_decay): accumulator + grad * grad, then
lr * grad / (sqrt(accumulator) + eps)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raftps.optimizers.base import (MAXIMIZE, NON_NEGATIVE, POSITIVE, STALENESS_AWARE, Context, Optimizer, new_like, prepare,
                                    torch_common)


class Adagrad(Optimizer):
    name = "adagrad"
    params = {"lr": (None, POSITIVE), "eps": (1e-10, POSITIVE), "initial_accumulator": (0.1, NON_NEGATIVE),
              "weight_decay": (0.0, NON_NEGATIVE), "maximize": MAXIMIZE, "staleness_aware": STALENESS_AWARE}
    torch_class = "Adagrad"
    torch_options = frozenset({"initial_accumulator_value"})

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        return {"accumulator": np.full_like(param, spec["initial_accumulator"]), "step": 0}

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        t, _, lr, param, grad, steps = prepare(spec, param, grad, state, ctx)
        acc = np.multiply(grad, grad, out=new_like(param))
        np.add(state["accumulator"], acc, out=acc)   # accumulator + grad * grad
        denominator = np.sqrt(acc, out=new_like(param))
        np.add(denominator, t(spec["eps"]), out=denominator)
        new = np.multiply(grad, lr, out=new_like(param))
        np.divide(new, denominator, out=new)         # lr * grad / (sqrt(acc) + eps)
        return np.subtract(param, new, out=new), {"accumulator": acc, "step": steps}

    def spec_from_torch(self, group: dict, number: Callable[[dict, str], float]) -> dict:
        return {"name": "adagrad", "eps": number(group, "eps"),
                "initial_accumulator": number(group, "initial_accumulator_value")}

    def torch_group(self, spec: dict) -> dict:
        return {**torch_common(spec), "lr_decay": 0.0, "eps": spec["eps"],
                "initial_accumulator_value": spec["initial_accumulator"]}

    def to_torch_state(self, spec: dict, state: dict) -> dict[str, Any]:
        return {"step": float(int(state.get("step", 0))), "sum": state["accumulator"]}

    def torch_state_keys(self, spec: dict, torch_state: dict) -> set[str]:
        return {"step", "sum"}

    def from_torch_state(self, spec: dict, torch_state: dict, array: Callable[[str], np.ndarray], steps: int,
                         like: np.ndarray) -> dict[str, Any]:
        return {"accumulator": array("sum"), "step": steps}


OPTIMIZERS = (Adagrad(),)
