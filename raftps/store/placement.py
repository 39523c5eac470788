"""What the placement loop does next (docs/design/elastic.md, "The placement loop"): pure.

One decision-maker, group 0's leader (placement_loop.py), asks ``next_steps`` once a turn and
carries out the steps it gets, each of a different group, so every group has at most one
membership change at a time. The steps are a function of the hosts record and of what the
hosts' heartbeats said (which nodes answer, which are dead, each group's bytes), in this order
of urgency:

1. a move in flight in the record (a driver, perhaps a leader that died, left it): go on with
   it, or roll it back if its target does not answer (it cannot catch up);
2. a dead node's replicas (past the dead-host timeout): re-created on live nodes;
3. a draining node's replicas: moved to the active nodes;
4. replicas: while the most loaded active node serves more than TOLERANCE replicas more than
   the least loaded, a replica moves from the first to the second (the group with the fewest
   bytes, the cheapest copy);
5. leaders: the same for the leaders the record names (``set_leader``); each group's leader
   hands leadership to the named member (replica/upkeep.py).

Each step of 4 and 5 lowers the sum of squares of the counts, so the loop ends. Group 0 is
never moved (its files share the node's data dir). A target may have at most
``catch_ups_per_host`` moves in flight: the snapshots it receives at once.

Only 2's refills go together (``next_steps``): each refilled group is one replica short already,
and copying them at once ends that sooner. Every other step comes alone. A move copies as a
learner, then takes a healthy group to 4 voters for the short time its new voter catches up the
log since: in that window one more failure among the other 3 stops the group. Several such
moves at once would let one host's failure stop two
groups (a member of one, the target of another); one at a time, only the group whose own
target or member fails is at risk (tests/groups/test_placement_plan.py shows the case).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from raftps.store.hosts import Hosts

TOLERANCE = 1           # replicas and leaders per active node within +-1 of each other
CATCH_UPS_PER_HOST = 1  # refills at once to one target: the snapshots a host receives at once


@dataclass(frozen=True)
class Step:
    kind: str           # "resume" | "abort" | "refill" | "drain" | "balance" | "lead"
    group: int
    source: int         # the node whose replica leaves (lead: the leader named now)
    target: int         # the node that gets it (lead: the leader to name)

    def describe(self, hosts: Hosts) -> str:
        if self.kind == "lead":
            return f"Raft group {self.group}: leader node {self.source} -> node {self.target}"
        if self.kind == "abort":
            return f"Raft group {self.group}: roll back the move to node {self.target} (it does not answer)"
        return f"Raft group {self.group}: {self.kind} a replica from node {self.source} to node {self.target}"


def next_step(hosts: Hosts, up: frozenset[int], dead: frozenset[int] = frozenset(),
              group_bytes: Mapping[int, int] | None = None, catch_ups_per_host: int = CATCH_UPS_PER_HOST,
              balance: bool = True) -> Step | None:
    """The one step the loop takes now, or None when placement is as it should be. ``up``: the
    nodes that answered the last heartbeat; ``dead``: those silent past the dead-host timeout
    (a subset of the others), never a target, whether they still serve replicas or were emptied
    by their refills. ``balance`` False: only steps 1-2 (a loop for dead hosts only)."""
    for move in hosts.moves:
        if move.target in up:
            return Step("resume", move.group, move.source, move.target)
        if move.target in dead or move.stage == "add":
            return Step("abort", move.group, move.source, move.target)
    if any(move.stage == "learn" for move in hosts.moves):
        # a learner's host briefly silent (busy installing the group's snapshot) costs its group
        # nothing: the move waits, as at catch_up, and is rolled back once its target is dead
        return None
    refills = _refills(hosts, up, dead)
    if refills:
        return refills[0]
    if not balance:
        return None
    # below: only with every node that serves a replica answering (a node briefly silent is
    # not a reason to move anything; a dead one was handled above)
    if any(n not in up and hosts.hosted_by(n) for n in _all(hosts)):
        return None
    for node in hosts.draining:
        plan = [(g, t) for g, t in hosts.drain_plan(node, avoid=dead) if g != 0]
        if plan:
            return Step("drain", plan[0][0], node, plan[0][1])
    return _balance_replicas(hosts, group_bytes or {}, catch_ups_per_host, dead) or _balance_leaders(hosts)


def next_steps(hosts: Hosts, up: frozenset[int], dead: frozenset[int] = frozenset(),
               group_bytes: Mapping[int, int] | None = None, catch_ups_per_host: int = CATCH_UPS_PER_HOST,
               balance: bool = True) -> list[Step]:
    """The steps the loop carries out together this turn (empty: placement is as it should
    be): ``next_step`` alone, or, when that is a refill, the dead nodes' refills of every group
    whose target has fewer than ``catch_ups_per_host`` refills already in the list (the others
    wait for a later turn). Refills come only with no move in flight in the record (1. first),
    so none of them shares a group or a target with a move in flight."""
    step = next_step(hosts, up, dead, group_bytes, catch_ups_per_host, balance)
    if step is None or step.kind != "refill":
        return [] if step is None else [step]
    steps: list[Step] = []
    receiving: Counter[int] = Counter()
    for refill in _refills(hosts, up, dead):
        if receiving[refill.target] < catch_ups_per_host and all(s.group != refill.group for s in steps):
            steps.append(refill)
            receiving[refill.target] += 1
    return steps


def silent_since(before: Mapping[int, float], answered: frozenset[int], nodes: int, now: float) -> dict[int, float]:
    """node -> since when it has been silent, after a heartbeat at ``now`` that ``answered``
    (node ids 1..``nodes``): from the first heartbeat it missed, not from the last it answered.
    A turn that carries out moves takes no heartbeat while they run (a refill of a large group,
    tens of seconds); a node busy with its catch-up that misses the next one has been silent
    for one heartbeat, not for the whole turn, and gets the full dead-host timeout."""
    return {n: before.get(n, now) for n in range(1, nodes + 1) if n not in answered}


def _refills(hosts: Hosts, up: frozenset[int], dead: frozenset[int]) -> list[Step]:
    """Every dead node's groups (not group 0), each to the live node drain_plan chooses."""
    silent = frozenset(n for n in _all(hosts) if n not in up)
    return [Step("refill", group, node, target) for node in sorted(dead)
            for group, target in hosts.drain_plan(node, avoid=silent) if group != 0]


def _all(hosts: Hosts) -> range:
    return range(1, len(hosts.nodes) + 1)


def replica_counts(hosts: Hosts) -> dict[int, int]:
    """Replicas per active node."""
    return {n: len(hosts.hosted_by(n)) for n in hosts.active()}


def leader_counts(hosts: Hosts) -> dict[int, int]:
    """Groups whose named leader is each active node."""
    counts = dict.fromkeys(hosts.active(), 0)
    for group in range(hosts.groups):
        leader = hosts.preferred_leader(group)
        if leader in counts:
            counts[leader] += 1
    return counts


def _balance_replicas(hosts: Hosts, group_bytes: Mapping[int, int], limit: int,
                      dead: frozenset[int] = frozenset()) -> Step | None:
    counts = {n: count for n, count in replica_counts(hosts).items() if n not in dead}
    busy = {m.target for m in hosts.moves if sum(o.target == m.target for o in hosts.moves) >= limit}
    for source in sorted(counts, key=lambda n: (-counts[n], n)):
        for target in sorted(counts, key=lambda n: (counts[n], n)):
            if counts[source] - counts[target] <= TOLERANCE:
                break
            if target in busy:
                continue
            groups = [g for g in hosts.hosted_by(source)
                      if g != 0 and target not in hosts.members(g) and hosts.move_of(g) is None]
            if groups:
                group = min(groups, key=lambda g: (group_bytes.get(g, 0), g))
                return Step("balance", group, source, target)
    return None


def _balance_leaders(hosts: Hosts) -> Step | None:
    counts = leader_counts(hosts)
    for source in sorted(counts, key=lambda n: (-counts[n], n)):
        # group 0 last: its leader runs this loop
        for group in sorted((g for g in range(hosts.groups) if hosts.preferred_leader(g) == source),
                            key=lambda g: (g == 0, g)):
            members = [n for n in hosts.placed[group] if n in counts]
            target = min(members, key=lambda n: (counts[n], n))
            if counts[source] - counts[target] > TOLERANCE:
                return Step("lead", group, source, target)
    return None


def remaining(hosts: Hosts, up: frozenset[int], limit: int = 64) -> int:
    """How many steps the plan still has (the record as each step would leave it): what a
    rebalance's progress bar counts down. Steps on moves in flight count as one."""
    count = 0
    while count < limit:
        step = next_step(hosts, up)
        if step is None:
            return count
        hosts = apply(hosts, step)
        count += 1
    return count


def apply(hosts: Hosts, step: Step) -> Hosts:
    """The record as ``step`` leaves it once done (for ``remaining``)."""
    if step.kind == "lead":
        return hosts.change({"action": "set_leader", "move_group": step.group, "target": step.target})
    if hosts.move_of(step.group) is not None:
        if step.kind == "abort":
            return hosts.change({"action": "move_abort", "move_group": step.group})
        hosts = hosts.change({"action": "move_stage", "move_group": step.group})
        return hosts.change({"action": "move_done", "move_group": step.group})
    hosts = hosts.change({"action": "move_start", "move_group": step.group, "source": step.source,
                          "target": step.target})
    hosts = hosts.change({"action": "move_stage", "move_group": step.group})
    return hosts.change({"action": "move_done", "move_group": step.group})
