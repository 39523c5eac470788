"""Power loss of a whole pysyncobj cluster on DurableJournals: no committed entry is lost.

Three node processes (tests/durability/durable_node.py) on 127.0.0.1:28100-28159, each on its own
SimulatedDisk (RAFTPS_SIMDISK). Under pipelined load every node is SIGKILLed, the power of each is
cut (raftps.chaos.simdisk.power_cut), the cluster restarts, and every push the leader reported
committed must be in the new leader's state exactly once. The same run with fsync=False must lose
acknowledged pushes (so the check can fail). Also, in one process, the two invariants the hook
exists for, checked on every message and every tick of a live cluster.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from pysyncobj import SyncObj, SyncObjConf, replicated

from raftps.raft.journal import DurableJournal
from raftps.raft.journal_hook import install_durable_journal
from raftps.chaos.simdisk import SIMDISK_ENV, SimulatedDisk, power_cut

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Node:
    def __init__(self, addrs: list[str], i: int, base: str, fsync: bool):
        self.addr = addrs[i]
        self.state = os.path.join(base, f"sim{i}")
        env = dict(os.environ, PYTHONPATH=ROOT, **{SIMDISK_ENV: self.state})
        others = [a for a in addrs if a != self.addr]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "durable_node.py"), self.addr, *others,
             os.path.join(base, f"journal{i}"), "1" if fsync else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        self.acks: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        assert self.expect("READY", 20) == "READY"

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("ACK "):
                self.acks.append(line[4:])
            else:
                self.lines.put(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line

    def status(self) -> dict:
        self.send("status")
        return json.loads(self.expect("STATUS ")[7:])

    def dump(self) -> list[str]:
        self.send("dump")
        return json.loads(self.expect("DUMP ")[5:])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def leader(nodes: list[Node], timeout: float = 30.0) -> Node:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            if node.status()["leader"]:
                return node
        time.sleep(0.2)
    raise AssertionError("no leader elected")


def wait_acks(node: Node, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(node.acks) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(node.acks) >= count, f"only {len(node.acks)} of {count} pushes acknowledged"


def run_power_loss(base: str, port: int, fsync: bool, mode: str,
                   victims: str | list[str] = "all") -> tuple[list[str], list[str]]:
    """Per round (``victims``: "all" or "leader+1"): load, SIGKILL those nodes mid-load, cut their
    power, restart them. Returns (acknowledged in every round, the final leader's state), after
    checking every replica matches that state."""
    addrs = [f"127.0.0.1:{port + i}" for i in range(3)]
    nodes = [Node(addrs, i, base, fsync) for i in range(3)]
    acked: list[str] = []
    try:
        for round_, who in enumerate([victims] if isinstance(victims, str) else victims):
            first = leader(nodes)
            before = len(first.acks)
            first.send(f"load 3000 r{round_}")
            wait_acks(first, before + 300, 60)   # mid-load: entries in flight on every node
            lead = nodes.index(first)
            dead = range(3) if who == "all" else [lead, (lead + 1) % 3]
            for i in dead:
                nodes[i].kill()
            acked += first.acks
            for i in dead:
                power_cut(nodes[i].state, mode, seed=100 * round_ + i)
                nodes[i] = Node(addrs, i, base, fsync)
            for node in nodes:                   # a surviving leader's acks are counted once
                if node is not first:
                    acked += node.acks
                    node.acks.clear()
        second = leader(nodes)
        second.send("load 1 final")              # commits (and applies) everything before it
        wait_acks(second, 1, 30)
        state = second.dump()
        commit = second.status()["commit"]
        deadline = time.monotonic() + 30
        while min(n.status()["applied"] for n in nodes) < commit and time.monotonic() < deadline:
            time.sleep(0.1)
        for node in nodes:
            assert node.dump()[:len(state)] == state, "replicas differ"
        return sorted(set(acked) - {"final-0"}), state
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()


@pytest.mark.parametrize("mode,victims,port", [
    ("synced", "all", 28100), ("torn", "all", 28110), ("torn", "leader+1", 28160),
    ("torn", ["all", "leader+1", "all"], 28190)])
def test_durable_cluster_keeps_every_committed_push(tmp_path, mode, victims, port):
    acked, present = run_power_loss(str(tmp_path), port, fsync=True, mode=mode, victims=victims)
    assert len(acked) >= 300 * (1 if isinstance(victims, str) else len(victims))
    missing = sorted(set(acked) - set(present))
    assert not missing, f"{len(missing)} acknowledged pushes lost, e.g. {missing[:5]}"
    duplicated = sorted(v for v in set(present) if present.count(v) > 1)
    assert not duplicated, f"applied twice: {duplicated[:5]}"


def test_non_durable_cluster_loses_acknowledged_pushes(tmp_path):
    acked, present = run_power_loss(str(tmp_path), 28120, fsync=False, mode="synced")
    lost = set(acked) - set(present)
    assert len(acked) >= 300 and lost, "fsync=False survived a power cut: the check cannot fail"


# ---- the invariants of journal_hook, in one process ----------------------------------------------

class Box(SyncObj):
    def __init__(self, me: str, peers: list[str], conf: SyncObjConf):
        self.n = 0
        super().__init__(me, peers, conf)

    @replicated
    def inc(self) -> int:
        self.n += 1
        return self.n


def raftps_fixes():
    try:                                         # where the lead is moving it
        from raftps.raft.pysyncobj_fixes import install
    except ImportError:
        from raftps.pysyncobj_fixes import install
    return install


@pytest.mark.parametrize("batch,fixes,port", [(False, False, 28130), (True, False, 28180),
                                              (False, True, 28185)])
def test_hook_acks_and_commits_only_durable_entries(tmp_path, batch, fixes, port):
    """(a) no follower acknowledges an index above its durable index; (b) a leader's commit index
    never exceeds its own durable index; checked on every ack sent and after every tick, with
    entries sent at once (raftps) and in pysyncobj's default batches, and with raftps's own
    pysyncobj fixes installed too (they wrap the same transport)."""
    addrs = [f"127.0.0.1:{port + i}" for i in range(3)]
    violations: list[str] = []
    checks = [0, 0]
    boxes, journals = [], []
    for i, addr in enumerate(addrs):
        journal = DurableJournal(str(tmp_path / f"j{i}"), storage=SimulatedDisk(str(tmp_path / f"s{i}")))
        conf = SyncObjConf(journalFile=None, appendEntriesUseBatch=batch, raftMinTimeout=0.5,
                           raftMaxTimeout=1.0, connectionRetryTime=0.2)
        box = Box(addr, [a for a in addrs if a != addr], conf)
        install_durable_journal(box, journal)
        if fixes:
            raftps_fixes()(box)
        transport = box._SyncObj__transport
        send = transport.send

        def observed_send(peer, message, journal=journal, send=send):
            if isinstance(message, dict) and message.get("type") == "next_node_idx" and message["success"]:
                checks[0] += 1
                acked = message["next_node_idx"] - 1
                if acked > journal.durable_index:
                    violations.append(f"ack of {acked} > durable {journal.durable_index}")
            return send(peer, message)

        def after_tick(box=box, journal=journal):
            if box._isLeader():
                checks[1] += 1
                if box.raftCommitIndex > journal.durable_index:
                    violations.append(f"commit {box.raftCommitIndex} > durable {journal.durable_index}")

        transport.send = observed_send
        box.addOnTickCallback(after_tick)
        boxes.append(box)
        journals.append(journal)
    try:
        commit_on_leader(boxes, 500)
        deadline = time.monotonic() + 10        # a loaded machine may commit all 500 in fewer ticks
        while checks[1] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checks[0] >= 2 and checks[1] >= 3, checks           # acks sent, leader ticks checked
        assert not violations, violations[:5]
        fsyncs = sum(j.fsync_count for j in journals)
        assert fsyncs < 3 * 500, f"{fsyncs} fsyncs for 500 entries on 3 nodes: no group commit"
    finally:
        for box in boxes:
            box.destroy()


def test_leader_syncs_its_appends_before_it_waits_for_replies(tmp_path):
    """The leader sends entries as it appends them (appendEntriesUseBatch=False); its fsync must
    run before poll() waits for the followers' replies, not after the first one arrives (the two
    fsyncs side by side, Raft dissertation 10.2.1): whenever a leader enters poll(), its journal
    has nothing left to sync."""
    addrs = [f"127.0.0.1:{16000 + i}" for i in range(3)]
    late: list[int] = []
    polls = [0]
    boxes = []
    for i, addr in enumerate(addrs):
        journal = DurableJournal(str(tmp_path / f"j{i}"), storage=SimulatedDisk(str(tmp_path / f"s{i}")))
        conf = SyncObjConf(journalFile=None, appendEntriesUseBatch=False, raftMinTimeout=0.5,
                           raftMaxTimeout=1.0, connectionRetryTime=0.2)
        box = Box(addr, [a for a in addrs if a != addr], conf)
        poll = box._poller.poll

        def observed_poll(timeout, box=box, journal=journal, poll=poll):
            if box._isLeader():
                polls[0] += 1
                if journal.pending:
                    late.append(len(journal))
            poll(timeout)

        box._poller.poll = observed_poll             # the hook's sync runs before this
        install_durable_journal(box, journal)
        boxes.append(box)
    try:
        commit_on_leader(boxes, 200)
        assert polls[0] > 0
        assert not late, f"the leader waited for replies with {len(late)} unsynced logs (lengths {late[:5]})"
    finally:
        for box in boxes:
            box.destroy()


def test_hook_one_node_commits_only_durable_entries(tmp_path):
    """(b) where it is tightest: a node alone elects itself and counts its own log at once,
    in the same tick as its term's no-op is appended."""
    journal = DurableJournal(str(tmp_path / "j"), storage=SimulatedDisk(str(tmp_path / "s")))
    conf = SyncObjConf(journalFile=None, raftMinTimeout=0.4, raftMaxTimeout=0.5)
    box = Box("127.0.0.1:28140", [], conf)
    install_durable_journal(box, journal)
    violations: list[str] = []
    ticks = [0]

    def after_tick():
        ticks[0] += 1
        if box.raftCommitIndex > journal.durable_index:
            violations.append(f"commit {box.raftCommitIndex} > durable {journal.durable_index}")

    box.addOnTickCallback(after_tick)
    try:
        assert box.inc(sync=True, timeout=10) == 1
        for n in range(2, 30):
            assert box.inc(sync=True, timeout=10) == n
        assert ticks[0] > 10 and not violations, (ticks, violations[:5])
    finally:
        box.destroy()


class Snapshotted(SyncObj):
    """``n`` is assigned after SyncObj.__init__, so pysyncobj's default serializer snapshots it."""

    def __init__(self, me: str, journal: DurableJournal, conf: SyncObjConf):
        super().__init__(me, [], conf)
        install_durable_journal(self, journal)
        self.n = 0

    @replicated
    def inc(self) -> int:
        self.n += 1
        return self.n


def test_restart_with_log_below_the_snapshot_keeps_the_entries_after_it(tmp_path):
    """If a journal still holds entries below the snapshot (compaction's ``start`` write lost),
    pysyncobj's __loadDumpFile would clear it (its first entries are not the snapshot's) and lose
    every entry after the snapshot; the hook drops only the prefix."""
    dump, jdir, old = str(tmp_path / "dump"), str(tmp_path / "j"), str(tmp_path / "old")
    conf = lambda: SyncObjConf(journalFile=None, fullDumpFile=dump, useFork=False,  # noqa: E731
                               raftMinTimeout=0.4, raftMaxTimeout=0.5,
                               logCompactionMinEntries=10 ** 9, logCompactionMinTime=10 ** 9)
    box = Snapshotted("127.0.0.1:28150", DurableJournal(jdir), conf())
    try:
        for n in range(1, 41):
            assert box.inc(sync=True, timeout=10) == n
        box._SyncObj__raftLog.sync()
        shutil.copytree(jdir, old)                   # the log before compaction: entries 1..~42
        box.forceLogCompaction()
        deadline = time.monotonic() + 10
        while len(box._SyncObj__raftLog) > 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(box._SyncObj__raftLog) <= 5, "no compaction"
        for n in range(41, 61):
            assert box.inc(sync=True, timeout=10) == n
    finally:
        box.destroy_synchronous()
    # The old, uncompacted log, continued with what was appended after the snapshot.
    after = DurableJournal(jdir)
    stale = DurableJournal(old)
    for entry in after[:]:
        if entry[1] > stale[-1][1]:
            stale.add(*entry)
    stale._destroy()
    after._destroy()
    shutil.rmtree(jdir)
    os.rename(old, jdir)
    box = Snapshotted("127.0.0.1:28151", DurableJournal(jdir), conf())
    try:
        assert box.inc(sync=True, timeout=10) == 61
    finally:
        box.destroy()


def test_install_refuses_a_file_journal_and_a_late_call(tmp_path):
    conf = SyncObjConf(journalFile=str(tmp_path / "file.journal"), autoTick=False)
    box = Box("127.0.0.1:28195", [], conf)
    try:
        with pytest.raises(RuntimeError, match="journalFile=None"):
            install_durable_journal(box, DurableJournal(str(tmp_path / "a")))
    finally:
        box.destroy()
    box = Box("127.0.0.1:28196", [], SyncObjConf(journalFile=None, autoTick=False))
    try:
        box.doTick(0.0)
        with pytest.raises(RuntimeError, match="ticked already"):
            install_durable_journal(box, DurableJournal(str(tmp_path / "b")))
    finally:
        box.destroy()


def commit_on_leader(boxes: list, n: int) -> None:
    """Once one of ``boxes`` leads (bounded wait), propose ``n`` increments there; all must commit."""
    deadline = time.monotonic() + 30
    while not any(b._isLeader() for b in boxes) and time.monotonic() < deadline:
        time.sleep(0.05)
    lead = next(b for b in boxes if b._isLeader())
    done = threading.Event()
    results = []

    def callback(result, error):
        results.append(error)
        if len(results) == n:
            done.set()

    for _ in range(n):
        lead.inc(callback=callback)
    assert done.wait(60), f"{len(results)} of {n} committed"
