"""The placement loop's plan (raftps/store/placement.py), pure: each expected step is worked out
by hand from the formula's placement (group g on nodes g+1..g+3 mod N)."""
import pytest

from raftps.errors import InvalidRequest
from raftps.groups import Layout
from raftps.store.hosts import Hosts
from raftps.store.placement import (Step, apply, leader_counts, next_step, next_steps, remaining, replica_counts,
                                    silent_since)

NODES = tuple(f"127.0.0.1:{9000 + i}" for i in range(1, 6))
ALL6 = frozenset(range(1, 7))


def six_groups_five_nodes() -> Hosts:
    """(G = 6, N = 5): g0 1,2,3; g1 2,3,4; g2 3,4,5; g3 1,4,5; g4 1,2,5; g5 1,2,3."""
    return Hosts.from_layout(Layout(NODES, 6))


def test_an_added_host_is_filled_then_leaders_spread():
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    assert replica_counts(hosts) == {1: 4, 2: 4, 3: 4, 4: 3, 5: 3, 6: 0}
    steps = []
    for _ in range(10):
        step = next_step(hosts, ALL6)
        if step is None:
            break
        steps.append(step)
        hosts = apply(hosts, step)
    # the most loaded node (lowest id on a tie) gives its lowest group that node 6 lacks (not
    # group 0): 1 gives g3; then 2 (4 replicas) gives g1; then 3 gives g2 (g1 is on 6 already)
    assert steps[:3] == [Step("balance", 3, 1, 6), Step("balance", 1, 2, 6), Step("balance", 2, 3, 6)]
    assert replica_counts(hosts) == dict.fromkeys(range(1, 7), 3)
    # named leaders then (node g+1 mod 6 where it serves g, else the lowest member): g0 1, g1 3,
    # g2 4, g3 4, g4 5, g5 1 -> node 1 and 4 lead 2, nodes 2 and 6 none: g5 goes 1 -> 2, g2 4 -> 6
    assert steps[3:] == [Step("lead", 5, 1, 2), Step("lead", 2, 4, 6)]
    assert leader_counts(hosts) == dict.fromkeys(range(1, 7), 1)
    assert next_step(hosts, ALL6) is None


def test_bytes_choose_the_cheapest_group_to_copy():
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    # node 1 serves g3, g4, g5 (and g0): g4 is the smallest
    assert next_step(hosts, ALL6, group_bytes={3: 900, 4: 100, 5: 500}) == Step("balance", 4, 1, 6)


def test_a_move_in_flight_goes_on_or_is_rolled_back():
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    hosts = hosts.change({"action": "move_start", "move_group": 3, "source": 1, "target": 6})
    hosts = hosts.change({"action": "move_stage", "move_group": 3})
    assert next_step(hosts, ALL6) == Step("resume", 3, 1, 6)
    # the target is silent: nothing is balanced while it is (it counts as serving g3) ...
    assert next_step(hosts, ALL6 - {6}) is None
    # ... and once it is dead the move is rolled back
    assert next_step(hosts, ALL6 - {6}, dead=frozenset({6})) == Step("abort", 3, 1, 6)


def test_a_silent_learner_waits_until_its_host_is_dead():
    """At stage learn the target is no voter (its learner changed no membership): a target that
    misses a heartbeat (busy installing a snapshot) costs the group nothing, so the move waits,
    and nothing else is planned meanwhile (one change at a time); once the target is dead it is
    rolled back. At stage add a silent target is rolled back at once, as before."""
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    hosts = hosts.change({"action": "move_start", "move_group": 3, "source": 1, "target": 6, "learn": True})
    assert next_step(hosts, ALL6) == Step("resume", 3, 1, 6)
    assert next_step(hosts, ALL6 - {6}) is None
    assert next_step(hosts, ALL6 - {6}, dead=frozenset({6})) == Step("abort", 3, 1, 6)
    hosts = hosts.change({"action": "move_stage", "move_group": 3, "stage": "add"})
    assert next_step(hosts, ALL6 - {6}) == Step("abort", 3, 1, 6)


def test_a_dead_node_is_refilled_before_anything_is_balanced():
    hosts = six_groups_five_nodes()
    up = frozenset({1, 2, 3, 4})
    # node 5 serves g2, g3, g4: g2 (3,4,5) goes to the least loaded live node outside it: 1, 2
    # serve 4 replicas each -> node 1 (the lowest id)
    assert next_step(hosts, up, dead=frozenset({5})) == Step("refill", 2, 5, 1)
    assert next_step(hosts, up) is None                  # silent but not yet dead: wait


def test_a_dead_nodes_replicas_are_refilled_together_one_catch_up_per_target():
    hosts = six_groups_five_nodes()
    up, dead = frozenset({1, 2, 3, 4}), frozenset({5})
    # node 5's g2 (3,4,5) -> 1 (1, 2 serve 4: the lowest id; 1 now 5); g3 (1,4,5) -> 2 (2, 3
    # serve 4); g4 (1,2,5) -> 4 (3 serves 4, 4 serves 3): three targets, three refills at once
    assert next_steps(hosts, up, dead) == [Step("refill", 2, 5, 1), Step("refill", 3, 5, 2), Step("refill", 4, 5, 4)]
    # an empty sixth host is every group's target (0, 1, 2 replicas): one snapshot at a time to it
    # unless allowed more
    grown = hosts.change({"action": "add_host", "address": "127.0.0.1:9006"})
    assert next_steps(grown, up | {6}, dead) == [Step("refill", 2, 5, 6)]
    assert next_steps(grown, up | {6}, dead, catch_ups_per_host=2) == [Step("refill", 2, 5, 6), Step("refill", 3, 5, 6)]
    # a move in flight in the record (a refill the last turn left) comes first, alone
    moving = hosts.change({"action": "move_start", "move_group": 3, "source": 5, "target": 2})
    assert next_steps(moving, up, dead) == [Step("resume", 3, 5, 2)]
    assert next_steps(hosts, up) == []                    # silent but not yet dead: wait


def test_a_dead_node_emptied_by_its_refills_is_no_target():
    hosts = six_groups_five_nodes()
    up, dead = frozenset({1, 2, 3, 4}), frozenset({5})
    for step in next_steps(hosts, up, dead):
        hosts = apply(hosts, step)
    # node 5 serves nothing now (1: 5 replicas, 2: 5, 3: 4, 4: 4): counted, it was the least
    # loaded node and the first balance target, a move that could only be rolled back, again
    # every few turns
    assert replica_counts(hosts) == {1: 5, 2: 5, 3: 4, 4: 4, 5: 0}
    # silent but not known dead: node 1 gives it g2 (its lowest group but g0)
    assert next_step(hosts, up) == Step("balance", 2, 1, 5)
    # known dead: nodes 1-4 are within 1 of each other, and the leaders are balanced next:
    # named g0 1, g1 2, g2 3, g3 4, g4 1 (5 left it), g5 1 -> node 1 hands g4 to node 2
    assert next_step(hosts, up, dead) == Step("lead", 4, 1, 2)
    # node 4 drained after a sixth host came: all 4 of its groups to node 6 (0, 1, 2, 3
    # replicas, nodes 1-3 serving 4 or 5), never to node 5 (its g1 would go there first)
    drained = hosts.change({"action": "add_host", "address": "127.0.0.1:9006"})
    drained = drained.change({"action": "drain_host", "address": NODES[3]})
    assert drained.drain_plan(4, avoid=dead) == [(1, 6), (2, 6), (3, 6), (4, 6)]
    assert drained.drain_plan(4)[0] == (1, 5)
    assert next_step(drained, up | {6}, dead) == Step("drain", 1, 4, 6)


def test_refills_at_once_interleave_their_entries_and_a_stale_plan_is_refused():
    """The refills' threads send their record changes in any order: each entry touches its own
    group, so the record they leave is the one of the refills made one after another; a refill
    planned from an older record (a second driver, a loop that lost group 0) is refused."""
    hosts = six_groups_five_nodes()
    steps = next_steps(hosts, frozenset({1, 2, 3, 4}), frozenset({5}))
    starts = [{"action": "move_start", "move_group": s.group, "source": s.source, "target": s.target} for s in steps]
    stages = [{"action": "move_stage", "move_group": s.group} for s in steps]
    dones = [{"action": "move_done", "move_group": s.group} for s in steps]
    interleaved = hosts
    for entry in [starts[2], starts[0], stages[0], starts[1], stages[2], dones[0], stages[1], dones[2], dones[1]]:
        interleaved = interleaved.change(entry)
    one_by_one = hosts
    for step in steps:
        one_by_one = apply(one_by_one, step)
    assert interleaved.placed == one_by_one.placed == ((1, 2, 3), (2, 3, 4), (1, 3, 4), (1, 2, 4), (1, 2, 4), (1, 2, 3))
    assert not interleaved.moves and interleaved.epoch == 9
    # a refill of g2 planned before the first was made: to node 3 while g2 moves to node 1 ...
    moving = hosts.change(starts[0])
    with pytest.raises(InvalidRequest, match="already moving a replica from node 5 to node 1"):
        moving.change({"action": "move_start", "move_group": 2, "source": 5, "target": 3})
    # ... or once it is done (node 5 no longer serves g2): refused, the record unchanged
    with pytest.raises(InvalidRequest, match="node 5 .* does not serve Raft group 2"):
        interleaved.change({"action": "move_start", "move_group": 2, "source": 5, "target": 3})


def test_a_node_is_silent_from_the_first_heartbeat_it_missed():
    """A turn refilling 170 MiB groups took no heartbeat for about 10 s; a target still busy
    with its snapshot then missed the next one and, counted from its last answer, was dead at
    once (a 10 s timeout) and its own replicas were refilled too. Counted from the missed
    heartbeat it has the full timeout."""
    silent = silent_since({}, frozenset({1, 2, 3, 4}), 4, 0.0)
    assert silent == {}
    silent = silent_since(silent, frozenset({1, 2, 3}), 4, 11.0)        # the heartbeat after a long turn
    assert silent == {4: 11.0}                                          # silent 0 s, not 11 s
    silent = silent_since(silent, frozenset({1, 2, 3}), 4, 12.0)
    assert silent == {4: 11.0}
    assert silent_since(silent, frozenset({1, 2, 3, 4}), 4, 13.0) == {}    # it answers: the clock stops
    # a new leader's first heartbeat: the nodes that do not answer are silent from then
    assert silent_since({}, frozenset({2, 3}), 4, 50.0) == {1: 50.0, 4: 50.0}


def stopped(hosts: Hosts, down: set[int]) -> list[int]:
    """The groups whose voters (the record's members, a joining target included) that are up
    and hold the log (a move's target is taken to be still copying its first snapshot) are no
    majority of them."""
    return [g for g in range(hosts.groups)
            if len(set(hosts.members(g)) - down - {m.target for m in hosts.moves if m.group == g})
            < len(hosts.members(g)) // 2 + 1]


def test_a_drains_moves_go_one_at_a_time_so_one_kill_stops_no_other_group():
    """Why a drain's moves stay one at a time: a moving group has 4 voters, one still copying, so
    a kill of its target leaves 3 of 4; with the drain's moves at once, a kill of one move's
    target that is a member of another moving group leaves that one 2 of 4, stopped. One at a
    time, a kill of the target or of any node outside the moving group stops nothing."""
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    for step in [Step("balance", 3, 1, 6), Step("balance", 1, 2, 6), Step("balance", 2, 3, 6)]:
        hosts = apply(hosts, step)
    hosts = hosts.change({"action": "drain_host", "address": "127.0.0.1:9006"})
    # node 6 serves g1 (3,4,6), g2 (4,5,6), g3 (4,5,6); nodes 1-5 serve 3 each: g1 -> 1 (the
    # lowest id outside it), g2 -> 2 (1 now 4), g3 -> 3
    assert hosts.drain_plan(6) == [(1, 1), (2, 2), (3, 3)]
    # the three at once, each joined and copying: node 3, g3's target, is killed
    together = hosts
    for group, target in hosts.drain_plan(6):
        together = together.change({"action": "move_start", "move_group": group, "source": 6, "target": target})
        together = together.change({"action": "move_stage", "move_group": group})
    assert together.members(1) == [1, 3, 4, 6]
    assert stopped(together, down={3}) == [1]     # g1: only 4 and 6 of 4 voters
    # the plan: one drain move, and nothing else while it is in flight
    up = frozenset(range(1, 7))
    assert next_steps(hosts, up) == [Step("drain", 1, 6, 1)]
    one = hosts.change({"action": "move_start", "move_group": 1, "source": 6, "target": 1})
    assert next_steps(one, up) == [Step("resume", 1, 6, 1)]
    one = one.change({"action": "move_stage", "move_group": 1})
    # killing its target, or any node outside g1, stops no group
    assert all(stopped(one, down={n}) == [] for n in (1, 2, 5))


def test_a_draining_node_is_emptied_and_drain_refusals():
    hosts = six_groups_five_nodes().change({"action": "drain_host", "address": NODES[4]})
    assert hosts.draining == (5,) and hosts.active() == [1, 2, 3, 4]
    # node 5's groups go to the least loaded active node outside each (1, 2, 3 serve 4, node 4
    # serves 3): g2 (3,4,5) -> 1; g3 (1,4,5) -> 2 (1 now serves 5); g4 (1,2,5) -> 4
    up = frozenset(range(1, 6))
    assert next_step(hosts, up) == Step("drain", 2, 5, 1)
    for expected in [Step("drain", 2, 5, 1), Step("drain", 3, 5, 2), Step("drain", 4, 5, 4)]:
        step = next_step(hosts, up)
        assert step == expected
        hosts = apply(hosts, step)
    assert hosts.hosted_by(5) == [] and replica_counts(hosts) == {1: 5, 2: 5, 3: 4, 4: 4}    # within 1
    # named leaders: g0 1, g1 2, g2 3, g3 4, g4 1 (5 left it), g5 1: node 1 hands g4 to node 2
    assert next_step(hosts, up) == Step("lead", 4, 1, 2) and remaining(hosts, up) == 1
    with pytest.raises(InvalidRequest, match="last 3 hosts"):
        hosts.change({"action": "drain_host", "address": NODES[3]}).change(
            {"action": "drain_host", "address": NODES[2]})
    with pytest.raises(InvalidRequest, match="serves Raft group 0"):
        hosts.change({"action": "drain_host", "address": NODES[0]})
    with pytest.raises(InvalidRequest, match="is draining"):
        hosts.change({"action": "move_start", "move_group": 1, "source": 2, "target": 5})
    assert hosts.change({"action": "drain_host", "address": NODES[4]}) is hosts
    assert Hosts.from_record(hosts.record()) == hosts


def test_an_added_host_that_never_answered_is_rolled_back_from_never_refilled_from():
    """Node 6 was added and a move of g2 to it reached catch_up, but node 6 was never started
    (it never answered a heartbeat). While within the dead-host timeout the loop waits; past it,
    the move is rolled back: node 6's share of g2 was never a replica, so nothing is re-created
    from it (placement_loop.py counts a silent node as dead only while it serves a group)."""
    hosts = six_groups_five_nodes().change({"action": "add_host", "address": "127.0.0.1:9006"})
    hosts = hosts.change({"action": "move_start", "move_group": 2, "source": 3, "target": 6})
    hosts = hosts.change({"action": "move_stage", "move_group": 2})
    up = frozenset(range(1, 6))
    assert hosts.hosted_by(6) == [2]
    assert next_step(hosts, up) is None
    assert next_step(hosts, up, dead=frozenset({6})) == Step("abort", 2, 3, 6)
    rolled_back = apply(hosts, Step("abort", 2, 3, 6))
    assert rolled_back.hosted_by(6) == [] and rolled_back.placed == six_groups_five_nodes().placed
