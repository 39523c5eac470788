"""``python -m trainer train ...`` (also the ``raftps-train`` console script)."""
from __future__ import annotations

import argparse
import json
import sys

from .config import DEFAULT_LR, MODES, Config


def _widths(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(",") if w.strip())


def _bound(text: str) -> int | None:
    if text in ("inf", "none", "unbounded"):
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("--staleness must be >= 0 or 'inf'")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model against a raftps cluster (or --local)")
    t.add_argument("--cluster", help="client addresses host:port,... (default: $RAFTPS_CLUSTER)")
    t.add_argument("--local", action="store_true", help="one process, no cluster: the baseline")
    t.add_argument("--mode", choices=MODES, default="async",
                   help="async (Downpour), sync (averaged steps), ssp (bounded staleness), easgd (elastic averaging), "
                        "diloco (local steps, the store's outer step every --sync-every)")
    t.add_argument("--workers", type=int, default=4)
    t.add_argument("--model", choices=["mlp", "softmax"], default="mlp")
    t.add_argument("--hidden", type=_widths, default=(1000, 1000), help="MLP widths, e.g. 1000,1000 (1.08M params)")
    t.add_argument("--dataset", default="digits")
    t.add_argument("--epochs", type=int, default=5)
    t.add_argument("--steps", type=int, help="stop after this many applied updates")
    t.add_argument("--batch", type=int, default=64, help="examples per applied update (sync: split over workers)")
    t.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default="sgd")
    t.add_argument("--lr", type=float, help=f"learning rate (default per optimizer: {DEFAULT_LR})")
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--staleness-aware", action="store_true",
                   help="the store divides lr by max(1, tau), tau = updates to the tensor since the worker's pull")
    t.add_argument("--adarevision-window", type=int, default=32,
                   help="adarevision: past gradient sums the store keeps (memory: that many copies of the model)")
    t.add_argument("--staleness", type=_bound, default=None, metavar="S",
                   help="ssp: max clocks ahead of the slowest worker (0 = BSP, 'inf' = ASP)")
    t.add_argument("--ssp-on-bound", choices=["wait", "reject"], default="wait",
                   help="ssp: wait at the leader before a step, or push and retry when refused")
    t.add_argument("--ssp-timeout", type=float, default=10.0,
                   help="ssp: drop a member stuck at the slowest clock this many seconds")
    t.add_argument("--easgd-alpha", type=float, help="easgd: moving rate (default 0.9 / workers)")
    t.add_argument("--compress", default="none", help="none | fp16 | topk:FRACTION (async and ssp)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--n-fetch", type=int, default=1, help="async: pull every N steps")
    t.add_argument("--n-push", type=int, default=1, help="async: push every N steps")
    t.add_argument("--fresh-pull", action="store_true",
                   help="async: pull through the leader (linearizable, newest) instead of any up-to-date node")
    t.add_argument("--warmup", type=int, default=0,
                   help="async: workers 1.. start after rank 0 alone has made this many updates (Downpour warm start)")
    t.add_argument("--step-timeout", type=float, default=10.0,
                   help="sync, diloco: seconds a step (round) waits for its last worker after the latest arrived; "
                        "then it applies without it")
    t.add_argument("--sync-every", type=int, default=20, metavar="H", help="diloco: inner steps per round")
    t.add_argument("--fragments", type=int, default=1,
                   help="diloco: sync F parts of the model, each every H steps at staggered offsets (streaming)")
    t.add_argument("--diloco-async", action="store_true",
                   help="diloco: the store applies each worker's pseudo-gradient on arrival (staleness-aware lr)")
    t.add_argument("--outer-lr", type=float, default=None,
                   help="diloco: the store's outer learning rate (default 0.7; with --diloco-async 1.0)")
    t.add_argument("--outer-momentum", type=float, default=None,
                   help="diloco: the outer Nesterov momentum (0: plain SGD; with --outer-lr 1: averaging); "
                        "default 0.9; with --diloco-async 0 (averaging: Nesterov diverges when rounds apply on arrival)")
    t.add_argument("--max-restarts", type=int, default=3, help="restarts of a dead worker")
    t.add_argument("--max-time", type=float, default=1800.0, help="abort the run after this many seconds")
    t.add_argument("--evals-per-epoch", type=int, default=2)
    t.add_argument("--prefix", default="model", help="tensor names PREFIX/W0, ...")
    t.add_argument("--out", default="runs/latest", help="directory for metrics.csv, plot.png, summary.json")
    t.add_argument("--kill-leader-at", type=float, metavar="FRACTION",
                   help="SIGKILL the leader when this fraction of the run is done (needs --run-dir)")
    t.add_argument("--run-dir", help="the local cluster's run dir (pid files), for --kill-leader-at")
    d = sub.add_parser("demo", help="start a local 3-node cluster, train with 4 async workers, SIGKILL the "
                                     "leader halfway, print the final accuracy and the plot, stop the cluster")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--base-port", type=int, default=7100, help="as RAFTPS_BASE_PORT: raft BASE+1.., clients BASE+101..")
    d.add_argument("--mode", choices=["async", "sync"], default="async")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--epochs", type=int, default=10)
    d.add_argument("--seed", type=int, default=0)
    return p


def demo(args: argparse.Namespace) -> int:
    import os

    from raftps.tools.localcluster import LocalCluster
    run_dir = os.path.join(args.out, "cluster")
    cluster = LocalCluster(run_dir, nodes=3, base_port=args.base_port)
    os.environ.update(cluster.client_env)   # this process's clients and the workers it starts find the token
    try:
        print(f"demo: starting 3 nodes in {run_dir}", file=sys.stderr, flush=True)
        addresses = cluster.start(timeout=60)
        print(f"demo: cluster up at {addresses}, leader node {cluster.leader()}", file=sys.stderr, flush=True)
        argv = ["train", "--cluster", addresses, "--mode", args.mode, "--workers", str(args.workers),
                "--model", "mlp", "--epochs", str(args.epochs), "--seed", str(args.seed),
                "--kill-leader-at", "0.5", "--run-dir", run_dir, "--out", os.path.join(args.out, "train")]
        return main(argv)
    finally:
        cluster.wipe()          # stops the nodes it started, by PID, and deletes their data
        print("demo: cluster stopped", file=sys.stderr, flush=True)


def config(args: argparse.Namespace) -> Config:
    """The run's Config from ``train``'s arguments (the parser's error, and exit, on a bad combination)."""
    if args.kill_leader_at is not None and not args.run_dir:
        parser().error("--kill-leader-at needs --run-dir (where the cluster's pid files are)")
    if args.workers < 1 or args.batch < 1 or args.epochs < 1 or args.n_fetch < 1 or args.n_push < 1 \
            or args.sync_every < 1 or args.fragments < 1:
        parser().error("--workers, --batch, --epochs, --n-fetch, --n-push, --sync-every and --fragments must be >= 1")
    if args.compress != "none" and (args.mode not in ("async", "ssp") or args.local):
        parser().error("--compress works with --mode async or ssp on a cluster")
    try:
        from raftps.compress import parse
        parse(args.compress)
    except ValueError as exc:
        parser().error(str(exc))
    if args.mode == "sync" and not args.local and args.batch % args.workers:
        parser().error(f"sync mode needs --batch ({args.batch}) divisible by --workers ({args.workers})")
    return Config(cluster=args.cluster, local=args.local, mode=args.mode, workers=args.workers, model=args.model,
                  hidden=args.hidden, dataset=args.dataset, epochs=args.epochs, steps=args.steps, batch=args.batch,
                  optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, seed=args.seed,
                  staleness_aware=args.staleness_aware, adarevision_window=args.adarevision_window,
                  staleness=args.staleness, ssp_on_bound=args.ssp_on_bound, ssp_timeout=args.ssp_timeout,
                  easgd_alpha=args.easgd_alpha, compress=args.compress,
                  n_fetch=args.n_fetch, n_push=args.n_push, warmup=args.warmup, fresh_pull=args.fresh_pull, step_timeout=args.step_timeout,
                  sync_every=args.sync_every, fragments=args.fragments, diloco_async=args.diloco_async,
                  outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                  max_restarts=args.max_restarts, max_time=args.max_time, evals_per_epoch=args.evals_per_epoch,
                  prefix=args.prefix, out=args.out, kill_leader_at=args.kill_leader_at, run_dir=args.run_dir)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        return demo(args)
    cfg = config(args)
    from .run import train
    summary = train(cfg)
    print(json.dumps({k: summary[k] for k in ("mode", "final_test_acc", "updates", "wall_s", "worker_restarts",
                                              "events") if k in summary}))
    print(f"final test accuracy {summary['final_test_acc']:.4f} after {summary['updates']} updates "
          f"in {summary['wall_s']:.1f} s; plot: {summary['plot']}")
    return 0 if not summary.get("failed_workers") else 1


if __name__ == "__main__":
    sys.exit(main())
