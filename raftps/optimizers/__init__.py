"""The store's optimizers, one object each, one module per optimizer (sgd, momentum, adagrad,
adam with adamw, adarevision, elastic, ...): its parameters and their checks, its state's start,
its deterministic step, whether a row-sparse push or a move may use it, and its torch.optim form.

Each module lists its objects in ``OPTIMIZERS``; the registry below finds every module of this
package (in name order), so a new optimizer is one file and its tests. The rest of raftps reads
the registry (``raftps.optim`` dispatches through it) instead of choosing by name.
"""
from __future__ import annotations

import importlib
import pkgutil

from raftps.optimizers.base import NO_CONTEXT, Context, Optimizer

__all__ = ["OPTIMIZERS", "Optimizer", "Context", "NO_CONTEXT"]


def _discover() -> dict[str, Optimizer]:
    found: dict[str, Optimizer] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for optimizer in getattr(module, "OPTIMIZERS", ()):
            if optimizer.name in found:
                raise RuntimeError(f"two optimizers are named {optimizer.name!r} (raftps/optimizers/)")
            found[optimizer.name] = optimizer
    return found


# name -> the optimizer; every module of the package is imported once, here.
OPTIMIZERS: dict[str, Optimizer] = _discover()
