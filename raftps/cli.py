"""Command line: ``raftps serve`` runs a node; ``raftps status`` and ``raftps cluster ...`` manage one."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .client import Client


def _status_table(rows: list[dict]) -> str:
    cols = ["node", "pid", "address", "role", "term", "applied", "version", "digest", "leader"]
    lines = [cols]
    for r in rows:
        lines.append(["-" if r.get(c) is None else (str(r[c])[:16] if c == "digest" else str(r[c])) for c in cols])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)


def serve(args: argparse.Namespace) -> int:
    from .node import NodeConfig, RaftNode
    from .server import ClientServer
    from .tuning import keep_large_buffers_on_the_heap

    keep_large_buffers_on_the_heap()

    logging.basicConfig(level=os.environ.get("RAFTPS_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s node{args.id} %(name)s %(levelname)s %(message)s")
    with open(args.secret_file, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        print(f"raftps serve: the secret in {args.secret_file} is shorter than 16 bytes", file=sys.stderr)
        return 2
    peers = args.peers.split(",")
    if not 1 <= args.id <= len(peers):
        print(f"raftps serve: --id {args.id} is not in 1..{len(peers)}", file=sys.stderr)
        return 2
    config = NodeConfig(node_id=args.id, peers=peers, data_dir=args.data_dir, secret=secret,
                        bind_host=args.bind_host, payload_dir=args.payload_dir, compaction_entries=args.compaction_entries,
                        payload_budget=args.payload_budget_mb << 20,
                        election_timeout=(args.election_timeout, 2 * args.election_timeout),
                        leader_fallback=args.leader_fallback or 2.5 * args.election_timeout,
                        request_timeout=args.request_timeout)
    node = RaftNode(config)
    server = ClientServer(node, *config.bind(config.client_offset))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"node {args.id}: raft {config.raft_address}, clients {config.address(args.id, config.client_offset)}, "
          f"data plane {config.address(args.id, config.data_offset)}", flush=True)
    while not stop.wait(1.0):
        if not node.tick_thread_alive():
            print(f"node {args.id}: the raft tick thread died; exiting so a supervisor restarts the node",
                  file=sys.stderr)
            return 1
    server.close()
    node.stop()
    return 0


def _cluster(args: argparse.Namespace):
    from .localcluster import LocalCluster
    run_dir = args.run_dir or os.environ.get("RAFTPS_RUN_DIR") or os.path.join(os.getcwd(), "cluster", "run")
    base = args.base_port or int(os.environ.get("RAFTPS_BASE_PORT", "7100"))
    return LocalCluster(run_dir, nodes=args.nodes, base_port=base)


def cluster(args: argparse.Namespace) -> int:
    cl = _cluster(args)
    if args.action == "start":
        addresses = cl.start(timeout=args.timeout)
        print(_status_table(cl.status()))
        print(f"RAFTPS_CLUSTER={addresses}")
    elif args.action == "stop":
        cl.stop()
        print(f"stopped the nodes of {cl.run_dir}")
    elif args.action == "wipe":
        cl.wipe()
        print(f"stopped the nodes and deleted {cl.run_dir} and their payloads")
    elif args.action == "kill":
        pid = cl.pid(args.node)
        cl.kill(args.node)
        print(f"node {args.node} (pid {pid}) killed with SIGKILL")
    elif args.action == "status":
        print(_status_table(cl.status()))
    return 0


def status(args: argparse.Namespace) -> int:
    with Client(args.cluster) as client:
        print(_status_table(client.status()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .node import NodeConfig
    parser = argparse.ArgumentParser(prog="raftps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one node")
    p.add_argument("--id", type=int, required=True, help="this node's number, 1..N (its place in --peers)")
    p.add_argument("--peers", required=True, help="every node's Raft address host:port, comma-separated, in node order"
                   " (client port = Raft port + 100, data-plane port = Raft port + 200)")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--secret-file", required=True, help="file holding the cluster's peer secret")
    p.add_argument("--bind-host", default=None, help="address to bind (default: this node's host in --peers)")
    p.add_argument("--payload-dir", default=None,
                   help="where payloads wait for a snapshot (default: tmpfs /dev/shm if present, else DATA_DIR/payloads)")
    defaults = NodeConfig.__dataclass_fields__
    p.add_argument("--compaction-entries", type=int, default=defaults["compaction_entries"].default,
                   help="snapshot once the Raft log holds this many entries")
    p.add_argument("--payload-budget-mb", type=int, default=defaults["payload_budget"].default >> 20,
                   help="snapshot once payload files on disk exceed this many MiB")
    p.add_argument("--election-timeout", type=float, default=defaults["election_timeout"].default[0],
                   help="minimum election timeout in seconds (the maximum is twice it)")
    p.add_argument("--leader-fallback", type=float, default=None,
                   help="a leader that hears from no majority for this long steps down (default 2.5 x election timeout)")
    p.add_argument("--request-timeout", type=float, default=defaults["request_timeout"].default,
                   help="how long a node waits for one write to replicate and commit")
    p.set_defaults(func=serve)

    p = sub.add_parser("status", help="a table of every node's role, term, applied index and digest")
    p.add_argument("--cluster", default=None, help="client addresses (default: $RAFTPS_CLUSTER)")
    p.set_defaults(func=status)

    p = sub.add_parser("cluster", help="manage a local cluster (RAFTPS_RUN_DIR, RAFTPS_BASE_PORT)")
    p.add_argument("action", choices=["start", "stop", "kill", "status", "wipe"])
    p.add_argument("node", type=int, nargs="?", help="node number for kill")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("RAFTPS_NODES", "3")))
    p.add_argument("--run-dir", default=None)
    p.add_argument("--base-port", type=int, default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.set_defaults(func=cluster)

    args = parser.parse_args(argv)
    if getattr(args, "action", None) == "kill" and args.node is None:
        parser.error("cluster kill needs a node number")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
