"""A sync step the store skipped, told to the ``torch.amp.GradScaler`` that stepped it.

With K > 1 sync ranks a ``DistributedOptimizer`` handles GradScaler's scale itself
(``_step_supports_amp_scaling``, optimizer.py): GradScaler calls every rank's ``step()``, also
one whose gradients hold an inf, and that rank's contribution makes the store skip the step for
all (modes/sync.py). Under DDP every rank's GradScaler sees the inf (the gradients are
all-reduced) and backs off: scale times ``backoff_factor``, its growth count back to 0. Here a
rank whose own gradients were finite learns of the skip from the store's answer, after its
GradScaler checked them; ``record_inf`` records an inf with that GradScaler, through its public
``unscale_``, so its next ``update()`` backs off as DDP's does and the ranks' scales never drift
apart (a rank that kept growing its scale would overflow alone later, and skip every rank's step).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

# GradScaler.step -> (Accelerate's patched step -> an LR scheduler's step counter ->) our step
MAX_FRAMES = 8


def calling_scaler(optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler | None:
    """The GradScaler whose ``step(optimizer)`` is running now, or None (a plain ``step()``).
    GradScaler hands the optimizer copies of its scale and of the inf it found, never itself;
    its frame on the call stack is the one honest way to the object whose ``update()`` comes next."""
    frame = inspect.currentframe()
    try:
        for _ in range(MAX_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            caller = frame.f_locals.get("self")
            if isinstance(caller, torch.amp.GradScaler) and frame.f_locals.get("optimizer") is optimizer:
                return caller
        return None
    finally:
        del frame          # a frame held here would keep every local of the stack alive


def record_inf(scaler: torch.amp.GradScaler, device: torch.device) -> Any:
    """Make ``scaler``'s next ``update()`` see an inf, as if one more optimizer's gradient had held
    one: a one-element optimizer whose gradient is inf, unscaled by ``scaler`` (``update()`` backs
    off if any optimizer stepped since the last one found an inf). Returns that optimizer: keep it
    until ``update()``, the scaler files what it found under its id."""
    marker = torch.nn.Parameter(torch.zeros(1, device=device))
    marker.grad = torch.full_like(marker, float("inf"))
    holder = torch.optim.SGD([marker], lr=0.0)
    scaler.unscale_(holder)
    return holder
