"""Asynchronous EASGD (Zhang, Choromanska, LeCun 2015, Algorithm 1): the store's tensors are the
centre variables c (the ``elastic`` rule adds what is pushed); each worker trains its own copy x
with a local optimizer, and every ``n_push`` steps pulls c, pushes delta = alpha (x - c) and moves
x by -delta. A restarted worker starts again from the centre.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from raftps.modes.link import StoreLink
from raftps.modes.local import LocalOptimizer


class Easgd:
    """``specs``: tensor name -> the local optimizer's spec, stepped here in numpy (``local_step``;
    none when the worker runs its own optimizer, as the torch adapter may)."""

    def __init__(self, link: StoreLink, alpha: float, n_push: int = 1, specs: Mapping[str, dict] | None = None):
        self.link, self.alpha, self.n_push = link, alpha, n_push
        self.local = LocalOptimizer(specs or {})
        self.since_push = 0
        self.last_push_bytes = 0                # the bytes the last exchange pushed

    def resume(self, names: list[str]) -> tuple[dict[str, np.ndarray], int]:
        """The newest values of ``names`` (the centre) and the step to start at."""
        return self.link.resume(names)

    def local_step(self, x: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                   hyper: Mapping[str, dict] | None = None) -> dict[str, np.ndarray]:
        """The local optimizer's step on the tensors in ``grads``; returns their new values."""
        return self.local.step(x, grads, hyper)

    def step_done(self) -> bool:
        """Count a local step; True when the exchange with the centre is due."""
        self.since_push += 1
        return self.since_push >= self.n_push

    def exchange(self, x: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pull the centre c, push alpha (x - c) (the store adds it to c); returns x's new values."""
        centre = self.link.pull(list(x))
        delta = {k: (v - centre[k]) * v.dtype.type(self.alpha) for k, v in x.items()}
        self.link.push(delta, steps=self.since_push)
        self.last_push_bytes = sum(d.nbytes for d in delta.values())
        self.since_push = 0
        return {k: x[k] - d for k, d in delta.items()}
