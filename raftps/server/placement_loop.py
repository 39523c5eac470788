"""The placement loop (docs/design/elastic.md): on group 0's leader, a node that has not
answered for ``dead_host_timeout`` seconds has its replicas re-created elsewhere, one move at a
time (elastic.py's five steps, the dead member removed first), so that every group is back to 3
replicas with no one asking. Off unless ``serve --dead-host-timeout S`` is given.

Group 0's replicas are not moved yet (their files share the node's data dir): a dead node
serving group 0 leaves it at 2 replicas, which the loop logs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from raftps import codec
from raftps.server.elastic import CLIENT_OFFSET, HostsAdmin
from raftps.errors import RaftpsError
from raftps.store.hosts import Hosts
from raftps.replica.config import offset_address
from raftps.client.transport import TcpTransport

log = logging.getLogger("raftps.placement")


class PlacementLoop:
    def __init__(self, token: str, dead_host_timeout: float, current: Callable[[], Hosts | None],
                 leads_group_0: Callable[[], bool], period: float = 1.0):
        self.token = token
        self.dead_host_timeout = dead_host_timeout
        self._current = current                   # the hosts record this node follows
        self._leads_group_0 = leads_group_0
        self.period = period
        self._seen: dict[int, float] = {}         # node -> when it last answered (monotonic)
        self._stop = threading.Event()
        self._said: str | None = None             # the last warning: a turn repeats it only when it changes

    def start(self) -> None:
        threading.Thread(target=self._run, name="placement-loop", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        transport = TcpTransport(self.token, None, codec.DEFAULT_LIMITS, connect_timeout=1.0)
        try:
            while not self._stop.wait(self.period):
                hosts = self._current()
                if hosts is None or not self._leads_group_0():
                    self._seen.clear()            # a new leader gives every node a full timeout
                    continue
                try:
                    self.turn(hosts, transport)
                except (RaftpsError, OSError, ConnectionError) as exc:
                    self._say(f"placement loop: {exc} (tried again every turn)")
        finally:
            transport.close()

    def turn(self, hosts: Hosts, transport: Any) -> None:
        """Probe every node; refill the first dead node's first group (one move per turn)."""
        now = time.monotonic()
        for node, address in enumerate(hosts.nodes, 1):
            self._seen.setdefault(node, now)
            try:
                transport.call(offset_address(address, CLIENT_OFFSET), {"op": "status", "digest": False}, 1.0)
                self._seen[node] = now
            except (OSError, ConnectionError):
                pass
        dead = frozenset(n for n, t in self._seen.items() if now - t > self.dead_host_timeout)
        for node in sorted(dead):
            plan = [(g, t) for g, t in hosts.drain_plan(node, avoid=dead) if g != 0]
            if 0 in hosts.hosted_by(node):
                self._say(f"node {node} is dead and served Raft group 0, which cannot be refilled yet")
            if plan:
                group, target = plan[0]
                log.warning("node %d has not answered for %.0f s: re-creating its replica of Raft group %d on "
                            "node %d", node, now - self._seen[node], group, target)
                live = [offset_address(a, CLIENT_OFFSET) for n, a in enumerate(hosts.nodes, 1) if n not in dead]
                with HostsAdmin(live, token=self.token, tls=False, timeout=30.0) as admin:
                    admin.move(group, hosts.nodes[node - 1], hosts.nodes[target - 1])
                return

    def _say(self, message: str) -> None:
        if message != self._said:
            self._said = message
            log.warning("%s", message)
