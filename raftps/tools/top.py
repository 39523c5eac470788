"""``raftps top``: a live view of every node, polled over the client port (no metrics server needed).

Each refresh asks every node for its status (without the digest, which would hash the store) and
shows, per node: role, term, applied index, lag (entries behind the leader's commit index),
applied entries/s and pushes/s since the last refresh, the staleness of the pushes applied in that
window (mean and max tau, from the store's histogram), payload and model bytes, and client
connections. On a terminal it redraws in place (rich's Live); otherwise (a pipe, a log file) it
prints one table per refresh. ``count`` and ``interval`` bound it.
"""
from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from raftps.client.client import Client

COLUMNS = ["node", "role", "term", "applied", "lag", "applied/s", "pushes/s", "tau mean", "tau max",
           "payload MB", "model MB", "conns"]


def sample(client: Client) -> tuple[float, list[dict]]:
    return time.monotonic(), client.status(timeout=1.0, digest=False)


def rows(previous: tuple[float, list[dict]] | None, current: tuple[float, list[dict]]) -> list[dict]:
    """One row per node (and Raft group, with several) with rates over the window since
    ``previous`` (None: the first sample); lag is behind the leader of the row's group."""
    now, nodes = current

    def key(n: dict) -> tuple:
        return n["node"], n.get("group", 0)
    heads = {}
    for g in {n.get("group", 0) for n in nodes}:
        mine = [n for n in nodes if n.get("group", 0) == g]
        leaders = [n for n in mine if n.get("role") == "leader"]
        commits = [n["commit"] for n in mine if n.get("commit") is not None]
        heads[g] = max(leaders, key=lambda n: n["term"])["commit"] if leaders else max(commits, default=None)
    before = {} if previous is None else {key(n): n for n in previous[1] if n.get("role") != "down"}
    dt = None if previous is None else max(now - previous[0], 1e-6)
    out = []
    for n in nodes:
        if n.get("role") == "down":
            out.append({"node": n["node"], "role": "down"})
            continue
        head = heads[n.get("group", 0)]
        row: dict[str, Any] = {"node": n["node"], "group": n.get("group", 0), "role": n["role"], "term": n["term"],
                               "applied": n["applied"], "lag": None if head is None else max(0, head - n["applied"]),
                               "payload MB": n.get("payload_disk_bytes", 0) / 2**20,
                               "model MB": n.get("model_bytes", 0) / 2**20, "conns": n.get("connections")}
        old = before.get(key(n))
        if old is not None and dt is not None:
            row["applied/s"] = (n["applied"] - old["applied"]) / dt
            row["pushes/s"] = (n.get("pushes", 0) - old.get("pushes", 0)) / dt
            window = _histogram_delta(old.get("staleness") or {}, n.get("staleness") or {})
            count = sum(window.values())
            if count:
                row["tau mean"] = sum(tau * k for tau, k in window.items()) / count
                row["tau max"] = max(tau for tau, k in window.items() if k)
        out.append(row)
    return out


def _histogram_delta(old: dict, new: dict) -> dict[int, int]:
    """Pushes per staleness applied between two snapshots of the store's histogram."""
    return {int(tau): n - old.get(tau, 0) for tau, n in new.items() if n - old.get(tau, 0) > 0}


def table(nodes: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    columns = COLUMNS[:1] + ["group"] + COLUMNS[1:] if any(r.get("group") for r in nodes) else COLUMNS
    for col in columns:
        t.add_column(col, justify="left" if col == "role" else "right")
    for row in nodes:
        style = {"leader": "bold green", "down": "red", "candidate": "yellow"}.get(row["role"])
        t.add_row(*[_cell(row.get(col)) for col in columns], style=style)
    return t


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if value < 1000 else f"{value:.0f}"
    return str(value)


def run(client: Client, count: int | None, interval: float, console: Console | None = None) -> int:
    """Refresh every ``interval`` seconds, ``count`` times (None: until interrupted)."""
    console = console or Console()
    previous = None
    shown = 0

    def frame() -> Table:
        nonlocal previous
        current = sample(client)
        nodes = rows(previous, current)
        previous = current
        return table(nodes, f"raftps top  {time.strftime('%H:%M:%S')}  every {interval:g} s")

    if not console.is_terminal:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            console.print(frame())
            shown += 1
        return 0
    with Live(frame(), console=console, auto_refresh=False) as live:
        shown = 1
        while count is None or shown < count:
            time.sleep(interval)
            live.update(frame(), refresh=True)
            shown += 1
    return 0
