"""bench/groups.py's accounting and report: per-node figures from the window's CPU and byte
deltas, the per-config summary against the targets, the cost model from the (3, 1) runs, and
groups.md/.json/.png. Pure functions of the records: tests/test_bench_groups.py checks them on
made-up ones."""
from __future__ import annotations

import os
import statistics
from typing import Any

from .common import MiB, write_results

TARGETS = {(6, 6): 0.6, (9, 9): 0.45}
MODES = ("elected", "spread")


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
    md = write_results(out, "groups", {"meta": meta, **result}, lambda: report(result, meta))
    plot(result, out)
    return md


