"""A training worker's pushes and pulls: the store versions it has pulled and pushed, its step
counters, and the retries a push may need. Every mode's engine sends through one ``StoreLink``.

Step counters (async modes, the torch adapter): each rank counts its steps in a tensor of its own
per Raft group holding the job (jobs.step_counter), pushed in the same atomic write as the
gradients it counts, so ``resume`` knows exactly the steps the store applied. A crash between
the Raft groups' parts of one push leaves some groups a push ahead: ``resume`` starts where every
group is, and the groups ahead are left out of pushes until the others catch up.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import numpy as np

from raftps import jobs
from raftps.client.client import Client
from raftps.errors import NotInGroup, StaleBase, StalenessBound
from raftps.client.ssp import SspMember

SENT = "sent"            # the store applied the push (or every Raft group had applied it before)
DROPPED = "dropped"      # StaleBase: the store no longer holds the push's base (AdaRevision): re-pull
REFUSED = "refused"      # SSP over its bound, and this link does not wait: take the step again


def step_counters(client: Client, prefix: str, rank: int, names: Iterable[str]) -> dict[int, str]:
    """Rank ``rank``'s step counter in each Raft group that holds one of ``names``: Raft group -> name."""
    groups = client.groups()
    return {g: jobs.step_counter(prefix, rank, g, groups) for g in sorted({client.group_of(n) for n in names})}


class StoreLink:
    """``ssp``: the worker's SSP membership (None outside mode ssp); ``wait_at_bound``: a push the
    SSP bound refuses waits its turn and goes again (else it is REFUSED); ``linearizable``: pulls
    read through the leader (the newest state) instead of any node that has this worker's last push."""

    def __init__(self, client: Client, ssp: SspMember | None = None, wait_at_bound: bool = True,
                 linearizable: bool = False, counters: dict[int, str] | None = None):
        self.client, self.ssp = client, ssp
        self.wait_at_bound, self.linearizable = wait_at_bound, linearizable
        self.counters = counters or {}          # Raft group -> this rank's step counter there (step_counters)
        self.ahead: dict[int, int] = {}         # Raft group -> steps it applied beyond the others
        self.version: Any = 0                   # the version last pulled: the next push's base
        self.pushed: Any = 0                    # the newest version this worker's writes reached
        self.timings = {"push": [0, 0.0], "pull": [0, 0.0]}    # what -> [calls, seconds]

    def resume(self, names: list[str]) -> tuple[dict[str, np.ndarray], int]:
        """Read ``names`` linearizably (the newest state): (their values, the steps the store
        applied of this rank's: 0 without counters)."""
        result = self.client.pull_result(list(names) + list(self.counters.values()))
        self.version = self.pushed = result["version"]
        applied = {g: int(result["tensors"][name][0]) for g, name in self.counters.items()}
        start = min(applied.values(), default=0)
        self.ahead = {g: n - start for g, n in applied.items() if n > start}
        return result["tensors"], start

    def pull(self, names: list[str]) -> dict[str, np.ndarray]:
        """``names`` from any node that has applied this worker's last write (or linearizably)."""
        tensors, version = self.client.pull(names, min_version=self.pushed, linearizable=self.linearizable)
        self.version = self.pushed = version
        return tensors

    def pull_rows(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, Any]:
        """Rows ``rows`` of a row-sparse tensor, from any node that has this worker's last write."""
        return self.client.pull_rows(name, rows, min_version=self.pushed, linearizable=False)

    def push(self, grads: dict[str, np.ndarray], encoding: dict | None = None, steps: int = 1,
             hyper: dict | None = None) -> str:
        """One push, atomic in each Raft group: ``grads`` and, per group, the count of the ``steps``
        they carry, based on the version last pulled. A group that applied these steps before a
        crash is left out. Returns SENT, DROPPED or REFUSED."""
        grads = dict(grads)
        for counter in self.counters.values():
            grads[counter] = np.array([float(steps)])
        for g in [g for g, n in self.ahead.items() if n >= steps]:
            self.ahead[g] -= steps
            grads = {k: v for k, v in grads.items() if self.client.group_of(k) != g}
            if encoding:
                encoding = {k: v for k, v in encoding.items() if self.client.group_of(k) != g} or None
        if not grads:
            return SENT
        hyper = {k: v for k, v in (hyper or {}).items() if k in grads}
        with self.timing("push"):
            return self._send(grads, encoding, hyper)

    def _send(self, grads: dict[str, np.ndarray], encoding: dict | None, hyper: dict) -> str:
        while True:
            try:
                self.pushed = self.client.push(grads, base_version=self.version, encoding=encoding,
                                               ssp=self.ssp.field() if self.ssp else None, hyper=hyper or None)
                return SENT
            except StalenessBound:        # too far ahead after all: wait for the slowest, send again
                if self.ssp is None or not self.wait_at_bound:
                    return REFUSED
                self.ssp.wait_turn()
            except NotInGroup:            # dropped as dead while away: join again, send again
                if self.ssp is None:
                    raise
                self.ssp.join()
            except StaleBase:             # AdaRevision no longer holds our base: drop it, re-pull
                return DROPPED

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """Count a push or a pull that succeeds and its seconds in ``timings``."""
        t0 = time.perf_counter()
        yield
        self.timings[what][0] += 1
        self.timings[what][1] += time.perf_counter() - t0

    def leave(self) -> None:
        """Leave the SSP group: a finished worker must not hold the others back."""
        if self.ssp is not None:
            try:
                self.ssp.leave()
            finally:
                self.ssp = None
