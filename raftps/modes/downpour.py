"""The async modes. ``async``: DownpourSGD (Dean et al. 2012, Algorithm 7.1): push the gradient
summed over ``n_push`` steps with the version pulled, pull every ``n_fetch`` steps (from any node
that has applied this worker's last push); in between the replica takes its own SGD steps
(``own_step``), so its next gradients are computed where its own steps led. ``ssp``: the same
with n = 1 and the SSP gate before every pull (Ho et al. 2013; raftps/client/ssp.py): the next step
waits until this worker is at most s clocks ahead of the slowest. A push is compressed as
``compress`` says (raftps.compress; top-k keeps a residual).

    d = Downpour(link, n_push, n_fetch, compress)
    every step:  [replica.own_step if d.own_steps]  d.add(grads)
                 if d.push_due: d.push(d.take())
                 if d.pull_due: replica = d.pull(names)
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from raftps import compress as codecs
from raftps.client.client import Client, newest
from raftps.modes.link import REFUSED, StoreLink


class Downpour:
    """One worker's schedule of pushes and pulls in the async modes (ssp when ``link.ssp``)."""

    def __init__(self, link: StoreLink, n_push: int = 1, n_fetch: int = 1, compress: str | None = None):
        self.link = link
        self.n_push, self.n_fetch = (1, 1) if link.ssp is not None else (n_push, n_fetch)
        self.method, fraction = codecs.parse(compress or "none")
        self._topk = codecs.TopK(fraction) if self.method == "topk" else None
        self.pending: dict[str, Any] = {}       # gradients summed since the last push
        self.since_push = self.since_fetch = 0
        self.last_push_bytes = 0                # the gradient bytes the last push carried

    @property
    def own_steps(self) -> bool:
        """Between pulls the replica takes its own steps (n_fetch > 1; with 1 the next pull replaces it)."""
        return self.n_fetch > 1

    def add(self, grads: Mapping[str, Any]) -> None:
        """One step's gradients, summed with those not pushed yet (any array type with ``+``)."""
        for name, g in grads.items():
            prev = self.pending.get(name)
            self.pending[name] = g if prev is None else prev + g
        self.since_push += 1
        self.since_fetch += 1

    @property
    def push_due(self) -> bool:
        return self.since_push >= self.n_push

    @property
    def pull_due(self) -> bool:
        return self.since_fetch >= self.n_fetch

    def take(self) -> dict[str, Any]:
        """The summed gradients, to push (the worker moves them to host arrays)."""
        pending, self.pending = self.pending, {}
        return pending

    def push(self, dense: dict[str, np.ndarray], rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
             plain: dict[str, np.ndarray] | None = None, hyper: dict | None = None) -> str:
        """Push the steps since the last push: ``dense`` gradients (compressed), row-sparse ones
        (``rows``: name -> (row indices, rows)) and ``plain`` tensors sent as they are. Returns the
        link's SENT, DROPPED (the worker pulls again) or REFUSED (after a short pause: the worker
        drops the steps and takes the step again, from a new pull)."""
        grads, encoding = codecs.encode_push(dense, self.method, self._topk)
        grads, encoding = dict(grads), dict(encoding or {})
        for name, (idx, values) in (rows or {}).items():     # the store updates those rows only
            parts, enc = codecs.encode_rows(name, idx, values)
            grads.update(parts)
            encoding.update(enc)
        grads.update(plain or {})
        self.last_push_bytes = sum(a.nbytes for a in grads.values())
        status = self.link.push(grads, encoding or None, steps=self.since_push, hyper=hyper)
        self.since_push = 0
        if status == REFUSED:
            time.sleep(0.01)
        return status

    def resume(self, names: list[str]) -> tuple[dict[str, np.ndarray], int]:
        """The newest values of ``names`` and the step to start at (the link's step counters)."""
        return self.link.resume(names)

    def pull(self, names: list[str], gate: bool = True) -> dict[str, np.ndarray]:
        """The SSP gate (mode ssp, waiting at the leader; ``gate=False``: a pull again after a
        dropped push, no step taken since), then ``names``' values."""
        ssp = self.link.ssp
        if gate and ssp is not None and self.link.wait_at_bound:
            self.link.pushed = newest(self.link.pushed, ssp.wait_turn())
        self.since_fetch = 0
        return self.link.pull(names)


def own_step(params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
    """One of a Downpour replica's own SGD steps between pulls (the paper's Algorithm 7.1)."""
    return {k: v - v.dtype.type(lr) * grads[k] for k, v in params.items()}


def wait_for_updates(client: Client, probe: str, updates: int, timeout: float) -> None:
    """Downpour's warm start: let rank 0 train alone until the store has applied ``updates``
    pushes to tensor ``probe``, so the others do not start from (and push stale gradients of)
    the random init."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if next(t["version"] for t in client.tensors() if t["name"] == probe) >= updates:
            return
        time.sleep(0.05)
    raise TimeoutError(f"warm-up: fewer than {updates} updates within {timeout} s")
