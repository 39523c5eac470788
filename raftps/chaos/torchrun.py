"""A torchrun job trained against a raftps cluster while its store leader and one of its workers
are SIGKILLed: the fault case behind the PyTorch demo and its test.

torchrun (``python -m torch.distributed.run``) runs in a session of its own; its workers are its
direct children. A killed worker makes torchrun stop the others and start the worker group again
(``--max-restarts``); every new worker resumes from the store (``DistributedOptimizer.start_step``).
Every process started here is stopped by PID on exit. ``PerRankJob`` (one process per rank,
each restarted alone) is how users launch such a job: it lives in raftps/tools/launch.py and is
imported here under its old name too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from raftps import Client, UnknownTensor, jobs
from raftps.tools.launch import PerRankJob, wait_for_exit
from raftps.tools.localcluster import LocalCluster

from raftps.chaos.harness import children
from raftps.chaos.reap import kill_tree

__all__ = ["PerRankJob", "TorchrunJob", "KillRun", "steps_done", "train_through_kills"]


class TorchrunJob:
    """``torchrun --nproc-per-node N --max-restarts R script args`` with a static rendezvous on
    127.0.0.1:``master_port`` (the workers open no process group: the store carries the gradients)."""

    def __init__(self, script: str, args: Sequence[str], nproc: int, max_restarts: int, env: dict[str, str],
                 log_path: str, master_port: int):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), "--node-rank", "0", script, *args]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.seen: set[int] = set()      # every worker PID ever seen, so that stop() can reap them all

    def workers(self) -> list[int]:
        pids = sorted(children(self.proc.pid))
        self.seen.update(pids)
        return pids

    def kill_worker(self, timeout: float = 60.0) -> int:
        """SIGKILL one running worker (the highest PID: a worker, not the agent's helpers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.workers()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                return pids[-1]
            time.sleep(0.1)
        raise TimeoutError(f"no torchrun worker to kill within {timeout} s")

    def poll(self) -> int | None:
        """torchrun's exit code, or None while it runs."""
        self.workers()
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """torchrun's exit code, or None if it still runs after ``timeout``."""
        return wait_for_exit(self, timeout)

    def stop(self) -> None:
        self.workers()
        kill_tree(self.proc, self.seen)
        self.log.close()


def steps_done(client: Client, prefix: str, ranks: int, sync_every: int | None = None) -> int:
    """Steps the store applied for a job: the sum of its ranks' step counters (async modes), the
    job's applied sync step + 1, or (``sync_every``: a DiLoCo job) its applied rounds times H."""
    if sync_every is not None:
        try:
            return (client.sync_applied(jobs.diloco_job(prefix, 0, 1)) + 1) * sync_every
        except UnknownTensor:
            return 0
    names = [jobs.step_counter(prefix, r) for r in range(ranks)]
    try:
        tensors, _ = client.pull(names, linearizable=False)
        return int(sum(float(t[0]) for t in tensors.values()))
    except UnknownTensor:
        pass
    try:
        return client.sync_applied(jobs.job_name(prefix)) + 1
    except (AttributeError, UnknownTensor):
        return 0


@dataclass
class KillRun:
    exit_code: int | None
    events: list[tuple[float, str]] = field(default_factory=list)     # (unix time, what happened)


def train_through_kills(cluster: LocalCluster, job: "TorchrunJob | PerRankJob", prefix: str, ranks: int,
                        total_steps: int,
                        leader_at: float = 0.3, worker_at: float = 0.6, timeout: float = 600.0,
                        say: Callable[[str], None] = print, sync_every: int | None = None) -> KillRun:
    """Wait until the job's store-side step count passes ``leader_at`` of ``total_steps``, SIGKILL
    the store's leader; past ``worker_at``, SIGKILL a worker; then wait for torchrun to exit."""
    run = KillRun(None)
    t0 = time.monotonic()
    deadline = t0 + timeout

    def event(text: str) -> None:
        run.events.append((time.time(), text))
        say(f"[{time.monotonic() - t0:6.1f} s] {text}")

    with cluster.client(timeout=30.0) as client:
        for fraction, action in ((leader_at, "leader"), (worker_at, "worker")):
            while time.monotonic() < deadline and job.poll() is None:
                if steps_done(client, prefix, ranks, sync_every) >= fraction * total_steps:
                    break
                time.sleep(0.2)
            if job.poll() is not None:
                event(f"the job exited (code {job.poll()}) before the {action} kill")
                break
            if action == "leader":
                leader = None
                while leader is None and time.monotonic() < deadline:
                    leader = cluster.leader()
                    time.sleep(0.05 if leader is None else 0)
                cluster.kill(leader)
                event(f"SIGKILL store leader node {leader} at step {steps_done(client, prefix, ranks, sync_every)}")
            else:
                event(f"SIGKILL worker pid {job.kill_worker()} at step {steps_done(client, prefix, ranks, sync_every)}")
    run.exit_code = job.wait(max(1.0, deadline - time.monotonic()))
    event(f"the job exited with code {run.exit_code}")
    return run
