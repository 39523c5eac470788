"""Network faults on one Linux machine: one network namespace per node, joined by a bridge.

    root namespace: bridge <prefix>br at <subnet>.254/24 (the test's clients live here)
    namespace <prefix>I: eth0 at <subnet>.I/24, a veth pair to the bridge, lo up

Faults are iptables rules inside a node's namespace, so they only ever touch our own addresses:
``isolate`` drops the traffic between a node and its peers but never the bridge address, so
clients in the root namespace still reach every node (the "isolated leader that clients can
still talk to" case). ``heal`` flushes the rules; ``down`` removes namespaces and bridge and is
safe to call twice. Needs root, ``ip`` (iproute2) and ``iptables``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Sequence

CMD_TIMEOUT = 10.0


def available() -> str | None:
    """None if namespaces can be used here, else the reason why not."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install -y {'iproute2' if tool == 'ip' else tool})"
    return None


def run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (ip, tc, iptables) with a timeout; raise with its stderr if it fails and ``check``."""
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _exists(link: str) -> bool:
    return os.path.exists(f"/sys/class/net/{link}")


class Net:
    """N namespaces on a bridge; use as a context manager so teardown always runs."""

    def __init__(self, nodes: int = 3, prefix: str = "rpsf", subnet: str = "10.77.0") -> None:
        if not 1 <= nodes <= 250 or len(prefix) > 8:
            raise ValueError("1..250 nodes and a prefix of at most 8 characters")
        self.nodes, self.prefix, self.subnet = nodes, prefix, subnet
        self.bridge = f"{prefix}br"
        self.bridge_ip = f"{subnet}.254"
        self._flappers: list[tuple[threading.Thread, threading.Event]] = []

    # -- naming -------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i}"

    def hosts(self) -> list[str]:
        return [self.ip(i) for i in range(1, self.nodes + 1)]

    def command_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside node i's namespace (exec, so the PID is the node's)."""
        return ["ip", "netns", "exec", self.ns(i)]

    # -- lifecycle ----------------------------------------------------------------------------
    def up(self) -> "Net":
        self.down()                                   # leftovers of a crashed run of ours
        try:
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
            for i in range(1, self.nodes + 1):
                ns, host_end, node_end = self.ns(i), f"{self.prefix}v{i}", f"{self.prefix}p{i}"
                run(["ip", "netns", "add", ns])
                run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end])
                run(["ip", "link", "set", host_end, "master", self.bridge, "up"])
                run(["ip", "link", "set", node_end, "netns", ns])
                nx = ["ip", "-n", ns]
                run(nx + ["link", "set", node_end, "name", "eth0"])
                run(nx + ["addr", "add", f"{self.ip(i)}/24", "dev", "eth0"])
                run(nx + ["link", "set", "eth0", "up"])
                run(nx + ["link", "set", "lo", "up"])
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Remove everything this Net created; returns what could not be removed (empty = clean)."""
        self.stop_flapping()
        left = []
        for i in range(1, self.nodes + 1):
            ns = self.ns(i)
            if not os.path.exists(f"/run/netns/{ns}"):
                continue
            pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:                           # only processes inside our own namespace
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    left.append(f"process {pid} was still running in {ns}")
                except ProcessLookupError:
                    pass
            if run(["ip", "netns", "del", ns], check=False).returncode != 0:
                left.append(f"namespace {ns}")
        links = [f"{self.prefix}v{i}" for i in range(1, self.nodes + 1)] + [self.bridge]
        deadline = time.monotonic() + 5.0            # the kernel drops a deleted namespace's veths
        while time.monotonic() < deadline and any(_exists(l) for l in links[:-1]):
            time.sleep(0.05)
        for link in links:
            if _exists(link):
                run(["ip", "link", "del", link], check=False)
        time.sleep(0.05)
        left += [f"link {l}" for l in links if _exists(l)]
        return left

    def __enter__(self) -> "Net":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- faults -------------------------------------------------------------------------------
    def iptables(self, i: int, *rule: str) -> None:
        run(self.command_prefix(i) + ["iptables", "-w", "5", *rule])

    def drop(self, i: int, peer: int, direction: str = "both", extra: Sequence[str] = ()) -> None:
        """In node i's namespace, drop packets from ('in'), to ('out') or both ways with node peer."""
        if direction not in ("in", "out", "both"):
            raise ValueError(direction)
        if direction in ("in", "both"):
            self.iptables(i, "-A", "INPUT", "-s", self.ip(peer), *extra, "-j", "DROP")
        if direction in ("out", "both"):
            self.iptables(i, "-A", "OUTPUT", "-d", self.ip(peer), *extra, "-j", "DROP")

    def others(self, i: int) -> list[int]:
        return [j for j in range(1, self.nodes + 1) if j != i]

    def isolate(self, i: int, direction: str = "both") -> None:
        """Cut node i off from every peer (clients from the root namespace still reach it).
        direction 'in': i hears no peer but its packets leave; 'out': the reverse."""
        for j in self.others(i):
            self.drop(i, j, direction)

    def cut(self, a: int, b: int) -> None:
        """Cut the single link a<->b (a 'bridge' partition when the others still see both)."""
        self.drop(a, b, "both")

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Only nodes in the same group can talk to each other."""
        where = {n: g for g, members in enumerate(groups) for n in members}
        for i in range(1, self.nodes + 1):
            for j in self.others(i):
                if where.get(i) != where.get(j):
                    self.drop(i, j, "both")

    def loss(self, i: int, probability: float) -> None:
        """Drop this fraction of node i's packets to and from its peers, at random."""
        extra = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.3f}"]
        for j in self.others(i):
            self.drop(i, j, "both", extra)

    def throttle(self, i: int, rate: str = "1mb/s") -> None:
        """Drop what node i receives from each peer above `rate` (bytes: "512kb/s", "1mb/s"):
        a bulk transfer to i then lasts size/rate seconds, whatever the machine's load."""
        for j in self.others(i):
            self.iptables(i, "-A", "INPUT", "-s", self.ip(j), "-m", "hashlimit",
                          "--hashlimit-above", rate, "--hashlimit-burst", "1mb",
                          "--hashlimit-name", f"{self.prefix}{i}from{j}", "-j", "DROP")

    def heal(self, i: int | None = None) -> None:
        for n in ([i] if i is not None else range(1, self.nodes + 1)):
            self.iptables(n, "-F", "INPUT")
            self.iptables(n, "-F", "OUTPUT")

    def rules(self, i: int) -> list[str]:
        out = run(self.command_prefix(i) + ["iptables", "-w", "5", "-S"]).stdout.splitlines()
        return [r for r in out if r.startswith("-A")]

    def flap(self, i: int, period: float, count: int, direction: str = "both") -> threading.Thread:
        """In the background: isolate node i for `period` s, heal for `period` s, `count` times."""
        stop = threading.Event()

        def flapping() -> None:
            for _ in range(count):
                if stop.is_set():
                    break
                self.isolate(i, direction)
                stop.wait(period)
                self.heal(i)
                stop.wait(period)

        t = threading.Thread(target=flapping, name=f"flap-{i}", daemon=True)
        self._flappers.append((t, stop))
        t.start()
        return t

    def stop_flapping(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for t, stop in self._flappers:
            stop.set()
            t.join(max(0.0, deadline - time.monotonic()))
        self._flappers = []
