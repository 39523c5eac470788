"""Case 4: SIGSTOP the leader past the election timeout, SIGCONT; case 8: a slow follower."""
from __future__ import annotations

import signal
import time

from raftps import RaftpsError, Unavailable
from raftps.chaos.harness import Harness, assert_clean
from raftps.chaos.history import FAILED, OK, PULL, PUSH, UNKNOWN, History
from raftps.chaos.workload import NAME


def test_paused_leader_serves_nothing_stale(tmp_path) -> None:
    with Harness("leader-pause", str(tmp_path), base_port=7720) as h:
        h.load(14.0)
        h.wait(2.0)
        old = h.leader()
        t = h.event(f"SIGSTOP leader n{old}")
        h.cluster.pause(old)
        h.wait(5.0)                                   # election timeout 1-2 s, leader fallback 2.5 s
        h.event(f"SIGCONT n{old}")
        h.cluster.resume(old)
        # Straight after the resume, read and write through the old leader only (client 98).
        with h.cluster.client([h.cluster.client_address(old)], timeout=3.0, attempt_timeout=1.0) as c:
            for seq in range(20):
                op = h.history.begin(PULL, client=98, seq=seq)
                try:
                    tensors, version = c.pull([NAME])
                    History.finish(op, OK, version, values=tensors[NAME])
                except Unavailable as exc:
                    History.finish(op, UNKNOWN, error=exc)
                except RaftpsError as exc:
                    History.finish(op, FAILED, error=exc)
                time.sleep(0.05)
        new = h.leader()
        result, line = h.finish(failover_s=lambda: h.failover(t), new_leader=new, old_leader=old)
    assert_clean(result, line)
    assert new != old, "no new leader took over while the old one was paused"


def test_slow_follower_catches_up(tmp_path) -> None:
    with Harness("slow-follower", str(tmp_path), base_port=7730) as h:
        h.load(18.0)
        h.wait(1.0)
        f = h.follower()
        h.event(f"SIGSTOP/SIGCONT cycles on n{f}")
        lag = 0
        for _ in range(10):                            # 10 x (0.7 s stopped, 0.2 s running)
            h.cluster.send_signal(f, signal.SIGSTOP)
            time.sleep(0.7)
            h.cluster.send_signal(f, signal.SIGCONT)
            time.sleep(0.2)
            rows = h.cluster.status()
            lead = [r for r in rows if r["role"] == "leader"]
            if lead and rows[f - 1].get("applied") is not None:
                lag = max(lag, lead[0]["applied"] - rows[f - 1]["applied"])
        h.cluster.send_signal(f, signal.SIGSTOP)      # then one long stall: far behind
        time.sleep(5.0)
        behind = h.status(h.leader())["applied"]
        h.cluster.send_signal(f, signal.SIGCONT)
        catchup = h.wait_caught_up(f)
        result, line = h.finish(catchup_s=catchup, max_lag_entries=lag, leader_applied_at_resume=behind)
    assert_clean(result, line)
    assert catchup is not None and catchup < 10.0, line
