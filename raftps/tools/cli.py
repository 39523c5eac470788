"""Command line: ``raftps serve`` runs a node; ``status``, ``top``, ``export``, ``import``,
``member``, ``move``, ``snapshot`` and ``cluster ...`` operate a cluster (docs/operations.md)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from raftps import auth, codec

from raftps.tools import elastic_cli, localcluster_cli
from raftps.client.client import Client
from raftps.errors import RaftpsError
from raftps.tools.localcluster import ClusterError, LocalCluster
from raftps.errors import UsageError


class OneLineParser(argparse.ArgumentParser):
    """A wrong argument in one line (argparse prints its whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _credentials(args: argparse.Namespace, loopback: bool) -> tuple[bytes, str | None]:
    """The peer secret and the client token, or ValueError saying why the node must not start."""
    secret = auth.read_secret_file(args.secret_file).encode() if args.secret_file else b""
    if not secret:
        if not (args.insecure and loopback):
            raise ValueError("refusing to start without a peer secret: the Raft port speaks pickle, so without "
                             "one anyone who reaches it can run code in this node. Give --secret-file (>= 16 "
                             "bytes; cluster/start.sh makes one), or --insecure for a cluster bound to loopback.")
        print("raftps serve: --insecure: no peer secret, peer traffic unauthenticated (loopback only)", file=sys.stderr)
    elif len(secret) < auth.MIN_SECRET_BYTES:
        raise ValueError(f"the secret in {args.secret_file} is shorter than {auth.MIN_SECRET_BYTES} bytes")
    token = auth.read_secret_file(args.token_file) if args.token_file else None
    if args.token_file and not token:
        raise ValueError(f"the token file {args.token_file} is empty")
    if token is None and not args.auth_file and not (loopback or args.insecure):
        raise ValueError("refusing to serve clients on a non-loopback address without a client token: give "
                         "--token-file (cluster/start.sh makes one) or --auth-file, or --insecure to allow any client")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return secret, token


def serve(args: argparse.Namespace) -> int:
    from raftps.groups import Layout, group_config
    from raftps.server.hosting import Hosting
    from raftps.server.node import NodeConfig, RaftNode
    from raftps.rbac import Authorizer
    from raftps.server.server import ClientServer
    from raftps.tuning import keep_large_buffers_on_the_heap

    keep_large_buffers_on_the_heap()

    logging.basicConfig(level=os.environ.get("RAFTPS_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s node{args.id} %(name)s %(levelname)s %(message)s")
    peers = args.peers.split(",")
    if not 1 <= args.id <= len(peers):
        print(f"raftps serve: --id {args.id} is not in 1..{len(peers)}", file=sys.stderr)
        return 2
    bind_host = args.bind_host or peers[args.id - 1].rsplit(":", 1)[0]
    try:
        secret, token = _credentials(args, auth.is_loopback(bind_host))
        authorizer = Authorizer(args.token_file, args.auth_file)     # refuses a bad identity file now
    except ValueError as exc:
        print(f"raftps serve: {exc}", file=sys.stderr)
        return 2
    limits = codec.Limits(max_blob_bytes=args.max_frame_mb << 20, max_tensor_bytes=args.max_tensor_mb << 20)
    config = NodeConfig(node_id=args.id, peers=peers, data_dir=args.data_dir, secret=secret,
                        bind_host=args.bind_host, payload_dir=args.payload_dir, compaction_entries=args.compaction_entries,
                        payload_budget=args.payload_budget_mb << 20,
                        election_timeout=(args.election_timeout, 2 * args.election_timeout),
                        leader_fallback=args.leader_fallback or 2.5 * args.election_timeout,
                        request_timeout=args.request_timeout, limits=limits, client_token=token,
                        token_file=args.token_file, auth_file=args.auth_file,
                        tls_cert=args.tls_cert, tls_key=args.tls_key, max_connections=args.max_connections,
                        max_connections_per_ip=args.max_connections_per_ip,
                        max_tensors_per_push=args.max_tensors_per_push, frame_timeout=args.frame_timeout,
                        idle_timeout=args.idle_timeout, metrics_port=args.metrics_port,
                        read_mode=args.read_mode, read_confirm=not args.unsafe_skip_read_confirm,
                        durability=args.durability, entries_in_flight=args.entries_in_flight)
    layout = Layout(tuple(peers), args.groups)
    # several groups: this node's replicas follow group 0's hosts record (hosting.py)
    hosting = Hosting(config, layout, RaftNode, join=args.join, dead_host_timeout=args.dead_host_timeout,
                      balance=args.balance) \
        if layout.groups > 1 else None
    try:
        replicas = hosting.replicas if hosting else {0: RaftNode(group_config(config, layout, 0))}
        if hosting:
            hosting.start()
    except ValueError as exc:                  # e.g. a data dir of the other durability mode
        print(f"raftps serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:                     # an unwritable data dir, the data-plane port taken
        where = "%s:%d" % config.bind(config.data_offset)
        print(f"raftps serve: {_os_error(exc, f'cannot listen on {where} (the data plane)')}", file=sys.stderr)
        return 1
    if not replicas:
        print(f"node {args.id}: joining: it serves clients once the hosts record gives it a Raft group", flush=True)
    while not replicas and not (hosting and hosting.learners):   # joining (serve --join): until the record names it
        time.sleep(0.2)
    node = replicas[min(replicas)] if replicas else next(iter(hosting.learners.values()))   # its metrics, status
    try:
        server = ClientServer(replicas, *config.bind(config.client_offset), authorizer=authorizer,
                              layout=hosting or layout, client_offset=config.client_offset, first=node)
    except OSError as exc:
        where = "%s:%d" % config.bind(config.client_offset)
        print(f"raftps serve: {_os_error(exc, f'cannot listen on {where} (clients)')}", file=sys.stderr)
        for replica in replicas.values():
            replica.stop()
        return 1
    metrics_at = config.metrics_bind()
    if metrics_at is not None:
        from raftps.server import metrics
        tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
        if metrics.serve(node, server, *metrics_at, tls=tls, extra=hosting and hosting.metrics_registry) is not None:
            node.metrics_address = "%s:%d" % metrics_at
    stop = threading.Event()
    # SIGHUP: re-read the token file and the identity file now (they are also re-read when they change).
    signal.signal(signal.SIGHUP, lambda *_: authorizer.reload())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"node {args.id}: raft {config.raft_address}, clients {config.address(args.id, config.client_offset)}, "
          f"data plane {config.address(args.id, config.data_offset)}, metrics {node.metrics_address or 'off'}",
          flush=True)
    while not stop.wait(1.0):
        if hosting and hosting.drained.is_set():
            print(f"node {args.id}: the hosts record leaves it no Raft group: exiting", flush=True)
            break
        if not all(r.tick_thread_alive() for r in list(replicas.values())):
            print(f"node {args.id}: the raft tick thread died; exiting so a supervisor restarts the node",
                  file=sys.stderr)
            return 1
    server.close()
    if hosting:
        hosting.stop()
    for replica in list(replicas.values()):
        replica.stop()
    return 0


def _client(args: argparse.Namespace, **kwargs) -> Client:
    token = auth.read_secret_file(args.token_file) if args.token_file else None
    try:
        return Client(args.cluster, token=token, tls=args.tls_ca, **kwargs)
    except ValueError as exc:                  # no or malformed cluster addresses
        raise UsageError(str(exc)) from None


def _os_error(exc: OSError, doing: str) -> str:
    """An OSError in one line: the file it names, or what was being done."""
    if exc.strerror is None:                   # raised with a message of ours (TimeoutError)
        return str(exc)
    why = exc.strerror
    return f"{why}: {exc.filename}" if exc.filename else f"{doing}: {why}"


def _run(name: str, fn: Callable[[], int]) -> int:
    """Run a command: an expected failure says why in one line on stderr instead of a traceback:
    exit 2 for bad input or files, 1 for a cluster that is down or refuses, 130 for Ctrl-C."""
    try:
        return fn()
    except UsageError as exc:
        print(f"raftps {name}: {exc}", file=sys.stderr)
        return 2
    except RaftpsError as exc:
        print(f"raftps {name}: {exc.code}: {exc}", file=sys.stderr)
        return 1
    except ClusterError as exc:
        print(f"raftps {name}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:                     # a file that cannot be read or written; a network failure
        print(f"raftps {name}: {_os_error(exc, 'failed')}", file=sys.stderr)
        return 2 if exc.filename else 1
    except KeyboardInterrupt:
        print(f"raftps {name}: interrupted", file=sys.stderr)
        return 130


def _answering(rows: list[dict]) -> list[dict]:
    """Status rows, or ClusterError when no node answered (a down node's row says "down")."""
    if all(r["role"] == "down" for r in rows):
        raise ClusterError("no node answers at " + ", ".join(r["address"] for r in rows) + ": is the cluster running?")
    return rows


def status(args: argparse.Namespace) -> int:
    def run() -> int:
        with _client(args) as client:
            rows = _answering(client.status())
        if args.output == "json":
            print(json.dumps(rows, indent=1, sort_keys=True))
        else:          # several Raft groups: the hosts record and the placement loop's progress below
            print(localcluster_cli.status_table(rows))
            elastic_cli.print_placement(argparse.Namespace(**{**vars(args), "timeout": 30.0}), rows)
        return 0
    return _run("status", run)


def top(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1 or not args.interval > 0:
        print("raftps top: --count must be >= 1 and --interval > 0", file=sys.stderr)
        return 2
    try:
        from raftps.tools import top as live
    except ImportError as exc:
        print(f"raftps top: {exc}: pip install 'raftps[ops]' (cluster/setup.sh installs it)", file=sys.stderr)
        return 2

    def run() -> int:
        with _client(args, timeout=5.0) as client:
            _answering(client.status())        # a cluster that is down: one line, not a table of "down"
            try:
                return live.run(client, args.count, args.interval)
            except KeyboardInterrupt:
                return 0
    return _run("top", run)


def export(args: argparse.Namespace) -> int:
    from raftps.tools.backup import SAVE_LIMITS
    from raftps.tools.model_files import export_model

    def run() -> int:
        with _client(args, timeout=args.timeout, attempt_timeout=30.0, limits=SAVE_LIMITS) as client:   # a model may exceed 1 GiB
            out = export_model(client, args.prefix, args.format, args.file)
        print(f"exported {out['tensors']} tensors ({out['bytes']} bytes) under {args.prefix.rstrip('/')}/ at store "
              f"version {out['version']} (digest {out['digest'][:16]}) to {out['path']} ({out['format']})")
        return 0
    return _run("export", run)


def import_(args: argparse.Namespace) -> int:
    from raftps.tools.model_files import import_model, parse_optimizer

    def run() -> int:
        spec = parse_optimizer(args.optimizer) if args.optimizer is not None else None
        with _client(args, timeout=args.timeout, attempt_timeout=30.0) as client:
            out = import_model(client, args.file, args.prefix, spec)
        print(f"imported {out['tensors']} tensors ({out['bytes']} bytes) from {args.file} under "
              f"{args.prefix.rstrip('/')}/: {out['created']} created, {out['existing']} already there; "
              f"store version {out['version']}")
        return 0
    return _run("import", run)


def snapshot(args: argparse.Namespace) -> int:
    from raftps.tools import backup

    def run() -> int:
        if args.action == "save":
            with _client(args, timeout=args.timeout, attempt_timeout=30.0, limits=backup.SAVE_LIMITS) as client:
                out = backup.save(client, args.file)
            print(f"saved the store at version {_versions(out)} ({out['tensors']} tensors, {out['bytes']} bytes) "
                  f"to {out['path']}")
            return 0
        dirs = list(args.data_dir or [])
        if args.run_dir:
            dirs += [LocalCluster(args.run_dir, nodes=args.nodes).data_dir(n) for n in range(1, args.nodes + 1)]
        out = backup.restore(args.file, dirs, args.peers.split(",") if args.peers else None)
        print(f"seeded {len(dirs)} data dir(s) with the store at version {_versions(out)} ({out['tensors']} "
              f"tensors, saved {out['created']}); start the nodes"
              + (f" with --groups {out['groups']}" if out["groups"] > 1 else ""))
        return 0
    return _run(f"snapshot {args.action}", run)


def _versions(out: dict) -> str:
    """'V (digest D...)', or per Raft group 'g0: V (digest D...), g1: ...'."""
    if isinstance(out["version"], dict):
        return ", ".join(f"g{g}: {v} (digest {out['digest'][g][:16]})" for g, v in sorted(out["version"].items()))
    return f"{out['version']} (digest {out['digest'][:16]})"


def member(args: argparse.Namespace) -> int:
    def run() -> int:
        if args.action in ("add", "remove") and len(args.nodes) != 1 or args.action == "replace" and len(args.nodes) != 2 \
                or args.action == "list" and args.nodes:
            print("raftps member: list | add NODE | remove NODE | replace OLD NEW (NODE: a Raft address host:port)",
                  file=sys.stderr)
            return 2
        if args.action == "replace" and elastic_cli.replace_member(args):    # several Raft groups
            return 0
        with _client(args, timeout=args.timeout) as client:
            old = {"old": args.nodes[0], "node": args.nodes[1]} if args.action == "replace" else {}
            out = client.members(args.action, **{"node": args.nodes[0] if args.nodes else None, **old})
        if "changed" in out:
            print("changed" if out["changed"] else "nothing to change")
        print("members: " + ", ".join(out["members"]))
        return 0
    return _run("member", run)


def move(args: argparse.Namespace) -> int:
    """Move a tensor to another Raft group online; run it again to finish an interrupted move."""
    def run() -> int:
        from raftps.tools.backup import SAVE_LIMITS
        from raftps.errors import InvalidRequest
        from raftps.client.tensor_move import check_move_request
        # a tensor's data and optimizer state come through us in one frame: read as much as a backup
        with _client(args, timeout=args.timeout, attempt_timeout=30.0, limits=SAVE_LIMITS) as client:
            try:
                check_move_request(args.name, args.to, client.groups())
            except InvalidRequest as exc:          # bad input: nothing was sent
                print(f"raftps move: {exc}", file=sys.stderr)
                return 2
            out = client.move(args.name, args.to)
        also = [n for n in out["names"] if n != out["tensor"]]
        print(f"moved {out['tensor']} from Raft group {out['from']} to {out['to']}"
              + (f" (with {', '.join(also)})" if also else ""))
        return 0
    return _run("move", run)


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=None, help="client addresses (default: $RAFTPS_CLUSTER)")
    p.add_argument("--token-file", default=None, help="client token file (default: $RAFTPS_TOKEN, $RAFTPS_TOKEN_FILE)")
    p.add_argument("--tls-ca", default=None, help="CA file for nodes serving TLS (default: $RAFTPS_TLS_CA)")


def tensors(args: argparse.Namespace) -> int:
    """One line per tensor the token may read (under --prefix): name, dtype, shape, version, optimizer."""
    with _client(args, timeout=args.timeout) as client:
        rows = client.tensors(prefix=args.prefix)
    for t in rows:
        print(f"{t['name']}\t{t['dtype']}\t{tuple(t['shape'])}\tversion {t['version']}\t{t['optimizer']['name']}")
    return 0


def token_hash(args: argparse.Namespace) -> int:
    """The SHA-256 of a token (read from a file, or stdin), for an identity file's token_sha256."""
    from raftps.rbac import token_digest
    token = auth.read_secret_file(args.token_file) if args.token_file else sys.stdin.readline().strip()
    if not token:
        print("raftps token-hash: empty token", file=sys.stderr)
        return 2
    print(token_digest(token).hex())
    return 0


def main(argv: list[str] | None = None) -> int:
    from raftps.tools.model_files import FORMATS
    from raftps.server.node import READ_MODES, NodeConfig
    parser = OneLineParser(prog="raftps", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one node")
    p.add_argument("--id", type=int, required=True, help="this node's number, 1..N (its place in --peers)")
    p.add_argument("--peers", required=True, help="every node's Raft address host:port, comma-separated, in node order"
                   " (client port = Raft port + 100, data-plane port = Raft port + 200)")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--groups", type=int, default=1,
                   help="Raft groups the tensors are sharded over (the same on every node): with G > 1 each "
                        "group has 3 members, group g on nodes g+1..g+3 (mod N), Raft port + 400 g")
    elastic_cli.add_serve_options(p)
    p.add_argument("--secret-file", default=None, help="file holding the cluster's peer secret (>= 16 bytes)")
    p.add_argument("--token-file", default=None,
                   help="file holding the client token; when given, every client must present it")
    p.add_argument("--auth-file", default=None,
                   help="JSON file of named client identities with roles over name prefixes (see raftps.rbac); "
                        "re-read when it changes and on SIGHUP")
    p.add_argument("--insecure", action="store_true",
                   help="allow no peer secret (loopback binds only) and no client token")
    p.add_argument("--tls-cert", default=None, help="serve the client port over TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    p.add_argument("--bind-host", default=None, help="address to bind (default: this node's host in --peers)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port of this node's host (default: Raft port + 300, "
                        "over HTTPS with --tls-cert); 0 turns it off")
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
    p.add_argument("--read-mode", choices=READ_MODES, default=defaults["read_mode"].default,
                   help="linearizable reads: readindex (the leader confirms its leadership with a round of "
                        "probes to a majority, no log entry), lease (the same rounds, sent every heartbeat, "
                        "give the leader a lease most reads are served on at once; assumes clocks whose rates "
                        "differ by < 10%%) or log (a barrier entry through the Raft log)")
    p.add_argument("--unsafe-skip-read-confirm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--entries-in-flight", type=int, default=defaults["entries_in_flight"].default,
                   help="group commit: log entries the leader keeps proposed and not yet applied; writes "
                        "arriving meanwhile share the next entry (0: every write its own entry)")
    p.add_argument("--durability", choices=("none", "fsync"), default=defaults["durability"].default,
                   help="fsync: the Raft journal, term and vote, payloads (in DATA_DIR/payloads) and snapshots "
                        "are fsynced before they count, so a power loss loses nothing acknowledged; none: "
                        "they survive a process crash only (see docs/guarantees/durability.md)")
    p.add_argument("--request-timeout", type=float, default=defaults["request_timeout"].default,
                   help="how long a node waits for one write to replicate and commit")
    limits = codec.Limits()
    p.add_argument("--max-frame-mb", type=int, default=limits.max_blob_bytes >> 20,
                   help="most tensor bytes in one frame, MiB (max_blob_bytes)")
    p.add_argument("--max-tensor-mb", type=int, default=limits.max_tensor_bytes >> 20,
                   help="most bytes of one tensor, MiB (max_tensor_bytes)")
    for flag, key, what in [("--max-tensors-per-push", "max_tensors_per_push", "tensors in one write"),
                            ("--max-connections", "max_connections", "client connections in total"),
                            ("--max-connections-per-ip", "max_connections_per_ip", "client connections from one IP"),
                            ("--frame-timeout", "frame_timeout", "seconds a frame may take from its first byte"),
                            ("--idle-timeout", "idle_timeout", "seconds an idle client connection stays open")]:
        p.add_argument(flag, type=type(defaults[key].default), default=defaults[key].default, help=what)
    p.set_defaults(func=serve)

    p = sub.add_parser("status", help="a table of every node's role, term, applied index and digest")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table",
                   help="table (default) or json: every field of every node's status, one list")
    _client_options(p)
    p.set_defaults(func=status)

    p = sub.add_parser("top", help="a live view of every node: rates, lag, staleness (rich)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--count", type=int, default=None, help="stop after this many refreshes (default: until Ctrl-C)")
    _client_options(p)
    p.set_defaults(func=top)

    p = sub.add_parser("export", help="write the tensors under a prefix, at one store version, to a file")
    p.add_argument("file", help="the file to write (replaced whole, or left as it was)")
    p.add_argument("--prefix", required=True, help="export tensors named PREFIX/<name>; the file names them <name>")
    p.add_argument("--format", default="safetensors", choices=FORMATS, help="file format (default: safetensors)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=export)

    p = sub.add_parser("import", help="create PREFIX/<name> for every tensor of a safetensors, npz or torch (export --format torch) file")
    p.add_argument("file", help="a safetensors file or an npz archive (told apart by content)")
    p.add_argument("--prefix", required=True, help="create tensors named PREFIX/<name>")
    p.add_argument("--optimizer", default=None,
                   help='the tensors\' optimizer: JSON (\'{"name": "adam", "lr": 0.001}\') or adam,lr=0.001 '
                        '(a torch checkpoint from `export --format torch` names its own)')
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=import_)

    p = sub.add_parser("member", help="list, add, remove or replace cluster members (Raft addresses)")
    p.add_argument("action", choices=["list", "add", "remove", "replace"])
    p.add_argument("nodes", nargs="*", help="add/remove: NODE; replace: OLD NEW (Raft addresses host:port)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=member)

    p = sub.add_parser("snapshot", help="save the whole store to a backup file, or seed new nodes from one")
    p.add_argument("action", choices=["save", "restore"])
    p.add_argument("file", help="the backup file")
    p.add_argument("--data-dir", action="append", help="restore: an empty data dir of a new node (repeat per node)")
    p.add_argument("--run-dir", default=None, help="restore: seed RUN_DIR/node1..N of a local cluster (--nodes N)")
    p.add_argument("--nodes", type=int, default=_env_int(parser, "RAFTPS_NODES", 3))
    p.add_argument("--peers", default=None, help="restore: the new cluster's --peers (recorded in the seed)")
    p.add_argument("--timeout", type=float, default=120.0, help="save: seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=snapshot)

    p = sub.add_parser("move", help="move a tensor to another Raft group, online (run again to finish an "
                                    "interrupted move)")
    p.add_argument("name", help="the tensor (its index tensor NAME:indices, if any, moves with it)")
    p.add_argument("--to", type=int, required=True, help="the Raft group to move it to (0..G-1)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=move)

    p = sub.add_parser("tensors", help="list the tensors (under --prefix) the token may read")
    p.add_argument("--prefix", default=None, help="only names that start with this (a job's prefix)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the cluster")
    _client_options(p)
    p.set_defaults(func=tensors)

    p = sub.add_parser("token-hash", help="print a token's SHA-256 (for an identity file's token_sha256)")
    p.add_argument("--token-file", default=None, help="file holding the token (default: read one line from stdin)")
    p.set_defaults(func=token_hash)

    localcluster_cli.add_parser(sub, lambda variable, default: _env_int(parser, variable, default))
    elastic_cli.add_parser(sub, _client_options)

    args = parser.parse_args(argv)
    name = args.command + (f" {args.action}" if args.command in ("cluster", "snapshot", "member", "hosts") else "")
    return _run(name, lambda: args.func(args))


def _env_int(parser: argparse.ArgumentParser, variable: str, default: int) -> int:
    value = os.environ.get(variable) or str(default)
    if not value.strip().isdigit():
        parser.error(f"${variable} must be a whole number, not {value!r}")
    return int(value)


if __name__ == "__main__":
    sys.exit(main())
