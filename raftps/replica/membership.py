"""Who else is in this replica's Raft group: the majority a write's payload must reach, the data
plane's peers, and membership changes (``raftps member add/remove``)."""
from __future__ import annotations

import logging
import threading

from raftps.server.dataplane import Peers
from raftps.errors import InvalidRequest
from raftps.raft import NotApplied, ReplicatedLog
from raftps.replica.config import NodeConfig, offset_address

log = logging.getLogger("raftps.server.node")


class Membership:
    def __init__(self, config: NodeConfig, peers: Peers):
        self._config = config
        self.peers = peers
        # The other members' Raft addresses. Membership changes move them; follow() keeps the
        # data plane and the majority in step.
        self._others: frozenset[str] = frozenset(self.initial_others(config))
        self._log: ReplicatedLog | None = None

    @staticmethod
    def initial_others(config: NodeConfig) -> list[str]:
        return sorted(config.peers[n - 1] for n in range(1, len(config.peers) + 1) if n != config.node_id)

    def attach(self, replicated_log: ReplicatedLog) -> None:
        self._log = replicated_log

    @property
    def members(self) -> list[str]:
        """Raft addresses of every member, this node included."""
        return sorted([self._config.raft_address, *self._others])

    @property
    def others(self) -> frozenset[str]:
        """The other members' Raft addresses, as of the last change the log appended."""
        return self._others

    @property
    def size(self) -> int:
        return len(self._others) + 1

    @property
    def majority(self) -> int:
        return (len(self._others) + 1) // 2 + 1

    def follow(self) -> None:
        """In the log's tick: take up a membership change the log has applied."""
        members = frozenset(self._log.others())
        if members != self._others:
            log.warning("membership changed: other members %s (were %s)", sorted(members), sorted(self._others))
            self._others = members
            self.peers.set_addresses([offset_address(a, self._config.data_offset) for a in sorted(members)])

    def change(self, action: str, address: str, timeout: float = 10.0) -> dict:
        """Add or remove one member (Raft single-server changes: the change is a log entry, in
        force from the moment it is appended). On the leader only. Idempotent: adding a member
        or removing a non-member changes nothing. The leader cannot remove itself: it hands
        leadership to a caught-up follower and raises NotApplied, so the client retries with the
        new leader."""
        me = self._config.raft_address
        if action == "add" and (address == me or address in self._others) or \
                action == "remove" and address != me and address not in self._others:
            return {"changed": False, "members": self.members}
        if action == "remove" and address == me:
            if not self._others:
                raise InvalidRequest(f"{address} is the only member: a cluster cannot remove its last node")
            self._log.transfer_leadership(timeout)
            raise NotApplied(f"{address} is the leader: leadership handed to another member; retry there", applied=False)
        done, box = threading.Event(), []
        self._log.change_members(action, address, lambda ok, why: box.append((ok, why)) or done.set())
        if not done.wait(timeout):
            raise NotApplied(f"membership change not committed within {timeout:.0f} s", applied=None)
        ok, why = box[0]
        if not ok:
            raise NotApplied(f"membership change refused by Raft ({why}): another change may be "
                             "under way; retry", applied=False)
        return {"changed": True, "members": self.members}
