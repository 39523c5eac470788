"""One worker's membership of an SSP group (bounded staleness, Ho et al. 2013), client side.

The state machine owns the clocks; this only decides when to ask. Before each step the worker
waits at the leader until it is at most s clocks ahead of the slowest member. A member stuck at
the slowest clock for ``timeout`` seconds is dropped by an ``ssp_drop`` entry, which the state
machine applies only if that member's clock did not move (compare-and-drop), so a dead worker
cannot block the others and a slow one is never dropped by a race. A dropped worker that comes
back is refused with NotInGroup and joins again.
"""
from __future__ import annotations

from typing import Callable

from raftps.client.client import Client


class SspMember:
    def __init__(self, client: Client, ssp_group: str, worker: str, staleness: int | None, timeout: float,
                 on_event: Callable[[str], None] | None = None):
        self.client, self.ssp_group, self.worker = client, ssp_group, worker
        self.staleness, self.timeout = staleness, timeout
        self.on_event = on_event or (lambda text: None)
        self.join()

    def join(self) -> int:
        """Join (a no-op for a member); returns this worker's clock."""
        return self.client.ssp_join(self.ssp_group, self.worker, self.staleness)

    def field(self) -> dict:
        """The ``ssp`` field of this worker's pushes."""
        return {"ssp_group": self.ssp_group, "worker": self.worker}

    def wait_turn(self) -> int:
        """Block until this worker may take its next step; returns the store version then."""
        while True:
            st = self.client.ssp_wait(self.ssp_group, self.worker, self.timeout)
            if not st["member"]:
                self.join()
                continue
            if st["ready"]:
                return st["version"]
            for worker, clock in st["slowest"]:
                if self.client.ssp_drop(self.ssp_group, worker, clock):
                    self.on_event(f"ssp: dropped {worker} (stuck at clock {clock} for {self.timeout:.0f} s)")

    def leave(self) -> None:
        self.client.ssp_leave(self.ssp_group, self.worker)
