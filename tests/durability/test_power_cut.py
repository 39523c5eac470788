"""Simulated power loss of whole raftps nodes under load (issue 15).

Every node runs with --durability fsync and its files on a simulated disk (raftps/chaos/simdisk.py,
one state dir per node): every write and fsync of its journal, payloads and snapshots is logged,
so after SIGKILLing nodes the test can cut every file back to what was fsynced ("synced"), or keep
a seeded-random part of the rest ("torn", as a page cache may). The nodes restart and the one-hot
workload goes on; the checker then demands every acknowledged push exactly once, linearizable
reads and identical replicas.

Two workloads. The first pushes 1000 float64 (8000 bytes), which travel inside the log entries,
with compaction off, and cuts all three nodes twice: the journal holds the whole state. The second
pushes 2048 float64 (16 KiB), which go through the data plane as payload files, with a snapshot
every 30 entries or 1 MiB of payloads, and cuts one node, then all three, then two: payload files
(new ones and overwritten spares), snapshots written and snapshots received from the leader are on
the cut disk too.

Each has a twin with one writer's fsyncs off (a test-only switch, RAFTPS_UNSAFE_<WRITER>_NO_FSYNC):
the same cuts must then lose acknowledged pushes or the state, or break a replica. That shows the
cut is real and the check can fail.

Election safety too: every node logs the term in which it becomes leader, and across the power
cuts no term may have had two leaders (a node that forgot its vote could elect a second one)."""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import pytest

from raftps.server import snapshot_file
from raftps.chaos.checker import Result
from raftps.chaos.harness import Harness, assert_clean
from raftps.chaos.history import OK, PUSH
from raftps.raft.pysyncobj_log import LEADER_LOG

LEADER_LINE = re.compile(re.escape(LEADER_LOG) + r" (?P<address>\S+) became leader of term (?P<term>\d+)")


def leaders_by_term(log_files: list[str]) -> dict[int, set[str]]:
    """Term -> the Raft addresses that logged becoming its leader, from the nodes' logs."""
    leaders: dict[int, set[str]] = {}
    for path in log_files:
        with open(path, errors="replace") as f:
            for line in f:
                found = LEADER_LINE.search(line)
                if found:
                    leaders.setdefault(int(found["term"]), set()).add(found["address"])
    return leaders


def assert_one_leader_per_term(log_files: list[str]) -> None:
    leaders = leaders_by_term(log_files)
    assert leaders, f"no node logged becoming leader in {log_files}"
    two = {term: sorted(who) for term, who in leaders.items() if len(who) > 1}
    assert not two, f"terms with two leaders: {two}"


ALL = (1, 2, 3)


@dataclass
class Run:
    result: Result
    line: str
    acked_pushes: int
    cut_files: Counter = field(default_factory=Counter)   # kind of file -> files a cut rewrote or removed


def file_kind(path: str) -> str:
    if "/payloads/" in path:
        return "payload"
    return "snapshot" if os.path.basename(path).startswith(snapshot_file.NAME) else "journal"


def run(tmp_path, base_port: int, mode: str, unsafe: str | None = None, cuts: Sequence[Sequence[int]] = (ALL, ALL),
        node_args: Sequence[str] = ("--compaction-entries", "1000000"), n: int = 1000, seconds: float = 16.0) -> Run:
    """The one-hot workload on three durable nodes, with the power of ``cuts[i]`` (node numbers)
    cut in ``mode`` every 3 s; ``unsafe``: the writer (journal, payload, snapshot) whose fsyncs a
    twin turns off. Checks election safety unless fsyncs are off."""
    env = {f"RAFTPS_UNSAFE_{unsafe.upper()}_NO_FSYNC": "1"} if unsafe else {}
    cut_files: Counter = Counter()
    with Harness(f"power-cut-{mode}" + (f"-no-{unsafe}-fsync" if unsafe else ""), str(tmp_path / "run"),
                 base_port=base_port, power_cuts=True, env=env, node_args=list(node_args), n=n) as h:
        h.load(seconds)
        for round_, nodes in enumerate(cuts):
            h.wait(3.0)
            h.event(f"power cut {round_ + 1}: node(s) {list(nodes)}")
            cut_files.update(file_kind(path) for path in h.power_cut(nodes, mode, seed=round_))
            for node in nodes:
                h.cluster.start_node(node)
        result, line = h.finish()
        acked = sum(1 for op in h.history.completed() if op.kind == PUSH and op.outcome == OK)
        logs = [h.cluster.log_file(node) for node in ALL]
    if not unsafe:
        assert_one_leader_per_term(logs)
    return Run(result, line, acked, cut_files)


def test_the_leader_check_finds_two_leaders_in_a_term(tmp_path) -> None:
    a, b = tmp_path / "node1.log", tmp_path / "node2.log"
    a.write_text(f"x WARNING {LEADER_LOG} 127.0.0.1:1 became leader of term 2\n"
                 f"x WARNING {LEADER_LOG} 127.0.0.1:1 became leader of term 4\n")
    b.write_text(f"x WARNING {LEADER_LOG} 127.0.0.1:2 became leader of term 3\n")
    assert leaders_by_term([str(a), str(b)]) == {2: {"127.0.0.1:1"}, 3: {"127.0.0.1:2"}, 4: {"127.0.0.1:1"}}
    assert_one_leader_per_term([str(a), str(b)])
    b.write_text(f"x WARNING {LEADER_LOG} 127.0.0.1:2 became leader of term 4\n")
    with pytest.raises(AssertionError, match="terms with two leaders"):
        assert_one_leader_per_term([str(a), str(b)])


def test_power_cut_of_every_node_loses_nothing_acknowledged(tmp_path) -> None:
    r = run(tmp_path, 30640, "synced")
    assert r.result.ok > 0
    assert_clean(r.result, r.line)


def test_torn_power_cut_loses_nothing_acknowledged(tmp_path) -> None:
    r = run(tmp_path, 30660, "torn")
    assert r.result.ok > 0
    assert_clean(r.result, r.line)


def run_twin(tmp_path, base_port: int, unsafe: str, **kwargs) -> Run | None:
    """A twin: the same cuts with ``unsafe``'s fsyncs off ("synced" mode). None: the state itself
    was lost, so there was no final state to read."""
    try:
        r = run(tmp_path, base_port, "synced", unsafe=unsafe, **kwargs)
    except AssertionError as exc:
        assert "no linearizable read of the final state" in str(exc)
        print(f"without {unsafe} fsyncs: {exc}")
        return None
    print(f"without {unsafe} fsyncs: {r.acked_pushes} acknowledged pushes; {r.line}")
    return r


def test_without_fsync_the_same_cut_loses_acknowledged_pushes(tmp_path) -> None:
    r = run_twin(tmp_path, 30680, "journal")
    assert r is None or (not r.result.valid and r.result.acked_lost > 0), r.line


# Pushes of 2048 float64 (16 KiB, above the 8 KiB that travel inside a log entry) go through the
# data plane as payload files; a snapshot every 30 entries or 1 MiB of payloads, so snapshots are
# written, payloads collected into spares and spares overwritten all through the run.
PAYLOAD_N = 2048
COMPACTING = ("--compaction-entries", "30", "--payload-budget-mb", "1")
ONE_ALL_TWO = ((1,), ALL, (2, 3))


@pytest.mark.parametrize("mode, base_port", [("synced", 17000), ("torn", 17010)])
def test_power_cuts_with_payloads_and_snapshots_lose_nothing_acknowledged(tmp_path, mode: str, base_port: int) -> None:
    r = run(tmp_path, base_port, mode, cuts=ONE_ALL_TWO, node_args=COMPACTING, n=PAYLOAD_N)
    print(f"{r.acked_pushes} acknowledged pushes; files the cuts rewrote or removed: {dict(r.cut_files)}")
    assert r.acked_pushes > 0
    assert r.cut_files["payload"] > 0 and r.cut_files["snapshot"] > 0, r.cut_files   # the cuts reached them
    assert_clean(r.result, r.line)


@pytest.mark.parametrize("unsafe, base_port", [("payload", 17020), ("snapshot", 17030)])
def test_without_payload_or_snapshot_fsync_the_same_cuts_lose_acknowledged_pushes(tmp_path, unsafe: str,
                                                                                 base_port: int) -> None:
    r = run_twin(tmp_path, base_port, unsafe, cuts=ONE_ALL_TWO, node_args=COMPACTING, n=PAYLOAD_N)
    assert r is None or r.result.acked_lost > 0 or not r.result.replicas_identical, r.line


def cut_after_receiving_a_snapshot(tmp_path, base_port: int, unsafe: str | None = None) -> tuple[int, Result, str]:
    """Node 3 is down while the others compact past its log, restarts and receives the leader's
    snapshot, and loses its power before it writes one of its own. Returns the snapshot index it
    received and the check."""
    env = {f"RAFTPS_UNSAFE_{unsafe.upper()}_NO_FSYNC": "1"} if unsafe else {}
    with Harness("received-snapshot" + (f"-no-{unsafe}-fsync" if unsafe else ""), str(tmp_path / "run"),
                 base_port=base_port, power_cuts=True, env=env, node_args=list(COMPACTING), n=PAYLOAD_N) as h:
        h.kill(3)
        h.load(3.0)
        for w in h.workloads:
            w.join()
        h.cluster.start_node(3)
        assert h.wait_caught_up(3) is not None, "node 3 did not catch up"
        received = h.status(3)["snapshot_index"]
        h.power_cut([3], "synced")
        h.cluster.start_node(3)
        result, line = h.finish()
    return received, result, line


def test_a_received_snapshot_survives_a_power_cut(tmp_path) -> None:
    """The follower's copy of the leader's snapshot is fsynced, renamed and its directory fsynced
    before pysyncobj clears its journal for it (it was not: journal_hook.install_durable_snapshots)."""
    received, result, line = cut_after_receiving_a_snapshot(tmp_path, 17040)
    assert received > 0, "node 3 caught up without a snapshot: nothing tested"
    assert_clean(result, line)


def test_a_received_snapshot_without_fsync_is_lost_to_the_cut(tmp_path) -> None:
    received, result, line = cut_after_receiving_a_snapshot(tmp_path, 17050, unsafe="snapshot")
    assert received > 0, "node 3 caught up without a snapshot: nothing tested"
    assert not result.replicas_identical, line


def test_nemesis_with_power_cuts() -> None:
    """The seeded nemesis with power cuts among its faults (seed 3: a follower killed, the leader's
    power cut twice, a pause, every node's power cut), on durable nodes, process faults only."""
    import subprocess
    import sys
    from raftps.chaos.nemesis import schedule
    assert {"powercut-leader", "powercut-all"} <= {s.fault for s in schedule(3, 30, False, power=True)}
    p = subprocess.run([sys.executable, "-m", "raftps.chaos", "--seconds", "30", "--seed", "3", "--no-netns",
                        "--power-cuts", "--base-port", "16700"], capture_output=True, text=True, timeout=240)
    print(p.stdout[-3000:], p.stderr[-3000:])
    line = next((l for l in p.stdout.splitlines() if l.startswith("case=nemesis")), "")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "acked_lost=0 duplicated=0" in line and line.endswith("replicas_identical=true"), line
