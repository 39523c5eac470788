"""Adam, and AdamW (Loshchilov & Hutter 2019; torch.optim.AdamW): the same step, AdamW's weight
decay decoupled (the parameter is first multiplied by 1 - lr * weight_decay). amsgrad keeps the
running maximum of v (torch's max_exp_avg_sq)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raftps.optimizers.base import (MAXIMIZE, NON_NEGATIVE, POSITIVE, STALENESS_AWARE, UNIT, Context, Optimizer, new_like, prepare,
                                    torch_common)


class Adam(Optimizer):
    torch_options = frozenset({"betas", "decoupled_weight_decay", "amsgrad"})

    def __init__(self, name: str, decoupled: bool, weight_decay: float, torch_class: str):
        self.name, self.decoupled, self.torch_class = name, decoupled, torch_class
        self.params = {"lr": (None, POSITIVE), "beta1": (0.9, UNIT), "beta2": (0.999, UNIT),
                       "eps": (1e-8, POSITIVE), "weight_decay": (weight_decay, NON_NEGATIVE), "amsgrad": (False, None),
                       "maximize": MAXIMIZE, "staleness_aware": STALENESS_AWARE}

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        state = {"m": np.zeros_like(param), "v": np.zeros_like(param), "beta1_t": 1.0, "beta2_t": 1.0, "step": 0}
        if spec.get("amsgrad"):
            state["v_max"] = np.zeros_like(param)
        return state

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        """``amsgrad`` and ``maximize`` are read with defaults: a spec stored before they existed
        applies as it always did."""
        t, _, lr, param, grad, steps = prepare(spec, param, grad, state, ctx, decoupled=self.decoupled)
        b1, b2 = spec["beta1"], spec["beta2"]
        m = np.multiply(state["m"], t(b1), out=new_like(param))
        scratch = np.multiply(grad, t(1.0 - b1), out=new_like(param))
        np.add(m, scratch, out=m)                    # b1 * m + (1 - b1) * grad
        v = np.multiply(grad, grad, out=new_like(param))
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
            second = new_state["v_max"] = np.maximum(state["v_max"], v, out=new_like(param))
        new = np.divide(m, t(1.0 - beta1_t), out=scratch)        # m_hat
        denominator = np.divide(second, t(1.0 - beta2_t), out=new_like(param))   # v_hat
        np.sqrt(denominator, out=denominator)
        np.add(denominator, t(spec["eps"]), out=denominator)
        np.multiply(new, lr, out=new)
        np.divide(new, denominator, out=new)         # lr * m_hat / (sqrt(v_hat) + eps)
        return np.subtract(param, new, out=new), new_state

    def runs_torch_group(self, base: str, group: dict, number: Callable[[dict, str], float]) -> bool:
        """torch.optim.Adam with decoupled_weight_decay=True is AdamW."""
        if base not in ("Adam", "AdamW"):
            return False
        return (base == "AdamW" or bool(group.get("decoupled_weight_decay", False))) == self.decoupled

    def spec_from_torch(self, group: dict, number: Callable[[dict, str], float]) -> dict:
        beta1, beta2 = (float(b) for b in group["betas"])
        return {"name": self.name, "beta1": beta1, "beta2": beta2, "eps": number(group, "eps"),
                "amsgrad": bool(group.get("amsgrad", False))}

    def torch_group(self, spec: dict) -> dict:
        return {**torch_common(spec), "betas": (spec["beta1"], spec["beta2"]), "eps": spec["eps"],
                "amsgrad": spec.get("amsgrad", False)}

    def to_torch_state(self, spec: dict, state: dict) -> dict[str, Any]:
        steps = int(state.get("step", 0))
        if not steps:
            return {}
        out = {"step": float(steps), "exp_avg": state["m"], "exp_avg_sq": state["v"]}
        if "v_max" in state:
            out["max_exp_avg_sq"] = state["v_max"]
        return out

    def torch_state_keys(self, spec: dict, torch_state: dict) -> set[str]:
        if not torch_state:
            return set()
        return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if spec.get("amsgrad") else set())

    def from_torch_state(self, spec: dict, torch_state: dict, array: Callable[[str], np.ndarray], steps: int,
                         like: np.ndarray) -> dict[str, Any]:
        if not torch_state:
            return dict(self.init_state(spec, like))
        out = {"m": array("exp_avg"), "v": array("exp_avg_sq"), "step": steps,
               "beta1_t": spec["beta1"] ** steps, "beta2_t": spec["beta2"] ** steps}
        if spec.get("amsgrad"):
            out["v_max"] = array("max_exp_avg_sq")
        if steps == 0:
            out["beta1_t"] = out["beta2_t"] = 1.0
        return out


# AdamW's default weight decay is torch's (0.01); Adam's is 0.
OPTIMIZERS = (Adam("adam", decoupled=False, weight_decay=0.0, torch_class="Adam"),
              Adam("adamw", decoupled=True, weight_decay=0.01, torch_class="AdamW"))
