"""One fault case: a cluster (optionally in network namespaces), the workload, the check, the line.

    with Harness("leader-kill", run_dir, base_port=7600) as h:
        h.load(3.0)                      # workload runs in the background from here
        t = h.event("kill leader"); h.cluster.kill(h.leader())
        h.wait(4.0); h.cluster.start_node(n)
        result, line = h.finish(failover_s=h.failover(t))
Everything the harness started (node processes by PID, workload threads, namespaces, iptables
rules) is stopped or removed on exit, whatever happened. With ``groups=G`` the cluster shards
over G Raft groups and the harness runs one workload per group (a tensor in each), checked group
by group: every guarantee holds per group.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Sequence

from raftps.groups import group_of
from raftps.tools.localcluster import LocalCluster

from raftps.chaos.checker import Result, check
from raftps.chaos.history import first_ack_after
from raftps.chaos.netns import Net
from raftps.chaos.simdisk import SIMDISK_ENV, power_cut
from raftps.chaos.workload import Workload, settle


def children(pid: int) -> list[int]:
    """Direct children of a process (e.g. pysyncobj's forked snapshot writer)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


class Harness:
    def __init__(self, case: str, run_dir: str, base_port: int, nodes: int = 3, netns: bool = False,
                 node_args: Sequence[str] = (), subnet: str = "10.77.0", groups: int = 1, durability: str = "none",
                 env: dict[str, str] | None = None, power_cuts: bool = False, **workload: Any) -> None:
        """``power_cuts``: durable nodes whose files are on the simulated disk (simdisk.py, a
        state dir per node, the nodes run by simdisk_node.py), so ``power_cut`` can cut them."""
        self.case, self.nodes, self.groups = case, nodes, groups
        self.simdisk = os.path.join(run_dir, "simdisk") if power_cuts else None
        if power_cuts:
            durability = "fsync"
            env = {**(env or {}), SIMDISK_ENV: os.path.join(self.simdisk, "node{node}")}
        self.net = Net(nodes, prefix=f"rps{base_port % 1000:03d}", subnet=subnet) if netns else None
        self.cluster = LocalCluster(run_dir, nodes=nodes, base_port=base_port,
                                    hosts=self.net.hosts() if self.net else None,
                                    command_prefix=self.net.command_prefix if self.net else None,
                                    extra_args=list(node_args), groups=groups, durability=durability, env=env,
                                    node_module="raftps.chaos.simdisk_node" if power_cuts else "raftps")
        self.workload_args = workload
        self.workload: Workload | None = None         # group 0's (the only one with one group)
        self.workloads: list[Workload] = []

    def __enter__(self) -> "Harness":
        try:
            if self.net:
                self.net.up()
            self.cluster.start(timeout=30.0)
            if self.groups == 1:
                self.workloads = [Workload(self.cluster.addresses, token=self.cluster.token, **self.workload_args)]
            else:
                names = [next(f"chaos{g}.{j}" for j in range(1000) if group_of(f"chaos{g}.{j}", self.groups) == g)
                         for g in range(self.groups)]
                self.workloads = [Workload(self.cluster.addresses, token=self.cluster.token, name=name, raft_group=g,
                                           **self.workload_args) for g, name in enumerate(names)]
            self.workload = self.workloads[0]
            for w in self.workloads:
                w.create()
        except BaseException as exc:
            tails = []
            for i in range(1, self.nodes + 1):
                try:
                    with open(self.cluster.log_file(i), errors="replace") as f:
                        tails.append(f"--- node{i}.log\n" + "".join(f.readlines()[-8:]))
                except FileNotFoundError:
                    pass
            self.close()
            raise RuntimeError(f"{self.case}: cluster did not start: {exc}\n" + "\n".join(tails)) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            for w in self.workloads:
                w.stop()
        finally:
            try:
                self.resume_all()
                self.cluster.stop()
                self.cluster.drop_payloads()     # the run dir (logs) stays for post-mortems; tmpfs is RAM
            finally:
                if self.net:
                    left = self.net.down()
                    if left:
                        raise RuntimeError(f"teardown left {left}")

    # -- driving --------------------------------------------------------------------------------
    @property
    def history(self):
        return self.workload.history

    def load(self, seconds: float, max_ops: int = 100_000) -> None:
        """Start the workload(s) for at most `seconds` (they run in the background)."""
        for w in self.workloads:
            w.start(seconds, max(1, max_ops // len(self.workloads)))

    def event(self, what: str) -> float:
        return self.history.event(what)

    @staticmethod
    def wait(seconds: float) -> None:
        time.sleep(seconds)

    def stop_load(self) -> None:
        for w in self.workloads:
            w.stop()

    def leader(self, timeout: float = 15.0, group: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.cluster.leader(group)
            if n is not None:
                return n
            time.sleep(0.1)
        raise TimeoutError(f"no leader within {timeout} s")

    def follower(self) -> int:
        lead = self.leader()
        return next(i for i in range(1, self.nodes + 1) if i != lead)

    def status(self, node: int) -> dict:
        return self.cluster.status()[node - 1]

    def kill(self, node: int) -> None:
        """SIGKILL a node and any child it forked (the snapshot writer), by PID."""
        pid = self.cluster.pid(node)
        kids = children(pid) if pid else []
        self.cluster.kill(node, signal.SIGKILL)
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def power_cut(self, nodes: Sequence[int], mode: str = "torn", seed: int = 0) -> dict[str, bytes | None]:
        """SIGKILL ``nodes`` and cut their simulated disks (Harness(power_cuts=True)); the caller
        restarts them. Returns every file the cuts rewrote (None: removed)."""
        if self.simdisk is None:
            raise RuntimeError("power_cut needs Harness(power_cuts=True)")
        if len(nodes) == self.nodes:
            self.kill_all()
        else:
            for node in nodes:
                self.kill(node)
        survived: dict[str, bytes | None] = {}
        for node in nodes:
            survived.update(power_cut(os.path.join(self.simdisk, f"node{node}"), mode, seed))
        return survived

    def kill_all(self) -> None:
        """SIGKILL every running node at once, then wait until all are gone."""
        up = [i for i in range(1, self.nodes + 1) if self.cluster.is_up(i)]
        for i in up:
            try:
                self.cluster.send_signal(i, signal.SIGKILL)
            except (RuntimeError, ProcessLookupError):
                pass
        deadline = time.monotonic() + 10.0
        while any(self.cluster.is_up(i) for i in up) and time.monotonic() < deadline:
            time.sleep(0.05)

    def resume_all(self) -> None:
        for i in range(1, self.nodes + 1):
            if self.cluster.is_up(i):
                try:
                    self.cluster.resume(i)
                except (RuntimeError, ProcessLookupError):
                    pass

    def failover(self, t: float) -> float | None:
        return first_ack_after(self.history.completed(), t)

    def wait_caught_up(self, node: int, timeout: float = 30.0) -> float | None:
        """Seconds until `node` has applied what the leader had applied when this was called."""
        t0 = time.monotonic()
        target = None
        while time.monotonic() - t0 < timeout:
            rows = self.cluster.status()
            if target is None:
                lead = [r for r in rows if r["role"] == "leader"]
                target = lead[0]["applied"] if lead else None
            mine = rows[node - 1].get("applied")
            if target is not None and mine is not None and mine >= target:
                return time.monotonic() - t0
            time.sleep(0.1)
        return None

    def finish(self, settle_s: float = 30.0, **extra: Any) -> tuple[Result, str]:
        """Stop the load, heal, let the nodes converge, check, and return (result, report line).
        With several groups: each group's line, and a result that is valid if every group's is."""
        for w in self.workloads:
            w.join()
        if self.net:
            self.net.heal()
        self.resume_all()
        extra = {k: (v() if callable(v) else v) for k, v in extra.items()}   # lazily: after the load
        results, lines = [], []
        replicas = self.nodes if self.groups == 1 else min(3, self.nodes)
        for w in self.workloads:
            final, statuses, converge = settle(self.cluster.addresses, replicas, settle_s, token=self.cluster.token,
                                               name=w.name, raft_group=w.raft_group)
            case = self.case if w.raft_group is None else f"{self.case}/group{w.raft_group}"
            if final is None:
                raise AssertionError(f"{case}: no linearizable read of the final state within {settle_s} s")
            result = check(w.history, final, statuses, nodes=replicas)
            line = result.line(case, **{**extra, "converge_s": extra.get("converge_s", converge)})
            print(line, flush=True)
            for p in result.problems:
                print("  problem:", p, flush=True)
            results.append(result)
            lines.append(line)
        if len(results) == 1:
            return results[0], lines[0]
        return AllGroups(results), "\n".join(lines)


class AllGroups:
    """The results of every group's workload: valid when each is."""

    def __init__(self, results: list[Result]):
        self.results = results
        self.valid = all(r.valid for r in results)
        self.problems = [p for r in results for p in r.problems]

    def sentence(self) -> str:
        return " ".join(f"group {g}: {r.sentence()}" for g, r in enumerate(self.results))


def assert_clean(result: Result | AllGroups, line: str) -> None:
    """Fail a test unless every promise held; the message has the line and the problems."""
    assert result.valid, line + "\n" + "\n".join(result.problems)
