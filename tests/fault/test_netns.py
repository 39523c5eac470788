"""netns.Net on its own, with plain sockets: reachability, partitions, heal, teardown."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from raftps.chaos import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

PORT = 7599
SERVER = ("import socket,sys\n"
          "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)\n"
          "while True:\n"
          "    c,_=s.accept(); c.sendall(b'hi'); c.close()\n")
PROBE = ("import socket,sys\n"
         "try:\n"
         "    c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0)\n"
         "    sys.exit(0 if c.recv(2)==b'hi' else 2)\n"
         "except OSError:\n"
         "    sys.exit(1)\n")


@pytest.fixture
def net():
    n = netns.Net(3, prefix="rpsnt", subnet="10.77.9")
    n.up()
    servers = [subprocess.Popen(n.command_prefix(i) + [sys.executable, "-c", SERVER, n.ip(i), str(PORT)])
               for i in (1, 2, 3)]
    try:
        time.sleep(0.5)
        yield n
    finally:
        for p in servers:
            p.kill()
            p.wait(5)
        assert n.down() == []
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "rpsnt" not in out
        assert subprocess.run(["ip", "link", "show", "rpsntbr"], capture_output=True).returncode != 0


def reach_from_root(n: netns.Net, i: int) -> bool:
    try:
        with socket.create_connection((n.ip(i), PORT), timeout=1.0) as c:
            return c.recv(2) == b"hi"
    except OSError:
        return False


def reach(n: netns.Net, src: int, dst: int) -> bool:
    rc = subprocess.run(n.command_prefix(src) + [sys.executable, "-c", PROBE, n.ip(dst), str(PORT)],
                        timeout=10).returncode
    return rc == 0


def test_bridge_connects_everything(net) -> None:
    assert all(reach_from_root(net, i) for i in (1, 2, 3))
    assert reach(net, 2, 1) and reach(net, 1, 3)


def test_isolate_keeps_the_client_path_and_heals(net) -> None:
    net.isolate(1)
    assert len(net.rules(1)) == 4
    assert not reach(net, 2, 1) and not reach(net, 1, 3)
    assert reach(net, 2, 3)
    assert reach_from_root(net, 1)                 # clients still reach the isolated node
    net.heal()
    assert net.rules(1) == []
    assert reach(net, 2, 1) and reach(net, 1, 3)


def test_asymmetric_and_cut(net) -> None:
    net.isolate(1, direction="in")                # 1 hears nobody: no TCP to or from it completes
    assert not reach(net, 2, 1) and not reach(net, 1, 2)
    assert net.rules(1) == [f"-A INPUT -s {net.ip(j)}/32 -j DROP" for j in (2, 3)]
    net.heal()
    net.cut(1, 3)                                  # 2 still talks to both
    assert not reach(net, 1, 3) and not reach(net, 3, 1)
    assert reach(net, 1, 2) and reach(net, 2, 3)


def test_partition_groups_and_loss_rules(net) -> None:
    net.partition([[1], [2, 3]])
    assert not reach(net, 1, 2) and not reach(net, 3, 1) and reach(net, 2, 3)
    net.heal()
    net.loss(2, 0.5)
    assert all("statistic" in r for r in net.rules(2)) and len(net.rules(2)) == 4


def test_flap_is_bounded_and_ends_healed(net) -> None:
    t = net.flap(1, period=0.3, count=2)
    time.sleep(0.1)
    assert net.rules(1)                            # isolated during the first half-period
    t.join(5)
    assert not t.is_alive() and net.rules(1) == []
    assert reach(net, 2, 1)
