"""Load per node as nodes and Raft groups are added (issue 14's benchmark): multi-Raft scale-out.

    python -m bench.groups [--configs 3x1,3x3,6x6,9x9] [--seconds 15] [--warmup 3] [--clients 4]
                           [--leaders elected[,spread]] [--repeat 2] [--max-ops 3000] [--out bench/results]
    python -m bench --parts groups          (only when named)

For each (N nodes, G groups) a fresh cluster (``serve --groups G``; G = 1: one group on all N),
every node in its own network namespace (raftps.chaos.netns.Net: a veth pair to a bridge, real
addresses 10.77.20.I), so nodes talk over real links, not loopback. 2G tensors of 1M float32
(4 MiB), two per group (names chosen with raftps.groups.group_of), SGD. CLIENTS threads in this
process (root namespace, each its own raftps.Client) push 4 MiB gradients, each push one tensor,
cycling through all 2G tensors, so every group gets the same share. After WARMUP s of load a
window of SECONDS s (or MAX_OPS acknowledged pushes, whichever first) is measured, per node
process:

* CPU seconds: utime + stime (+ cutime + cstime: reaped children, if any) from /proc/PID/stat.
  The node is started by ``ip netns exec``, which execs, so its PID is the node's.
* bytes sent + received: rx_bytes + tx_bytes of the node's host-side veth (rpsbvI in the root
  namespace): everything the node sends to or receives from peers and clients, with frame headers.

each divided by the pushes acknowledged in the window. Per config: pushes/s, the busiest node's
CPU per push (the figure that throughput across hosts follows: with one node per host, the
busiest host's core saturates first), the mean node's, the busiest node's bytes per push, which
node leads how many groups (pysyncobj elects at random) and the nodes' idle CPU (2 s before the
load: Raft heartbeats and ticks of every group the node hosts). Targets: busiest-node CPU per
push at (6, 6) <= 0.6x and at (9, 9) <= 0.45x that of (3, 1).

Writes groups.md, groups.json and groups.png in --out. Needs root (namespaces). Ports: base 31000
(group g at Raft port + 400 g), bound inside the namespaces only, so they cannot clash with
anything in the root namespace. The nodes run with --request-timeout 30 so that no push is sent
twice because a loaded 2-core machine took over 3 s to commit it (a re-sent push would count its
bytes twice and the push once).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .common import MiB, log

CONFIGS = [(3, 1), (3, 3), (6, 6), (9, 9)]
BASE_PORT = 31000
PREFIX, SUBNET = "rpsb", "10.77.20"
ELEMENTS = 1 << 20                      # float32: 4 MiB per push
REQUEST_TIMEOUT = 30.0
TARGETS = {(6, 6): 0.6, (9, 9): 0.45}
IDLE_SECONDS = 2.0
# A node can die while 9 start at once: raftps.node.sweep_abandoned_payload_dirs in one node can
# read another's payload-dir OWNER file in the instant PayloadStore has created it empty and not
# yet written it, take "" for a missing data dir and delete the live payload dir (FileNotFoundError
# in PayloadStore.__init__'s listdir). Seen in 1 of 6 starts of 9 nodes. Such a config is run
# again on a fresh cluster, and the failed start is kept in the record ("failed_starts").
START_RETRIES = 2


# ---- per-node accounting ----------------------------------------------------------------------

def proc_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` in seconds (NaN if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def veth_bytes(link: str) -> int:
    """rx + tx bytes of a link in this (the root) namespace."""
    total = 0
    for d in ("rx_bytes", "tx_bytes"):
        with open(f"/sys/class/net/{link}/statistics/{d}") as f:
            total += int(f.read())
    return total


def host_veth(net: Any, node: int) -> str:
    """The root-namespace end of node ``node``'s veth pair (Net.up names it <prefix>v<I>)."""
    return f"{net.prefix}v{node}"


def sample(pids: dict[int, int], links: dict[int, str]) -> dict[int, tuple[float, int]]:
    return {n: (proc_cpu_seconds(pids[n]), veth_bytes(links[n])) for n in pids}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat (all cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = v[3] + v[4]                       # idle + iowait
    return (sum(v[:8]) - idle) / tck, sum(v[:8]) / tck


def delta(a: dict[int, tuple[float, int]], b: dict[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
    return {n: (b[n][0] - a[n][0], b[n][1] - a[n][1]) for n in a}


def tensor_names(groups: int, per_group: int = 2) -> list[str]:
    """``per_group`` names hashing into each group, group by group."""
    from itertools import count, islice
    out = []
    for g in range(groups):
        out += islice((n for n in (f"p{g}.{j}" for j in count()) if _group_of(n, groups) == g), per_group)
    return out


def _group_of(name: str, groups: int) -> int:
    from raftps.groups import group_of
    return group_of(name, groups)


def leaders(rows: list[dict]) -> dict[int, int]:
    """group -> the node leading it (the highest term's), from Client.status() rows."""
    best: dict[int, dict] = {}
    for r in rows:
        if r.get("role") == "leader":
            g = r.get("group", 0)
            if g not in best or (r.get("term") or 0) > (best[g].get("term") or 0):
                best[g] = r
    return {g: r["node"] for g, r in sorted(best.items())}


def settle_leaders(admin: Any, cl: Any, groups: int, timeout: float = 30.0) -> float | None:
    """Seconds until every group is led by its preferred member (raftps hands leadership over to
    it once it is connected and caught up), so that no hand-over falls in the measured window;
    None if this raftps has no preferred leaders or they did not all take over within ``timeout``."""
    from raftps.groups import Layout
    layout = Layout(tuple(cl.peers), groups)
    if groups == 1 or not hasattr(layout, "preferred_leader"):
        return None
    want = {g: layout.preferred_leader(g) for g in range(groups)}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if leaders(admin.status(timeout=5.0, digest=False)) == want:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.3)
    return None


def spread_leaders(cl: Any, net: Any, admin: Any, nodes: int, groups: int, budget: float = 60.0) -> dict[str, Any]:
    """Move leaderships until no node leads more than ceil(G/N) groups. raftps has no leadership
    transfer a client can ask for, so: take a group led by the node that leads most, preferably
    one with a member that leads fewer than ceil(G/N), and cut its leader off from that group
    only (iptables in the leader's namespace drops TCP to and from the group's Raft ports; the
    node's other groups are untouched) until another member is elected, then heal. The new
    leader is either other member, at random, so it may take a few moves within ``budget`` s."""
    from raftps.groups import Layout
    layout = Layout(tuple(cl.peers), groups)
    ideal = -(-groups // nodes)
    moves: list[dict[str, int]] = []
    deadline = time.monotonic() + budget
    lead: dict[int, int] = {}
    rng = np.random.default_rng(0)

    def count(lead: dict[int, int]) -> dict[int, int]:
        return {n: sum(1 for v in lead.values() if v == n) for n in range(1, nodes + 1)}

    while time.monotonic() < deadline:
        lead = leaders(admin.status(timeout=5.0, digest=False))
        if len(lead) < groups:
            time.sleep(0.3)
            continue
        c = count(lead)
        worst = max(c, key=c.get)
        if c[worst] <= ideal:
            break
        led = [g for g, n in lead.items() if n == worst]
        helpful = [g for g in led if any(c[m] < ideal for m in layout.members(g) if m != worst)]
        g = int(rng.choice(helpful or led))
        ports = [int(layout.raft_address(m, g).rsplit(":", 1)[1]) for m in layout.members(g)]
        try:
            for port in ports:
                for chain, way in (("INPUT", "--dport"), ("INPUT", "--sport"), ("OUTPUT", "--dport"),
                                   ("OUTPUT", "--sport")):
                    net.iptables(worst, "-A", chain, "-p", "tcp", way, str(port), "-j", "DROP")
            t = time.monotonic()
            while time.monotonic() - t < 10.0 and leaders(admin.status(timeout=5.0, digest=False)).get(g) == worst:
                time.sleep(0.2)
        finally:
            net.heal(worst)
        moves.append({"group": g, "from": worst})
        time.sleep(1.0)                       # the old leader hears the new term and steps down
    c = count(lead) if len(lead) == groups else {}
    return {"moves": moves, "leaders": lead, "spread": bool(c) and max(c.values()) <= ideal}


# ---- load -------------------------------------------------------------------------------------

class Load:
    """``clients`` threads, each its own Client, pushing one tensor per push, cycling the names."""

    def __init__(self, make_client: Any, names: list[str], clients: int, groups: int) -> None:
        self.make_client, self.names, self.groups = make_client, names, groups
        self.lock = threading.Lock()
        self.ok = 0
        self.next = 0
        self.per_group = [0] * groups
        self.errors: list[str] = []
        self.lat: list[float] = []           # seconds, of pushes completed while recording
        self.recording = False
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True, name=f"push-{k}")
                        for k in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        grad = np.full(ELEMENTS, 1e-7, np.float32)
        with self.make_client() as c:
            while not self.stop.is_set():
                with self.lock:                               # one rotation shared by all threads
                    name = self.names[self.next % len(self.names)]
                    self.next += 1
                t = time.perf_counter()
                try:
                    c.push({name: grad})
                except Exception as exc:                      # counted, reported; the load goes on
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.1)
                    continue
                dt = time.perf_counter() - t
                with self.lock:
                    self.ok += 1
                    self.per_group[_group_of(name, self.groups)] += 1
                    if self.recording:
                        self.lat.append(dt)

    def counts(self) -> tuple[int, list[int]]:
        with self.lock:
            return self.ok, list(self.per_group)

    def finish(self, timeout: float = 60.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))


# ---- one configuration ------------------------------------------------------------------------

def measure_config(run_dir: str, nodes: int, groups: int, seconds: float, warmup: float, clients: int,
                   max_ops: int, base_port: int = BASE_PORT, prefix: str = PREFIX, subnet: str = SUBNET,
                   per_group: int = 2, leaders_mode: str = "elected") -> dict[str, Any]:
    """One fresh cluster of ``nodes`` nodes and ``groups`` groups in namespaces; ``leaders_mode``
    "elected": leaders where the cluster puts them; "spread": moved first (spread_leaders)."""
    from raftps.chaos.netns import Net, available
    from raftps.localcluster import LocalCluster
    why = available()
    if why:
        raise RuntimeError(f"bench.groups needs network namespaces: {why}")
    net = Net(nodes, prefix=prefix, subnet=subnet)
    cl = LocalCluster(run_dir, nodes=nodes, base_port=base_port, hosts=net.hosts(), command_prefix=net.command_prefix,
                      extra_args=["--request-timeout", str(REQUEST_TIMEOUT)], groups=groups)
    rec: dict[str, Any] = {"nodes": nodes, "groups": groups, "clients": clients, "push_bytes": ELEMENTS * 4,
                           "leaders_mode": leaders_mode}
    load: Load | None = None
    t_start = time.monotonic()
    try:
        net.up()
        cl.start(timeout=120.0)
        rec["start_s"] = round(time.monotonic() - t_start, 1)
        pids = {n: int(cl.pid(n)) for n in range(1, nodes + 1)}
        links = {n: host_veth(net, n) for n in pids}
        names = tensor_names(groups, per_group)
        with cl.client(timeout=60.0) as admin:
            rec["leaders_elected"] = leaders(admin.status(timeout=5.0, digest=False))
            if leaders_mode == "spread":
                rec["spread"] = spread_leaders(cl, net, admin, nodes, groups)
            else:
                rec["leaders_settled_s"] = settle_leaders(admin, cl, groups)
            admin.create_many({n: np.zeros(ELEMENTS, np.float32) for n in names},
                              {n: {"name": "sgd", "lr": 1e-3} for n in names})
            # idle: what hosting the groups costs with no load (Raft heartbeats, ticks)
            s0 = sample(pids, links)
            time.sleep(IDLE_SECONDS)
            idle = delta(s0, sample(pids, links))
            rec["idle_cpu_per_s"] = {n: idle[n][0] / IDLE_SECONDS for n in pids}
            rec["idle_bytes_per_s"] = {n: idle[n][1] / IDLE_SECONDS for n in pids}
            load = Load(lambda: cl.client(timeout=60.0), names, clients, groups)
            load.start()
            time.sleep(warmup)
            lead0 = leaders(admin.status(timeout=5.0, digest=False))
            ok0, pg0 = load.counts()
            s0, t0 = sample(pids, links), time.monotonic()
            me0, m0 = proc_cpu_seconds(os.getpid()), machine_busy()
            with load.lock:
                load.recording = True
            while time.monotonic() - t0 < seconds and load.counts()[0] - ok0 < max_ops:
                time.sleep(0.05)
            ok1, pg1 = load.counts()
            s1, t1 = sample(pids, links), time.monotonic()
            me1, m1 = proc_cpu_seconds(os.getpid()), machine_busy()
            with load.lock:
                load.recording = False
            lead1 = leaders(admin.status(timeout=5.0, digest=False))
            load.finish()
            rec["converged"] = _converged(admin, groups)
        d = delta(s0, s1)
        pushes = ok1 - ok0
        window = t1 - t0
        rec.update(window_s=round(window, 2), pushes=pushes, pushes_per_group=[b - a for a, b in zip(pg0, pg1)],
                   pushes_per_s=pushes / window, errors=len(load.errors), error_examples=load.errors[:3],
                   latency_ms_p50=1e3 * statistics.median(load.lat) if load.lat else None,
                   leaders_start=lead0, leaders_end=lead1, leaders_changed=lead0 != lead1)
        rec.update(summarize_nodes(d, pushes, window, groups, nodes, lead1, rec["idle_cpu_per_s"]))
        # the client threads live in this process (its other threads only sleep and sample)
        rec["client_cpu_ms_per_push"] = 1e3 * (me1 - me0) / max(pushes, 1)
        rec["client_cores"] = (me1 - me0) / window
        rec["machine_cores_busy"] = (m1[0] - m0[0]) / window      # everything on the machine, others' work too
        rec["loadavg_1m"] = round(os.getloadavg()[0], 2)
    finally:
        if load is not None:
            load.finish()
        try:
            cl.stop()                           # SIGTERM each node by its PID, SIGKILL what is left
            cl.drop_payloads()
        finally:
            left = net.down()
            pids_left = [p for p in (cl.pid(n) for n in range(1, nodes + 1)) if p and _alive(p)]
            rec["cleanup"] = {"net_left": left, "pids_left": pids_left}
            if left or pids_left:
                log(f"groups {nodes}x{groups}: teardown left {left} {pids_left}")
    return rec


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def summarize_nodes(d: dict[int, tuple[float, int]], pushes: int, window: float, groups: int, nodes: int,
                    lead: dict[int, int], idle_per_s: dict[int, float] | None = None) -> dict[str, Any]:
    """Per-node and per-config figures from the window's CPU and byte deltas. ``idle_per_s``: each
    node's CPU seconds per second with no load; subtracted (times the window) for the
    load-attributable figure ("net"), which a machine whose cores cap pushes/s would otherwise
    inflate by idle CPU / pushes/s."""
    from raftps.groups import Layout
    layout = Layout(tuple(f"x:{n}" for n in range(1, nodes + 1)), groups)
    p = max(pushes, 1)
    per_node = []
    for n in sorted(d):
        cpu, b = d[n]
        idle = (idle_per_s or {}).get(n, 0.0) * window
        per_node.append({"node": n, "cpu_s": round(cpu, 3), "bytes": b, "cpu_ms_per_push": 1e3 * cpu / p,
                         "net_cpu_ms_per_push": 1e3 * (cpu - idle) / p,
                         "kib_per_push": b / p / 1024, "cores": cpu / window,
                         "hosts_groups": layout.hosted_by(n) if groups > 1 else [0],
                         "leads": sum(1 for g, ln in lead.items() if ln == n)})
    busiest = max(per_node, key=lambda r: r["cpu_ms_per_push"])
    return {"per_node": per_node, "busiest_node": busiest["node"],
            "busiest_cpu_ms_per_push": busiest["cpu_ms_per_push"],
            "busiest_net_cpu_ms_per_push": max(r["net_cpu_ms_per_push"] for r in per_node),
            "mean_cpu_ms_per_push": statistics.mean(r["cpu_ms_per_push"] for r in per_node),
            "total_cpu_ms_per_push": sum(r["cpu_ms_per_push"] for r in per_node),
            "busiest_bytes_per_push": max(r["kib_per_push"] for r in per_node) * 1024,
            "busiest_cpu_node_bytes_per_push": busiest["kib_per_push"] * 1024,
            "nodes_cores_busy": sum(r["cores"] for r in per_node),
            "leads_per_node": {r["node"]: r["leads"] for r in per_node}}


def _converged(client: Any, groups: int, timeout: float = 60.0) -> bool:
    """Every group's replicas at one version with one digest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = client.status(timeout=10.0)
        by: dict[int, set] = {}
        for r in rows:
            by.setdefault(r.get("group", 0), set()).add((r.get("applied"), r.get("digest")))
        if all(r["role"] != "down" for r in rows) and len(by) == groups and all(len(s) == 1 for s in by.values()):
            return True
        time.sleep(0.5)
    return False


# ---- the whole benchmark ----------------------------------------------------------------------

MODES = ("elected", "spread")


def measure(run_dir: str, configs: list[tuple[int, int]] = CONFIGS, seconds: float = 15.0, warmup: float = 3.0,
            clients: int = 4, max_ops: int = 3000, modes: tuple[str, ...] = MODES, repeat: int = 1) -> dict[str, Any]:
    """Every config once per leader mode (a fresh cluster each time), modes one after the other,
    all of it ``repeat`` times."""
    from raftps.chaos.netns import Net
    Net(max(n for n, _ in configs), prefix=PREFIX, subnet=SUBNET).down()     # leftovers of a crashed run
    records = []
    for rep, mode in [(rep, mode) for rep in range(1, repeat + 1) for mode in modes]:
        for nodes, groups in configs:
            log(f"groups: round {rep}, N={nodes} G={groups}, leaders {mode}: {seconds:.0f} s after {warmup:.0f} s of warm-up")
            failed_starts: list[dict[str, Any]] = []
            for attempt in range(1 + START_RETRIES):
                d = os.path.join(run_dir, f"n{nodes}g{groups}{mode}{rep}.{attempt}")
                try:
                    rec = measure_config(d, nodes, groups, seconds, warmup, clients, max_ops, leaders_mode=mode)
                except Exception as exc:
                    log(f"groups: N={nodes} G={groups} failed: {type(exc).__name__}: {exc}")
                    rec = {"nodes": nodes, "groups": groups, "leaders_mode": mode,
                           "error": f"{type(exc).__name__}: {exc}", "log_tails": _log_tails(d, nodes)}
                    for name, tail in rec["log_tails"].items():
                        log(f"--- {name} (last lines)\n{tail}")
                shutil.rmtree(d, ignore_errors=True)
                if "exited during start" not in rec.get("error", ""):
                    break
                # a node died while the cluster started (see START_RETRIES): a fresh cluster, once more
                failed_starts.append({k: rec[k] for k in ("error", "log_tails")})
                rec = {**rec, "error": rec["error"] + f" ({attempt + 1} tries)"}
            rec["failed_starts"] = failed_starts
            rec["round"] = rep
            records.append(rec)
            if "error" not in rec:
                log(f"groups: N={nodes} G={groups} ({mode}): {rec['pushes_per_s']:.1f} pushes/s ({rec['pushes']}), "
                    f"busiest node {rec['busiest_node']} {rec['busiest_cpu_ms_per_push']:.1f} ms CPU/push "
                    f"(net of idle {rec['busiest_net_cpu_ms_per_push']:.1f}), mean {rec['mean_cpu_ms_per_push']:.1f}, "
                    f"busiest {rec['busiest_bytes_per_push'] / MiB:.1f} MiB/push; leads {rec['leads_per_node']}"
                    f"{' (spread: ' + str(len(rec['spread']['moves'])) + ' moves)' if 'spread' in rec else ''}; "
                    f"client {rec['client_cores']:.2f} cores, machine {rec['machine_cores_busy']:.2f} cores busy; "
                    f"{rec['errors']} errors; cleanup {rec['cleanup']}")
    return {"records": records, "summary": summarize(records, configs, modes), "model": cost_model(records)}


def _log_tails(run_dir: str, nodes: int, lines: int = 15) -> dict[str, str]:
    """The last lines of each node's log that has an error or a traceback (for a failed config)."""
    out = {}
    for i in range(1, nodes + 1):
        try:
            with open(os.path.join(run_dir, f"node{i}.log"), errors="replace") as f:
                text = f.readlines()
        except OSError:
            continue
        if any("Traceback" in t or "rror" in t for t in text):
            out[f"node{i}.log"] = "".join(text[-lines:])
    return out


SUMMED = ("pushes_per_s", "busiest_cpu_ms_per_push", "busiest_net_cpu_ms_per_push", "mean_cpu_ms_per_push",
          "busiest_bytes_per_push", "total_cpu_ms_per_push", "machine_cores_busy", "client_cores")


def summarize(records: list[dict[str, Any]], configs: list[tuple[int, int]],
              modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Per leader mode and config (the mean if a config ran more than once), with the ratios of
    busiest-node CPU per push to (3, 1)'s, and the targets. With one group there is nothing to
    spread, so every (3, 1) run, whatever its mode, is the same cluster: the base is their mean."""
    out = []
    ones = [r for r in records if (r["nodes"], r["groups"]) == (3, 1) and "error" not in r]
    base = {k: statistics.mean(r[k] for r in ones) for k in SUMMED} if ones else None
    for mode in modes:
        rows = []
        for nodes, groups in configs:
            rs = [r for r in records if (r["nodes"], r["groups"], r.get("leaders_mode")) == (nodes, groups, mode)
                  and "error" not in r]
            if not rs:
                rows.append({"nodes": nodes, "groups": groups, "leaders_mode": mode, "runs": 0})
                continue
            rows.append({"nodes": nodes, "groups": groups, "leaders_mode": mode, "runs": len(rs),
                         **{k: statistics.mean(r[k] for r in rs) for k in SUMMED},
                         "max_leads": max(max(r["leads_per_node"].values()) for r in rs)})
        for s in rows:
            if base and s["runs"]:
                s["ratio_busiest_cpu"] = s["busiest_cpu_ms_per_push"] / base["busiest_cpu_ms_per_push"]
                s["ratio_busiest_net_cpu"] = s["busiest_net_cpu_ms_per_push"] / base["busiest_net_cpu_ms_per_push"]
                s["ratio_mean_cpu"] = s["mean_cpu_ms_per_push"] / base["mean_cpu_ms_per_push"]
                s["ratio_busiest_bytes"] = s["busiest_bytes_per_push"] / base["busiest_bytes_per_push"]
                t = TARGETS.get((s["nodes"], s["groups"]))
                if t is not None:
                    s["target"] = t
                    s["target_met"] = s["ratio_busiest_cpu"] <= t
        out += rows
    return out


def cost_model(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a push costs the leader and a follower of its group, net of idle, from the (3, 1) runs
    (L, F ms), and what that predicts for each run's busiest node: node i leading l_i and following
    f_i of the G groups (each getting 1/G of the pushes) costs (l_i L + f_i F) / G per push, plus
    its idle CPU rate / pushes/s. ``balanced``: the busiest node with leaders spread evenly and no
    idle term (one node per host, whose pushes/s the cores do not cap), as a ratio to L."""
    ones = [r for r in records if (r["nodes"], r["groups"]) == (3, 1) and "error" not in r]
    lead = [n["net_cpu_ms_per_push"] for r in ones for n in r["per_node"] if n["leads"]]
    follow = [n["net_cpu_ms_per_push"] for r in ones for n in r["per_node"] if not n["leads"]]
    if not lead or not follow:
        return None
    L, F = statistics.mean(lead), statistics.mean(follow)
    runs = []
    for r in records:
        if "error" in r:
            continue
        pred = [(n["leads"] * L + (len(n["hosts_groups"]) - n["leads"]) * F) / r["groups"]
                + 1e3 * _get(r["idle_cpu_per_s"], n["node"]) / max(r["pushes_per_s"], 1e-9) for n in r["per_node"]]
        runs.append({"nodes": r["nodes"], "groups": r["groups"], "leaders_mode": r["leaders_mode"],
                     "round": r.get("round"), "measured": r["busiest_cpu_ms_per_push"], "model": max(pred)})
    balanced = {}
    for nodes, groups in sorted({(r["nodes"], r["groups"]) for r in records}):
        from raftps.groups import Layout
        hosted = len(Layout(tuple(f"x:{i}" for i in range(1, nodes + 1)), groups).hosted_by(1))
        leads = -(-groups // nodes)
        balanced[f"{nodes}x{groups}"] = (leads * L + (hosted - leads) * F) / groups / L
    return {"leader_ms": L, "follower_ms": F, "runs": runs, "balanced_ratio_no_idle": balanced}


def _get(d: dict, node: int) -> float:
    return d.get(node, d.get(str(node), 0.0))          # int keys in memory, str keys from JSON


# ---- report -----------------------------------------------------------------------------------

def _leads(rec: dict[str, Any]) -> str:
    return " ".join(f"{c}" for n, c in sorted(rec["leads_per_node"].items(), key=lambda kv: int(kv[0])))


def _settled(rec: dict[str, Any]) -> str:
    """How the leaders got where they are: elected, then handed to the preferred members."""
    if rec.get("leaders_mode") != "elected" or rec["groups"] == 1 or "leaders_elected" not in rec:
        return ""
    first = {}
    for g, n in rec["leaders_elected"].items():
        first[int(n)] = first.get(int(n), 0) + 1
    elected = " ".join(str(first.get(i, 0)) for i in range(1, rec["nodes"] + 1))
    s = rec.get("leaders_settled_s")
    return f" (elected: {elected}; " + (f"all preferred after {s} s)" if s is not None else "not all preferred)")


def _restarts(rec: dict[str, Any]) -> str:
    n = len(rec.get("failed_starts") or [])
    return f" ({n} failed start{'s' if n > 1 else ''}, see START_RETRIES)" if n else ""


def _x(v: Any, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}x"


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    recs, summ = result["records"], result["summary"]
    L = ["# Load per node as nodes and Raft groups are added (multi-Raft)", "",
         f"{meta.get('date', '')}, commit {meta.get('commit', '?')}, {meta.get('machine', '')}; load average "
         f"{meta.get('loadavg_start')} at the start, {meta.get('loadavg_end')} at the end; {meta.get('elapsed_s')} s. "
         f"`{meta.get('command', 'python -m bench.groups')}` (bench/groups.py).", "",
         f"Every node in its own network namespace (veth + bridge, real addresses 10.77.20.I); {meta.get('clients')} "
         "client threads in the root namespace, each its own `raftps.Client`, pushing 4 MiB float32 gradients (SGD), "
         "one tensor per push, cycling through 2 tensors per group (names hashed into each group); "
         f"{meta.get('warmup')} s warm-up, then a window of {meta.get('seconds')} s (at most {meta.get('max_ops')} "
         "pushes). CPU: utime+stime (+reaped children) of each node process over the window; bytes: rx+tx of the "
         "node's host-side veth; both divided by the pushes acknowledged in the window. \"net of idle\" subtracts "
         "each node's own CPU rate with no load (measured for 2 s before the load) times the window. Leaders "
         "\"elected\": as the cluster placed them itself (pysyncobj elects at random; since the preferred-leader "
         "hand-over in raftps a leader then hands over to its group's preferred member, node g+1); \"spread\": moved before the load, one group at a time, by "
         "cutting the leader of a group led by the node leading most off from that group's Raft ports (iptables in "
         "its namespace) until another member is elected, until no node leads more than ceil(G/N).", "",
         "## Per run", "",
         "| N | G | leaders | round | pushes/s | pushes | busiest-node CPU ms/push | (net of idle) | mean-node CPU ms/push "
         "| all nodes CPU ms/push | busiest-node MiB/push | groups led by node 1..N | idle CPU % of a core/node "
         "| cores busy: machine / client | errors |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if "error" in r:
            L.append(f"| {r['nodes']} | {r['groups']} | {r.get('leaders_mode')} | {r.get('round')} | failed: "
                     f"{r['error']} | | | | | | | | | | |")
            continue
        idle = [100 * v for v in r["idle_cpu_per_s"].values()]
        L.append(f"| {r['nodes']} | {r['groups']} | {r['leaders_mode']} | {r['round']} | {r['pushes_per_s']:.1f} | {r['pushes']} | "
                 f"{r['busiest_cpu_ms_per_push']:.1f} (node {r['busiest_node']}) | "
                 f"{r['busiest_net_cpu_ms_per_push']:.1f} | {r['mean_cpu_ms_per_push']:.1f} | "
                 f"{r['total_cpu_ms_per_push']:.1f} | {r['busiest_bytes_per_push'] / MiB:.1f} | {_leads(r)}"
                 f"{' (changed in the window)' if r['leaders_changed'] else ''}"
                 f"{'' if 'spread' not in r else ' (' + str(len(r['spread']['moves'])) + ' moves' + ('' if r['spread']['spread'] else ', not spread') + ')'}"
                 f"{_settled(r)} | "
                 f"{min(idle):.1f}-{max(idle):.1f} | {r['machine_cores_busy']:.2f} / {r['client_cores']:.2f} | "
                 f"{r['errors']}{_restarts(r)} |")
    L += ["", "## Per configuration: ratios to (3, 1) and the targets", "",
          "Means over the runs of each config and leader mode; ratios to the mean of every (3, 1) run (one "
          "group: both modes are the same cluster).", "",
          "| leaders | N | G | runs | pushes/s | busiest-node CPU ms/push | busiest / (3,1) | net of idle: busiest / (3,1) "
          "| mean-node CPU ms/push | mean / (3,1) | busiest-node MiB/push | target | met |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summ:
        if not s["runs"]:
            L.append(f"| {s['leaders_mode']} | {s['nodes']} | {s['groups']} | 0 | failed | | | | | | | | |")
            continue
        t = s.get("target")
        L.append(f"| {s['leaders_mode']} | {s['nodes']} | {s['groups']} | {s['runs']} | {s['pushes_per_s']:.1f} | "
                 f"{s['busiest_cpu_ms_per_push']:.1f} | **{_x(s.get('ratio_busiest_cpu'))}** | "
                 f"{_x(s.get('ratio_busiest_net_cpu'))} | {s['mean_cpu_ms_per_push']:.1f} | "
                 f"{_x(s.get('ratio_mean_cpu'))} | {s['busiest_bytes_per_push'] / MiB:.1f} | "
                 f"{f'<= {t}x' if t else '-'} | {('yes' if s['target_met'] else 'no') if t else '-'} |")
    model = result.get("model")
    if model:
        L += ["", "## A cost model from the (3, 1) runs", "",
              f"Net of idle, a push costs its group's leader L = {model['leader_ms']:.1f} ms and each follower "
              f"F = {model['follower_ms']:.1f} ms of CPU (the (3, 1) runs). A node leading l and following f of "
              "the G groups should then spend (l L + f F) / G per push, plus its idle CPU rate / pushes/s:", "",
              "| N | G | leaders | round | busiest node measured ms/push | model |", "|---|---|---|---|---|---|"]
        for m in model["runs"]:
            L.append(f"| {m['nodes']} | {m['groups']} | {m['leaders_mode']} | {m['round']} | {m['measured']:.1f} | "
                     f"{m['model']:.1f} |")
        L += ["", "With leaders spread evenly and no idle term (one node per host, where pushes/s are not capped "
              "by two shared cores), the busiest node's CPU per push would be "
              + ", ".join(f"({k.replace('x', ', ')}) {v:.2f}x" for k, v in model["balanced_ratio_no_idle"].items())
              + " that of (3, 1) by this model."]
    L += ["", "Per node (CPU ms/push, net of idle, KiB/push, groups hosted, groups led) in groups.json. "
          "Plot: groups.png.", ""]
    if meta.get("notes"):
        L += [meta["notes"], ""]
    return "\n".join(L)


def plot(result: dict[str, Any], out: str) -> str | None:
    """Busiest-node and mean-node CPU per push for each config (N = 3 with G = 1 and 3, then
    G = N): the mean of the runs as lines, each run as a faint mark, the targets as bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = [s for s in result["summary"] if s["runs"]]
    recs = [r for r in result["records"] if "error" not in r]
    if not summ:
        return None
    configs = sorted({(s["nodes"], s["groups"]) for s in summ})
    pos = {c: i for i, c in enumerate(configs)}
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    looks = {("elected", "busiest"): dict(color="C3", ls="-", marker="o", mfc="C3"),
             ("spread", "busiest"): dict(color="C1", ls="--", marker="o", mfc="white"),
             ("elected", "mean"): dict(color="C0", ls="-", marker="s", mfc="C0"),
             ("spread", "mean"): dict(color="C9", ls="--", marker="s", mfc="white")}
    for mode in [m for m in MODES if any(s["leaders_mode"] == m for s in summ)]:
        ss = [s for s in summ if s["leaders_mode"] == mode]
        dx = -0.06 if mode == "elected" else 0.06
        for what in ("busiest", "mean"):
            key = f"{what}_cpu_ms_per_push"
            look = looks[(mode, what)]
            ax.plot([pos[(s["nodes"], s["groups"])] + dx for s in ss], [s[key] for s in ss], lw=1.5, ms=6,
                    label=f"{what} node, leaders {mode}", **look)
            rs = [r for r in recs if r.get("leaders_mode") == mode]
            ax.plot([pos[(r["nodes"], r["groups"])] + dx for r in rs], [r[key] for r in rs], ls="none", marker="x",
                    ms=4, color=look["color"], alpha=0.5)
    ones = [r["busiest_cpu_ms_per_push"] for r in recs if (r["nodes"], r["groups"]) == (3, 1)]
    if ones:
        b = statistics.mean(ones)
        for c, t in TARGETS.items():
            if c in pos:
                ax.plot([pos[c] - 0.25, pos[c] + 0.25], [t * b] * 2, "-", color="k", lw=2)
                ax.annotate(f"target {t}x", (pos[c] + 0.27, t * b), fontsize=7, va="center")
        ax.plot([], [], "-", color="k", lw=2, label="target for the busiest node (x the (3,1) mean)")
    ax.set_xticks(range(len(configs)), [f"N={n}, G={g}" for n, g in configs])
    ax.set_xlim(-0.4, len(configs) - 0.4)
    ax.set_xlabel("nodes N and Raft groups G (x: one run, lines: mean of runs)")
    ax.set_ylabel("node CPU ms per committed 4 MiB push")
    ax.set_ylim(bottom=0)
    ax.set_title("CPU per push on the busiest and the mean node as nodes and Raft groups are added", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "groups.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict[str, Any], meta: dict[str, Any], out: str) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "groups.json"), "w") as f:
        json.dump({"meta": meta, **result}, f, indent=1, default=str)
    md = report(result, meta)
    with open(os.path.join(out, "groups.md"), "w") as f:
        f.write(md)
    plot(result, out)
    return md


def run(out: str, configs: list[tuple[int, int]] = CONFIGS, seconds: float = 15.0, warmup: float = 3.0,
        clients: int = 4, max_ops: int = 3000, modes: tuple[str, ...] = MODES, repeat: int = 1,
        command: str = "python -m bench.groups") -> dict:
    import platform
    import subprocess
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="raftps-groups-") as run_dir:
        result = measure(run_dir, configs, seconds, warmup, clients, max_ops, modes, repeat)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "machine": f"{os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}",
            "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
            "seconds": seconds, "warmup": warmup, "clients": clients, "max_ops": max_ops, "modes": list(modes), "repeat": repeat,
            "elapsed_s": round(time.monotonic() - t0, 1)}
    md = write(result, meta, out)
    print(md)
    return {"meta": meta, **result}


def bench_part(out: str, mode: str) -> list[dict]:
    """``python -m bench --parts groups``: writes groups.md/.json/.png; no rows for results.md."""
    run(out, modes=("elected",), seconds=20.0 if mode == "full" else 10.0, repeat=2 if mode == "full" else 1, command=f"python -m bench --parts groups ({mode})")
    return []


def _configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        n, g = item.lower().split("x")
        out.append((int(n), int(g)))
    return out


def main(argv: list[str] | None = None) -> int:
    import sys
    ap = argparse.ArgumentParser(prog="python -m bench.groups", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="3x1,3x3,6x6,9x9", help="NxG, comma-separated (at most 9 nodes)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per config")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-ops", type=int, default=3000, help="most pushes in a window")
    ap.add_argument("--leaders", default="elected",
                    help="comma list, one fresh cluster per config for each: elected (where the cluster puts "
                         "them), spread (leaderships moved by the benchmark until no node leads more than "
                         "ceil(G/N): for a raftps without the preferred-leader hand-over, which would undo it)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of everything (the summary is their mean)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--render", action="store_true",
                    help="only re-render groups.md and groups.png from --out/groups.json (its meta.notes too)")
    a = ap.parse_args(argv)
    if a.render:
        with open(os.path.join(a.out, "groups.json")) as f:
            data = json.load(f)
        meta = data.pop("meta")
        data["model"] = cost_model(data["records"])
        print(write(data, meta, a.out))
        return 0
    modes = tuple(m for m in a.leaders.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--leaders: a comma list of {MODES}")
    r = run(a.out, _configs(a.configs), a.seconds, a.warmup, a.clients, a.max_ops, modes, a.repeat,
            command="python -m bench.groups " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0 if all("error" not in x for x in r["records"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
