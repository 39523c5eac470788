"""Load per node as nodes and Raft groups are added (issue 14's benchmark): multi-Raft scale-out.

    python -m bench.groups [--configs 3x1,3x3,6x6,9x9] [--seconds 15] [--warmup 3] [--clients 4]
                           [--runs 2] [--max-ops 3000] [--out bench/results]
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


def delta(a: dict[int, tuple[float, int]], b: dict[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
    return {n: (b[n][0] - a[n][0], b[n][1] - a[n][1]) for n in a}


def tensor_names(groups: int, per_group: int = 2) -> list[str]:
    """``per_group`` names hashing into each group, group by group."""
    out = []
    for g in range(groups):
        out += [n for n in (f"p{g}.{j}" for j in range(100_000)) if _group_of(n, groups) == g][:per_group]
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
                   per_group: int = 2) -> dict[str, Any]:
    from raftps.chaos.netns import Net, available
    from raftps.localcluster import LocalCluster
    why = available()
    if why:
        raise RuntimeError(f"bench.groups needs network namespaces: {why}")
    net = Net(nodes, prefix=prefix, subnet=subnet)
    cl = LocalCluster(run_dir, nodes=nodes, base_port=base_port, hosts=net.hosts(), command_prefix=net.command_prefix,
                      extra_args=["--request-timeout", str(REQUEST_TIMEOUT)], groups=groups)
    rec: dict[str, Any] = {"nodes": nodes, "groups": groups, "clients": clients, "push_bytes": ELEMENTS * 4}
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
            with load.lock:
                load.recording = True
            while time.monotonic() - t0 < seconds and load.counts()[0] - ok0 < max_ops:
                time.sleep(0.05)
            ok1, pg1 = load.counts()
            s1, t1 = sample(pids, links), time.monotonic()
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
        rec.update(summarize_nodes(d, pushes, window, groups, nodes, lead1))
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
                    lead: dict[int, int]) -> dict[str, Any]:
    """Per-node and per-config figures from the window's CPU and byte deltas."""
    from raftps.groups import Layout
    layout = Layout(tuple(f"x:{n}" for n in range(1, nodes + 1)), groups)
    p = max(pushes, 1)
    per_node = []
    for n in sorted(d):
        cpu, b = d[n]
        per_node.append({"node": n, "cpu_s": round(cpu, 3), "bytes": b, "cpu_ms_per_push": 1e3 * cpu / p,
                         "kib_per_push": b / p / 1024, "cores": cpu / window,
                         "hosts_groups": layout.hosted_by(n) if groups > 1 else [0],
                         "leads": sum(1 for g, ln in lead.items() if ln == n)})
    busiest = max(per_node, key=lambda r: r["cpu_ms_per_push"])
    return {"per_node": per_node, "busiest_node": busiest["node"],
            "busiest_cpu_ms_per_push": busiest["cpu_ms_per_push"],
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

def measure(run_dir: str, configs: list[tuple[int, int]] = CONFIGS, seconds: float = 15.0, warmup: float = 3.0,
            clients: int = 4, max_ops: int = 3000, runs: int = 1) -> dict[str, Any]:
    from raftps.chaos.netns import Net
    Net(max(n for n, _ in configs), prefix=PREFIX, subnet=SUBNET).down()     # leftovers of a crashed run
    records = []
    for run in range(1, runs + 1):
        for nodes, groups in configs:
            log(f"groups: run {run}, N={nodes} G={groups}: {seconds:.0f} s after {warmup:.0f} s of warm-up")
            d = os.path.join(run_dir, f"n{nodes}g{groups}r{run}")
            try:
                rec = measure_config(d, nodes, groups, seconds, warmup, clients, max_ops)
            except Exception as exc:
                log(f"groups: N={nodes} G={groups} failed: {type(exc).__name__}: {exc}")
                rec = {"nodes": nodes, "groups": groups, "error": f"{type(exc).__name__}: {exc}"}
            rec["run"] = run
            shutil.rmtree(d, ignore_errors=True)
            records.append(rec)
            if "error" not in rec:
                log(f"groups: N={nodes} G={groups}: {rec['pushes_per_s']:.1f} pushes/s ({rec['pushes']}), busiest "
                    f"node {rec['busiest_node']} {rec['busiest_cpu_ms_per_push']:.1f} ms CPU/push, mean "
                    f"{rec['mean_cpu_ms_per_push']:.1f}, busiest {rec['busiest_bytes_per_push'] / MiB:.1f} MiB/push; "
                    f"leads {rec['leads_per_node']}; {rec['errors']} errors; cleanup {rec['cleanup']}")
    return {"records": records, "summary": summarize(records, configs)}


def summarize(records: list[dict[str, Any]], configs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per config: the mean over runs, and the ratios of busiest-node CPU per push to (3, 1)'s."""
    out = []
    for nodes, groups in configs:
        rs = [r for r in records if r["nodes"] == nodes and r["groups"] == groups and "error" not in r]
        if not rs:
            out.append({"nodes": nodes, "groups": groups, "runs": 0})
            continue
        m = {k: statistics.mean(r[k] for r in rs) for k in
             ("pushes_per_s", "busiest_cpu_ms_per_push", "mean_cpu_ms_per_push", "busiest_bytes_per_push",
              "total_cpu_ms_per_push")}
        out.append({"nodes": nodes, "groups": groups, "runs": len(rs), **m,
                    "busiest_cpu_ms_per_push_runs": [r["busiest_cpu_ms_per_push"] for r in rs]})
    base = next((s for s in out if (s["nodes"], s["groups"]) == (3, 1) and s["runs"]), None)
    for s in out:
        if base and s["runs"]:
            s["ratio_busiest_cpu"] = s["busiest_cpu_ms_per_push"] / base["busiest_cpu_ms_per_push"]
            s["ratio_mean_cpu"] = s["mean_cpu_ms_per_push"] / base["mean_cpu_ms_per_push"]
            t = TARGETS.get((s["nodes"], s["groups"]))
            if t is not None:
                s["target"] = t
                s["target_met"] = s["ratio_busiest_cpu"] <= t
    return out


# ---- report -----------------------------------------------------------------------------------

def _leads(rec: dict[str, Any]) -> str:
    return " ".join(f"{n}:{c}" for n, c in sorted(rec["leads_per_node"].items(), key=lambda kv: int(kv[0])))


def report(result: dict[str, Any], meta: dict[str, Any]) -> str:
    recs, summ = result["records"], result["summary"]
    L = ["# Load per node as nodes and Raft groups are added (multi-Raft)", "",
         f"{meta.get('date', '')}, commit {meta.get('commit', '?')}, {meta.get('machine', '')}; load average "
         f"{meta.get('loadavg_start')} at the start, {meta.get('loadavg_end')} at the end. "
         f"`{meta.get('command', 'python -m bench.groups')}`.", "",
         f"Every node in its own network namespace (veth + bridge, 10.77.20.I); {meta.get('clients')} client threads "
         "in the root namespace, each its own `raftps.Client`, pushing 4 MiB float32 gradients (SGD), one tensor "
         "per push, cycling through 2 tensors per group; "
         f"{meta.get('warmup')} s warm-up, then a window of {meta.get('seconds')} s (at most {meta.get('max_ops')} "
         "pushes). CPU: utime+stime(+children) of each node process over the window; bytes: rx+tx of the node's "
         "host-side veth; both divided by the pushes acknowledged in the window.", "",
         "## Per run", "",
         "| N | G | run | pushes/s | pushes | busiest-node CPU ms/push | mean-node CPU ms/push | all nodes CPU ms/push "
         "| busiest-node MiB/push | groups led per node | idle CPU %/node (max) | errors |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if "error" in r:
            L.append(f"| {r['nodes']} | {r['groups']} | {r['run']} | failed: {r['error']} | | | | | | | | |")
            continue
        L.append(f"| {r['nodes']} | {r['groups']} | {r['run']} | {r['pushes_per_s']:.1f} | {r['pushes']} | "
                 f"{r['busiest_cpu_ms_per_push']:.1f} (node {r['busiest_node']}) | {r['mean_cpu_ms_per_push']:.1f} | "
                 f"{r['total_cpu_ms_per_push']:.1f} | {r['busiest_bytes_per_push'] / MiB:.1f} | {_leads(r)}"
                 f"{' (changed)' if r['leaders_changed'] else ''} | "
                 f"{100 * max(r['idle_cpu_per_s'].values()):.0f} | {r['errors']} |")
    L += ["", "## Per configuration (mean over runs) and the targets", "",
          "| N | G | runs | pushes/s | busiest-node CPU ms/push | mean-node CPU ms/push | busiest-node MiB/push "
          "| busiest / (3,1) | mean / (3,1) | target | met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summ:
        if not s["runs"]:
            L.append(f"| {s['nodes']} | {s['groups']} | 0 | failed | | | | | | | |")
            continue
        t = s.get("target")
        L.append(f"| {s['nodes']} | {s['groups']} | {s['runs']} | {s['pushes_per_s']:.1f} | "
                 f"{s['busiest_cpu_ms_per_push']:.1f} | {s['mean_cpu_ms_per_push']:.1f} | "
                 f"{s['busiest_bytes_per_push'] / MiB:.1f} | {s.get('ratio_busiest_cpu', float('nan')):.2f}x | "
                 f"{s.get('ratio_mean_cpu', float('nan')):.2f}x | {f'<= {t}x' if t else '-'} | "
                 f"{('yes' if s['target_met'] else 'no') if t else '-'} |")
    L += ["", "Per node (CPU ms/push, KiB/push, leads) in groups.json. Plot: groups.png.", ""]
    if meta.get("notes"):
        L += [meta["notes"], ""]
    return "\n".join(L)


def plot(result: dict[str, Any], out: str) -> str | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in result["records"] if "error" not in r]
    summ = [s for s in result["summary"] if s["runs"]]
    if not summ:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    label = lambda s: f"N={s['nodes']}, G={s['groups']}"   # noqa: E731
    xs = list(range(len(summ)))
    ax.plot(xs, [s["busiest_cpu_ms_per_push"] for s in summ], "o-", color="C3", label="busiest node (mean of runs)")
    ax.plot(xs, [s["mean_cpu_ms_per_push"] for s in summ], "s-", color="C0", label="mean node (mean of runs)")
    for i, s in enumerate(summ):
        rs = [r for r in recs if (r["nodes"], r["groups"]) == (s["nodes"], s["groups"])]
        ax.plot([i] * len(rs), [r["busiest_cpu_ms_per_push"] for r in rs], "x", color="C3", alpha=0.6)
        ax.plot([i] * len(rs), [r["mean_cpu_ms_per_push"] for r in rs], "+", color="C0", alpha=0.6)
    base = next((s for s in summ if (s["nodes"], s["groups"]) == (3, 1)), None)
    if base:
        for (n, g), t in TARGETS.items():
            if any((s["nodes"], s["groups"]) == (n, g) for s in summ):
                i = next(i for i, s in enumerate(summ) if (s["nodes"], s["groups"]) == (n, g))
                ax.plot([i - 0.2, i + 0.2], [t * base["busiest_cpu_ms_per_push"]] * 2, "--", color="k", lw=1)
        ax.plot([], [], "--", color="k", lw=1, label="target for the busiest node")
    ax.set_xticks(xs, [label(s) for s in summ])
    ax.set_ylabel("node CPU ms per committed 4 MiB push")
    ax.set_ylim(bottom=0)
    ax.set_title("CPU per push per node as nodes and Raft groups are added")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
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
        clients: int = 4, max_ops: int = 3000, runs: int = 1, command: str = "python -m bench.groups") -> dict:
    import platform
    import subprocess
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="raftps-groups-") as run_dir:
        result = measure(run_dir, configs, seconds, warmup, clients, max_ops, runs)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "machine": f"{os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}",
            "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
            "seconds": seconds, "warmup": warmup, "clients": clients, "max_ops": max_ops, "runs": runs,
            "elapsed_s": round(time.monotonic() - t0, 1)}
    md = write(result, meta, out)
    print(md)
    return {"meta": meta, **result}


def bench_part(out: str, mode: str) -> list[dict]:
    """``python -m bench --parts groups``: writes groups.md/.json/.png; no rows for results.md."""
    full = mode == "full"
    run(out, seconds=20.0 if full else 10.0, runs=2 if full else 1, command=f"python -m bench --parts groups ({mode})")
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
    ap.add_argument("--runs", type=int, default=2, help="fresh clusters per config (leaders are elected at random)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    r = run(a.out, _configs(a.configs), a.seconds, a.warmup, a.clients, a.max_ops, a.runs,
            command="python -m bench.groups " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0 if all("error" not in x for x in r["records"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
