"""A worker's own optimizer, stepped in numpy on its copy of the parameters: EASGD's local steps
(easgd.py) and the numpy trainer's DiLoCo inner steps. The same deterministic step the store
applies (raftps.optim), with one spec per tensor and its state kept here, on the worker."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from raftps import optim


class LocalOptimizer:
    """``specs``: tensor name -> store spec (checked and completed here, as the store would)."""

    def __init__(self, specs: Mapping[str, dict]):
        self.specs = {name: optim.normalize(spec, name) for name, spec in specs.items()}
        self.state: dict[str, Any] = {}         # tensor name -> its optimizer state, made at its first step

    def step(self, x: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             hyper: Mapping[str, dict] | None = None) -> dict[str, np.ndarray]:
        """One step of the tensors in ``grads`` (``hyper``: this step's hyperparameters per tensor,
        over its spec); returns their new values."""
        out = {}
        for name, g in grads.items():
            if name not in self.state:
                self.state[name] = optim.init_state(self.specs[name], x[name])
            spec = optim.with_hyperparameters(self.specs[name], (hyper or {}).get(name), name)
            out[name], self.state[name] = optim.step(spec, x[name], g, self.state[name])
        return out
