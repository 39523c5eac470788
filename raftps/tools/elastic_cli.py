"""``raftps hosts list | add ADDR | move GROUP FROM TO | abort GROUP | drain ADDR``: elastic hosts of a cluster of several
Raft groups (elastic.py; docs/cluster.md, "Adding a host")."""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from raftps import auth
from raftps.server.elastic import HostsAdmin
from raftps.errors import Unavailable, UsageError
from raftps.store.hosts import Hosts
from raftps.store.placement import leader_counts, remaining, replica_counts


def add_parser(sub: Any, client_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``hosts`` subcommand (``sub``: the subparsers of raftps's parser)."""
    p = sub.add_parser("hosts", help="which nodes serve which Raft group: list, add a host, move a group's replica")
    p.add_argument("action", choices=["list", "add", "move", "abort", "drain"])
    p.add_argument("args", nargs="*", help="add: ADDR (the new node's Raft address host:port); "
                                           "move: GROUP FROM TO (a Raft group, two nodes' Raft addresses); abort: GROUP "
                                           "(roll back its move in flight); drain: ADDR (move every replica off it)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the cluster (and a catch-up)")
    client_options(p)
    p.set_defaults(func=hosts)


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """``raftps serve``'s options for elastic hosts (with --groups G > 1)."""
    p.add_argument("--join", action="store_true",
                   help="with --groups G > 1: a new host (raftps hosts add): serve no Raft group until the hosts "
                        "record gives it one")
    p.add_argument("--dead-host-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="with --groups G > 1: while this node leads group 0, re-create the replicas of a node that "
                        "has not answered for this long on the others (0: off, the default)")
    p.add_argument("--balance", action="store_true",
                   help="with --groups G > 1: while this node leads group 0, fill added hosts, empty draining ones "
                        "(raftps cluster add-host / drain-host) and spread replicas and leaders within 1 of each other")


def open_admin(args: argparse.Namespace) -> HostsAdmin:
    """A HostsAdmin of the cluster the client options name."""
    token = auth.read_secret_file(args.token_file) if args.token_file else None
    try:
        return HostsAdmin(args.cluster, token=token, tls=args.tls_ca, timeout=args.timeout)
    except ValueError as exc:                  # no or malformed cluster addresses
        raise UsageError(str(exc)) from None


def hosts(args: argparse.Namespace) -> int:
    want = {"list": 0, "add": 1, "move": 3, "abort": 1, "drain": 1}[args.action]
    if len(args.args) != want or args.action in ("move", "abort") and not args.args[0].isdigit():
        raise UsageError("usage: raftps hosts list | add ADDR | move GROUP FROM TO | abort GROUP | drain ADDR (GROUP: a number; "
                         "ADDR, FROM, TO: nodes' Raft addresses host:port, as in --peers)")
    with open_admin(args) as admin:
        if args.action == "list":
            record = admin.hosts()
        elif args.action == "add":
            record = admin.add_host(args.args[0])
            print(f"added {args.args[0]} as node {len(record.nodes)}: start it with serve --join; "
                  "raftps hosts move gives it replicas")
        elif args.action == "drain":
            record, moved = admin.drain(args.args[0], catch_up_timeout=args.timeout)
            print(f"drained {args.args[0]}: {moved} replica(s) moved; its node exits")
        elif args.action == "abort":
            record = admin.abort(int(args.args[0]))
            print(f"Raft group {args.args[0]}: move rolled back")
        else:
            group, source, target = int(args.args[0]), args.args[1], args.args[2]
            record, moved = admin.move(group, source, target, catch_up_timeout=args.timeout)
            print(f"Raft group {group}: replica moved from {source} to {target}" if moved else "nothing to change")
    print(describe(record))
    return 0


def describe(record: Hosts) -> str:
    """The record in lines: its epoch, then each group's members (and its move in flight)."""
    lines = [f"hosts epoch {record.epoch}: " + ", ".join(f"{i}={a}" for i, a in enumerate(record.nodes, 1))]
    for group in range(record.groups):
        move = record.move_of(group)
        lines.append(f"group {group}: nodes {','.join(map(str, record.placed[group]))}"
                     + (f" (moving {move.source} -> {move.target}: {move.stage})" if move else ""))
    return "\n".join(lines)


# ---- raftps cluster add-host | drain-host, and raftps status's placement ----------------------

def placement_now(admin: HostsAdmin) -> tuple[Hosts, frozenset[int], int]:
    """The record, the nodes answering, and the steps the placement loop still has to take."""
    record = admin.hosts()
    up = frozenset(admin.status_rows(record, timeout=2.0))
    return record, up, remaining(record, up)


def change_and_wait(args: argparse.Namespace, action: str, address: str) -> int:
    """``cluster add-host ADDR`` (the record gets a host; start it with serve --join) or
    ``cluster drain-host ADDR`` (it is marked draining); then, unless --no-wait, a bar while the
    placement loop (serve --balance, on group 0's leader) fills or empties it, until the
    placement is balanced (Unavailable after --timeout)."""
    with open_admin(args) as admin:
        if action == "add-host":
            record = admin.add_host(address)
            print(f"added {address} as node {len(record.nodes)}: start it with serve --join")
        elif action == "wait":                 # only the wait (cluster start --add, once the node is up)
            pass
        else:
            record = admin.drain_host(address)
            print(f"{address} (node {record.node_of(address)}) is draining: its replicas move to the other hosts, "
                  "then its node exits")
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout
        record, up, left = placement_now(admin)
        total = max(left, 1)
        with _bar(total) as advance:
            while left or record.moves:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the placement is not balanced after {args.timeout:.0f} s ({left} step(s) to "
                                      "go): is the placement loop on (serve --balance) and the new host up?")
                advance(total - min(left, total))
                time.sleep(1.0)
                record, up, left = placement_now(admin)
            advance(total)
    print(describe(record))
    return 0


def replace_member(args: argparse.Namespace) -> bool:
    """``raftps member replace OLD NEW`` on a cluster of several Raft groups (False when it runs
    one: the member op replaces there): NEW joins the hosts record and OLD drains into it, one
    group at a time, with a bar (replace_host, docs/design/elastic.md). Run again, it resumes."""
    old, new = args.nodes
    with open_admin(args) as admin:
        if admin.groups() == 1:
            return False
        record = admin.change("replace_host", address=old, new=new)
        node = record.node_of(old)
        print(f"{new} is node {record.node_of(new)}, replacing {old} (node {node}): start it with serve --join; "
              "the replicas move to it one Raft group at a time", flush=True)
        with _bar(max(1, len(record.hosted_by(node))), "replacing") as advance:
            record, moved = admin.drain(old, catch_up_timeout=args.timeout, on_plan=lambda done, _: advance(done))
    print(f"replaced {old} with {new}: {moved} replica(s) moved; the old node exits. Its id {node} stays in the "
          "record, retired: a running node knows itself by its id, so ids are never renumbered or reused")
    print(describe(record))
    return True


def _bar(total: int, label: str = "rebalancing") -> Any:
    """A rich progress bar of the placement loop's steps (a line per step without rich)."""
    try:
        from rich.progress import Progress
    except ImportError:                        # rich comes with raftps[ops]
        return _TextBar(total, label)
    return _RichBar(Progress(transient=False), total, label)


class _RichBar:
    def __init__(self, progress: Any, total: int, label: str):
        self.progress, self.total, self.label = progress, total, label

    def __enter__(self) -> Callable[[int], None]:
        self.progress.start()
        task = self.progress.add_task(self.label, total=self.total)
        return lambda done: self.progress.update(task, completed=done)

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


class _TextBar:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, -1

    def __enter__(self) -> Callable[[int], None]:
        return self.advance

    def advance(self, done: int) -> None:
        if done != self.done:
            self.done = done
            print(f"{self.label}: {done}/{self.total} steps", flush=True)

    def __exit__(self, *exc: object) -> None:
        pass


def print_placement(args: argparse.Namespace, rows: list[dict]) -> None:
    """Below ``raftps status``'s table, with several Raft groups: the hosts record, replicas and
    named leaders per node, and how far the placement loop is from balanced."""
    if not any(r.get("group") for r in rows):
        return
    with open_admin(args) as admin:
        record, up, left = placement_now(admin)
    replicas, leaders = replica_counts(record), leader_counts(record)
    print(describe(record))
    print("per node: " + ", ".join(f"{n}: {replicas[n]} replicas, {leaders[n]} leading" for n in replicas)
          + "".join(f"; {n} draining ({len(record.hosted_by(n))} left)" for n in record.draining))
    placed = sum(len(m) for m in record.placed)
    silent = [n for n in range(1, len(record.nodes) + 1) if n not in up and record.hosted_by(n)]
    if not left and not record.moves and not silent:
        print("placement: balanced")
        return
    if not left:
        print("placement: waiting" + (f" for node(s) {', '.join(map(str, silent))} to answer" if silent else "")
              + (f"; {len(record.moves)} move(s) in flight" if record.moves else ""))
        return
    print(f"placement: {left} step(s) to go")
    try:
        from rich.console import Console
        from rich.progress_bar import ProgressBar
    except ImportError:
        return
    Console().print(ProgressBar(total=placed, completed=max(0, placed - left), width=40))
