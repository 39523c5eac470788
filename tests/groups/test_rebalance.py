"""The placement loop balances a (G = 6, N = 5) cluster by itself (docs/design/elastic.md), on
real processes under a steady push load of the chaos workload, one tensor per Raft group:

- a sixth host is added (``raftps cluster add-host``, then ``serve --join``): the loop moves
  replicas onto it until every node serves 3, and names leaders until every node leads one,
  and the groups' leaders follow;
- the sixth host is drained (``raftps cluster drain-host``) while group 0's leader, which runs
  the loop, is SIGKILLed mid-move and restarted, and then the host receiving the next replica
  is SIGKILLed during its catch-up: each move finishes or is rolled back, and no group is ever
  without a majority of its configured voters.

After each, the chaos checker (raftps/chaos/checker.py) finds every acknowledged push applied
exactly once and each group's replicas identical. One cluster for the file."""
import os
import subprocess
import sys
import threading
import time

import pytest

from raftps.chaos import checker
from raftps.chaos.workload import Workload, settle
from raftps.groups import group_of
from raftps.server.elastic import HostsAdmin
from raftps.tools.localcluster import LocalCluster

BASE = 33000        # Raft 33001..33006 (+ 400 per group up to group 5; clients + 100, data + 200, metrics + 300)
GROUPS, NODES = 6, 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tensor_per_group(tag: str) -> dict[int, str]:
    """A tensor name for each Raft group (names hash to groups, groups.group_of)."""
    names: dict[int, str] = {}
    for i in range(1000):
        names.setdefault(group_of(f"{tag}{i}", GROUPS), f"{tag}{i}")
    assert len(names) == GROUPS
    return names


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    cl = LocalCluster(str(tmp_path_factory.mktemp("rebalance")), nodes=NODES, base_port=BASE, groups=GROUPS,
                      extra_args=["--balance", "--dead-host-timeout", "4"])
    try:
        cl.start(timeout=120)
        yield cl
    finally:
        cl.wipe()


def cluster_cmd(cl, *args):
    done = subprocess.run([sys.executable, "-m", "raftps", "cluster", *args],
                          env={**os.environ, **cl.client_env, "RAFTPS_CLUSTER": cl.addresses, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


class Load:
    """One chaos workload per Raft group (one client each, 5 ops/s)."""

    def __init__(self, cl, tag):
        self.cl = cl
        self.work = {g: Workload(cl.addresses, token=cl.token, clients=1, rate=5.0, timeout=10.0, name=name,
                                 raft_group=g)
                     for g, name in tensor_per_group(tag).items()}
        for w in self.work.values():
            w.create(timeout=60)
            w.start(seconds=240)

    def check(self):
        """Stop the clients, then the checker per tensor: nothing lost or doubled, replicas agree."""
        for w in self.work.values():
            w.stop()
        lines = []
        for w in self.work.values():
            final, statuses, _ = settle(self.cl.addresses, 3, timeout=60, token=self.cl.token, name=w.name,
                                        raft_group=w.raft_group)
            assert final is not None, w.name
            result = checker.check(w.history, final, statuses, nodes=3)
            lines.append(result.line(w.name))
            assert result.ok > 0 and result.acked_lost == 0 and result.duplicated == 0 \
                and result.failed_applied == 0 and result.replicas_identical, (result.line(w.name), result.problems)
        return lines


def placement(cl):
    with HostsAdmin(cl.addresses, token=cl.token, tls=False, timeout=30) as admin:
        record = admin.hosts()
        return record, admin.status_rows(record, timeout=2.0)


def until(what, check, timeout, seen=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout} s: {what} (last seen: {seen})")


def test_an_added_host_takes_its_share_of_replicas_and_leaders(cl):
    load = Load(cl, "add")
    time.sleep(2)
    new = cl.add_node()
    address = cl.peers[new - 1]
    assert f"as node {new}" in cluster_cmd(cl, "add-host", address, "--no-wait")
    cl.start_node(new, ("--join",))
    started = time.monotonic()

    seen = []

    def balanced():
        record, rows = placement(cl)
        serving = {n: len(record.hosted_by(n)) for n in range(1, new + 1)}
        leading = {n: sum(r["role"] == "leader" for r in rows.get(n, [])) for n in range(1, new + 1)}
        seen[:] = [record, serving, leading]
        ok = not record.moves and set(serving.values()) == {3} and max(leading.values()) - min(leading.values()) <= 1
        return (serving, leading) if ok else None
    serving, leading = until("every node serves 3 replicas and leads 1 +- 1", balanced, timeout=150, seen=seen)
    print(f"rebalanced in {time.monotonic() - started:.1f} s: replicas {serving}, leaders {leading}")
    assert leading[new] >= 1
    for line in load.check():
        print(line)
