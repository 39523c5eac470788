"""raftps member add / replace / remove on a real cluster under load: nodes join, a SIGKILLed
leader is replaced, a live leader is removed, and every acknowledged push is applied exactly once."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from raftps import Client, InvalidRequest, Unavailable
from raftps.tools.localcluster import LocalCluster
from tests.conftest import start_cluster

BASE = 24100
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = ",".join(f"127.0.0.1:{BASE + 100 + i}" for i in range(1, 7))     # nodes 1-6, up or not


def member(cl, *args):
    done = subprocess.run([sys.executable, "-m", "raftps", "member", *args, "--cluster", ALL],
                          env={**os.environ, **cl.client_env, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout.splitlines()[-1].removeprefix("members: ").split(", ")


def converged(cl, nodes, timeout=60.0):
    """The status rows of ``nodes``: all up, one leader, same version and digest (bounded wait)."""
    deadline = time.monotonic() + timeout
    with Client(",".join(cl.client_address(n) for n in nodes), token=cl.token, timeout=5) as c:
        while time.monotonic() < deadline:
            rows = c.status()
            if all(r["role"] != "down" for r in rows) and len({(r["version"], r["digest"]) for r in rows}) == 1 \
                    and sum(r["role"] == "leader" for r in rows) == 1:
                return rows
            time.sleep(0.2)
    raise AssertionError(f"nodes {nodes} did not converge: {[(r['node'], r['role'], r.get('version')) for r in rows]}")


class Load:
    """Two clients pushing +1 to a float64 counter: acked pushes must all be there, once."""

    def __init__(self, cl):
        self.acked = self.unknown = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(cl,)) for _ in range(2)]
        for t in self.threads:
            t.start()

    def run(self, cl):
        try:
            with Client(ALL, token=cl.token, timeout=20) as c:
                for _ in range(100_000):
                    if self.stop.is_set():
                        return
                    try:
                        c.push({"ctr": -np.ones(1)})
                    except Unavailable:
                        with self.lock:
                            self.unknown += 1
                        continue
                    with self.lock:
                        self.acked += 1
        except BaseException as exc:
            self.errors.append(exc)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not self.errors, self.errors
        return self.acked, self.unknown


def wait_acked(load, more, timeout=60.0):
    start = load.acked
    deadline = time.monotonic() + timeout
    while load.acked < start + more and time.monotonic() < deadline and not load.errors:
        time.sleep(0.05)
    assert load.acked >= start + more, f"pushes stalled at {load.acked} (errors {load.errors})"


def test_add_replace_remove_under_load(tmp_path):
    cl = start_cluster(tmp_path / "run", BASE)
    try:
        with cl.client() as c:
            c.create("ctr", np.zeros(1), {"name": "sgd", "lr": 1.0})
            c.create("w", np.zeros(1 << 18, np.float32), {"name": "adam", "lr": 0.01})
            c.push({"w": np.ones(1 << 18, np.float32)})                    # a payload on the data plane
        load = Load(cl)
        wait_acked(load, 20)

        # 1. a fourth node joins while pushes go on, and catches up
        n4 = cl.add_node()
        assert member(cl, "add", cl.peers[n4 - 1]) == cl.peers[:4]
        cl.start_node(n4)
        wait_acked(load, 50)
        assert member(cl, "add", cl.peers[n4 - 1]) == cl.peers[:4]       # again: nothing to change

        # 2. the leader is SIGKILLed and replaced by a new node: the dead one goes first
        dead = cl.leader()
        cl.kill(dead)
        n5 = cl.add_node()
        members = member(cl, "replace", cl.peers[dead - 1], cl.peers[n5 - 1])
        assert sorted(members) == sorted(p for i, p in enumerate(cl.peers, 1) if i != dead)
        cl.start_node(n5)
        wait_acked(load, 50)

        # 3. the live leader is removed: it hands leadership over first; then it is stopped
        live = [n for n in range(1, 6) if n != dead]
        leader = next(r["node"] for r in converged_or_rows(cl, live) if r["role"] == "leader")
        members = member(cl, "remove", cl.peers[leader - 1])
        assert cl.peers[leader - 1] not in members and len(members) == 3
        cl.kill(leader, signal.SIGTERM)
        wait_acked(load, 50)
        acked, unknown = load.finish()

        final = [n for n in live if n != leader]
        rows = converged(cl, final)
        assert all(sorted(r["members"]) == sorted(members) for r in rows)
        with Client(",".join(cl.client_address(n) for n in final), token=cl.token, timeout=30) as c:
            total = int(c.pull(["ctr"])[0]["ctr"][0])
            assert acked <= total <= acked + unknown, (acked, unknown, total)
            # the new three-node cluster survives losing its leader
            cl.kill(next(r["node"] for r in rows if r["role"] == "leader"))
            assert c.push({"ctr": -np.ones(1)}) > rows[0]["version"]
    finally:
        cl.wipe()


def converged_or_rows(cl, nodes):
    with Client(",".join(cl.client_address(n) for n in nodes), token=cl.token, timeout=5) as c:
        for _ in range(100):
            rows = [r for r in c.status() if r["role"] != "down"]
            if any(r["role"] == "leader" for r in rows):
                return rows
            time.sleep(0.1)
    raise AssertionError("no leader")


def test_bad_member_requests(tmp_path):
    cl = start_cluster(tmp_path / "run", BASE + 50, nodes=1)
    try:
        env = {**os.environ, **cl.client_env, "PYTHONPATH": ROOT}
        for args, message in [(["add", "nohost"], "not 'nohost'"), (["add", "h:notaport"], "HOST:PORT"),
                              (["replace", "127.0.0.1:1", "127.0.0.1:1"], "with itself"),
                              (["add"], "add NODE"), (["list", "x:1"], "list |")]:
            done = subprocess.run([sys.executable, "-m", "raftps", "member", *args], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode in (1, 2) and message in done.stderr, (args, done.stderr)
        with cl.client() as c:
            assert c.members()["members"] == cl.peers
            with pytest.raises(InvalidRequest, match="the only member"):
                c.members("remove", cl.peers[0])
            assert c.members("remove", "127.0.0.1:1")["changed"] is False       # not a member: nothing to do
    finally:
        cl.wipe()
