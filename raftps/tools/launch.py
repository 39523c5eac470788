"""Launch a training job's workers as one process per rank, each supervised on its own:

    python -m raftps.launch --nproc-per-node K [--nnodes N --node-rank I] [--max-restarts R]
                            [--log-dir DIR] script.py [script args ...]

Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun
sets them (rank = node rank x K + local rank), so ``DistributedOptimizer`` finds its rank. A rank
that dies by a signal is started again alone, at most R times in all on this node, while the
others keep training: raftps workers share no process group, the store is their only meeting
point, and a restarted worker resumes at the store's step (sync) or round (DiLoCo). torchrun
cannot do this: its agent stops every worker when one dies and starts the whole group again, and
it sets RANK and WORLD_SIZE itself (one ``torchrun --nproc-per-node 1`` per worker would make each
worker rank 0 of 1). The launch ends when every rank has exited: with 0 if all exited 0, else
the first other exit code (128 + N for a rank killed by signal N with no restart left).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Protocol, Sequence

RESTART_POLL = 0.2      # seconds between checks of the ranks


class PerRankJob:
    """One process per rank (RANK and WORLD_SIZE set), each supervised on its own: a rank that
    dies by a signal is started again alone, at most ``restarts`` times in all, while the others
    keep training. ``ranks`` processes here, ranks ``first_rank`` .. ``first_rank + ranks - 1``
    of ``world_size`` (default: ``ranks``). Logs go to ``log_dir``/rank<r>.log (None: this
    process's own output). Every process it started is stopped by PID in ``stop()``."""

    def __init__(self, argv: Sequence[str], ranks: int, env: dict[str, str], log_dir: str | None,
                 restarts: int = 3, first_rank: int = 0, world_size: int | None = None):
        self.argv, self.ranks, self.env, self.log_dir, self.restarts = list(argv), ranks, env, log_dir, restarts
        self.first_rank, self.world_size = first_rank, world_size or ranks
        self.procs: dict[int, subprocess.Popen] = {}      # local rank -> its process now
        self.restarted: list[tuple[float, int]] = []     # (unix time, local rank) of every restart
        for r in range(ranks):
            self._start(r)

    def _start(self, rank: int) -> None:
        env = {**os.environ, **self.env, "RANK": str(self.first_rank + rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.ranks)}
        if self.log_dir is None:
            self.procs[rank] = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            return
        with open(os.path.join(self.log_dir, f"rank{self.first_rank + rank}.log"), "ab") as log:
            self.procs[rank] = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)

    def workers(self) -> list[int]:
        return sorted(p.pid for p in self.procs.values() if p.poll() is None)

    def kill_worker(self, rank: int | None = None) -> int:
        """SIGKILL one rank's process (the last rank by default); poll() starts it again."""
        proc = self.procs[self.ranks - 1 if rank is None else rank]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return proc.pid

    def poll(self) -> int | None:
        """Restart the ranks killed by a signal (while restarts remain); None while any rank runs,
        else 0 if every rank exited 0, else the first other exit code (negative: a signal)."""
        for rank, proc in sorted(self.procs.items()):
            if proc.poll() is not None and proc.returncode < 0 and self.restarts > 0:
                self.restarts -= 1
                self.restarted.append((time.time(), rank))
                print(f"raftps.launch: rank {self.first_rank + rank} died (signal {-proc.returncode}); starting it "
                      f"again ({self.restarts} restarts left)", file=sys.stderr, flush=True)
                self._start(rank)
        codes = [p.poll() for _, p in sorted(self.procs.items())]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def wait(self, timeout: float) -> int | None:
        return wait_for_exit(self, timeout)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Job(Protocol):
    def poll(self) -> int | None: ...


def wait_for_exit(job: Job, timeout: float) -> int | None:
    """``job.poll()`` until it gives an exit code, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = job.poll()
        if code is not None:
            return code
        time.sleep(RESTART_POLL)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raftps.launch", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes, each running this launcher")
    ap.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes)")
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts of dead ranks, in all, on this node")
    ap.add_argument("--log-dir", help="write each rank's output to DIR/rank<r>.log (default: this terminal)")
    ap.add_argument("script", help="the training script (run with this Python)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = ap.parse_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes or args.max_restarts < 0:
        ap.error("need --nproc-per-node >= 1, --nnodes >= 1, 0 <= --node-rank < --nnodes, --max-restarts >= 0")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    job = PerRankJob([sys.executable, args.script, *args.args], args.nproc_per_node, {}, args.log_dir,
                     args.max_restarts, args.node_rank * args.nproc_per_node, args.nnodes * args.nproc_per_node)
    try:
        while (code := job.poll()) is None:          # as long as the job runs: a launcher's lifetime
            time.sleep(RESTART_POLL)
    finally:
        job.stop()                                   # Ctrl-C or SIGTERM: no rank outlives the launcher
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
