"""``raftps hosts list | add ADDR | move GROUP FROM TO | abort GROUP | drain ADDR``: elastic hosts of a cluster of several
Raft groups (elastic.py; docs/cluster.md, "Adding a host")."""
from __future__ import annotations

import argparse
from typing import Any, Callable

from raftps import auth
from raftps.server.elastic import HostsAdmin
from raftps.errors import UsageError
from raftps.store.hosts import Hosts


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


def hosts(args: argparse.Namespace) -> int:
    want = {"list": 0, "add": 1, "move": 3, "abort": 1, "drain": 1}[args.action]
    if len(args.args) != want or args.action in ("move", "abort") and not args.args[0].isdigit():
        raise UsageError("usage: raftps hosts list | add ADDR | move GROUP FROM TO | abort GROUP | drain ADDR (GROUP: a number; "
                         "ADDR, FROM, TO: nodes' Raft addresses host:port, as in --peers)")
    token = auth.read_secret_file(args.token_file) if args.token_file else None
    try:
        admin = HostsAdmin(args.cluster, token=token, tls=args.tls_ca, timeout=args.timeout)
    except ValueError as exc:                  # no or malformed cluster addresses
        raise UsageError(str(exc)) from None
    with admin:
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
