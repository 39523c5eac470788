"""Network partitions (case 5): iptables rules inside per-node namespaces; clients in the root
namespace still reach every node. Nodes run with raftps.raft.pysyncobj_fixes installed, as always."""
from __future__ import annotations

import pytest

from raftps.chaos import netns
from raftps.chaos.harness import Harness, assert_clean

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def partition(h: Harness, kind: str) -> tuple[int, float]:
    lead = h.leader()
    other = h.follower()
    target = other if kind == "follower" else lead
    if kind in ("leader", "follower"):
        h.net.isolate(target)
    elif kind == "asymmetric":
        h.net.isolate(target, direction="in")       # the leader hears nobody; its packets still leave
    elif kind == "bridge":
        h.net.cut(lead, other)                      # the third node still sees both
    elif kind == "flap":
        t = h.event(f"flap n{target}")
        h.net.flap(target, period=0.8, count=4).join(10)
        return target, t
    t = h.event(f"{kind} partition around n{target} in place")   # after the rules: failover from here
    h.wait(6.0)
    return target, t


@pytest.mark.parametrize("kind", ["leader", "follower", "asymmetric", "bridge", "flap"])
def test_partition(tmp_path, kind: str) -> None:
    port = 7650 + 10 * ["leader", "follower", "asymmetric", "bridge", "flap"].index(kind)
    with Harness(f"{kind}-partition", str(tmp_path), base_port=port, netns=True) as h:
        h.load(14.0)
        h.wait(2.0)
        target, t = partition(h, kind)
        h.net.heal()
        catchup = h.wait_caught_up(target, timeout=20.0)
        result, line = h.finish(failover_s=lambda: h.failover(t), catchup_s=catchup)
    assert_clean(result, line)
    assert catchup is not None, f"n{target} did not catch up within 20 s of the heal"
    assert result.ok > 100, line
