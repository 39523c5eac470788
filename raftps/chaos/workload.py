"""The bounded one-hot workload: concurrent clients pushing and pulling, recorded in a History.

Each client thread owns one raftps Client and runs operations one at a time: a push of ``-e_k``
for a fresh k, or (every ``pull_every``-th op) a pull, linearizable or not. Bounded by wall time,
by the tensor size (one push per element) and by ``max_ops``. On a cluster of several Raft groups
a workload drives one tensor, so one group (``raft_group``), and records that group's versions.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from raftps import Client, RaftpsError, Unavailable

from raftps.chaos.history import FAILED, OK, PULL, PUSH, UNKNOWN, History, push_gradient

NAME = "chaos"


@dataclass
class Workload:
    addresses: str
    token: str | None = None       # the cluster's client token
    n: int = 4096                  # elements = most pushes a run can make (32 KiB float64)
    clients: int = 3
    pull_every: int = 4            # every 4th op of a client is a pull
    stale_every: int = 3           # every 3rd pull is linearizable=False with min_version
    rate: float = 40.0             # ops per second per client (keeps 2 shared cores usable)
    timeout: float = 5.0           # client timeout: Unavailable after this = unknown outcome
    name: str = NAME               # the tensor
    raft_group: int | None = None  # its Raft group on a cluster of several (versions are {group: v})
    history: History = field(default_factory=History)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ks: "itertools.count[int]" = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _deadline: float = 0.0

    def create(self, timeout: float = 20.0) -> None:
        with Client(self.addresses, timeout=timeout, token=self.token) as c:
            c.create(self.name, np.zeros(self.n, np.float64), optimizer={"name": "sgd", "lr": 1.0})

    def start(self, seconds: float, max_ops: int = 100_000) -> None:
        deadline = self._deadline = time.monotonic() + seconds
        per_client = max(1, max_ops // self.clients)
        for cid in range(self.clients):
            t = threading.Thread(target=self._run, args=(cid, deadline, per_client),
                                 name=f"workload-{cid}", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        """Ask the clients to stop and wait for them (at most one client timeout + a margin)."""
        self._stop.set()
        self.join()

    def join(self) -> None:
        """Wait for the load to end by itself: its deadline, plus one client timeout and a margin."""
        now = time.monotonic()
        end = now if self._stop.is_set() else max(now, self._deadline)
        limit = end + self.timeout + 10.0
        for t in self._threads:
            t.join(max(0.0, limit - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"workload threads did not stop: {alive}")

    def _next_k(self) -> int | None:
        with self._lock:
            k = next(self._ks)
        return k if k < self.n else None

    def _run(self, cid: int, deadline: float, max_ops: int) -> None:
        seen = 0
        with Client(self.addresses, timeout=self.timeout, attempt_timeout=min(2.0, self.timeout),
                    token=self.token) as c:
            for seq in range(max_ops):
                started = time.monotonic()
                if self._stop.is_set() or started >= deadline:
                    return
                if seq % self.pull_every == self.pull_every - 1:
                    lin = (seq // self.pull_every) % self.stale_every != self.stale_every - 1
                    op = self.history.begin(PULL, cid, seq, linearizable=lin)
                    try:
                        tensors, version = c.pull([self.name], min_version=None if lin else self._at(seen),
                                                  linearizable=lin)
                        version = self._of(version)
                        History.finish(op, OK, version, values=tensors[self.name])
                        seen = max(seen, version)
                    except Unavailable as exc:
                        History.finish(op, UNKNOWN, error=exc)
                    except RaftpsError as exc:
                        History.finish(op, FAILED, error=exc)
                else:
                    k = self._next_k()
                    if k is None:
                        return
                    op = self.history.begin(PUSH, cid, seq, k=k)
                    try:
                        version = self._of(c.push({self.name: push_gradient(self.n, k)}))
                        History.finish(op, OK, version)
                        seen = max(seen, version)
                    except Unavailable as exc:
                        History.finish(op, UNKNOWN, error=exc)
                    except RaftpsError as exc:
                        History.finish(op, FAILED, error=exc)
                pause = started + 1.0 / self.rate - time.monotonic()
                if pause > 0:
                    self._stop.wait(pause)

    def _of(self, version: int | dict) -> int:
        return version[self.raft_group] if self.raft_group is not None else version

    def _at(self, version: int) -> int | dict:
        return {self.raft_group: version} if self.raft_group is not None else version


def settle(addresses: str, nodes: int, timeout: float = 30.0, token: str | None = None, name: str = NAME,
           raft_group: int | None = None) -> tuple[np.ndarray | None, list[dict], float | None]:
    """After healing: one linearizable pull of the final tensor, then wait until every replica
    (of ``raft_group``, if given) has applied the same index. Returns (final tensor or None, last
    statuses, seconds to converge)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    final = None
    statuses: list[dict] = []
    with Client(addresses, timeout=5.0, token=token) as c:
        while final is None and time.monotonic() < deadline:
            try:
                final = c.pull([name])[0][name]
            except RaftpsError:
                time.sleep(0.2)
        while time.monotonic() < deadline:
            statuses = c.status(timeout=1.0)
            if raft_group is not None:
                statuses = [s for s in statuses if s.get("group", raft_group) == raft_group]
            applied = {s.get("applied") for s in statuses}
            if len(statuses) == nodes and None not in applied and len(applied) == 1 \
                    and len({s.get("digest") for s in statuses}) == 1:
                return final, statuses, time.monotonic() - t0
            time.sleep(0.2)
    return final, statuses, None
