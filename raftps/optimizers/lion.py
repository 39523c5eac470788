"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): every
coordinate steps by lr along the sign of an interpolation of its momentum and its gradient, and
the momentum then moves with its own beta:

    c <- beta1 * m + (1 - beta1) * grad
    param <- param * (1 - lr * weight_decay) - lr * sign(c)      (weight decay decoupled)
    m <- beta2 * m + (1 - beta2) * grad

sign(c) is (c > 0) - (c < 0): two comparisons, exact on every replica; the rest is * + -, so the
step is as deterministic as SGD's. The state is per element (m) and a step count: a row-sparse
push, a move and assign_state take it. torch.optim has no Lion, so it has no torch form.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from raftps.optimizers.base import MAXIMIZE, NON_NEGATIVE, POSITIVE, STALENESS_AWARE, UNIT, Context, Optimizer, new_like, prepare


class Lion(Optimizer):
    name = "lion"
    params = {"lr": (None, POSITIVE), "beta1": (0.9, UNIT), "beta2": (0.99, UNIT),
              "weight_decay": (0.0, NON_NEGATIVE), "maximize": MAXIMIZE, "staleness_aware": STALENESS_AWARE}

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        return {"m": np.zeros_like(param), "step": 0}

    def step(self, spec: dict, param: np.ndarray, grad: np.ndarray, state: dict,
             ctx: Context) -> tuple[np.ndarray, dict]:
        t, _, lr, param, grad, steps = prepare(spec, param, grad, state, ctx, decoupled=True)
        b1, b2 = spec["beta1"], spec["beta2"]
        c = np.multiply(state["m"], t(b1), out=new_like(param))
        scratch = np.multiply(grad, t(1.0 - b1), out=new_like(param))
        np.add(c, scratch, out=c)                    # b1 * m + (1 - b1) * grad
        new = np.subtract(np.greater(c, 0), np.less(c, 0), dtype=param.dtype, out=new_like(param))   # sign(c)
        np.multiply(new, lr, out=new)
        np.subtract(param, new, out=new)             # param - lr * sign(c)
        m = np.multiply(state["m"], t(b2), out=c)
        np.multiply(grad, t(1.0 - b2), out=scratch)
        np.add(m, scratch, out=m)                    # b2 * m + (1 - b2) * grad
        return new, {"m": m, "step": steps}


OPTIMIZERS = (Lion(),)
