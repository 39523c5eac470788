"""A host that vanishes from the network (every packet in or out of it dropped, as a dead
machine's are: no refusal, no reset) is found dead by the placement loop and its replica is
re-created on the others after the dead-host timeout, with no one asking; meanwhile the loop's
heartbeat of every host stays short (the silent host costs one connect timeout, not one per turn
per silent host). (G = 2, N = 4), one network namespace per node (raftps/chaos/netns.py), under
a push load: every acknowledged push applied once, group 1's replicas agree. Needs root."""
import time
import urllib.request

import pytest

from raftps.chaos import netns
from raftps.tools.localcluster import LocalCluster
from tests.groups.test_elastic import group_rows, hosts_cmd, finished_and_agreeing, started_under_load, until

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
PREFIX, SUBNET = "rpsvh", "10.77.23"
BASE = 14600       # Raft BASE+1..BASE+4 on each namespace's address (+ 400 for group 1; + 100/200/300)
VANISHED = 4       # group 1 starts on nodes 2, 3, 4; group 0 (the placement loop's) on 1, 2, 3


def heartbeat_seconds(cl, node):
    """The placement loop's last heartbeat time, from node ``node``'s /metrics (None: not its loop)."""
    url = f"http://{cl.hosts[node - 1]}:{BASE + node + 300}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        lines = [l for l in page.read().decode().splitlines() if l.startswith("raftps_placement_heartbeat_seconds ")]
    return float(lines[0].split()[1]) if lines else None


def test_a_host_whose_packets_are_dropped_is_refilled(tmp_path):
    net = netns.Net(4, prefix=PREFIX, subnet=SUBNET)
    net.up()
    cl = LocalCluster(str(tmp_path), nodes=4, base_port=BASE, hosts=net.hosts(), command_prefix=net.command_prefix,
                      groups=2, extra_args=["--dead-host-timeout", "3"])
    try:
        names, load = started_under_load(cl)
        vanished_at = time.monotonic()
        for chain in ("INPUT", "OUTPUT"):
            net.iptables(VANISHED, "-A", chain, "-j", "DROP")
        until("node 1 serves group 1", lambda: 1 in group_rows(cl, 1), timeout=90)
        refilled = time.monotonic() - vanished_at
        assert "group 1: nodes 1,2,3\n" in until("the move is done", lambda: (
            lambda out: out if "moving" not in out else None)(hosts_cmd(cl, "list")))
        # the loop's node (group 0's leader) timed its last heartbeat with node 4 still silent
        loop_node = cl.leader(0)
        took = heartbeat_seconds(cl, loop_node)
        print(f"vanished host refilled after {refilled:.1f} s (dead-host timeout 3 s); heartbeat {took:.2f} s")
        assert took is not None and took < 1.6, took
        finished_and_agreeing(cl, load, names)
    finally:
        net.heal()
        cl.wipe()
        assert net.down() == []
