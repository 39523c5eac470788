"""SSP groups as the state machine keeps them (Ho et al. 2013): each group's staleness bound and
its members' clocks. Pure: every change is a log entry's (join, leave, a push's clock, a
compare-and-drop), never time's. The workers' side (waiting for a turn) is ssp.py.
"""
from __future__ import annotations

from typing import Any

from .errors import InvalidRequest, NotInGroup, StalenessBound


def fields(command: dict) -> tuple[str, str]:
    """The SSP group and worker a command names."""
    group, worker = command.get("group"), command.get("worker")
    if not isinstance(group, str) or not group or not isinstance(worker, str) or not worker:
        raise InvalidRequest("SSP needs group (str) and worker (str)")
    return group, worker


def ahead(group: dict, worker: str) -> int:
    """How many clocks ``worker`` is ahead of the slowest member of an SSP group."""
    clocks = group["clocks"]
    return clocks[worker] - min(clocks.values())


class SspClocks:
    """ssp_group -> {"staleness": s or None, "clocks": {worker: clock}}."""

    def __init__(self) -> None:
        self.groups: dict[str, dict] = {}

    def get(self, group: str) -> dict | None:
        return self.groups.get(group)

    def state(self, group: str) -> dict | None:
        """A copy of one group, clocks in worker order (None: no such group)."""
        g = self.groups.get(group)
        return None if g is None else {"staleness": g["staleness"], "clocks": dict(sorted(g["clocks"].items()))}

    def check(self, ssp: Any) -> tuple[str, str] | None:
        """A push's SSP gate: the worker must be a member, and at most s clocks ahead of the
        slowest member. Its clock advances (``advance``) only if the push is applied."""
        if ssp is None:
            return None
        if not isinstance(ssp, dict):
            raise InvalidRequest("'ssp' must be {group, worker}")
        group, worker = fields(ssp)
        g = self.groups.get(group)
        if g is None or worker not in g["clocks"]:
            raise NotInGroup(f"worker {worker!r} is not in SSP group {group!r}: join it first (or again, "
                             f"after it was dropped)")
        if g["staleness"] is not None and ahead(g, worker) > g["staleness"]:
            raise StalenessBound(f"worker {worker!r} at clock {g['clocks'][worker]} is {ahead(g, worker)} clocks "
                                 f"ahead of the slowest in group {group!r} (bound {g['staleness']}): wait, then "
                                 "pull and push")
        return group, worker

    def advance(self, group: str, worker: str) -> int:
        clocks = self.groups[group]["clocks"]
        clocks[worker] += 1
        return clocks[worker]

    def join(self, command: dict) -> int:
        group, worker = fields(command)
        s = command.get("staleness")
        if s is not None and (type(s) is not int or s < 0):
            raise InvalidRequest("staleness must be an int >= 0, or null for unbounded (ASP)")
        g = self.groups.get(group)
        if g is not None and g["staleness"] != s:
            raise InvalidRequest(f"SSP group {group!r} has staleness {g['staleness']}, not {s}")
        if g is None:
            g = self.groups[group] = {"staleness": s, "clocks": {}}
        clocks = g["clocks"]
        if worker not in clocks:
            # A (re)joining worker starts at the slowest member's clock: it holds nobody back.
            clocks[worker] = min(clocks.values()) if clocks else 0
        return clocks[worker]

    def leave(self, command: dict) -> bool:
        group, worker = fields(command)
        g = self.groups.get(group)
        return g is not None and g["clocks"].pop(worker, None) is not None

    def drop(self, command: dict) -> bool:
        """Drop a worker that made no progress, only if its clock is still the one the caller saw
        (compare-and-drop), so the decision, made on a timeout outside, is itself a log entry."""
        group, worker = fields(command)
        clock = command.get("clock")
        if type(clock) is not int:
            raise InvalidRequest("ssp_drop needs the clock (int) the caller saw the worker at")
        g = self.groups.get(group)
        dropped = g is not None and g["clocks"].get(worker) == clock
        if dropped:
            del g["clocks"][worker]
        return dropped

    def snapshot(self) -> list:
        return [[group, g["staleness"], sorted(g["clocks"].items())] for group, g in sorted(self.groups.items())]

    def restore(self, rows: list) -> None:
        self.groups = {group: {"staleness": s, "clocks": dict(clocks)} for group, s, clocks in rows}
