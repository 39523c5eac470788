"""Where data lives when a cluster runs several Raft groups (``--groups G``): pure functions.

N nodes (``--peers``, node ids 1..N) host G groups. Group 0 is the cluster of one group, as
always: with G = 1 every node is a member. With G > 1 each group has R = min(3, N) members, group
g on nodes g, g+1, ..., g+R-1 (mod N), so every node hosts about G*R/N replicas and adding nodes
adds capacity. A tensor lives in group ``group_of(name)``, a hash of its name, the same on every
client and node, unless it was moved (``raftps move``, moves.py): group 0 keeps the placement of
moved tensors, and the group a tensor left answers requests naming it with ``Moved``.

Ports: node i's group g listens for Raft on the node's Raft port + STRIDE*g and for payloads on
that + 200 (the data-plane offset); the node's client port (+100) and metrics (+300) are group 0's
block and serve every group it hosts. Data: group 0 in the node's data dir, group g in its
``group<g>`` subdirectory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import Any

STRIDE = 400
REPLICAS = 3


class Addressing:
    """What a layout and the hosts record (hosts.py) both answer, from their ``nodes``,
    ``groups`` and ``members(group)``."""
    nodes: tuple[str, ...]
    groups: int

    def members(self, group: int) -> list[int]:
        raise NotImplementedError

    def hosted_by(self, node: int) -> list[int]:
        return [g for g in range(self.groups) if node in self.members(g)]

    def raft_address(self, node: int, group: int) -> str:
        host, port = self.nodes[node - 1].rsplit(":", 1)
        return f"{host}:{int(port) + STRIDE * group}"

    def peers(self, group: int) -> list[str]:
        """``group``'s members' Raft addresses (its --peers)."""
        return [self.raft_address(m, group) for m in self.members(group)]

    def group_of(self, name: str) -> int:
        return group_of(name, self.groups)


@dataclass(frozen=True)
class Layout(Addressing):
    nodes: tuple[str, ...]          # every node's Raft address (group 0's), in node-id order
    groups: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.groups, int) or not 1 <= self.groups <= 64:
            raise ValueError(f"groups must be an int in 1..64, not {self.groups!r}")

    @property
    def replicas(self) -> int:
        return len(self.nodes) if self.groups == 1 else min(REPLICAS, len(self.nodes))

    def members(self, group: int) -> list[int]:
        """Node ids of ``group``'s members, in the order that numbers them inside the group."""
        n = len(self.nodes)
        return sorted(((group + k) % n) + 1 for k in range(self.replicas))

    def preferred_leader(self, group: int) -> int:
        """The node that should lead ``group``: node g+1 (mod N), the first of its chain, so that
        with G = N every node leads one group."""
        return group % len(self.nodes) + 1

    def member_change_refusal(self, group: int, action: str, address: str) -> str | None:
        """Why a Raft membership change must not run: with several groups, a node that follows
        the hosts record (hosting.py) allows its moves' changes; the bare formula allows none."""
        if self.groups == 1:
            return None
        return ("with several Raft groups, membership changes go through the hosts record: to replace a host, "
                "raftps cluster add-host NEW, then drain-host OLD (or raftps hosts move)")

    def base_fields(self) -> dict:
        """The formula as the base of a hosts_change entry (hosts.py)."""
        return {"base_nodes": list(self.nodes), "base_placed": [self.members(g) for g in range(self.groups)]}


def group_of(name: str, groups: int) -> int:
    if groups == 1:
        return 0
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % groups


def data_dir(node_data_dir: str, group: int) -> str:
    return node_data_dir if group == 0 else os.path.join(node_data_dir, f"group{group}")


def group_config(config: Any, layout: Layout, group: int) -> Any:
    """The NodeConfig of this node's replica of ``group``, from the node's own (group 0's block)."""
    if group == 0 and layout.groups == 1:
        return config
    node = config.node_id
    members = layout.members(group)
    shift = STRIDE * group
    return dataclasses.replace(
        config, node_id=members.index(node) + 1, peers=layout.peers(group), cluster_node=node,
        data_dir=data_dir(config.data_dir, group),
        payload_dir=data_dir(config.payload_dir, group) if config.payload_dir else None,
        # the client port and /metrics are the node's (group 0's block), whatever group this is
        client_offset=config.client_offset - shift, metrics_offset=config.metrics_offset - shift,
        metrics_port=config.metrics_port if group == layout.hosted_by(node)[0] else 0,
        preferred_leader=layout.raft_address(layout.preferred_leader(group), group))
