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
import urllib.request

import pytest

from raftps.chaos import checker
from raftps.chaos.workload import Workload, settle
from raftps.groups import group_of
from raftps.server.elastic import HostsAdmin
from raftps.tools.localcluster import LocalCluster
from tests.groups.test_elastic import until

BASE = 22540       # Raft 22541..22546 (+ 400 per group up to group 5; clients + 100, data + 200, metrics + 300),
                    # below the ephemeral ports (32768 and up), which a node cannot always bind
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


def cluster_cmd(cl, *args, ok=True, command="cluster"):
    done = subprocess.run([sys.executable, "-m", "raftps", command, *args],
                          env={**os.environ, **cl.client_env, "RAFTPS_CLUSTER": cl.addresses, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=200)
    assert (done.returncode == 0) == ok, (args, done.stdout, done.stderr)
    return done.stdout if ok else done.stderr


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
        up = ",".join(self.cl.client_address(n) for n in range(1, self.cl.nodes + 1) if self.cl.is_up(n))
        for w in self.work.values():
            final, statuses, _ = settle(up, 3, timeout=60, token=self.cl.token, name=w.name,
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


def test_an_added_host_takes_its_share_of_replicas_and_leaders(cl):
    load = Load(cl, "add")
    time.sleep(2)
    new = cl.add_node()
    address = cl.peers[new - 1]
    assert f"as node {new}" in cluster_cmd(cl, "add-host", address, "--no-wait")
    cl.start_node(new, ("--join",))
    started = time.monotonic()

    def balanced():
        record, rows = placement(cl)
        serving = {n: len(record.hosted_by(n)) for n in range(1, new + 1)}
        leading = {n: sum(r["role"] == "leader" for r in rows.get(n, [])) for n in range(1, new + 1)}
        ok = not record.moves and set(serving.values()) == {3} and max(leading.values()) - min(leading.values()) <= 1
        return (serving, leading) if ok else None
    serving, leading = until("every node serves 3 replicas and leads 1 +- 1", balanced, timeout=150)
    print(f"rebalanced in {time.monotonic() - started:.1f} s: replicas {serving}, leaders {leading}")
    assert leading[new] >= 1
    # the loop counted its steps where it ran (group 0's leader): 3 replicas moved, 2 leaders named
    changes, replicas_seen = {}, {}
    for n in range(1, new + 1):
        with urllib.request.urlopen(f"http://127.0.0.1:{BASE + n + 300}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("raftps_placement_changes_total{"):
                    kind = line.split('"')[1]
                    changes[kind] = changes.get(kind, 0) + float(line.split()[-1])
                if line.startswith("raftps_host_load{") and 'kind="replicas"' in line:
                    replicas_seen.setdefault(n, {})[line.split('node="')[1].split('"')[0]] = float(line.split()[-1])
    # (a move interrupted by an error is finished by a later turn, counted as "resume")
    assert set(changes) <= {"balance", "resume", "lead"} and changes.get("balance", 0) + changes.get("resume", 0) == 3 \
        and changes["lead"] == 2, changes
    # the hosts' heartbeat, as the loop's node (group 0's leader, the only one with figures) saw it
    assert list(replicas_seen) == [cl.leader(0)], replicas_seen
    assert until("the heartbeat says 3 replicas each", lambda: all(
        f'raftps_host_load{{kind="replicas",node="{n}"}} 3.0' in urllib.request.urlopen(
            f"http://127.0.0.1:{BASE + cl.leader(0) + 300}/metrics", timeout=10).read().decode()
        for n in range(1, new + 1)), timeout=10)
    status = subprocess.run([sys.executable, "-m", "raftps", "status", "--cluster", cl.addresses],
                            env={**os.environ, **cl.client_env, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                            timeout=60).stdout
    assert "placement: balanced" in status and "6: 3 replicas, 1 leading" in status, status
    for line in load.check():
        print(line)


class MajorityWatch:
    """Samples every Raft group once a second: the voters its members' rows name (a leader's
    view first), and how many of them answer. A group below a majority of its configured voters
    is a violation."""

    def __init__(self, cl):
        self.cl, self.samples, self.violations = cl, 0, []
        self.stop = threading.Event()
        # a daemon: a failed assertion before finish() must not hold pytest at exit for its 10 minutes
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        for _ in range(600):                          # bounded: at most 10 minutes
            if self.stop.wait(1.0):
                return
            try:
                record, rows = placement(self.cl)
            except Exception:                         # group 0 electing: no sample this second
                continue
            self.samples += 1
            for g in range(record.groups):
                grows = [r for node_rows in rows.values() for r in node_rows if r.get("group", 0) == g]
                if not grows:
                    self.violations.append((g, "no replica answers"))
                    continue
                # the voters as the group's leader sees them (else the longest list a member has)
                voters = max((r["members"] for r in grows),
                             key=lambda m: (any(r["role"] == "leader" and r["members"] == m for r in grows), len(m)))
                answering = {record.raft_address(r["node"], g) for r in grows}
                if len(set(voters) & answering) < len(voters) // 2 + 1:
                    self.violations.append((g, voters, sorted(answering)))

    def finish(self):
        self.stop.set()
        self.thread.join(30)
        return self.samples, self.violations


def test_bad_commands_change_nothing(cl):
    """One clear line each, and the record keeps its epoch."""
    epoch = placement(cl)[0].epoch
    for args, message in [(("add-host", cl.peers[0]), "already host 1"),
                          (("drain-host", "127.0.0.1:1"), "not a host of this cluster"),
                          (("drain-host", cl.peers[0]), "serves Raft group 0"),
                          (("member", "replace", cl.peers[3], cl.peers[1]), "is already host 2")]:
        command = "member" if args[0] == "member" else "cluster"
        said = cluster_cmd(cl, *args[command == "member":], ok=False, command=command)
        assert message in said and len(said.strip().splitlines()) == 1, (args, said)
    assert placement(cl)[0].epoch == epoch


def test_draining_with_the_deciding_leader_and_a_catching_up_host_killed(cl):
    """Node 6 is drained; while its first move is in flight group 0's leader (the node whose
    placement loop drives it) is SIGKILLed and restarted; then the host receiving a replica is
    SIGKILLed once its replica has joined, and kept down past the dead-host timeout (4 s), so
    the move is rolled back (or had finished), then restarted. The drain finishes; node 6 exits."""
    load = Load(cl, "drain")
    watch = MajorityWatch(cl)
    drained = 6
    assert "is draining" in cluster_cmd(cl, "drain-host", cl.peers[drained - 1], "--no-wait")

    record = until("a move in flight", lambda: placement(cl)[0].moves and placement(cl)[0], timeout=60)
    decider = cl.leader(0)
    cl.kill(decider)
    cl.start_node(decider)
    print(f"killed and restarted group 0's leader, node {decider}, during {record.moves[0]}")

    def joining():
        rec = placement(cl)[0]
        return next((m for m in rec.moves if m.stage == "catch_up" and m.target != decider), None)
    move = until("a move whose target has joined", joining, timeout=90)
    cl.kill(move.target)
    print(f"killed node {move.target}, the target of {move}")

    def resolved():
        rec = placement(cl)[0]
        return rec if rec.move_of(move.group) != move else None
    rec = until("the move finishes or is rolled back", resolved, timeout=60)
    placed = set(rec.placed[move.group])
    print(f"then group {move.group}: nodes {sorted(placed)}, move {rec.move_of(move.group)}")
    assert rec.move_of(move.group) is None and placed in ({move.source, *placed} - {move.target},
                                                          {move.target, *placed} - {move.source})
    assert len(placed) == 3
    cl.start_node(move.target)

    def done():
        rec, rows = placement(cl)
        from raftps.store.placement import remaining
        finished = not rec.hosted_by(drained) and not rec.moves and not remaining(rec, frozenset(rows)) \
            and all(len(m) == 3 for m in rec.placed)
        return rec if finished else None
    rec = until("node 6 is drained and placement balanced", done, timeout=180)
    until("the drained node exits", lambda: not cl.is_up(drained), timeout=30)
    samples, violations = watch.finish()
    print(f"majority watch: {samples} samples, violations {violations}")
    assert samples > 10 and not violations
    for line in load.check():
        print(line)
