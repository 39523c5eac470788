"""SGD with momentum, as torch.optim.SGD with momentum > 0: the buffer is
momentum * buffer + (1 - dampening) * grad, and with dampening it starts as the first gradient;
nesterov steps along grad + momentum * buffer."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raftps.optimizers.base import (MAXIMIZE, NON_NEGATIVE, POSITIVE, STALENESS_AWARE, UNIT, Context, Optimizer, new_like, prepare,
                                    torch_common)
from raftps.optimizers.sgd import SGD_OPTIONS


class Momentum(Optimizer):
    name = "momentum"
    params = {"lr": (None, POSITIVE), "momentum": (0.9, UNIT), "dampening": (0.0, UNIT),
              "nesterov": (False, None), "weight_decay": (0.0, NON_NEGATIVE), "maximize": MAXIMIZE,
              "staleness_aware": STALENESS_AWARE}
    torch_class = "SGD"
    torch_options = SGD_OPTIONS

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        return {"velocity": np.zeros_like(param), "step": 0}

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        """``dampening`` is read with a default, so a spec stored before it existed applies as it
        always did; ``step`` counts the updates for torch's state_dict and enters no formula
        except through dampening's first step."""
        t, _, lr, param, grad, steps = prepare(spec, param, grad, state, ctx)
        mu = t(spec["momentum"])
        dampening = spec.get("dampening", 0.0)
        if dampening and steps == 1:                 # torch's buffer starts as the first gradient
            velocity = np.copy(grad)
        else:
            velocity = np.multiply(state["velocity"], mu, out=new_like(param))
            if dampening:
                scratch = np.multiply(grad, t(1.0 - dampening), out=new_like(param))
                np.add(velocity, scratch, out=velocity)    # mu * velocity + (1 - dampening) * grad
            else:
                np.add(velocity, grad, out=velocity)       # mu * velocity + grad
        if spec["nesterov"]:
            new = np.multiply(velocity, mu, out=new_like(param))
            np.add(grad, new, out=new)               # grad + mu * velocity
            np.multiply(new, lr, out=new)
        else:
            new = np.multiply(velocity, lr, out=new_like(param))
        return np.subtract(param, new, out=new), {"velocity": velocity, "step": steps}

    def runs_torch_group(self, base: str, group: dict, number: Callable[[dict, str], float]) -> bool:
        return base == "SGD" and number(group, "momentum") != 0

    def spec_from_torch(self, group: dict, number: Callable[[dict, str], float]) -> dict:
        return {"name": "momentum", "momentum": number(group, "momentum"), "dampening": number(group, "dampening"),
                "nesterov": bool(group["nesterov"])}

    def torch_group(self, spec: dict) -> dict:
        return {**torch_common(spec), "momentum": spec.get("momentum", 0.0), "dampening": spec.get("dampening", 0.0),
                "nesterov": spec.get("nesterov", False)}

    def to_torch_state(self, spec: dict, state: dict) -> dict[str, Any]:
        steps = int(state.get("step", 0))
        return {"momentum_buffer": state["velocity"]} if steps or "step" not in state else {}

    def torch_state_keys(self, spec: dict, torch_state: dict) -> set[str]:
        return set() if torch_state.get("momentum_buffer") is None else {"momentum_buffer"}

    def from_torch_state(self, spec: dict, torch_state: dict, array: Callable[[str], np.ndarray], steps: int,
                         like: np.ndarray) -> dict[str, Any]:
        if torch_state.get("momentum_buffer") is None:
            return {"velocity": np.zeros_like(like), "step": 0}
        return {"velocity": array("momentum_buffer"), "step": 1}


OPTIMIZERS = (Momentum(),)
