"""SSP groups as the state machine keeps them (Ho et al. 2013): each SSP group's staleness bound
and its members' clocks. Pure: every change is a log entry's (join, leave, a push's clock, a
compare-and-drop), never time's. The workers' side (waiting for a turn) is ssp.py.
"""
from __future__ import annotations

from typing import Any

from raftps.errors import InvalidRequest, NotInGroup, StalenessBound


def fields(command: dict) -> tuple[str, str]:
    """The SSP group and worker a command (or a push's ``ssp`` map) names."""
    ssp_group, worker = command.get("ssp_group"), command.get("worker")
    if not isinstance(ssp_group, str) or not ssp_group or not isinstance(worker, str) or not worker:
        raise InvalidRequest("SSP needs group (str) and worker (str)")   # word for word as before: see check_job
    return ssp_group, worker


def ahead(members: dict, worker: str) -> int:
    """How many clocks ``worker`` is ahead of the slowest member of an SSP group (``members``: its entry)."""
    clocks = members["clocks"]
    return clocks[worker] - min(clocks.values())


class SspClocks:
    """ssp_group -> {"staleness": s or None, "clocks": {worker: clock}}."""

    def __init__(self) -> None:
        self.ssp_groups: dict[str, dict] = {}

    def get(self, ssp_group: str) -> dict | None:
        return self.ssp_groups.get(ssp_group)

    def state(self, ssp_group: str) -> dict | None:
        """A copy of one SSP group, clocks in worker order (None: no such group)."""
        g = self.ssp_groups.get(ssp_group)
        return None if g is None else {"staleness": g["staleness"], "clocks": dict(sorted(g["clocks"].items()))}

    def check(self, ssp: Any) -> tuple[str, str] | None:
        """A push's SSP gate: the worker must be a member, and at most s clocks ahead of the
        slowest member. Its clock advances (``advance``) only if the push is applied."""
        if ssp is None:
            return None
        if not isinstance(ssp, dict):
            raise InvalidRequest("'ssp' must be {group, worker}")
        ssp_group, worker = fields(ssp)
        g = self.ssp_groups.get(ssp_group)
        if g is None or worker not in g["clocks"]:
            raise NotInGroup(f"worker {worker!r} is not in SSP group {ssp_group!r}: join it first (or again, "
                             f"after it was dropped)")
        if g["staleness"] is not None and ahead(g, worker) > g["staleness"]:
            raise StalenessBound(f"worker {worker!r} at clock {g['clocks'][worker]} is {ahead(g, worker)} clocks "
                                 f"ahead of the slowest in group {ssp_group!r} (bound {g['staleness']}): wait, then "
                                 "pull and push")
        return ssp_group, worker

    def advance(self, ssp_group: str, worker: str) -> int:
        clocks = self.ssp_groups[ssp_group]["clocks"]
        clocks[worker] += 1
        return clocks[worker]

    def join(self, command: dict) -> int:
        ssp_group, worker = fields(command)
        s = command.get("staleness")
        if s is not None and (type(s) is not int or s < 0):
            raise InvalidRequest("staleness must be an int >= 0, or null for unbounded (ASP)")
        g = self.ssp_groups.get(ssp_group)
        if g is not None and g["staleness"] != s:
            raise InvalidRequest(f"SSP group {ssp_group!r} has staleness {g['staleness']}, not {s}")
        if g is None:
            g = self.ssp_groups[ssp_group] = {"staleness": s, "clocks": {}}
        clocks = g["clocks"]
        if worker not in clocks:
            # A (re)joining worker starts at the slowest member's clock: it holds nobody back.
            clocks[worker] = min(clocks.values()) if clocks else 0
        return clocks[worker]

    def leave(self, command: dict) -> bool:
        ssp_group, worker = fields(command)
        g = self.ssp_groups.get(ssp_group)
        return g is not None and g["clocks"].pop(worker, None) is not None

    def drop(self, command: dict) -> bool:
        """Drop a worker that made no progress, only if its clock is still the one the caller saw
        (compare-and-drop), so the decision, made on a timeout outside, is itself a log entry."""
        ssp_group, worker = fields(command)
        clock = command.get("clock")
        if type(clock) is not int:
            raise InvalidRequest("ssp_drop needs the clock (int) the caller saw the worker at")
        g = self.ssp_groups.get(ssp_group)
        dropped = g is not None and g["clocks"].get(worker) == clock
        if dropped:
            del g["clocks"][worker]
        return dropped

    def snapshot(self) -> list:
        return [[ssp_group, g["staleness"], sorted(g["clocks"].items())]
                for ssp_group, g in sorted(self.ssp_groups.items())]

    def restore(self, rows: list) -> None:
        self.ssp_groups = {ssp_group: {"staleness": s, "clocks": dict(clocks)} for ssp_group, s, clocks in rows}
