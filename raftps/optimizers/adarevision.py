"""AdaRevision (McMahan & Streeter, NIPS 2014, Algorithm 2), per coordinate, unconstrained: a
delayed gradient is corrected by the gradients applied since its pusher read the parameter. lr
is alpha, initial_accumulator is z = z' at the start, window is how many past gradient sums the
store keeps, by the log index that applied them: a state that means nothing in another Raft
group, so it is neither moved nor assigned, and a row-sparse push cannot use it."""
from __future__ import annotations

from typing import Any

import numpy as np

from raftps.errors import StaleBase
from raftps.optimizers.base import COUNT, POSITIVE, Context, Optimizer


class AdaRevision(Optimizer):
    name = "adarevision"
    params = {"lr": (None, POSITIVE), "initial_accumulator": (0.1, POSITIVE), "window": (64, COUNT)}
    rows = False
    bound_to_log = ("keeps its gradient sums by this group's store versions, which mean nothing in another "
                    "group")

    def init_state(self, spec: dict, param: np.ndarray) -> dict[str, Any]:
        z0 = np.full_like(param, spec["initial_accumulator"])
        # history: [[index, gradient sum after the update applied at that index], ...], oldest
        # first, at most `window` long; updates: how many updates were applied in all.
        return {"gbar": np.zeros_like(param), "z": z0, "z_max": z0, "history": [], "updates": 0}

    def check_applicable(self, spec: dict, state: dict, ctx: Context) -> None:
        gradient_sum_at(state, ctx.base)

    def step(self, spec: dict, x: np.ndarray, g: np.ndarray, state: dict, ctx: Context) -> tuple[np.ndarray, dict]:
        """Per coordinate:

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


OPTIMIZERS = (AdaRevision(),)
