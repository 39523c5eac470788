"""Appends/s of the Raft journal: fsync per entry, group commit, no fsync, and pysyncobj's FileJournal.

    python -m bench.journal [--dir /work/tmp-bench] [--size 1024] [--seconds 3] [--groups 16,64]
                            [--cluster 5000 --port 28900]

Every mode appends ``--size``-byte entries to a fresh journal in ``--dir`` (a real disk: not tmpfs,
or fsync costs nothing) for ``--seconds``, then reports entries/s, MB/s and the fsyncs it made.
``group N`` is DurableJournal.sync() after every N appends: what one tick of a busy node does.
pysyncobj's FileJournal never fsyncs; ``+ flush`` adds its own mmap flush (msync) per entry.
With ``--cluster N``, also N pipelined entries through 3 pysyncobj nodes in this process (one GIL:
compare the rows, not with a real cluster) on DurableJournal with and without fsync (through
``install_durable_journal``, one fsync per node per tick) and on FileJournal; "per fsync" there is
entries x 3 nodes / fsyncs. Stock pysyncobj, without raftps's fixes: its success replies rewind
the leader's nextIndex below batches in flight (raftps/pysyncobj_fixes.py, keep_next_index), which
the acknowledgements held until the tick's fsync make more frequent ("truncating already-applied
log entries" in the log).
Prints the filesystem the directory is on, a table, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable

from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.journal import FileJournal

from raftps.raft.journal import DurableJournal
from raftps.raft.journal_hook import install_durable_journal


def filesystem(path: str) -> str:
    """The mount point, device and type ``path`` lives on (from /proc/mounts)."""
    path = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[1]):
                    best = (device, mount, fstype)
    except OSError:
        pass
    return f"{best[2]} ({best[0]} on {best[1]})"


Maker = Callable[[str], tuple[Callable[[bytes, int], None], Callable[[], int], Callable[[], None]]]


def run(name: str, make: Maker, base: str, size: int, seconds: float) -> dict:
    """Append for ``seconds`` through ``make(path)``'s (add, fsync count, close)."""
    path = os.path.join(base, name.replace(" ", "_"))
    add, fsyncs, close = make(path)
    payload = os.urandom(size)
    idx = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(16):                     # check the clock every 16 appends, not each one
            idx += 1
            add(payload, idx)
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    count = fsyncs()
    close()
    shutil.rmtree(path, ignore_errors=True)
    return {"mode": name, "entries": idx, "seconds": round(elapsed, 3), "per_s": round(idx / elapsed),
            "mb_s": round(idx * size / elapsed / 1e6, 2), "fsyncs": count,
            "entries_per_fsync": round(idx / count, 1) if count else None}


def durable(group: int | None, fsync: bool = True):
    def make(path: str):
        j = DurableJournal(path, fsync=fsync)
        base = j.fsync_count

        def add(payload: bytes, idx: int) -> None:
            j.add(payload, idx, 1)
            if group and idx % group == 0:
                j.sync()
        return add, lambda: j.fsync_count - base, j._destroy
    return make


def file_journal(flush: bool):
    def make(path: str):
        os.makedirs(path, exist_ok=True)
        j = FileJournal(os.path.join(path, "journal"))
        flushes = [0]

        def add(payload: bytes, idx: int) -> None:
            j.add(payload, idx, 1)
            if flush:
                j.flush()
                flushes[0] += 1
        return add, lambda: flushes[0], j._destroy
    return make


class _Sink(SyncObj):
    def __init__(self, me: str, peers: list[str], conf: SyncObjConf):
        self.count = 0
        super().__init__(me, peers, conf)

    @replicated
    def put(self, blob: bytes) -> int:
        self.count += 1
        return self.count


def cluster(journal: str, base: str, port: int, size: int, entries: int) -> dict:
    """3 SyncObjs in this process on 127.0.0.1:port..port+2; ``entries`` pipelined puts to the
    leader; entries/s until the last is committed, and the fsyncs per entry of all three nodes.
    ``journal``: "fsync" or "no fsync" (DurableJournal), or "FileJournal" (pysyncobj's)."""
    addrs = [f"127.0.0.1:{port + i}" for i in range(3)]
    nodes, journals = [], []
    for i, addr in enumerate(addrs):
        path = os.path.join(base, f"c{port}-{i}")
        conf = SyncObjConf(journalFile=os.path.join(base, f"c{port}-{i}.journal") if journal == "FileJournal"
                           else None, appendEntriesUseBatch=False, raftMinTimeout=1.0, raftMaxTimeout=2.0,
                           appendEntriesBatchSizeBytes=1 << 20)
        node = _Sink(addr, [a for a in addrs if a != addr], conf)
        if journal != "FileJournal":
            j = DurableJournal(path, fsync=journal == "fsync")
            install_durable_journal(node, j)
            journals.append(j)
        nodes.append(node)
    try:
        deadline = time.monotonic() + 30
        while not any(n._isLeader() for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("no leader")
            time.sleep(0.05)
        lead = next(n for n in nodes if n._isLeader())
        lead.put(b"warm", sync=True, timeout=30)
        before = sum(j.fsync_count for j in journals)
        done = threading.Event()
        results: list[int] = []

        def callback(result: object, error: int) -> None:
            results.append(error)
            if len(results) == entries:
                done.set()

        payload = os.urandom(size)
        start = time.perf_counter()
        for _ in range(entries):
            lead.put(payload, callback=callback)
        if not done.wait(300):
            raise RuntimeError(f"{len(results)} of {entries} committed")
        elapsed = time.perf_counter() - start
        fsyncs = sum(j.fsync_count for j in journals) - before
        return {"mode": f"cluster, {journal}", "entries": entries, "seconds": round(elapsed, 3),
                "per_s": round(entries / elapsed), "mb_s": round(entries * size / elapsed / 1e6, 2),
                "fsyncs": fsyncs, "entries_per_fsync": round(3 * entries / fsyncs, 1) if fsyncs else None}
    finally:
        for node in nodes:
            node.destroy_synchronous()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/work/tmp-bench-journal", help="a directory on the disk to measure")
    ap.add_argument("--size", type=int, default=1024, help="entry size in bytes")
    ap.add_argument("--seconds", type=float, default=3.0, help="per mode")
    ap.add_argument("--groups", default="16,64", help="group-commit sizes")
    ap.add_argument("--cluster", type=int, default=0, metavar="N",
                    help="also N pipelined entries through 3 in-process pysyncobj nodes per journal")
    ap.add_argument("--port", type=int, default=28900, help="first of the cluster ports (3 per mode)")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-", dir=args.dir)
    modes = [("fsync per entry", durable(1))]
    modes += [(f"group {g}", durable(int(g))) for g in args.groups.split(",")]
    modes += [("no fsync", durable(None, fsync=False)),
              ("pysyncobj FileJournal", file_journal(False)),
              ("FileJournal + flush", file_journal(True))]
    print(f"# {args.size} B entries, {args.seconds} s per mode, in {base}: {filesystem(base)}")
    print(f"{'mode':<24}{'entries':>9}{'appends/s':>12}{'MB/s':>9}{'fsyncs':>9}{'per fsync':>11}")
    rows = []
    try:
        for name, make in modes:
            row = run(name, make, base, args.size, args.seconds)
            rows.append(row)
            print(f"{name:<24}{row['entries']:>9}{row['per_s']:>12}{row['mb_s']:>9}{row['fsyncs']:>9}"
                  f"{row['entries_per_fsync'] if row['entries_per_fsync'] else '-':>11}")
            sys.stdout.flush()
        for k, journal in enumerate(["fsync", "no fsync", "FileJournal"] if args.cluster else []):
            row = cluster(journal, base, args.port + 3 * k, args.size, args.cluster)
            rows.append(row)
            print(f"{row['mode']:<24}{row['entries']:>9}{row['per_s']:>12}{row['mb_s']:>9}{row['fsyncs']:>9}"
                  f"{row['entries_per_fsync'] if row['entries_per_fsync'] else '-':>11}")
            sys.stdout.flush()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"size": args.size, "filesystem": filesystem(args.dir), "rows": rows}))


if __name__ == "__main__":
    main()
