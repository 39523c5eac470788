"""Case 7: SIGKILL a node while it writes a snapshot, and while it receives one."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from raftps.chaos import netns
from raftps.chaos.harness import Harness, assert_clean


def test_kill_while_writing_snapshot(tmp_path) -> None:
    with Harness("kill-writing-snapshot", str(tmp_path), base_port=7740,
                 node_args=["--compaction-entries", "100"]) as h:
        with h.cluster.client(timeout=10.0) as c:   # 8 MiB ballast: a write that lasts
            c.create("ballast", np.zeros(1 << 20), optimizer={"name": "sgd", "lr": 1.0})
        h.load(14.0)
        h.wait(1.0)
        # raftps passes its own serializer, so pysyncobj writes the snapshot in the tick thread
        # (no fork): "writing" = raft.snapshot.tmp exists. Kill that node at once.
        tmps = {i: os.path.join(h.cluster.data_dir(i), "raft.snapshot.tmp") for i in (1, 2, 3)}
        victim, deadline = None, time.monotonic() + 8.0
        while victim is None and time.monotonic() < deadline:
            victim = next((i for i, p in tmps.items() if os.path.exists(p)), None)
            if victim is None:
                time.sleep(0.0005)
        if victim is not None:
            h.kill(victim)
        tmp_seen = victim is not None and os.path.exists(tmps[victim])
        h.event(f"killed n{victim} while writing a snapshot")
        h.wait(1.0)
        h.cluster.start_node(victim)
        catchup = h.wait_caught_up(victim)
        result, line = h.finish(catchup_s=catchup, tmp_left_by_kill=tmp_seen)
    assert victim is not None, "never saw a snapshot being written in 8 s"
    assert_clean(result, line)


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_kill_while_receiving_snapshot(tmp_path) -> None:
    with Harness("kill-receiving-snapshot", str(tmp_path), base_port=7750, netns=True,
                 node_args=["--compaction-entries", "100"]) as h:
        with h.cluster.client(timeout=10.0) as c:   # 16 MiB ballast: a long multi-chunk snapshot
            c.create("ballast", np.zeros(1 << 21), optimizer={"name": "sgd", "lr": 1.0})
        h.load(150.0)                                  # outlasts every attempt below; stopped after
        h.wait(1.0)
        f = h.follower()
        seen = False
        for _attempt in range(3):
            held = h.status(f)["applied"]
            h.kill(f)
            # Until the leader's log is compacted past what f holds, f catches up from the log
            # (no snapshot); on a loaded machine 100 entries can take longer than a fixed wait.
            deadline = time.monotonic() + 30.0
            while h.status(h.leader())["snapshot_index"] <= held and time.monotonic() < deadline:
                h.wait(0.25)
            # 16 MiB at <= 1 MB/s: the transfer lasts >= 16 s however fast or loaded the machine.
            h.net.throttle(f, "1mb/s")
            h.cluster.start_node(f)
            deadline = time.monotonic() + 20.0
            while not seen and time.monotonic() < deadline:
                seen = any(p.endswith(".tmp") for p in os.listdir(h.cluster.data_dir(f)))
                time.sleep(0.002)
            if seen:
                break
            h.net.heal(f)
        h.event(f"kill n{f} while receiving a snapshot")
        h.kill(f)
        h.net.heal(f)
        h.cluster.start_node(f)
        catchup = h.wait_caught_up(f)
        h.stop_load()
        result, line = h.finish(catchup_s=catchup, receive_tmp_seen=seen)
    assert seen, "never saw the follower's partial snapshot file"
    assert_clean(result, line)
