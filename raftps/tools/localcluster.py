"""Start, kill, pause and stop a cluster of raftps node processes on one machine.

The cluster scripts (cluster/*.sh), the tests, the benchmarks and the fault injector all use
this one class, so there is one place that knows the run-directory layout:

    RUN_DIR/secret          the peer secret (mode 600), made on first start
    RUN_DIR/token           the client token (mode 600), made on first start: what clients need
    RUN_DIR/nodeI/          node I's data (journal, snapshot, payloads)
    RUN_DIR/nodeI.pid       its process id;  RUN_DIR/nodeI.log  its log
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from raftps import auth
from raftps.client.client import Client

CLIENT_OFFSET, DATA_OFFSET = 100, 200


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X") and b"raftps" in cmdline


def _last_line(path: str) -> str:
    """The last non-empty line of a log file ("" if none): why a node exited."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


class ClusterError(RuntimeError):
    """An expected state of a local cluster that stops an action: the operator gets its message."""


class NodeNotRunning(ClusterError):
    """A signal for a node whose process is gone (killed, stopped, never started)."""


class NodeExited(ClusterError):
    def __init__(self, nodes: list[int], message: str):
        super().__init__(message)
        self.nodes = nodes


class LocalCluster:
    def __init__(self, run_dir: str, nodes: int = 3, base_port: int = 7100, hosts: list[str] | None = None,
                 command_prefix: Callable[[int], list[str]] | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, tls_dir: str | None = None, groups: int = 1,
                 durability: str = "none", node_module: str = "raftps"):
        """``tls_dir``: a directory made by cluster/make-certs.sh (ca.pem, node.pem, node.key);
        the nodes then serve their client ports over TLS only. ``groups``: Raft groups the
        tensors are sharded over (serve --groups; groups.py). ``durability``: serve --durability.
        ``node_module``: what ``python -m`` runs a node with: raftps, or a test tool that wraps
        its command line (raftps.chaos.simdisk_node: a node on a simulated disk)."""
        self.run_dir = os.path.abspath(run_dir)
        self.nodes = nodes
        self.base_port = base_port
        self.hosts = list(hosts or ["127.0.0.1"] * nodes)
        if len(self.hosts) != nodes:
            raise ValueError(f"{nodes} nodes need {nodes} hosts, got {self.hosts}")
        self.command_prefix = command_prefix
        self.node_module = node_module
        self.groups = groups
        self.durability = durability
        self.extra_args = (extra_args or []) + (["--groups", str(groups)] if groups > 1 else []) \
            + (["--durability", durability] if durability != "none" else [])
        self.env = env or {}
        self.tls_dir = os.path.abspath(tls_dir) if tls_dir else None
        self._procs: dict[int, subprocess.Popen] = {}
        os.makedirs(self.run_dir, exist_ok=True)

    # ---- layout ---------------------------------------------------------------------------

    @property
    def peers(self) -> list[str]:
        return [f"{h}:{self.base_port + i}" for i, h in enumerate(self.hosts, 1)]

    def client_address(self, node: int) -> str:
        return f"{self.hosts[node - 1]}:{self.base_port + CLIENT_OFFSET + node}"

    @property
    def addresses(self) -> str:
        return ",".join(self.client_address(i) for i in range(1, self.nodes + 1))

    @property
    def secret_file(self) -> str:
        return auth.make_secret_file(os.path.join(self.run_dir, "secret"))

    @property
    def token_file(self) -> str:
        return auth.make_secret_file(os.path.join(self.run_dir, "token"))

    @property
    def token(self) -> str:
        return auth.read_secret_file(self.token_file)

    @property
    def tls_ca(self) -> str | None:
        return os.path.join(self.tls_dir, "ca.pem") if self.tls_dir else None

    @property
    def client_env(self) -> dict[str, str]:
        """What a client process needs in its environment to reach this cluster."""
        env = {"RAFTPS_CLUSTER": self.addresses, "RAFTPS_TOKEN_FILE": self.token_file}
        if self.tls_ca:
            env["RAFTPS_TLS_CA"] = self.tls_ca
        return env

    def client(self, addresses: str | list[str] | None = None, **kwargs) -> Client:
        """A Client of this cluster (all nodes, or ``addresses``) with its token (and TLS CA)."""
        return Client(addresses or self.addresses, token=self.token, tls=self.tls_ca or False, **kwargs)

    def add_node(self, host: str = "127.0.0.1") -> int:
        """Make room for one more node (not started): its number. Start it after `raftps member
        add` has made it a member; its --peers name every node so far."""
        self.hosts.append(host)
        self.nodes += 1
        return self.nodes

    def data_dir(self, node: int) -> str:
        return os.path.join(self.run_dir, f"node{node}")

    def log_file(self, node: int) -> str:
        return os.path.join(self.run_dir, f"node{node}.log")

    def _pid_file(self, node: int) -> str:
        return os.path.join(self.run_dir, f"node{node}.pid")

    def pid(self, node: int) -> int | None:
        try:
            with open(self._pid_file(node)) as f:
                pid = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid

    def known_nodes(self) -> list[int]:
        """The nodes this run dir has ever started (a data dir or a pid file), in order."""
        found = (re.fullmatch(r"node(\d+)(\.pid)?", name) for name in os.listdir(self.run_dir))
        return sorted({int(m[1]) for m in found if m})

    def is_up(self, node: int) -> bool:
        proc = self._procs.get(node)
        if proc is not None:
            # Our child: its exit status is the truth. /proc/PID/cmdline is empty while a
            # process is inside execve (`ip netns exec python ...` starting), so reading it
            # made live nodes look dead during start.
            return proc.poll() is None
        pid = self.pid(node)
        return pid is not None and _alive(pid)

    # ---- lifecycle ------------------------------------------------------------------------

    def start_node(self, node: int, extra_args: tuple[str, ...] = ()) -> int:
        """``extra_args``: this start's own serve flags (``--join``: a host added to a cluster of
        several Raft groups, raftps hosts add)."""
        if self.is_up(node):
            return self.pid(node)
        argv = [sys.executable, "-m", self.node_module, "serve", "--id", str(node), "--peers", ",".join(self.peers),
                "--data-dir", self.data_dir(node), "--secret-file", self.secret_file,
                "--token-file", self.token_file, *self._tls_args(), *self.extra_args, *extra_args]
        if self.command_prefix is not None:
            argv = self.command_prefix(node) + argv
        # "{node}" in a value is this node's number (e.g. a simulated disk's state dir per node)
        env = {**os.environ, **{k: v.replace("{node}", str(node)) for k, v in self.env.items()}}
        with open(self.log_file(node), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self._procs[node] = proc
        with open(self._pid_file(node), "w") as f:
            f.write(f"{proc.pid}\n")
        return proc.pid

    def _tls_args(self) -> list[str]:
        if not self.tls_dir:
            return []
        return ["--tls-cert", os.path.join(self.tls_dir, "node.pem"), "--tls-key", os.path.join(self.tls_dir, "node.key")]

    def start(self, timeout: float = 60.0) -> str:
        """Start every node that is down; return the client addresses once a leader is elected
        and every node answers. If that fails (a node exits, the timeout passes), the nodes this
        call started are stopped, by PID, before the error is raised: a failed start leaves no
        process behind (found: two nodes of a start whose third could not bind its port, still
        running an hour later)."""
        started = [node for node in range(1, self.nodes + 1) if not self.is_up(node)]
        for node in started:
            self.start_node(node)
        try:
            self.wait_ready(timeout)
        except BaseException:
            for node in started:
                if self.is_up(node):
                    self.kill(node)
            raise
        return self.addresses

    def wait_ready(self, timeout: float = 60.0, nodes: list[int] | None = None) -> None:
        want = nodes or [n for n in range(1, self.nodes + 1) if self.is_up(n)]
        deadline = time.monotonic() + timeout
        last: list[dict] = []
        with self.client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                dead = [n for n in want if not self.is_up(n)]
                if dead:
                    said = _last_line(self.log_file(dead[0]))
                    raise NodeExited(dead, f"node(s) {dead} exited during start" + (f": {said}" if said else "")
                                     + f" (log: {self.log_file(dead[0])})")
                last = client.status(timeout=1.0)
                answering = {s["node"] for s in last if s["role"] != "down"}
                led = {s.get("group", 0) for s in last if s["role"] == "leader"}
                if answering >= set(want) and led >= set(range(self.groups)):
                    return
                time.sleep(0.1)
        raise TimeoutError(f"no leader with nodes {want} up within {timeout:.0f} s: "
                           f"{[(s['node'], s['role']) for s in last]}")

    def send_signal(self, node: int, sig: int) -> None:
        pid = self.pid(node)
        if pid is None or not self.is_up(node):
            raise NodeNotRunning(f"node {node} is not running")
        os.kill(pid, sig)

    def kill(self, node: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to node ``node`` and wait until its process is gone."""
        self.send_signal(node, sig)
        self._wait_exit(node, timeout)

    def _wait_exit(self, node: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        proc = self._procs.get(node)
        while self.is_up(node):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} (pid {self.pid(node)}) did not exit within {timeout:.0f} s")
            if proc is not None:
                try:
                    proc.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.05)

    def pause(self, node: int) -> None:
        self.send_signal(node, signal.SIGSTOP)

    def resume(self, node: int) -> None:
        self.send_signal(node, signal.SIGCONT)

    def leader(self, group: int = 0) -> int | None:
        """The node that leads Raft group ``group`` (the highest term's, if two think they do)."""
        with self.client(timeout=2.0) as client:
            leaders = [s for s in client.status(timeout=1.0) if s["role"] == "leader" and s.get("group", 0) == group]
        return max(leaders, key=lambda s: s["term"])["node"] if leaders else None

    def status(self) -> list[dict]:
        """A row per node (and, with several Raft groups, per group it hosts: ``group``)."""
        with self.client(timeout=2.0) as client:
            rows = client.status(timeout=1.0)
        for row in rows:
            row["pid"] = self.pid(row["node"]) if self.is_up(row["node"]) else None
        return rows

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node: SIGTERM (graceful), then SIGKILL what is still there."""
        up = [n for n in range(1, self.nodes + 1) if self.is_up(n)]
        for node in up:
            try:
                os.kill(self.pid(node), signal.SIGCONT)      # a paused node cannot handle SIGTERM
                os.kill(self.pid(node), signal.SIGTERM)
            except ProcessLookupError:
                pass
        for node in up:
            try:
                self._wait_exit(node, timeout)
            except TimeoutError:
                self.kill(node)
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs.clear()

    def wipe(self) -> None:
        """Stop, then delete every node's data, payloads (tmpfs) included, and the run dir."""
        self.stop()
        self.drop_payloads()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def drop_payloads(self) -> None:
        """Delete the stopped nodes' tmpfs payload dirs (RAM that outlives the run dir otherwise)."""
        from raftps.groups import data_dir
        from raftps.raft.durability import default_payload_dir
        for node in range(1, self.nodes + 1):
            for group in range(self.groups):
                shutil.rmtree(default_payload_dir(data_dir(self.data_dir(node), group)), ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
