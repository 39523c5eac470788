"""Elastic hosts on real processes (docs/design/elastic.md): a fifth host joins a (G = 3, N = 4)
cluster under a steady push load and takes a replica of Raft group 1 from its leader's node; a
move to a host that is not up is rolled back, one interrupted goes on when run again, and the
fifth host is drained. A second cluster's placement loop re-creates a SIGKILLed host's two replicas
by itself, at once. Every acknowledged push is applied once, each group's replicas agree,
clients routed by the old layout keep working, and every node follows the same hosts record.
Bad commands change nothing."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from raftps import Client, Unavailable, codec
from raftps.tools.localcluster import LocalCluster
from raftps.raft.durability import default_payload_dir
from raftps.server.elastic import HostsAdmin
from raftps.client.transport import TcpTransport

BASE = 19000       # nodes: Raft 19001..19005 (+ 400 per group; clients + 100, data + 200, metrics + 300)
GROUP = 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hosts_cmd(cl, *args, ok=True, timeout=90, command="hosts"):
    done = subprocess.run([sys.executable, "-m", "raftps", command, *args, "--cluster", cl.addresses,
                           "--timeout", str(timeout)], env={**os.environ, **cl.client_env, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=150)
    assert (done.returncode == 0) == ok, (args, done.stdout, done.stderr)
    return done.stdout if ok else done.stderr


class Load:
    """Two clients made before the move (so routed by the old layout), each pushing -1 to every
    counter (sgd, lr 1: +1 each) in one push: a counter's total counts the pushes applied."""

    def __init__(self, cl, names):
        self.names, self.acked, self.unknown = names, 0, 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.clients = [cl.client(timeout=30) for _ in range(2)]
        for c in self.clients:
            c.groups()                     # the layout, learned now: before the move
        self.threads = [threading.Thread(target=self.run, args=(c,)) for c in self.clients]
        for t in self.threads:
            t.start()

    def run(self, client):
        grads = {n: -np.ones(1) for n in self.names}
        try:
            for _ in range(100_000):              # bounded; the test stops it far sooner
                if self.stop.is_set():
                    return
                acked = self.push(client, grads)
                with self.lock:
                    self.acked += acked
                    self.unknown += not acked
        except BaseException as exc:
            self.errors.append(exc)

    @staticmethod
    def push(client, grads) -> bool:
        """True: acknowledged; False: no definite answer (it may or may not have been applied)."""
        try:
            client.push(grads)
            return True
        except Unavailable:
            return False

    def wait(self, more, timeout=60.0):
        start, deadline = self.acked, time.monotonic() + timeout
        while self.acked < start + more and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)
        assert self.acked >= start + more and not self.errors, (self.acked, self.errors)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(60)
        for c in self.clients:
            c.close()
        assert not self.errors, self.errors
        return self.acked, self.unknown


def group_rows(cl, node, timeout=30.0):
    """Node ``node``'s status rows by Raft group."""
    with Client(cl.client_address(node), token=cl.token, timeout=timeout) as c:
        return {r.get("group", 0): r for r in c.status() if r["role"] != "down"}


def until(what, check, timeout=60.0, period=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(period)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_new_host_takes_a_replica_under_load(tmp_path):
    cl = LocalCluster(str(tmp_path), nodes=4, base_port=BASE, groups=3)
    try:
        cl.start(timeout=90)
        with cl.client() as c:
            names = [f"ctr{i}" for i in range(12)]
            c.create_many({n: np.zeros(1) for n in names}, {n: {"name": "sgd", "lr": 1.0} for n in names})
            mine = next(n for n in names if c.group_of(n) == GROUP)       # a tensor of the moving group
        assert "hosts epoch 0" in hosts_cmd(cl, "list")        # the formula: no record yet
        load = Load(cl, names)
        load.wait(10)

        # a fifth host joins; it serves nothing until the record gives it group 1's replica,
        # which it takes from the node leading group 1 (so the leader hands over first)
        new = cl.add_node()
        new_addr = cl.peers[new - 1]
        assert f"as node {new}" in hosts_cmd(cl, "add", new_addr)
        cl.start_node(new, ("--join",))
        source = cl.leader(GROUP)
        assert source is not None
        out = hosts_cmd(cl, "move", str(GROUP), cl.peers[source - 1], new_addr)
        assert f"replica moved from {cl.peers[source - 1]} to {new_addr}" in out
        assert source in (2, 3, 4)                        # group 1 starts on nodes 2, 3, 4
        members = sorted(({2, 3, 4} - {source}) | {new})
        assert f"group {GROUP}: nodes {','.join(map(str, members))}" in out
        load.wait(20)
        # the source's node stops its replica, and then answers a request for the group with
        # where it went (a client routed by the old layout follows that as it follows a "not the
        # leader")
        until("the source stops serving group 1", lambda: GROUP not in group_rows(cl, source))
        transport = TcpTransport(cl.token, None, codec.DEFAULT_LIMITS, connect_timeout=2.0)
        try:
            reply = transport.call(cl.client_address(source), {"op": "pull", "names": [mine], "raft_group": GROUP}, 5.0)
        finally:
            transport.close()
        assert reply["retry"] and reply["not_leader"] and reply["leader"] in [cl.client_address(n) for n in members]

        # bad commands: one line each, and the record stays as it is
        epoch = out.split("hosts epoch ")[1].split(":")[0]
        for args, message in [(("add", new_addr), f"already host {new}"),
                              (("move", str(GROUP), "127.0.0.1:1", new_addr), "not a host of this cluster"),
                              (("move", str(GROUP), cl.peers[source - 1], new_addr), "nothing to change"),
                              (("move", "0", cl.peers[0], new_addr), "Raft group 0"),
                              (("move", "7", cl.peers[0], new_addr), "out of range"),
                              (("drain", cl.peers[0]), "serves Raft group 0")]:
            ok = message == "nothing to change"           # a finished move, run again
            said = hosts_cmd(cl, *args, ok=ok)
            assert message in said.splitlines()[0] and (ok or len(said.strip().splitlines()) == 1), (args, said)
        for args, message in [((cl.peers[3], cl.peers[3]), "the same address"),
                              (("127.0.0.1:1", "127.0.0.1:2"), "127.0.0.1:1 is not a host"),
                              ((cl.peers[3], cl.peers[1]), "is already host 2"),
                              ((cl.peers[0], "127.0.0.1:2"), "serves Raft group 0")]:
            said = hosts_cmd(cl, "replace", *args, ok=False, command="member")
            assert message in said and len(said.strip().splitlines()) == 1, (args, said)
        assert f"hosts epoch {epoch}:" in hosts_cmd(cl, "list")

        # a move whose target is not up stops at its learner's catch-up and is rolled back; the
        # learner changed no membership: group 2 keeps its 3 voters throughout
        late = cl.add_node()
        hosts_cmd(cl, "add", cl.peers[late - 1])
        said = hosts_cmd(cl, "move", "2", cl.peers[0], cl.peers[late - 1], ok=False, timeout=5)
        assert "did not catch up" in said and "Run the command again" in said, said
        assert "group 2: nodes 1,3,4 (moving 1 -> 6: learn)" in hosts_cmd(cl, "list")
        load.wait(10)
        out = hosts_cmd(cl, "abort", "2")
        assert "move rolled back" in out and "group 2: nodes 1,3,4\n" in out, out
        until("group 2 is back to 3 members", lambda: all(len(group_rows(cl, n)[2]["members"]) == 3 for n in (1, 3, 4)))
        load.wait(10)

        # a move interrupted while its target was down goes on when run again, once the host is up
        hosts_cmd(cl, "move", "2", cl.peers[0], cl.peers[late - 1], ok=False, timeout=3)
        cl.start_node(late, ("--join",))
        out = hosts_cmd(cl, "move", "2", cl.peers[0], cl.peers[late - 1])
        assert f"group 2: nodes 3,4,{late}\n" in out, out
        until("node 1 stops serving group 2", lambda: 2 not in group_rows(cl, 1))
        # and sets its files aside; its payloads in tmpfs are gone (a later replica starts empty)
        left = os.path.join(cl.data_dir(1), "group2")
        until("node 1's replica of group 2 is set aside", lambda: not os.path.exists(left)
              and not os.path.exists(default_payload_dir(left)))
        load.wait(10)

        # the fifth host is drained (its one replica moves on) and its node exits
        out = hosts_cmd(cl, "drain", new_addr)
        assert f"drained {new_addr}: 1 replica(s) moved" in out, out
        until("the drained node exits", lambda: not cl.is_up(new))
        load.wait(10)

        # node 4 is replaced by a seventh host (member replace), started first: a joining host
        # waits for the record to give it a group. Interrupted (the new host paused with SIGSTOP
        # through the first catch-up), then run again, it moves each of node 4's replicas to the
        # new host; node 4 exits
        spare = cl.add_node()
        cl.start_node(spare, ("--join",))
        time.sleep(3)                                     # three polls of a record that names it nowhere
        assert cl.is_up(spare)
        os.kill(cl.pid(spare), signal.SIGSTOP)
        try:
            said = hosts_cmd(cl, "replace", cl.peers[3], cl.peers[spare - 1], ok=False, timeout=3, command="member")
            assert "did not catch up" in said, said
        finally:
            os.kill(cl.pid(spare), signal.SIGCONT)
        out = hosts_cmd(cl, "replace", cl.peers[3], cl.peers[spare - 1], command="member")
        assert f"replaced {cl.peers[3]} with {cl.peers[spare - 1]}: " in out and "id 4 stays" in out, out
        until("the replaced node exits", lambda: not cl.is_up(4))
        load.wait(10)
        epoch = int(out.split("hosts epoch ")[1].split(":")[0])
        acked, unknown = load.finish()

        # every node still serving holds the newest record; the drained ones left by following a
        # record that places them in no group (that record, or a later one seen before exiting)
        def records():
            got = [json.load(open(os.path.join(cl.data_dir(n), "hosts.json"))) for n in (1, 2, 3, late, spare)]
            return got if all(r == got[0] and r["epoch"] == epoch for r in got) else None
        placed = until("every node follows the newest record", records)[0]["placed"]
        for gone in (new, 4):
            left_by = json.load(open(os.path.join(cl.data_dir(gone), "hosts.json")))
            assert left_by["epoch"] <= epoch and all(gone not in m for m in left_by["placed"]), left_by
        assert all(len(m) == 3 and new not in m and 4 not in m for m in placed), placed
        assert placed[2] == [3, late, spare], placed         # node 4's place, taken by the new host
        for group, members in enumerate(placed):          # each group's replicas agree, one leads
            def agreeing():
                rows = [group_rows(cl, n).get(group) for n in members]
                return rows if None not in rows and len({(r["version"], r["digest"]) for r in rows}) == 1 else None
            rows = until(f"group {group}'s replicas agree", agreeing)
            assert sum(r["role"] == "leader" for r in rows) == 1, (group, rows)
        with cl.client() as c:
            totals = c.pull(names)[0]
        for n in names:                                   # each acked push applied once, none twice
            assert acked <= int(totals[n][0]) <= acked + unknown, (n, acked, unknown, totals[n])
    finally:
        cl.wipe()


LOOP_BASE = 11000  # the second cluster: Raft 11001..11004 (+ 400 per group up to group 2; + 100/200/300)


def test_the_placement_loop_refills_a_dead_hosts_replicas_together(tmp_path):
    """(G = 3, N = 4): group 1 starts on nodes 2, 3, 4, group 2 on 1, 3, 4. Node 4 is SIGKILLed
    for good; after the dead-host timeout (3 s) group 0's leader re-creates both replicas with
    no one asking, at once (two moves in the record together): group 1's on node 1, the only
    node outside it, and group 2's on node 2 (nodes 1 and 2 serve 2 groups each, node 3 all 3;
    the lowest id, node 1, already serves group 2). Pushes go on throughout; nothing is lost
    or doubled."""
    cl = LocalCluster(str(tmp_path), nodes=4, base_port=LOOP_BASE, groups=3, extra_args=["--dead-host-timeout", "3"])
    try:
        names, load = started_under_load(cl)
        cl.kill(4)
        in_flight = []          # the moves in the record, polled every 0.1 s until both are done

        def refilled():
            with HostsAdmin(cl.addresses, token=cl.token, tls=False, timeout=10) as admin:
                record = admin.hosts()
            in_flight.append(len(record.moves))
            return record if not record.moves and record.placed[1:] == ((1, 2, 3), (1, 2, 3)) else None
        until("groups 1 and 2 on nodes 1, 2, 3", refilled, timeout=90, period=0.1)
        assert max(in_flight) == 2, in_flight
        for group, rows in finished_and_agreeing(cl, load, names, groups=(1, 2)).items():
            ports = [f"127.0.0.1:{LOOP_BASE + 400 * group + n}" for n in (1, 2, 3)]     # Raft port + 400 g
            assert all(sorted(r["members"]) == ports for r in rows), rows
    finally:
        cl.wipe()


def started_under_load(cl):
    """Start ``cl``, create 8 counters and push to them (a Load, 10 pushes in): (names, load)."""
    cl.start(timeout=90)
    names = [f"ctr{i}" for i in range(8)]
    with cl.client() as c:
        c.create_many({n: np.zeros(1) for n in names}, {n: {"name": "sgd", "lr": 1.0} for n in names})
    load = Load(cl, names)
    load.wait(10)
    return names, load


def finished_and_agreeing(cl, load, names, groups=(1,)):
    """Once the refill is done: 10 more pushes, the load stopped, each of ``groups``' replicas on
    nodes 1, 2, 3 agree, every acknowledged push applied once: {group: its rows}."""
    load.wait(10)
    acked, unknown = load.finish()
    def agreeing(group):
        rows = [group_rows(cl, n).get(group) for n in (1, 2, 3)]
        return rows if None not in rows and len({(r["version"], r["digest"]) for r in rows}) == 1 else None
    rows = {group: until(f"group {group}'s replicas agree", lambda: agreeing(group)) for group in groups}
    with cl.client() as c:
        totals = c.pull(names)[0]
    for n in names:
        assert acked <= int(totals[n][0]) <= acked + unknown, (n, acked, unknown, totals[n])
    return rows
