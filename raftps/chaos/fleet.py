"""A fleet on one machine: store hosts and worker hosts as network namespaces on a bridge, each
host's link shaped both ways with tbf, as a NIC of that rate would be.

    with Fleet(store_hosts=3, worker_hosts=2, link="workers=100mbit,store=1gbit") as fleet:
        cluster = fleet.cluster(run_dir)             # LocalCluster: node i on store host i
        cluster.start()
        fleet.start_worker(1, [sys.executable, "worker.py", ...])   # on worker host 1
        fleet.link_bytes()                           # {host: (sent, received)} from the kernel

Hosts are numbered 1..S (store) then S+1..S+W (workers) in netns.Net's numbering. A link rate
shapes both directions of a host's veth: its namespace end (``eth0``: what the host sends) and
its bridge end (what it receives). This kernel has no netem, so links get a rate, not a delay.
``down`` kills every worker this fleet started, by PID, stops the store nodes, then removes every
namespace, veth and the bridge. Needs root, iproute2's ``ip`` and ``tc`` (``available``).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import IO, Sequence

from raftps.tools.localcluster import LocalCluster
from raftps.chaos import netns

RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
ROLES = ("store", "workers")


def available() -> str | None:
    """None if a fleet can be built here, else why not."""
    problem = netns.available()
    if problem is None and shutil.which("tc") is None:
        problem = "tc is not installed (Debian: apt-get install -y iproute2)"
    return problem


def parse_rate(text: str) -> float | None:
    """Bits per second of a link rate ("100mbit", "1gbit", "512kbit"); None for "unshaped"."""
    text = text.strip().lower()
    if text in ("unshaped", "none", ""):
        return None
    m = RATE.fullmatch(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"bad link rate {text!r}: a positive number then kbit, mbit or gbit "
                         "(e.g. 100mbit), or 'unshaped'")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_link(text: str) -> dict[str, float | None]:
    """{"store": bits/s, "workers": bits/s} of a --link value: one rate for every host
    ("100mbit"), or per role ("workers=100mbit,store=1gbit"; a role left out is unshaped)."""
    if "=" not in text:
        rate = parse_rate(text)
        return {role: rate for role in ROLES}
    out: dict[str, float | None] = {role: None for role in ROLES}
    for part in text.split(","):
        role, _, rate = part.partition("=")
        role = role.strip().lower()
        if role not in ROLES:
            raise ValueError(f"bad link role {role!r} in {text!r}: expected store= and/or workers=")
        out[role] = parse_rate(rate)
    return out


def tbf(rate: float) -> list[str]:
    """tc arguments of a tbf of ``rate`` bits/s: a burst of 10 ms of the rate (at least 32 kbit,
    so a full-size packet always fits) and a queue of 400 ms (a slow link queues, not drops)."""
    burst_kbit = max(32, int(rate / 100 / 1000))
    return ["tbf", "rate", f"{int(rate)}bit", "burst", f"{burst_kbit}kbit", "latency", "400ms"]


class Fleet:
    def __init__(self, store_hosts: int = 3, worker_hosts: int = 2, link: str = "unshaped",
                 prefix: str = "rpsfl", subnet: str = "10.79.0") -> None:
        if store_hosts < 1 or worker_hosts < 0:
            raise ValueError("a fleet needs at least one store host and no negative count of workers")
        self.store_hosts, self.worker_hosts = store_hosts, worker_hosts
        self.rates = parse_link(link)
        self.net = netns.Net(store_hosts + worker_hosts, prefix, subnet)
        self.workers: list[subprocess.Popen] = []
        self.clusters: list[LocalCluster] = []

    # -- hosts ---------------------------------------------------------------------------------
    def store_host(self, node: int) -> int:
        return node

    def worker_host(self, worker: int) -> int:
        """Host number of worker host ``worker`` (1-based)."""
        if not 1 <= worker <= self.worker_hosts:
            raise ValueError(f"worker host {worker} of {self.worker_hosts}")
        return self.store_hosts + worker

    def ip(self, host: int) -> str:
        return self.net.ip(host)

    def role(self, host: int) -> str:
        return "store" if host <= self.store_hosts else "workers"

    # -- lifecycle -----------------------------------------------------------------------------
    def up(self) -> "Fleet":
        self.net.up()
        try:
            for host in range(1, self.net.nodes + 1):
                self.shape(host, self.rates[self.role(host)])
        except BaseException:
            self.net.down()
            raise
        return self

    def shape(self, host: int, rate: float | None) -> None:
        """Set (None: remove) host ``host``'s link rate, both ways."""
        for prefix, dev in ((self.net.command_prefix(host), "eth0"), ([], f"{self.net.prefix}v{host}")):
            netns.run(prefix + ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                netns.run(prefix + ["tc", "qdisc", "add", "dev", dev, "root", *tbf(rate)])

    def cluster(self, run_dir: str, **kwargs) -> LocalCluster:
        """A LocalCluster of one node per store host (not started); ``down`` stops it."""
        c = LocalCluster(run_dir, nodes=self.store_hosts, hosts=[self.ip(h) for h in range(1, self.store_hosts + 1)],
                         command_prefix=self.net.command_prefix, **kwargs)
        self.clusters.append(c)
        return c

    def start_worker(self, worker: int, argv: Sequence[str], env: dict[str, str] | None = None,
                     log: IO | int | None = None) -> subprocess.Popen:
        """Run ``argv`` on worker host ``worker``, its output (stdout and stderr) to ``log`` (a
        file, subprocess.PIPE, or None: discarded); ``down`` kills it by PID if it still runs."""
        proc = subprocess.Popen(self.net.command_prefix(self.worker_host(worker)) + list(argv),
                                env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL if log is None else log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.workers.append(proc)
        return proc

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """{host: (bytes it sent, bytes it received)} on its link, from the kernel's counters of
        the veth's bridge end (what it receives, the host sent)."""
        out = {}
        for host in range(1, self.net.nodes + 1):
            base = f"/sys/class/net/{self.net.prefix}v{host}/statistics"
            with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
                out[host] = (int(rx.read()), int(tx.read()))
        return out

    def down(self) -> list[str]:
        """Kill the workers (by PID), stop the store, remove the namespaces: what was left (empty: clean)."""
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        left = []
        for c in self.clusters:
            try:
                c.stop(timeout=5.0)
            except (OSError, TypeError) as exc:      # its run dir went first: Net.down kills by namespace
                left.append(f"cluster in {c.run_dir} did not stop cleanly: {exc}")
        return left + self.net.down()

    def __enter__(self) -> "Fleet":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
