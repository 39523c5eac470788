"""Process faults: SIGKILL of leader, follower, quorum, everyone (cases 1, 2, 3, 6)."""
from __future__ import annotations

import time

from raftps.chaos.harness import Harness, assert_clean
from raftps.chaos.history import OK, PUSH, UNKNOWN



def test_leader_kill(tmp_path) -> None:
    with Harness("leader-kill", str(tmp_path), base_port=7610) as h:
        h.load(9.0)
        h.wait(3.0)
        lead = h.leader()
        t = h.event(f"kill leader n{lead}")
        h.kill(lead)
        h.wait(3.0)
        h.cluster.start_node(lead)
        result, line = h.finish(failover_s=lambda: h.failover(t))
        slowest = max(o.end - o.start for o in h.history.completed() if o.end > t)
    assert_clean(result, line)
    assert result.ok > 100 and h.failover(t) is not None and h.failover(t) < 6.0, (line, slowest)


def test_follower_kill_catches_up_by_snapshot(tmp_path) -> None:
    with Harness("follower-kill-snapshot", str(tmp_path), base_port=7620,
                 node_args=["--compaction-entries", "150"]) as h:
        h.load(12.0)
        h.wait(1.0)
        f = h.follower()
        before = h.status(f)["applied"]
        h.event(f"kill follower n{f}")
        h.kill(f)
        h.wait(5.0)                          # > 150 entries: the log is compacted past `before`
        lead = h.leader()
        snap = h.status(lead)["snapshot_index"]
        h.cluster.start_node(f)
        catchup = h.wait_caught_up(f)
        got = h.status(f)["snapshot_index"]
        result, line = h.finish(catchup_s=catchup, leader_snapshot=snap, follower_applied_at_kill=before)
    assert_clean(result, line)
    assert snap > before, f"the leader did not compact past the follower ({snap} <= {before})"
    assert got > before, "the restarted follower did not install a snapshot"
    assert catchup is not None and catchup < 15.0, line


def test_quorum_kill_fails_cleanly_then_resumes(tmp_path) -> None:
    timeout = 3.0
    with Harness("quorum-kill", str(tmp_path), base_port=7630, timeout=timeout) as h:
        h.load(19.0)
        h.wait(2.0)
        lead = h.leader()
        other = h.follower()
        t_kill = h.event(f"kill n{lead} and n{other}")
        h.kill(lead)
        h.kill(other)
        h.wait(3 * timeout)        # room for at least one whole push attempt inside the outage
        t_back = h.event(f"restart n{other}")
        h.cluster.start_node(other)
        h.wait(5.0)
        h.cluster.start_node(lead)
        ops = h.history.completed()
        during = [o for o in ops if o.kind == PUSH and o.start > t_kill + 0.5 and o.end < t_back]
        resumed = [o for o in ops if o.kind == PUSH and o.outcome == OK and o.start > t_back]
        result, line = h.finish(failover_s=lambda: h.failover(t_back), during=len(during))
    assert_clean(result, line)
    assert during and all(o.outcome != OK for o in during), "a push was acknowledged without a majority"
    assert all(o.end - o.start <= timeout + 1.5 for o in during), "a push hung past the client timeout"
    assert sum(o.outcome == UNKNOWN for o in during) > 0
    assert resumed, "load did not resume after restarting one node"


def test_full_cluster_restart_keeps_every_ack(tmp_path) -> None:
    with Harness("full-restart", str(tmp_path), base_port=7640) as h:
        h.load(14.0)
        for round_ in range(2):
            h.wait(3.0)
            t = h.event(f"kill all, round {round_}")
            h.kill_all()
            h.cluster.start(timeout=30.0)
        result, line = h.finish(failover_s=lambda: h.failover(t))
    assert_clean(result, line)
    assert result.ok > 100, line
