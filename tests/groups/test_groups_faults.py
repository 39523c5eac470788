"""The fault suite's guarantees per Raft group on a cluster of three groups: the one-hot workload
on a tensor in each group, checked group by group (0 acknowledged lost, 0 duplicated,
linearizable reads, identical replicas)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raftps.chaos import netns
from raftps.chaos.harness import Harness, assert_clean


def test_kill_the_node_that_leads_most_groups(tmp_path) -> None:
    with Harness("groups-kill", str(tmp_path), base_port=29300, groups=3) as h:
        h.load(12.0)
        h.wait(3.0)
        leaders = [h.leader(group=g) for g in range(3)]
        victim = max(set(leaders), key=leaders.count)
        t = h.event(f"kill n{victim}, leader of groups {[g for g, n in enumerate(leaders) if n == victim]}")
        h.kill(victim)
        h.wait(4.0)
        h.cluster.start_node(victim)
        result, line = h.finish(failover_s=h.failover(t), led=leaders.count(victim))
    assert_clean(result, line)


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_isolate_the_leader_of_group_0(tmp_path) -> None:
    with Harness("groups-isolate", str(tmp_path), base_port=29310, netns=True, subnet="10.77.11", groups=3) as h:
        h.load(12.0)
        h.wait(3.0)
        lead = h.leader(group=0)
        h.event(f"isolate n{lead}")
        h.net.isolate(lead)
        h.wait(4.0)
        h.net.heal(lead)
        result, line = h.finish()
    assert_clean(result, line)


def test_nemesis_over_three_groups() -> None:
    seconds = 20
    p = subprocess.run([sys.executable, "-m", "raftps.chaos", "--seconds", str(seconds), "--seed", "7",
                        "--base-port", "29320", "--groups", "3"], capture_output=True, text=True,
                       timeout=seconds + 150)
    print(p.stdout[-4000:], p.stderr[-3000:])
    lines = [l for l in p.stdout.splitlines() if l.startswith("case=nemesis")]
    assert p.returncode == 0 and len(lines) == 3, p.stdout[-3000:] + p.stderr[-3000:]
    for line in lines:
        assert "acked_lost=0 duplicated=0" in line and line.endswith("replicas_identical=true"), line
