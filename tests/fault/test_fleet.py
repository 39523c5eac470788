"""The fleet harness (raftps.chaos.fleet) at a small size: link rates parsed, each host's link
shaped both ways, the kernel's byte counters, and a teardown that leaves nothing behind."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raftps.chaos import fleet as fleets

SERVE = ("import socket,sys\n"
         "s=socket.create_server((sys.argv[1], 7698)); c,_=s.accept(); n=0\n"
         "while True:\n"
         "    b=c.recv(1<<16)\n"
         "    if not b: break\n"
         "    n+=len(b)\n"
         "print(n)\n")
SEND = ("import socket,sys,time\n"
        "time.sleep(0.3); c=socket.create_connection((sys.argv[1], 7698)); c.sendall(b'x'*1_000_000); c.close()\n")


def test_link_rates_parse_per_role_and_refuse_nonsense() -> None:
    assert fleets.parse_link("100mbit") == {"store": 100e6, "workers": 100e6}
    assert fleets.parse_link("workers=100mbit,store=1gbit") == {"store": 1e9, "workers": 100e6}
    assert fleets.parse_link("workers=512kbit") == {"store": None, "workers": 512e3}
    assert fleets.parse_link("unshaped") == {"store": None, "workers": None}
    for bad, match in (("100mb", "bad link rate"), ("fast", "bad link rate"), ("0mbit", "bad link rate"),
                       ("gpus=1gbit", "bad link role")):
        with pytest.raises(ValueError, match=match):
            fleets.parse_link(bad)


@pytest.mark.skipif(fleets.available() is not None, reason=str(fleets.available()))
def test_a_shaped_host_sends_at_its_rate_and_the_kernel_counts_it() -> None:
    f = fleets.Fleet(store_hosts=1, worker_hosts=1, link="workers=20mbit", prefix="rpsft", subnet="10.79.8")
    f.up()
    try:
        qdiscs = [subprocess.run(f.net.command_prefix(h) + ["tc", "qdisc", "show", "dev", "eth0"],
                                 capture_output=True, text=True, timeout=10).stdout for h in (1, 2)]
        assert "tbf" not in qdiscs[0] and "rate 20Mbit" in qdiscs[1], qdiscs
        before = f.link_bytes()
        server = subprocess.Popen(f.net.command_prefix(1) + [sys.executable, "-c", SERVE, f.ip(1)],
                                  stdout=subprocess.PIPE, text=True)
        f.workers.append(server)            # down() kills it by PID should the test fail first
        started = time.monotonic()
        sender = f.start_worker(1, [sys.executable, "-c", SEND, f.ip(1)])
        assert sender.wait(20) == 0
        assert server.wait(20) == 0 and int(server.stdout.read()) == 1_000_000
        took = time.monotonic() - started - 0.3
        after = f.link_bytes()
        sent = after[2][0] - before[2][0]
        received = after[1][1] - before[1][1]
        assert 1_000_000 < sent < 1_100_000 and 1_000_000 < received < 1_100_000, (sent, received)
        assert took >= 0.9 * 8e6 / 20e6, took     # 1 MB at 20 Mbit/s: at least 0.4 s
    finally:
        left = f.down()
    assert left == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert "rpsft" not in namespaces
    assert subprocess.run(["ip", "link", "show", "rpsftbr"], capture_output=True, timeout=10).returncode != 0
