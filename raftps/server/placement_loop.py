"""The placement loop (docs/design/elastic.md): on group 0's leader, once a turn, the hosts'
heartbeat (each node's status rows: the groups it serves, those it leads, the bytes of their
state, its pushes) and then the steps of the plan (store/placement.py), carried out with the
operators of elastic.py: finish or roll back a move in flight, re-create a dead node's replicas,
empty a draining node, balance replicas and leaders over the nodes. A turn's steps are of
different groups and each a different target, so every group has at most one membership change
in flight and a new replica is the only snapshot its host receives. Several come only for a
dead node's replicas: each is then carried out on a thread of its own (with its own
connections), and the turn waits for all of them, so the next turn plans from the record they
left. Each record change they make is one entry of group 0's log that the state machine checks
against the record it meets (move_start: that group's source still serves it, its target does
not, no move of it in flight), so a change planned from an older record is refused, not merged.

``serve --dead-host-timeout S`` turns on re-creating the replicas of a node silent for S
seconds; ``serve --balance`` turns on draining and balancing. Either starts the loop.

Group 0's replicas are not moved yet (their files share the node's data dir): a dead node
serving group 0 leaves it at 2 replicas, which the loop logs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from raftps.errors import RaftpsError
from raftps.instruments import PlacementInstruments
from raftps.server.elastic import CLIENT_OFFSET, HostsAdmin
from raftps.store.hosts import Hosts
from raftps.store.placement import Step, next_steps, silent_since
from raftps.replica.config import offset_address

log = logging.getLogger("raftps.placement")
CATCH_UP_TIMEOUT = 120.0        # a turn's move waits this long for its new replica, then the next turn goes on


class PlacementLoop:
    def __init__(self, token: str, dead_host_timeout: float, current: Callable[[], Hosts | None],
                 leads_group_0: Callable[[], bool], balance: bool = False, period: float = 1.0):
        self.token = token
        self.dead_host_timeout = dead_host_timeout
        self.balance = balance
        self._current = current                   # the hosts record as group 0's replica here applied it
        self._leads_group_0 = leads_group_0
        self.period = period
        self.instruments = PlacementInstruments()
        self.pushes: dict[int, tuple[float, int]] = {}     # node -> (when, pushes applied) at the last beat
        self.write_rate: dict[int, float] = {}    # node -> pushes/s applied by the groups it leads
        self._silent_since: dict[int, float] = {}     # node -> the first heartbeat it missed (monotonic)
        self._leading = False                     # whether the last turn ran here
        self._answered: set[int] = set()          # nodes that answered a heartbeat of this loop's tenure
        self._stop = threading.Event()
        self._said: str | None = None             # the last warning: a turn repeats it only when it changes

    def start(self) -> None:
        threading.Thread(target=self._run, name="placement-loop", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            hosts = self._current()
            if hosts is None or not self._leads_group_0():
                if self._leading:                 # no longer the loop's node: its heartbeat figures go
                    self.instruments.host_load.clear()
                    self.instruments.under_replicated.set(0)
                self._leading = False
                self._silent_since.clear()        # a new leader gives every node a full timeout
                self._answered.clear()
                continue
            self._leading = True
            try:
                self.turn(hosts)
            except (RaftpsError, OSError, ConnectionError) as exc:
                self._say(f"placement loop: {exc} (tried again every turn)")

    def turn(self, hosts: Hosts) -> list[Step]:
        """One heartbeat of every node, then this turn's steps of the plan, carried out (empty:
        nothing to do)."""
        addresses = [offset_address(a, CLIENT_OFFSET) for a in hosts.nodes]
        with HostsAdmin(addresses, token=self.token, tls=False, timeout=30.0, connect_timeout=1.0) as admin:
            asked = time.monotonic()
            beat = admin.status_rows(hosts, timeout=1.0)
            now = time.monotonic()
            self.instruments.heartbeat_seconds.set(now - asked)
            self._silent_since = silent_since(self._silent_since, frozenset(beat), len(hosts.nodes), now)
            self._note_load(hosts, beat, now)
            up = frozenset(beat)
            self._answered |= up
            # dead: silent past the timeout, and serving replicas or seen answering by this loop
            # (one its refills emptied is no target); a host added but never started is neither
            dead = frozenset(n for n, t in self._silent_since.items() if self.dead_host_timeout > 0
                             and now - t > self.dead_host_timeout and (hosts.hosted_by(n) or n in self._answered))
            if any(0 in hosts.hosted_by(n) for n in dead):
                self._say(f"node(s) {sorted(dead)} dead; a replica of Raft group 0 cannot be re-created yet")
            group_bytes = {r["group"]: int(r.get("model_bytes") or 0) for rows in beat.values() for r in rows
                           if r.get("role") == "leader" and "group" in r}
            steps = next_steps(hosts, up, dead, group_bytes, balance=self.balance)
            if len(steps) == 1:
                self.carry_out(admin, hosts, steps[0])
            elif steps:
                self._together(addresses, hosts, steps)
            return steps

    def _together(self, addresses: list[str], hosts: Hosts, steps: list[Step]) -> None:
        """Each step on a thread with a HostsAdmin of its own (a router serves one thread); back
        once all have ended, done or failed (a failed one leaves its move in the record for the
        next turn to resume or roll back)."""
        def drive(step: Step) -> None:
            try:
                with HostsAdmin(addresses, token=self.token, tls=False, timeout=30.0, connect_timeout=1.0) as admin:
                    self.carry_out(admin, hosts, step)
            except (RaftpsError, OSError, ConnectionError) as exc:
                self._say(f"placement: {step.describe(hosts)}: {exc} (the next turn goes on or rolls it back)")
        threads = [threading.Thread(target=drive, args=(step,), name=f"placement-{step.kind}-{step.group}",
                                    daemon=True) for step in steps]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()      # as long as one step alone would take: each request and wait of a move is bounded

    def carry_out(self, admin: HostsAdmin, hosts: Hosts, step: Step) -> None:
        log.warning("placement: %s", step.describe(hosts))
        if step.kind == "lead":
            admin.set_leader(step.group, step.target)
        elif step.kind == "abort":
            admin.abort(step.group)
        else:
            admin.last_catch_up = admin.last_voting_window = None
            admin.move(step.group, hosts.nodes[step.source - 1], hosts.nodes[step.target - 1],
                       catch_up_timeout=CATCH_UP_TIMEOUT, gone_after=self.dead_host_timeout or None)
            if admin.last_catch_up is not None:
                seconds, size = admin.last_catch_up
                self.instruments.catch_up_seconds.observe(seconds)
                self.instruments.catch_up_bytes.inc(size)
            if admin.last_voting_window is not None:
                self.instruments.voting_window_seconds.observe(admin.last_voting_window)
        self.instruments.changes.labels(step.kind).inc()

    def _note_load(self, hosts: Hosts, beat: dict[int, list[dict]], now: float) -> None:
        """Write rates from the pushes the groups each node leads have applied, and the groups
        with fewer answering replicas than the record places."""
        for node, rows in beat.items():
            pushes = sum(int(r.get("pushes") or 0) for r in rows if r.get("role") == "leader")
            before = self.pushes.get(node)
            if before is not None and now > before[0]:
                self.write_rate[node] = max(0.0, (pushes - before[1]) / (now - before[0]))
            self.pushes[node] = (now, pushes)
            load = {"replicas": len(rows), "leaders": sum(r.get("role") == "leader" for r in rows),
                    "bytes": sum(int(r.get("model_bytes") or 0) for r in rows),
                    "pushes_per_second": self.write_rate.get(node, 0.0)}
            for kind, value in load.items():
                self.instruments.host_load.labels(str(node), kind).set(value)
        short = sum(1 for g in range(hosts.groups)
                    if sum(1 for n in hosts.placed[g] if any(r.get("group", 0) == g for r in beat.get(n, ()))) <
                    len(hosts.placed[g]))
        self.instruments.under_replicated.set(short)

    def _say(self, message: str) -> None:
        if message != self._said:
            self._said = message
            log.warning("%s", message)
