"""raftps status -o table|json and raftps top against a real 3-node cluster, as subprocesses."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

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


def run_cli(*args, env=None, timeout=60, stdin=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "raftps", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, input=stdin)


def one_line(done) -> str:
    """The one stderr line a refused command prints (no traceback, no usage block)."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_commands_against_a_down_cluster_say_so_in_one_line(tmp_path):
    """Nothing listens on these ports: every client command names the problem in one line."""
    down = {"RAFTPS_CLUSTER": f"127.0.0.1:{BASE + 91},127.0.0.1:{BASE + 92}", "RAFTPS_TOKEN": "t" * 32}
    status = run_cli("status", env=down)
    assert status.returncode == 1 and "no node answers" in one_line(status)
    assert f"127.0.0.1:{BASE + 91}" in one_line(status)
    top = run_cli("top", "--count", "1", env=down)
    assert top.returncode == 1 and "no node answers" in one_line(top)
    for args in (["tensors", "--timeout", "2"], ["member", "list", "--timeout", "2"],
                 ["move", "w", "--to", "1", "--timeout", "2"],
                 ["export", str(tmp_path / "m.npz"), "--prefix", "m", "--format", "npz", "--timeout", "2"],
                 ["snapshot", "save", str(tmp_path / "b.rps"), "--timeout", "2"]):
        done = run_cli(*args, env=down)
        assert done.returncode == 1 and "Unavailable" in one_line(done), (args, done.stderr)
    assert not (tmp_path / "m.npz").exists() and not (tmp_path / "b.rps").exists()


def test_wrong_arguments_and_files_are_one_line(tmp_path):
    env = {"RAFTPS_CLUSTER": f"127.0.0.1:{BASE + 91}"}
    cases = [
        (["status"], {"RAFTPS_CLUSTER": ""}, "no cluster addresses"),
        (["status"], {"RAFTPS_CLUSTER": "nowhere"}, "'nowhere'"),
        (["status", "--token-file", str(tmp_path / "missing")], env, str(tmp_path / "missing")),
        (["status"], {**env, "RAFTPS_TOKEN_FILE": str(tmp_path / "missing")}, str(tmp_path / "missing")),
        (["token-hash", "--token-file", str(tmp_path / "missing")], {}, str(tmp_path / "missing")),
        (["move", "w", "--to", "one"], env, "'one'"),
        (["snapshot", "restore", str(tmp_path / "missing.rps"), "--data-dir", str(tmp_path / "d")], {},
         "missing.rps"),
        (["cluster", "kill"], {}, "number of the node"),
        (["nosuchcommand"], {}, "nosuchcommand"),
        (["serve", "--id", "4", "--peers", "127.0.0.1:1,127.0.0.1:2", "--data-dir", str(tmp_path / "d")], {},
         "--id 4"),
    ]
    for args, extra, named in cases:
        done = run_cli(*args, env=extra)
        assert done.returncode == 2 and named in one_line(done), (args, done.stderr)
    assert not (tmp_path / "d").exists()


def test_cluster_commands_name_a_wrong_node_and_a_missing_cluster(tmp_path):
    run = ["--run-dir", str(tmp_path / "run"), "--base-port", str(BASE + 40)]
    status = run_cli("cluster", "status", *run)
    assert status.returncode == 1 and "no node" in one_line(status)
    kill = run_cli("cluster", "kill", "9", *run)
    assert kill.returncode == 2 and "node 9" in one_line(kill)
    stop = run_cli("cluster", "stop", *run)
    assert stop.returncode == 0 and "no node" in stop.stdout


def test_serve_names_a_port_in_use(tmp_path):
    """A node whose client port is taken exits at once with one line naming the address."""
    import socket
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", BASE + 60 + 100 + 1))        # node 1's client port (Raft port + 100)
        taken.listen()
        done = run_cli("serve", "--id", "1", "--peers", f"127.0.0.1:{BASE + 61}", "--data-dir",
                       str(tmp_path / "d"), "--secret-file", str(secret), "--metrics-port", "0", timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1 and f"127.0.0.1:{BASE + 161}" in one_line(done)


def test_a_failed_cluster_start_leaves_no_node_running(tmp_path):
    """Node 2 cannot bind its client port: start raises NodeExited naming it, and the nodes
    that start launched are stopped, by PID, before it returns."""
    import socket
    from raftps.tools.localcluster import LocalCluster, NodeExited
    cl = LocalCluster(str(tmp_path / "run"), nodes=3, base_port=BASE + 60)
    host, port = cl.addresses.split(",")[1].split(":")
    taken = socket.socket()
    try:
        taken.bind((host, int(port)))
        taken.listen()
        with pytest.raises(NodeExited, match=r"node\(s\) \[2\] exited during start"):
            cl.start(timeout=30.0)
        assert [n for n in (1, 2, 3) if cl.is_up(n)] == []
    finally:
        taken.close()
        cl.wipe()
