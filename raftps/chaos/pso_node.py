"""A bare pysyncobj node (default settings) for reproducing pysyncobj bugs without raftps.

    python -m raftps.chaos.pso_node --self 10.77.0.1:7900 --partners 10.77.0.2:7900,10.77.0.3:7900 \
        --dir DIR --seconds 60 [--fix]

It holds a replicated counter with journal and dump files, writes 20 commands of 1 KiB a second
itself (sync, 2 s timeout, as a trainer would), and every 0.2 s writes its getStatus() to
DIR/status.json. It exits by itself after --seconds. --fix installs raftps.raft.pysyncobj_fixes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from pysyncobj import SyncObj, SyncObjConf, replicated


class Counter(SyncObj):
    def __init__(self, me: str, partners: list[str], directory: str) -> None:
        conf = SyncObjConf(journalFile=os.path.join(directory, "journal"),
                           fullDumpFile=os.path.join(directory, "dump"), dynamicMembershipChange=False)
        super().__init__(me, partners, conf)
        self.count = 0

    @replicated
    def add(self, payload: bytes) -> int:
        self.count += 1
        return self.count


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--self", required=True)
    p.add_argument("--partners", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--fix", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    node = Counter(args.self, args.partners.split(","), args.dir)
    if args.fix:
        from raftps.raft.pysyncobj_fixes import install
        install(node)
    end = time.monotonic() + args.seconds

    def writer() -> None:
        payload = os.urandom(1024)
        while time.monotonic() < end:
            try:
                node.add(payload, sync=True, timeout=2.0)
            except Exception:       # timeouts and leader changes are expected here
                pass
            time.sleep(0.05)
    threading.Thread(target=writer, daemon=True).start()
    path = os.path.join(args.dir, "status.json")
    while time.monotonic() < end:
        s = node.getStatus()
        status = {"state": s["state"], "term": s["raft_term"], "commit": s["commit_idx"],
                  "log_len": s["log_len"], "leader": str(s["leader"]) if s["leader"] else None,
                  "fix": args.fix}
        with open(path + ".tmp", "w") as f:
            json.dump(status, f)
        os.replace(path + ".tmp", path)
        time.sleep(0.2)
    node.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
