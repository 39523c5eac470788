"""``raftps cluster start|stop|kill|status|wipe``: the local cluster of a run dir
(``raftps/tools/localcluster.py``) from the command line, as the cluster/*.sh scripts run it."""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable

from raftps.tools import elastic_cli
from raftps.tools.localcluster import ClusterError, LocalCluster
from raftps.errors import UsageError


def status_table(rows: list[dict]) -> str:
    """Status rows (Client.status, LocalCluster.status) as an aligned text table, one row per node
    (per node and Raft group when there are several)."""
    cols = ["node", "pid", "address", "role", "term", "applied", "version", "digest", "leader", "metrics"]
    if any(r.get("group") for r in rows):          # several Raft groups: a row per node and group
        cols.insert(1, "group")
    lines = [cols]
    for r in rows:
        lines.append(["-" if r.get(c) is None else (str(r[c])[:16] if c == "digest" else str(r[c])) for c in cols])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)


def add_parser(sub: argparse._SubParsersAction, env_int: Callable[[str, int], int]) -> None:
    """The ``cluster`` subcommand; ``env_int(variable, default)``: an environment variable's
    whole number (a wrong one refused by name)."""
    p = sub.add_parser("cluster", help="manage a local cluster (RAFTPS_RUN_DIR, RAFTPS_BASE_PORT)")
    p.add_argument("action", choices=["start", "stop", "kill", "status", "wipe", "add-host", "drain-host"])
    p.add_argument("node", nargs="?", help="kill: a node number; add-host, drain-host: a host's Raft address "
                                           "HOST:PORT (of the cluster at $RAFTPS_CLUSTER, else of the run dir's)")
    p.add_argument("--add", action="store_true", help="start: add one host to a running cluster of several Raft "
                                                      "groups and wait for the placement loop to fill it")
    p.add_argument("--no-wait", dest="wait", action="store_false",
                   help="add-host, drain-host: return once the hosts record has the change")
    p.add_argument("--nodes", type=int, default=env_int("RAFTPS_NODES", 3))
    p.add_argument("--groups", type=int, default=env_int("RAFTPS_GROUPS", 0) or None,
                   help="Raft groups to shard tensors over (start: fixed for the cluster's life; default 1)")
    p.add_argument("--durability", choices=("none", "fsync"), default=os.environ.get("RAFTPS_DURABILITY") or None,
                   help="start: fsync (survives power loss) or none (default; fixed for the cluster's life)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--base-port", type=int, default=env_int("RAFTPS_BASE_PORT", 7100))
    p.add_argument("--timeout", type=float, default=60.0)
    p.set_defaults(func=cluster)


def open_cluster(args: argparse.Namespace) -> LocalCluster:
    """The local cluster of RUN_DIR. Its Raft groups and durability are fixed when it is first
    started (recorded in RUN_DIR/cluster.json): a later start without the flags keeps them; other
    values are refused."""
    run_dir = args.run_dir or os.environ.get("RAFTPS_RUN_DIR") or os.path.join(os.getcwd(), "cluster", "run")
    recorded_file = os.path.join(run_dir, "cluster.json")
    try:
        recorded = json.load(open(recorded_file)) if os.path.exists(recorded_file) else {}
    except ValueError as exc:
        raise ValueError(f"{recorded_file} is not what `raftps cluster start` writes ({exc}): wipe the cluster "
                         "(raftps cluster wipe: deletes its data) or fix the file") from None
    chosen = {"groups": args.groups or recorded.get("groups", 1),
              "durability": args.durability or recorded.get("durability", "none")}
    for key, value in chosen.items():
        if key in recorded and recorded[key] != value:
            raise ValueError(f"the cluster in {run_dir} runs with {key} {recorded[key]}, not {value}: "
                             "wipe it first (raftps cluster wipe: deletes its data) to change it")
    # hosts added with start --add are counted in the record; several groups balance themselves
    cl = LocalCluster(run_dir, nodes=args.nodes + recorded.get("added", 0), base_port=args.base_port,
                      extra_args=["--balance"] if chosen["groups"] > 1 else None, **chosen)
    if args.action == "start" and not recorded:
        with open(recorded_file, "w") as f:
            json.dump(chosen, f)
    return cl


def cluster(args: argparse.Namespace) -> int:
    """A stopped cluster or node is named in one line (exit 1), a node the cluster never had too
    (exit 2); stop and wipe of a stopped cluster succeed, saying nothing was running."""
    if args.action == "kill" and not (args.node or "").isdigit():
        raise UsageError("give the number of the node to kill" + (f", not {args.node!r}" if args.node else ""))
    if args.action in ("add-host", "drain-host") and not args.node:
        raise UsageError(f"give the Raft address HOST:PORT of the host to {args.action.split('-')[0]}")
    if args.action in ("add-host", "drain-host") and os.environ.get("RAFTPS_CLUSTER"):
        return elastic_cli.change_and_wait(_elastic_args(args, os.environ["RAFTPS_CLUSTER"], None), args.action,
                                           args.node)
    try:
        cl = open_cluster(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    up = [n for n in cl.known_nodes() if cl.is_up(n)]
    if args.action in ("add-host", "drain-host"):
        return elastic_cli.change_and_wait(_elastic_args(args, cl.addresses, cl.token_file), args.action, args.node)
    if args.action == "start" and args.add:
        return _add_a_node(args, cl)
    if args.action == "start":
        addresses = cl.start(timeout=args.timeout)
        print(status_table(cl.status()))
        print(f"RAFTPS_TOKEN_FILE={cl.token_file}")
        print(f"RAFTPS_CLUSTER={addresses}")
    elif args.action in ("stop", "wipe") and not up:
        if args.action == "wipe":
            cl.wipe()
        print(f"no node of {cl.run_dir} was running" + ("; deleted it and its payloads" if args.action == "wipe" else ""))
    elif args.action == "stop":
        cl.stop()
        print(f"stopped the nodes of {cl.run_dir}")
    elif args.action == "wipe":
        cl.wipe()
        print(f"stopped the nodes and deleted {cl.run_dir} and their payloads")
    elif args.action == "kill":
        args.node = int(args.node)
        known = cl.known_nodes()
        if args.node not in known:
            raise UsageError(f"the cluster in {cl.run_dir} has no node {args.node} "
                             + (f"(its nodes: {_ranges(known)})" if known else "(no node was ever started there)"))
        pid = cl.pid(args.node)
        cl.kill(args.node)                     # NodeNotRunning if it is down
        print(f"node {args.node} (pid {pid}) killed with SIGKILL")
    elif not up:
        raise ClusterError(f"no node of {cl.run_dir} is running (cluster/start.sh starts them)")
    else:
        print(status_table(cl.status()))
    return 0


def _elastic_args(args: argparse.Namespace, addresses: str, token_file: str | None) -> argparse.Namespace:
    return argparse.Namespace(cluster=addresses, token_file=token_file, tls_ca=None, timeout=max(args.timeout, 300.0),
                              wait=args.wait)


def _add_a_node(args: argparse.Namespace, cl: LocalCluster) -> int:
    """``cluster start --add``: one more node for a running local cluster of several Raft
    groups: in the hosts record, started with serve --join, filled by the placement loop."""
    if cl.groups == 1:
        raise UsageError("--add needs a cluster of several Raft groups (start it with --groups G, G > 1); "
                         "a one-group cluster grows with raftps member add")
    cl.start(timeout=args.timeout)
    node = cl.add_node()
    address = cl.peers[node - 1]
    elastic_cli.change_and_wait(argparse.Namespace(**{**vars(_elastic_args(args, cl.addresses, cl.token_file)),
                                                      "wait": False}), "add-host", address)
    cl.start_node(node, ("--join",))
    _record(cl, added=_recorded(cl).get("added", 0) + 1)
    return elastic_cli.change_and_wait(_elastic_args(args, cl.addresses, cl.token_file), "wait", address)


def _recorded(cl: LocalCluster) -> dict:
    path = os.path.join(cl.run_dir, "cluster.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def _record(cl: LocalCluster, **fields: object) -> None:
    recorded = {**_recorded(cl), **fields}          # read before the file is opened for writing
    with open(os.path.join(cl.run_dir, "cluster.json"), "w") as f:
        json.dump(recorded, f)


def _ranges(nodes: list[int]) -> str:
    """'1..3' for consecutive node numbers, else '1, 2, 5'."""
    if nodes and nodes == list(range(nodes[0], nodes[-1] + 1)) and len(nodes) > 1:
        return f"{nodes[0]}..{nodes[-1]}"
    return ", ".join(map(str, nodes))
