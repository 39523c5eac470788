"""A move's new replica catches up as a non-voting learner before it is added (docs/design/elastic.md,
"Moving a replica"), on real processes: a (G = 2, N = 4) cluster, group 1 on nodes 2, 3, 4 holding
32 MiB, under the chaos workload on a tensor of group 1, and a fifth host that takes a replica.

Why this matters. Before learners, a move added its target as a voter first and then let it
copy the group's snapshot: for the whole copy the group had 4 voters, one of them empty, so a
commit needed 3 acknowledgements from the 3 old members. An old member lost during the copy left
2 of 4 voters answering, and no push to the group was acknowledged until the copy ended. With a
learner the group keeps its 3 voters during the copy: an old member lost then leaves 2 of 3, a
majority, and pushes go on being acknowledged. The voter is added only once the learner holds
(nearly) everything, and starts on the learner's files, so the 4-voter window is a short log delta.

- An old member (neither the source nor group 1's leader) is SIGKILLed while the record says the
  move is at stage "learn": pushes to group 1 are acknowledged with it down and the learner
  still the group's newest copy; group 1's membership is unchanged meanwhile. The driver is held
  (SIGSTOP) at stage learn for that check, so the window is not a race; once it goes on, the
  move completes (its Raft add commits with the source, the leader and the new voter: the dead
  member's vote is not needed), the dead member comes back, and the chaos checker finds every
  acknowledged push applied once, none twice, and group 1's three replicas identical.
- The learner's host is SIGKILLed mid-catch-up: the move is rolled back (``hosts abort``: no Raft
  change, since the learner changed no membership), group 1's membership never changed, and the
  host, restarted, sets the learner's files aside; the move run again then completes.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np

from raftps.chaos import checker
from raftps.chaos.history import OK, PUSH
from raftps.chaos.workload import Workload, settle
from raftps.client.transport import TcpTransport
from raftps import codec
from raftps.groups import group_of
from raftps.server.elastic import HostsAdmin
from raftps.tools.localcluster import LocalCluster
from tests.groups.test_elastic import hosts_cmd, until

BASE = 12000        # Raft 12001..12005 (+ 400 for group 1; clients + 100, data + 200, metrics + 300)
CRASH_BASE = 13000  # the second test's cluster, the same layout
GROUP = 1
BIG_MIB = 32
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def names_in_group(tag: str, count: int) -> list[str]:
    names = [f"{tag}{i}" for i in range(1000) if group_of(f"{tag}{i}", 2) == GROUP]
    return names[:count]


def started(tmp_path, base: int):
    """The cluster, group 1 filled with BIG_MIB MiB, the fifth host added and started with
    --join, and the chaos workload on a tensor of group 1: (cluster, new node, workload)."""
    # a snapshot every 100 entries: the learner copies group 1's snapshot (32 MiB in 1 MiB
    # chunks), not only its log
    cl = LocalCluster(str(tmp_path), nodes=4, base_port=base, groups=2, extra_args=["--compaction-entries", "100"])
    cl.start(timeout=120)
    big = names_in_group("big", 4)
    floats = (BIG_MIB << 20) // 4 // len(big)
    rng = np.random.default_rng(7)
    with cl.client(timeout=120) as c:
        for name in big:              # random bytes: the snapshot does not compress away
            c.create(name, rng.standard_normal(floats).astype(np.float32), optimizer={"name": "sgd", "lr": 1.0})
    new = cl.add_node()
    hosts_cmd(cl, "add", cl.peers[new - 1])
    cl.start_node(new, ("--join",))
    work = Workload(cl.addresses, token=cl.token, clients=2, rate=10.0, timeout=10.0,
                    name=names_in_group("ctr", 1)[0], raft_group=GROUP)
    work.create(timeout=60)
    work.start(seconds=600)
    until("group 1's leader has compacted its log", lambda: all(
        (group_row(cl, n) or {}).get("snapshot_index", 0) > 0 for n in (2, 3, 4)), timeout=120, period=0.5)
    return cl, new, work


def move_in_background(cl, source: int, target: int, timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "raftps", "hosts", "move", str(GROUP), cl.peers[source - 1],
                             cl.peers[target - 1], "--cluster", cl.addresses, "--timeout", str(timeout)],
                            env={**os.environ, **cl.client_env, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def record(cl):
    with HostsAdmin(cl.addresses, token=cl.token, tls=False, timeout=20) as admin:
        return admin.hosts()


def stage(cl) -> str | None:
    move = record(cl).move_of(GROUP)
    return None if move is None else move.stage


def status(cl, node: int) -> dict:
    transport = TcpTransport(cl.token, None, codec.DEFAULT_LIMITS, connect_timeout=2.0)
    try:
        return transport.call(cl.client_address(node), {"op": "status", "digest": False}, 10.0)
    finally:
        transport.close()


def group_row(cl, node: int, key: str = "groups") -> dict | None:
    """Node ``node``'s row of group 1 (``key`` "learners": its learner's), or None (also while
    the node does not answer: a joining node opens its client port with its first learner)."""
    try:
        reply = status(cl, node)
    except (OSError, ConnectionError):
        return None
    rows = reply.get(key, [reply] if key == "groups" else [])
    return next((r for r in rows if r.get("group", 0) == GROUP and r.get("role") != "down"), None)


def acked_pushes(work, since: float) -> int:
    return sum(1 for o in work.history.completed() if o.kind == PUSH and o.outcome == OK and o.start >= since)


def checked(cl, work, members: list[int]) -> list[dict]:
    """Stop the workload; the checker on group 1: nothing lost or doubled, its replicas identical."""
    work.stop()
    up = ",".join(cl.client_address(n) for n in members)
    final, statuses, _ = settle(up, 3, timeout=90, token=cl.token, name=work.name, raft_group=GROUP)
    assert final is not None
    result = checker.check(work.history, final, statuses, nodes=3)
    assert result.ok > 0 and result.acked_lost == 0 and result.duplicated == 0 and result.failed_applied == 0 \
        and result.replicas_identical, (result.line(work.name), result.problems)
    return statuses


def test_an_old_member_lost_during_the_learners_catch_up_does_not_stop_the_group(tmp_path):
    cl, new, work = started(tmp_path, BASE)
    driver = None
    try:
        leader = until("group 1 has a leader", lambda: cl.leader(GROUP), timeout=60)
        source, victim = [n for n in (2, 3, 4) if n != leader][:2]
        members = sorted(group_row(cl, leader)["members"])
        assert len(members) == 3
        driver = move_in_background(cl, source, new, timeout=180)
        until("the move is at stage learn", lambda: stage(cl) == "learn", timeout=60, period=0.05)
        os.kill(driver.pid, signal.SIGSTOP)                 # the record stays at learn while we look
        learner = until("node 5 runs a learner of group 1", lambda: group_row(cl, new, "learners"), timeout=60,
                        period=0.05)
        cl.kill(victim)
        killed = time.monotonic()
        goal = group_row(cl, leader)["commit"]
        print(f"learner at the kill: applied {learner['applied']} of {goal} ({learner['model_bytes']} bytes)")
        # with one of the three old members down, group 1 commits: 2 of its 3 voters
        until("20 pushes to group 1 acknowledged with an old member down", lambda: acked_pushes(work, killed) >= 20,
              timeout=60)
        assert stage(cl) == "learn"
        assert sorted(group_row(cl, leader)["members"]) == members         # the learner is no member
        learner = group_row(cl, new, "learners")
        assert learner is not None and learner["role"] == "learner" and learner["model_bytes"] >= BIG_MIB << 20
        os.kill(driver.pid, signal.SIGCONT)
        out, err = driver.communicate(timeout=240)
        assert driver.returncode == 0, (out, err)
        kept = sorted({leader, victim, new})
        assert f"group {GROUP}: nodes {','.join(map(str, kept))}" in out, out
        until("the source stops serving group 1", lambda: group_row(cl, source) is None, timeout=60)
        assert acked_pushes(work, killed) > 20
        cl.start_node(victim)
        statuses = checked(cl, work, kept)
        assert {s["node"] for s in statuses} == set(kept)
    finally:
        if driver is not None and driver.poll() is None:
            os.kill(driver.pid, signal.SIGCONT)
            driver.kill()
            driver.wait(30)
        work.stop()
        cl.wipe()


def test_a_learners_host_killed_mid_catch_up_rolls_the_move_back(tmp_path):
    cl, new, work = started(tmp_path, CRASH_BASE)
    driver = None
    try:
        leader = until("group 1 has a leader", lambda: cl.leader(GROUP), timeout=60)
        source = next(n for n in (2, 3, 4) if n != leader)
        members = {n: sorted(group_row(cl, n)["members"]) for n in (2, 3, 4)}
        driver = move_in_background(cl, source, new, timeout=15)
        until("node 5 runs a learner of group 1", lambda: group_row(cl, new, "learners"), timeout=60, period=0.02)
        cl.kill(new)
        killed = time.monotonic()
        out, err = driver.communicate(timeout=120)
        assert driver.returncode != 0 and "did not catch up" in err, (out, err)
        assert stage(cl) == "learn"
        assert {n: sorted(group_row(cl, n)["members"]) for n in (2, 3, 4)} == members
        until("10 pushes to group 1 acknowledged after the learner's host died", lambda: acked_pushes(work, killed) >= 10,
              timeout=60)
        out = hosts_cmd(cl, "abort", str(GROUP))
        assert "move rolled back" in out and f"group {GROUP}: nodes 2,3,4\n" in out, out
        assert {n: sorted(group_row(cl, n)["members"]) for n in (2, 3, 4)} == members   # no Raft change at all
        # the host comes back: it follows the record, which has no move, and sets the learner's
        # files aside (a later replica of group 1 there starts empty)
        cl.start_node(new, ("--join",))
        left = os.path.join(cl.data_dir(new), f"group{GROUP}")
        until("the learner's files are set aside", lambda: not os.path.exists(left) and any(
            f.startswith(f"group{GROUP}.left-e") for f in os.listdir(cl.data_dir(new))), timeout=60)
        # the move, run again, completes
        out = hosts_cmd(cl, "move", str(GROUP), cl.peers[source - 1], cl.peers[new - 1], timeout=180)
        kept = sorted(({2, 3, 4} - {source}) | {new})
        assert f"group {GROUP}: nodes {','.join(map(str, kept))}" in out, out
        statuses = checked(cl, work, kept)
        assert {s["node"] for s in statuses} == set(kept)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(30)
        work.stop()
        cl.wipe()
