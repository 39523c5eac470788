"""Placement of Raft groups over nodes and of tensors over groups (pure functions)."""
from __future__ import annotations

import collections

import pytest

from raftps.groups import STRIDE, Layout, data_dir, group_of, group_config
from raftps.server.node import NodeConfig


def test_one_group_is_every_node() -> None:
    layout = Layout(("h:1", "h:2", "h:3", "h:4", "h:5"), 1)
    assert layout.members(0) == [1, 2, 3, 4, 5]
    assert all(layout.hosted_by(n) == [0] for n in range(1, 6))
    assert group_of("anything", 1) == 0


@pytest.mark.parametrize("nodes,groups", [(3, 3), (4, 4), (6, 6), (9, 9), (5, 8)])
def test_groups_have_three_members_spread_evenly(nodes: int, groups: int) -> None:
    layout = Layout(tuple(f"h:{7000 + i}" for i in range(nodes)), groups)
    hosted = collections.Counter(n for g in range(groups) for n in layout.members(g))
    for g in range(groups):
        assert len(set(layout.members(g))) == 3
    # every node hosts groups*3/nodes replicas when nodes divide groups: adding nodes adds capacity
    if groups % nodes == 0:
        assert set(hosted.values()) == {3 * groups // nodes}
    assert set(hosted) == set(range(1, nodes + 1))
    assert sum(hosted.values()) == 3 * groups


def test_ports_and_dirs_per_group() -> None:
    layout = Layout(("10.0.0.1:7100", "10.0.0.2:7101", "10.0.0.3:7102", "10.0.0.4:7103"), 4)
    assert layout.raft_address(2, 3) == f"10.0.0.2:{7101 + 3 * STRIDE}"
    assert layout.peers(1) == [layout.raft_address(n, 1) for n in (2, 3, 4)]
    assert data_dir("/d", 0) == "/d" and data_dir("/d", 2) == "/d/group2"
    base = NodeConfig(node_id=4, peers=list(layout.nodes), data_dir="/d/n4", secret=b"s" * 16)
    assert layout.hosted_by(4) == [1, 2, 3]                  # node 4 is in no replica of group 0
    g2 = group_config(base, layout, 2)
    assert g2.peers == layout.peers(2) and g2.node_id == layout.members(2).index(4) + 1
    # the group's client and metrics addresses are the node's own, whatever the group
    assert g2.address(g2.node_id, g2.client_offset) == base.address(4, base.client_offset)
    assert g2.bind(g2.metrics_offset) == base.bind(base.metrics_offset)
    assert g2.data_dir == "/d/n4/group2" and g2.cluster_node == 4


def test_names_spread_over_groups_the_same_everywhere() -> None:
    names = [f"layer{i}.weight" for i in range(300)]
    counts = collections.Counter(group_of(n, 3) for n in names)
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 60
    assert [group_of(n, 3) for n in names] == [group_of(n, 3) for n in names]
    assert group_of("layer0.weight", 3) == 1          # SHA-256 of the name: fixed, not per process


def test_bad_group_count_is_refused() -> None:
    with pytest.raises(ValueError, match="groups must be an int in 1..64"):
        Layout(("h:1",), 0)
