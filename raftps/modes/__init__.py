"""One engine per training mode, shared by the numpy trainer (trainer/worker.py) and the torch
adapter (raftps/torch/worker.py): each mode's state and transitions in one place, numpy arrays
in and out, no framework. The workers only move tensors in and out of them (after dask's
``WorkerState``, apart from its ``Worker``).

- ``link.py``: ``StoreLink``, a worker's pushes and pulls: the versions it has seen and pushed,
  its per-Raft-group step counters, a push's retries (SSP bound, SSP membership, a stale base).
- ``sync.py``: ``SyncSteps``, a job's synchronous steps (one contribution per rank per step).
- ``downpour.py``: ``Downpour``, the async modes: DownpourSGD, and SSP (n = 1 and the gate).
- ``easgd.py``: ``Easgd``, asynchronous elastic averaging with the store's centre variables.
- ``local.py``: ``LocalOptimizer``, a worker's own optimizer in numpy (EASGD's, DiLoCo's inner one).
- DiLoCo's rounds are ``raftps/client/diloco.py`` (its own module: a documented import path).
"""
from __future__ import annotations

from raftps.modes.downpour import Downpour
from raftps.modes.easgd import Easgd
from raftps.modes.link import DROPPED, REFUSED, SENT, StoreLink, step_counters
from raftps.modes.local import LocalOptimizer
from raftps.modes.sync import StepResult, SyncSteps

__all__ = ["Downpour", "Easgd", "LocalOptimizer", "StoreLink", "SyncSteps", "StepResult", "SENT", "DROPPED", "REFUSED", "step_counters"]
