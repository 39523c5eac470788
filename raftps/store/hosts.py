"""Which nodes serve which Raft group, as replicated state (docs/design/elastic.md): pure.

With several Raft groups (``--groups G``) the formula of groups.py (group g on nodes g+1..g+3
mod N) is only where a cluster starts. Once an operator adds a host or moves a replica, group 0
keeps a ``Hosts`` record in its state machine, changed only by ``hosts_change`` entries of its
log, and every node hosts the replicas the newest record gives it (hosting.py). A cluster that
never changed has no record: the formula holds, so old clusters start unchanged.

A record: the nodes (node id i is ``nodes[i-1]``, its Raft address in group 0's port block), each
group's members (node ids), the moves in flight (one per group at most) and an epoch, the number
of changes applied. Moving group g's replica from node F to node T goes through these stages,
each one entry, each idempotent (the driver, elastic.py, sends them between the Raft changes):

- ``move_start``: the intent; the group's members are still the old ones. With ``learn`` (what
  elastic.py sends) the move starts at stage "learn": T's node runs a non-voting learner of g
  (a pysyncobj read-only node) that catches up g's snapshot and log into T's replica dir, and
  no membership changes. Without it (entries of older drivers) it starts at stage "add".
- ``move_stage`` to "add" (``stage="add"``, from "learn"): T's learner has caught up; the
  driver now adds T to g's Raft membership.
- ``move_stage`` to "catch_up" (no ``stage``, or ``stage="catch_up"``): group g's Raft log has
  committed T as a member; T now counts as
  a member here too, so T's node stops its learner and starts its replica from the learner's
  files: what remains to catch up is the log written since.
- ``move_done``: g's Raft log has removed F; F's node stops its replica. ``move_abort`` instead
  forgets the move (the driver first removes T from g's Raft membership).

``Hosts`` answers what ``groups.Layout`` answers (members, peers, raft_address, hosted_by, ...),
so ``groups.group_config`` builds a replica's config from either.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from raftps.errors import InvalidRequest
from raftps.groups import REPLICAS, Addressing, Layout

STAGES = ("learn", "add", "catch_up")
ACTIONS = ("add_host", "move_start", "move_stage", "move_done", "move_abort", "drain_host", "set_leader",
           "replace_host")
MIN_HOSTS = 3           # drain_host refuses to leave fewer hosts that are not draining


@dataclass(frozen=True)
class Move:
    group: int
    source: int       # the node whose replica leaves
    target: int       # the node whose replica joins
    stage: str        # one of STAGES


@dataclass(frozen=True)
class Hosts(Addressing):
    nodes: tuple[str, ...]                  # node id i -> nodes[i-1], its Raft address (group 0's block)
    placed: tuple[tuple[int, ...], ...]     # Raft group -> its settled members' node ids, sorted
    moves: tuple[Move, ...] = ()            # in flight, by group
    epoch: int = 0                          # changes applied since the formula
    draining: tuple[int, ...] = ()          # nodes being emptied (drain-host); once empty, retired
    leaders: tuple[int, ...] = ()           # Raft group -> the node that should lead it (0: the default rule)
    replacing: tuple[tuple[int, int], ...] = ()     # (old, new): a draining node's replicas all go to new

    @classmethod
    def from_layout(cls, layout: Layout) -> "Hosts":
        """The formula's placement: where every cluster starts."""
        return cls(tuple(layout.nodes), tuple(tuple(layout.members(g)) for g in range(layout.groups)))

    # ---- what groups.Layout answers -------------------------------------------------------

    @property
    def groups(self) -> int:
        return len(self.placed)

    def move_of(self, group: int) -> Move | None:
        return next((m for m in self.moves if m.group == group), None)

    def learner_of(self, group: int) -> int | None:
        """The node running a learner of ``group`` for a move in flight (stages learn and add:
        until it starts its voter at catch_up), or None."""
        move = self.move_of(group)
        return move.target if move is not None and move.stage in ("learn", "add") else None

    def members(self, group: int) -> list[int]:
        """Node ids serving ``group``: its settled members and a joining one once its Raft log
        has it (stage catch_up), sorted (the order that numbers them inside the group)."""
        move = self.move_of(group)
        joining = (move.target,) if move is not None and move.stage == "catch_up" else ()
        return sorted({*self.placed[group], *joining})

    def preferred_leader(self, group: int) -> int:
        """The leader the placement loop chose (``set_leader``) while it still serves the group,
        else the formula's choice (node g+1 mod N) while that does, else the group's lowest
        settled member."""
        chosen = self.leaders[group] if group < len(self.leaders) else 0
        if chosen in self.placed[group]:
            return chosen
        wanted = group % len(self.nodes) + 1
        return wanted if wanted in self.placed[group] else self.placed[group][0]

    def node_of(self, address: str) -> int:
        """The node id of a node's Raft address (group 0's block), or InvalidRequest."""
        if address not in self.nodes:
            raise InvalidRequest(f"{address} is not a host of this cluster (hosts: {', '.join(self.nodes)}); "
                                 "add it first with raftps hosts add")
        return self.nodes.index(address) + 1

    def drain_plan(self, node: int, avoid: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """(group, target) for every group ``node`` serves, in group order: a move in flight off
        ``node`` keeps its target; a node being replaced (replace_host) sends each replica to its
        replacement (the same groups: the spread of replicas is kept) while that is not avoided;
        otherwise the node serving the fewest replicas among those
        outside the group, not draining and not in ``avoid`` (dead ones), counting the plan's earlier moves,
        the lowest id on a tie. InvalidRequest when a group has no such node: draining would
        leave it short of replicas."""
        load = {n: len(self.hosted_by(n)) for n in self.active() if n != node and n not in avoid}
        replacement = dict(self.replacing).get(node)
        plan = []
        for group in self.hosted_by(node):
            move = self.move_of(group)
            if move is not None and move.source == node:
                target = move.target
            elif replacement in load and replacement not in self.members(group):
                target = replacement
            else:
                free = sorted((count, n) for n, count in load.items() if n not in self.members(group))
                if not free:
                    raise InvalidRequest(f"draining node {node} ({self.nodes[node - 1]}) would leave Raft group {group} "
                                         f"with {len(self.members(group)) - 1} replicas: add a host first")
                target = free[0][1]
            if target in load:       # a move in flight may target an avoided (silent) node: never a new target
                load[target] += 1
            plan.append((group, target))
        return plan

    # ---- the record as plain data (log entries, snapshots, replies) -----------------------

    def record(self) -> dict:
        record = {"nodes": list(self.nodes), "placed": [list(m) for m in self.placed],
                  "moves": [[m.group, m.source, m.target, m.stage] for m in self.moves], "epoch": self.epoch}
        if self.draining:                     # only once used: older records stay as they were
            record["draining"] = list(self.draining)
        if self.leaders:
            record["leaders"] = list(self.leaders)
        if self.replacing:
            record["replacing"] = [list(pair) for pair in self.replacing]
        return record

    @classmethod
    def from_record(cls, record: Any) -> "Hosts":
        """A record back (from a snapshot, a reply or an entry's base); ValueError if malformed."""
        try:
            nodes = tuple(str(a) for a in record["nodes"])
            placed = tuple(tuple(sorted(int(n) for n in m)) for m in record["placed"])
            moves = tuple(Move(int(g), int(s), int(t), str(st)) for g, s, t, st in record.get("moves", []))
            hosts = cls(nodes, placed, moves, int(record.get("epoch", 0)),
                        tuple(sorted(int(n) for n in record.get("draining", []))),
                        tuple(int(n) for n in record.get("leaders", [])),
                        tuple((int(old), int(new)) for old, new in record.get("replacing", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a hosts record: {exc}") from None
        if not 1 <= hosts.groups <= 64 or any(not 1 <= n <= len(nodes) for m in placed for n in m) \
                or any(not m for m in placed) or any(m.stage not in STAGES for m in moves) \
                or any(not 1 <= n <= len(nodes) for n in hosts.draining) \
                or len(hosts.leaders) not in (0, hosts.groups) or any(not 0 <= n <= len(nodes) for n in hosts.leaders) \
                or any(not 1 <= n <= len(nodes) for pair in hosts.replacing for n in pair):
            raise ValueError("not a hosts record: a group without members, a node id out of range or a bad stage")
        return hosts

    # ---- changes: each a pure function of the record and one entry ------------------------

    def change(self, command: dict) -> "Hosts":
        """The record after one ``hosts_change`` entry; InvalidRequest (nothing changes) when the
        entry does not fit the record. Repeating the last change is allowed and changes nothing
        but the epoch's answer (``changed`` in apply_change)."""
        action = command.get("action")
        if action not in ACTIONS:
            raise InvalidRequest(f"hosts_change: action must be one of {', '.join(ACTIONS)}, not {action!r}")
        if action == "add_host":
            return self._add_host(command.get("address"))
        if action == "drain_host":
            return self._drain_host(command.get("address"))
        if action == "replace_host":
            return self._replace_host(command.get("address"), command.get("new"))
        group = command.get("move_group")
        if type(group) is not int or not 0 <= group < self.groups:
            raise InvalidRequest(f"hosts_change {action}: Raft group {group!r} is out of range 0..{self.groups - 1}")
        if action == "set_leader":
            return self._set_leader(group, command.get("target"))
        move = self.move_of(group)
        if action == "move_start":
            return self._move_start(group, command.get("source"), command.get("target"), move,
                                    command.get("learn") is True)
        if move is None:
            raise InvalidRequest(f"hosts_change {action}: Raft group {group} has no move in flight")
        others = tuple(m for m in self.moves if m.group != group)
        if action == "move_stage":
            stage = command.get("stage", "catch_up")
            if stage not in STAGES[1:]:
                raise InvalidRequest(f"hosts_change move_stage: stage must be add or catch_up, not {stage!r}")
            if STAGES.index(move.stage) >= STAGES.index(stage):
                return self           # already there (or past it)
            return self._next(moves=tuple(sorted((*others, dataclasses.replace(move, stage=stage)),
                                                 key=lambda m: m.group)))
        if action == "move_done":
            if move.stage != "catch_up":
                raise InvalidRequest(f"hosts_change move_done: Raft group {group}'s move has not reached catch_up")
            members = tuple(sorted({*self.placed[group], move.target} - {move.source}))
            placed = self.placed[:group] + (members,) + self.placed[group + 1:]
            if (move.source, move.target) in self.replacing and self.preferred_leader(group) == move.source:
                # a replacement takes over what its old host led: the spread of leaders is kept
                leaders = list(self.leaders) or [0] * self.groups
                leaders[group] = move.target
                return self._next(placed=placed, moves=others, leaders=tuple(leaders))
            return self._next(placed=placed, moves=others)
        return self._next(moves=others)           # move_abort

    def _add_host(self, address: Any) -> "Hosts":
        if not isinstance(address, str) or ":" not in address:
            raise InvalidRequest(f"add-host: a host is its Raft address HOST:PORT, not {address!r}")
        if address in self.nodes:
            raise InvalidRequest(f"add-host: {address} is already host {self.nodes.index(address) + 1} of this cluster")
        return self._next(nodes=(*self.nodes, address))

    def active(self) -> list[int]:
        """The nodes that are not draining (nor retired: drained)."""
        return [n for n in range(1, len(self.nodes) + 1) if n not in self.draining]

    def _drain_host(self, address: Any) -> "Hosts":
        node = self.node_of(address) if isinstance(address, str) else 0
        if node in self.draining:
            return self               # already draining: nothing changes
        if len(self.active()) - 1 < MIN_HOSTS:
            raise InvalidRequest(f"drain-host: {address} is one of the last {len(self.active())} hosts that are not "
                                 f"draining; a cluster keeps at least {MIN_HOSTS} (add a host first)")
        if node in self.members(0):
            raise InvalidRequest(f"drain-host: {address} serves Raft group 0, whose replica cannot be moved yet")
        return self._next(draining=tuple(sorted((*self.draining, node))))

    def _replace_host(self, old: Any, new: Any) -> "Hosts":
        """``new`` joins as a host and ``old`` drains into it: every replica old serves moves to
        new (drain_plan). Repeating it changes nothing, so a replace run again resumes."""
        if not isinstance(old, str) or not isinstance(new, str) or ":" not in new:
            raise InvalidRequest(f"replace: OLD and NEW are hosts' Raft addresses HOST:PORT, not {old!r} and {new!r}")
        if old == new:
            raise InvalidRequest(f"replace: OLD and NEW are the same address {old}")
        node = self.node_of(old)
        if new in self.nodes:
            if (node, self.nodes.index(new) + 1) in self.replacing:
                return self           # the same replace again: under way
            raise InvalidRequest(f"replace: {new} is already host {self.nodes.index(new) + 1} of this cluster; "
                                 "a replacement is a new host (to empty a host into the others: drain-host)")
        if node in self.draining:
            raise InvalidRequest(f"replace: {old} (node {node}) is already draining or drained")
        if node in self.members(0):
            raise InvalidRequest(f"replace: {old} serves Raft group 0, whose replica cannot be moved yet")
        added = self._add_host(new)
        return dataclasses.replace(added, draining=tuple(sorted((*self.draining, node))),
                                   replacing=tuple(sorted((*self.replacing, (node, len(added.nodes))))))

    def _set_leader(self, group: int, leader: Any) -> "Hosts":
        if type(leader) is not int or leader not in self.placed[group]:
            raise InvalidRequest(f"set_leader: node {leader!r} does not serve Raft group {group}")
        leaders = list(self.leaders) or [0] * self.groups
        if leaders[group] == leader:
            return self
        leaders[group] = leader
        return self._next(leaders=tuple(leaders))

    def _move_start(self, group: int, source: Any, target: Any, move: Move | None, learn: bool = False) -> "Hosts":
        n = len(self.nodes)
        if type(source) is not int or type(target) is not int or not (1 <= source <= n and 1 <= target <= n):
            raise InvalidRequest(f"move of Raft group {group}: source and target must be node ids in 1..{n}")
        if move is not None:
            if (move.source, move.target) == (source, target):
                return self           # the same move again: already started
            raise InvalidRequest(f"Raft group {group} is already moving a replica from node {move.source} to node "
                                 f"{move.target}: one change per group at a time (finish or abort it first)")
        if source not in self.placed[group]:
            raise InvalidRequest(f"node {source} ({self.nodes[source - 1]}) does not serve Raft group {group}")
        if target in self.placed[group]:
            raise InvalidRequest(f"node {target} ({self.nodes[target - 1]}) already serves Raft group {group}")
        if target in self.draining:
            raise InvalidRequest(f"node {target} ({self.nodes[target - 1]}) is draining: it takes no replicas")
        if len(self.placed[group]) < min(REPLICAS, n) - 1:
            raise InvalidRequest(f"Raft group {group} has too few members to move one")
        first = "learn" if learn else "add"
        return self._next(moves=tuple(sorted((*self.moves, Move(group, source, target, first)), key=lambda m: m.group)))

    def _next(self, **changes: Any) -> "Hosts":
        return dataclasses.replace(self, epoch=self.epoch + 1, **changes)


class HostsState:
    """Group 0's state-machine part: the record, or None while the formula holds. Held by
    TensorStore as it holds Moves; its snapshot is a plain record."""

    def __init__(self) -> None:
        self.current: Hosts | None = None

    def apply_change(self, command: dict) -> dict:
        """One ``hosts_change`` entry. The first one carries the formula's record (``base``) that
        the cluster started from: the state machine does not know the layout, so the entry does."""
        current = self.current
        if current is None:
            try:
                current = Hosts.from_record({"nodes": command.get("base_nodes"), "placed": command.get("base_placed")})
            except ValueError as exc:
                raise InvalidRequest(f"hosts_change: the first change needs the formula's record as base ({exc})")
        after = current.change(command)
        changed = after is not current or self.current is None
        self.current = after
        return {"changed": changed, "hosts": after.record()}

    def snapshot(self) -> dict | None:
        return None if self.current is None else self.current.record()

    def restore(self, record: Any) -> None:
        self.current = None if record is None else Hosts.from_record(record)
