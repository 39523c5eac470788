"""python -m raftps.chaos --seconds 60 --seed 7 [--no-netns] [--base-port 7800] [--dump FILE]

Runs a 3-node cluster under the one-hot workload while a seeded random schedule of faults
(kills, pauses, and with root + iptables: partitions, packet loss, flapping) plays, then heals,
checks and prints one report line. Exit status 0 only if every promise held.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

from raftps.chaos import netns
from raftps.chaos.harness import Harness
from raftps.chaos.nemesis import apply, schedule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raftps.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-netns", action="store_true", help="process faults only (no root needed)")
    p.add_argument("--base-port", type=int, default=7800)
    p.add_argument("--dump", default=None, help="write the history as JSON here")
    p.add_argument("--power-cuts", action="store_true",
                   help="durable nodes on a simulated disk, and power cuts (of the leader, of every node) "
                        "among the faults")
    p.add_argument("--groups", type=int, default=1,
                   help="shard over this many Raft groups (a workload per group, checked per group; "
                        "leader faults hit group 0's leader)")
    args = p.parse_args(argv)
    network = not args.no_netns and netns.available() is None
    steps = schedule(args.seed, args.seconds, network, power=args.power_cuts)
    print(f"nemesis seed={args.seed} network={network} schedule: "
          + " ".join(f"{s.fault}/{s.duration}s" for s in steps), flush=True)
    run_dir = tempfile.mkdtemp(prefix="raftps-chaos-")
    try:
        with Harness(f"nemesis-seed{args.seed}", run_dir, base_port=args.base_port, netns=network,
                     subnet="10.77.8", groups=args.groups, power_cuts=args.power_cuts,
                     n=8000) as h:
            t0 = time.monotonic()
            h.load(args.seconds)
            done = [apply(h, s) for s in steps]
            result, _ = h.finish(faults=len(done), wall_s=lambda: time.monotonic() - t0)
            print(result.sentence(), flush=True)
            if args.dump:
                h.history.dump(args.dump)         # group 0's
    except BaseException:
        print(f"run directory kept for post-mortem: {run_dir}", file=sys.stderr)
        raise
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if result.valid else 1


if __name__ == "__main__":
    sys.exit(main())
