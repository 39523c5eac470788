"""The hosts record (raftps/store/hosts.py): pure changes, and its life in group 0's state machine
(apply, snapshot, restore). Expected placements are written out by hand."""
import pytest

from raftps.errors import InvalidRequest
from raftps.groups import Layout
from raftps.store.hosts import Hosts, HostsState
from raftps.store.machine import TensorStore

NODES = tuple(f"127.0.0.1:{9000 + i}" for i in range(1, 5))
# 4 nodes, 3 groups: group g on nodes g+1..g+3 (mod 4), written out
START = ((1, 2, 3), (2, 3, 4), (1, 3, 4))


def start() -> Hosts:
    return Hosts.from_layout(Layout(NODES, 3))


def test_the_formula_is_where_a_cluster_starts():
    hosts = start()
    assert hosts.placed == START and hosts.epoch == 0 and hosts.moves == ()
    assert hosts.hosted_by(1) == [0, 2] and hosts.hosted_by(4) == [1, 2]
    assert hosts.peers(1) == ["127.0.0.1:9402", "127.0.0.1:9403", "127.0.0.1:9404"]   # Raft port + 400 g


def test_moving_a_replica_to_a_new_host():
    hosts = start().change({"action": "add_host", "address": "127.0.0.1:9005"})
    assert hosts.nodes[-1] == "127.0.0.1:9005" and hosts.epoch == 1 and hosts.hosted_by(5) == []
    hosts = hosts.change({"action": "move_start", "move_group": 1, "source": 2, "target": 5})
    assert hosts.members(1) == [2, 3, 4] and hosts.hosted_by(5) == []       # intent only
    hosts = hosts.change({"action": "move_stage", "move_group": 1})
    assert hosts.members(1) == [2, 3, 4, 5] and hosts.hosted_by(5) == [1]   # the target catches up
    assert hosts.change({"action": "move_stage", "move_group": 1}) is hosts      # again: nothing changes
    hosts = hosts.change({"action": "move_done", "move_group": 1})
    assert hosts.placed == ((1, 2, 3), (3, 4, 5), (1, 3, 4)) and hosts.moves == () and hosts.epoch == 4
    assert hosts.hosted_by(2) == [0] and hosts.hosted_by(5) == [1]
    assert Hosts.from_record(hosts.record()) == hosts


def test_a_move_with_a_learner_goes_learn_add_catch_up_done():
    """A learner changes no membership: at stages learn and add the target hosts nothing (its
    node runs a learner); at catch_up it is a member. Stages never go back; an entry without
    ``learn`` (an older driver's) starts at add, and a move_stage without ``stage`` goes to
    catch_up, as before: old logs replay the same."""
    hosts = start().change({"action": "add_host", "address": "127.0.0.1:9005"})
    learning = hosts.change({"action": "move_start", "move_group": 1, "source": 2, "target": 5, "learn": True})
    assert learning.move_of(1).stage == "learn" and learning.members(1) == [2, 3, 4]
    assert learning.hosted_by(5) == [] and learning.learner_of(1) == 5 and learning.learner_of(2) is None
    adding = learning.change({"action": "move_stage", "move_group": 1, "stage": "add"})
    assert adding.move_of(1).stage == "add" and adding.members(1) == [2, 3, 4] and adding.learner_of(1) == 5
    assert adding.change({"action": "move_stage", "move_group": 1, "stage": "add"}) is adding
    joined = adding.change({"action": "move_stage", "move_group": 1, "stage": "catch_up"})
    assert joined.members(1) == [2, 3, 4, 5] and joined.hosted_by(5) == [1] and joined.learner_of(1) is None
    assert joined.change({"action": "move_stage", "move_group": 1, "stage": "add"}) is joined     # never back
    assert joined.change({"action": "move_done", "move_group": 1}).placed[1] == (3, 4, 5)
    with pytest.raises(InvalidRequest, match="has not reached catch_up"):
        adding.change({"action": "move_done", "move_group": 1})
    with pytest.raises(InvalidRequest, match="stage must be add or catch_up"):
        learning.change({"action": "move_stage", "move_group": 1, "stage": "learn"})
    assert learning.change({"action": "move_abort", "move_group": 1}).members(1) == [2, 3, 4]
    assert Hosts.from_record(learning.record()) == learning
    old = hosts.change({"action": "move_start", "move_group": 1, "source": 2, "target": 5})
    assert old.move_of(1).stage == "add"
    assert learning.change({"action": "move_stage", "move_group": 1}).move_of(1).stage == "catch_up"


@pytest.mark.parametrize("command, message", [
    ({"action": "add_host", "address": NODES[1]}, "already host 2"),
    ({"action": "add_host", "address": "nohost"}, "HOST:PORT"),
    ({"action": "move_start", "move_group": 1, "source": 1, "target": 4}, r"node 1 \(127.0.0.1:9001\) does not serve"),
    ({"action": "move_start", "move_group": 1, "source": 2, "target": 3}, "already serves Raft group 1"),
    ({"action": "move_start", "move_group": 1, "source": 2, "target": 9}, "node ids in 1..4"),
    ({"action": "move_start", "move_group": 3, "source": 2, "target": 1}, "out of range 0..2"),
    ({"action": "move_done", "move_group": 1}, "no move in flight"),
    ({"action": "grow", "move_group": 1}, "action must be one of"),
])
def test_a_change_that_does_not_fit_is_refused(command, message):
    with pytest.raises(InvalidRequest, match=message):
        start().change(command)


def test_one_change_per_group_at_a_time():
    moving = start().change({"action": "move_start", "move_group": 1, "source": 2, "target": 1})
    assert moving.change({"action": "move_start", "move_group": 1, "source": 2, "target": 1}) is moving
    with pytest.raises(InvalidRequest, match="already moving a replica from node 2 to node 1"):
        moving.change({"action": "move_start", "move_group": 1, "source": 3, "target": 1})
    with pytest.raises(InvalidRequest, match="has not reached catch_up"):
        moving.change({"action": "move_done", "move_group": 1})
    # another group may move meanwhile; an abort forgets the move and keeps the members
    both = moving.change({"action": "move_start", "move_group": 2, "source": 1, "target": 2})
    aborted = both.change({"action": "move_abort", "move_group": 1})
    assert aborted.placed == START and [m.group for m in aborted.moves] == [2]


def entry(seq: int, **fields) -> dict:
    return {"op": "hosts_change", "client": "admin", "seq": seq, **fields,
            "base_nodes": list(NODES), "base_placed": [list(m) for m in START]}


def test_group_0_keeps_the_record_through_its_log_and_snapshots():
    store, other = TensorStore(), TensorStore()
    assert "hosts" not in store.snapshot()           # a cluster that never changed: as before
    entries = [entry(1, action="add_host", address="127.0.0.1:9005"),
               entry(2, action="move_start", move_group=2, source=4, target=5),
               entry(3, action="move_start", move_group=2, source=1, target=5)]   # refused: one move at a time
    results = [store.apply(i, e) for i, e in enumerate(entries, 1)]
    for i, e in enumerate(entries, 1):
        other.apply(i, e)
    assert results[0]["changed"] and results[1]["hosts"]["moves"] == [[2, 4, 5, "add"]]
    assert results[2]["error"] == "InvalidRequest"
    assert store.digest() == other.digest()
    restored = TensorStore()
    restored.restore(store.snapshot())
    assert restored.hosts.current == store.hosts.current and restored.digest() == store.digest()


def test_the_first_change_needs_the_formula():
    state = HostsState()
    with pytest.raises(InvalidRequest, match="needs the formula's record as base"):
        state.apply_change({"action": "add_host", "address": "127.0.0.1:9005"})
    assert state.current is None


def test_a_drain_spreads_the_replicas_and_never_leaves_a_group_short():
    hosts = start().change({"action": "add_host", "address": "127.0.0.1:9005"})
    # node 3 serves groups 0, 1, 2; nodes 1, 2, 4 serve two each, node 5 none. Group 0 (outside
    # it: 4 with 2, 5 with 0) -> 5; group 1 (outside: 1 with 2, 5 now with 1) -> 5; group 2
    # (outside: 2 with 2, 5 now with 2) -> 2, the lower id of a tie
    assert hosts.hosted_by(1) == [0, 2] and hosts.hosted_by(2) == [0, 1] and hosts.hosted_by(4) == [1, 2]
    assert hosts.drain_plan(3) == [(0, 5), (1, 5), (2, 2)]
    # a move in flight off the node keeps its target (node 1, now with 3); group 2 (outside it:
    # 2 with 2, 5 with 1) -> 5
    moving = hosts.change({"action": "move_start", "move_group": 1, "source": 3, "target": 1})
    assert moving.drain_plan(3) == [(0, 5), (1, 1), (2, 5)]
    three = Hosts.from_layout(Layout(NODES[:3], 2))
    with pytest.raises(InvalidRequest, match="would leave Raft group 0 with 2 replicas: add a host first"):
        three.drain_plan(1)


def test_a_dead_node_is_never_a_target():
    hosts = start().change({"action": "add_host", "address": "127.0.0.1:9005"})
    # as above, with node 5 dead: group 0 -> 4 (the only node outside {1,2,3}), group 1 -> 1
    # (the only one outside {2,3,4}), group 2 -> 2 (the only one outside {1,3,4})
    assert hosts.drain_plan(3, avoid=frozenset({5})) == [(0, 4), (1, 1), (2, 2)]
    with pytest.raises(InvalidRequest, match="would leave Raft group 0 with 2 replicas"):
        hosts.drain_plan(3, avoid=frozenset({4, 5}))


def test_a_move_in_flight_to_a_silent_node_keeps_its_target_in_a_drain_plan():
    """The placement loop plans a drain with the silent nodes avoided, while a move off the
    draining node may still target one of them (its catch-up stage, the target gone quiet)."""
    hosts = start().change({"action": "add_host", "address": "127.0.0.1:9005"})
    moving = hosts.change({"action": "move_start", "move_group": 1, "source": 3, "target": 5})
    # group 0 -> 4 (outside {1,2,3}, 5 avoided), group 1 keeps its move's target 5, group 2 -> 2
    assert moving.drain_plan(3, avoid=frozenset({5})) == [(0, 4), (1, 5), (2, 2)]


def test_a_replaced_host_hands_its_groups_and_the_leaders_it_had_to_its_replacement():
    """replace_host: node 4 (groups 1, 2; named leader of group 2) is replaced by a new node 5.
    Each of its replicas goes to node 5, whatever the loads; node 5 takes over group 2's lead."""
    hosts = start().change({"action": "set_leader", "move_group": 2, "target": 4})
    replacing = hosts.change({"action": "replace_host", "address": NODES[3], "new": "127.0.0.1:9005"})
    assert replacing.nodes[4] == "127.0.0.1:9005" and replacing.draining == (4,) and replacing.epoch == 2
    assert replacing.drain_plan(4) == [(1, 5), (2, 5)]
    # run again (an interrupted replace resumed): nothing changes
    assert replacing.change({"action": "replace_host", "address": NODES[3], "new": "127.0.0.1:9005"}) is replacing
    done = replacing
    for group in (1, 2):
        done = done.change({"action": "move_start", "move_group": group, "source": 4, "target": 5})
        done = done.change({"action": "move_stage", "move_group": group})
        done = done.change({"action": "move_done", "move_group": group})
    assert done.placed == ((1, 2, 3), (2, 3, 5), (1, 3, 5)) and done.hosted_by(4) == []
    assert done.preferred_leader(2) == 5 and done.preferred_leader(1) == 2
    assert Hosts.from_record(done.record()) == done


@pytest.mark.parametrize("old, new, message", [
    ("127.0.0.1:1", "127.0.0.1:9005", r"127.0.0.1:1 is not a host of this cluster"),
    (NODES[3], NODES[1], "127.0.0.1:9002 is already host 2 of this cluster"),
    (NODES[3], NODES[3], "the same address 127.0.0.1:9004"),
    (NODES[0], "127.0.0.1:9005", "serves Raft group 0"),
    (NODES[3], "nohost", "HOST:PORT"),
])
def test_a_bad_replace_is_refused(old, new, message):
    with pytest.raises(InvalidRequest, match=message):
        start().change({"action": "replace_host", "address": old, "new": new})
