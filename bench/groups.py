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

from .common import MiB, log, machine
from .groups_report import MODES, cost_model, summarize, summarize_nodes, write

CONFIGS = [(3, 1), (3, 3), (6, 6), (9, 9)]
BASE_PORT = 31000
PREFIX, SUBNET = "rpsb", "10.77.20"
ELEMENTS = 1 << 20                      # float32: 4 MiB per push
REQUEST_TIMEOUT = 30.0
IDLE_SECONDS = 2.0
# A node can die while 9 start at once: raftps.server.node.sweep_abandoned_payload_dirs in one node can
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
    from raftps.tools.localcluster import LocalCluster
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


def run(out: str, configs: list[tuple[int, int]] = CONFIGS, seconds: float = 15.0, warmup: float = 3.0,
        clients: int = 4, max_ops: int = 3000, modes: tuple[str, ...] = MODES, repeat: int = 1,
        command: str = "python -m bench.groups") -> dict:
    import subprocess
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="raftps-groups-") as run_dir:
        result = measure(run_dir, configs, seconds, warmup, clients, max_ops, modes, repeat)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "machine": machine(),
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
