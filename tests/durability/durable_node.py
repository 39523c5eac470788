"""One pysyncobj node on a DurableJournal, driven over stdin by tests/durability/test_durable_raft.py.

    python durable_node.py SELF PEER PEER JOURNAL_DIR FSYNC(0|1)

With RAFTPS_SIMDISK=<state dir> its files go through a SimulatedDisk (raftps/chaos/simdisk.py), so
the test can SIGKILL it and cut the power. Commands (one a line): ``load N TAG`` submits N pipelined
pushes ``TAG-i`` and prints ``ACK TAG-i`` for each one this node saw committed and applied;
``status`` prints ``STATUS {json}``; ``dump`` prints ``DUMP [values...]``.
"""

from __future__ import annotations

import json
import sys
import threading

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated

from raftps.raft.journal import DurableJournal
from raftps.raft.journal_hook import install_durable_journal
from raftps.chaos.simdisk import storage_from_env

_out = threading.Lock()


def say(line: str) -> None:
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Counter(SyncObj):
    def __init__(self, me: str, peers: list[str], conf: SyncObjConf):
        self.values: list[str] = []              # before SyncObj.__init__: the tick thread reads it
        self.lock = threading.Lock()
        super().__init__(me, peers, conf)

    @replicated
    def push(self, value: str) -> int:
        with self.lock:
            self.values.append(value)
            return len(self.values)


def main() -> None:
    me, peer1, peer2, journal_dir, fsync = sys.argv[1:6]
    journal = DurableJournal(journal_dir, storage=storage_from_env(), fsync=fsync == "1",
                             segment_size=64 << 10)
    conf = SyncObjConf(journalFile=None, appendEntriesUseBatch=False, raftMinTimeout=0.5,
                       raftMaxTimeout=1.0, connectionRetryTime=0.2, leaderFallbackTimeout=2.0,
                       logCompactionMinEntries=10 ** 9, logCompactionMinTime=10 ** 9,
                       dynamicMembershipChange=False)
    node = Counter(me, [peer1, peer2], conf)
    install_durable_journal(node, journal)
    say("READY")

    def acked(tag: str):
        def callback(result: object, error: int) -> None:
            if error == FAIL_REASON.SUCCESS:
                say(f"ACK {tag}")
        return callback

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "load":
            for i in range(int(words[1])):
                value = f"{words[2]}-{i}"
                node.push(value, callback=acked(value))
        elif words[0] == "status":
            say("STATUS " + json.dumps({"leader": node._isLeader(), "term": node.raftCurrentTerm,
                                        "commit": node.raftCommitIndex, "applied": node.raftLastApplied,
                                        "durable": journal.durable_index}))
        elif words[0] == "dump":
            with node.lock:
                say("DUMP " + json.dumps(node.values))


if __name__ == "__main__":
    main()
