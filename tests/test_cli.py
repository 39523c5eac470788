"""raftps status -o table|json and raftps top against a real 3-node cluster, as subprocesses."""
import json
import os
import subprocess
import sys
import threading

import numpy as np

from tests.conftest import wait_converged

BASE = 24080
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raftps(cluster, *args, timeout=60):
    env = {**os.environ, **cluster.client_env, "PYTHONPATH": ROOT, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "raftps", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def parse_tables(text: str) -> list[list[dict]]:
    """rich's tables as printed to a pipe: one list of {column: cell} per table."""
    tables, header = [], None
    for line in text.splitlines():
        if "│" not in line and "┃" not in line:
            continue
        cells = [c.strip() for c in line.replace("┃", "│").strip("│ ").split("│")]
        if cells[0] == "node":
            header = cells
            tables.append([])
        elif header:
            tables[-1].append(dict(zip(header, cells)))
    return tables


def test_status_json_and_table(make_cluster):
    cl = make_cluster(BASE)
    with cl.client() as c:
        wait_converged(c, 3)
    done = raftps(cl, "status", "-o", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["node"] for r in rows] == [1, 2, 3] and sum(r["role"] == "leader" for r in rows) == 1
    assert len({r["digest"] for r in rows}) == 1 and all(len(r["digest"]) == 64 for r in rows)
    assert [r["metrics"] for r in rows] == [f"127.0.0.1:{BASE + 300 + i}" for i in (1, 2, 3)]
    table = raftps(cl, "status", "-o", "table")
    lines = table.stdout.splitlines()
    assert table.returncode == 0 and lines[0].split() == ["node", "pid", "address", "role", "term", "applied",
                                                          "version", "digest", "leader", "metrics"]
    assert len(lines) == 4 and f"127.0.0.1:{BASE + 301}" in lines[1]
    bad = raftps(cl, "status", "-o", "yaml")
    assert bad.returncode == 2 and "invalid choice: 'yaml'" in bad.stderr


def test_top_shows_rates_lag_and_staleness(make_cluster):
    cl = make_cluster(BASE + 10)
    stop = threading.Event()
    with cl.client() as c:
        c.create("t.w", np.zeros(64, np.float32), {"name": "sgd", "lr": 0.01})

    def pusher(seed):
        with cl.client() as c:
            base = c.push({"t.w": np.ones(64, np.float32)})
            for i in range(5000):
                if stop.is_set():
                    return
                base = c.push({"t.w": np.ones(64, np.float32)}, base_version=base if i % 2 else None) or base

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        done = raftps(cl, "top", "--count", "3", "--interval", "0.5")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert done.returncode == 0, done.stderr
    tables = parse_tables(done.stdout)
    assert len(tables) == 3 and all(len(t) == 3 for t in tables)
    first, last = tables[0], tables[-1]
    assert all(r["pushes/s"] == "-" for r in first)            # no window yet
    assert sorted(r["role"] for r in last) == ["follower", "follower", "leader"]
    for r in last:
        assert float(r["pushes/s"]) > 0 and float(r["applied/s"]) > 0
        assert int(r["lag"]) >= 0 and r["tau mean"] != "-" and float(r["tau max"]) >= 0
    leader = next(r for r in last if r["role"] == "leader")
    assert int(leader["lag"]) == 0 and int(leader["conns"]) >= 2

    follower = int(next(r["node"] for r in last if r["role"] == "follower"))
    cl.kill(follower)
    down = parse_tables(raftps(cl, "top", "--count", "1").stdout)[0]
    assert {int(r["node"]): r["role"] for r in down}[follower] == "down"
    bad = raftps(cl, "top", "--count", "0")
    assert bad.returncode == 2 and "--count must be >= 1" in bad.stderr
