"""bench/goodput.py's launchers: torchrun in a session of its own, and one supervised process
per raftps worker (a dead one restarts alone), and what they load (the char GPT example, torchft).
Every process started here is stopped by PID."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from raftps.chaos.reap import children, kill_tree


class Torchrun:
    """``torchrun --nproc-per-node N --max-restarts R`` in its own session (its workers are its children)."""

    def __init__(self, script: str, args: list[str], nproc: int, port: int, env: dict[str, str], log_path: str,
                 max_restarts: int = 3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--node-rank", "0", script, *args]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> list[int]:
        return sorted(children(self.proc.pid))

    def kill_worker(self) -> int | None:
        """SIGKILL the newest worker (the highest PID: local rank nproc-1 in practice)."""
        pids = self.workers()
        if not pids:
            return None
        os.kill(pids[-1], signal.SIGKILL)
        return pids[-1]

    def done(self) -> bool:
        return self.proc.poll() is not None

    def ok(self) -> bool:
        return self.proc.poll() == 0

    def stop(self) -> None:
        """SIGKILL torchrun and every process under it, by PID (raftps.chaos.reap says why)."""
        kill_tree(self.proc)
        self.log.close()


class Supervised:
    """One process per raftps worker (RANK, WORLD_SIZE set); a worker that dies by a signal is
    started again alone (at most ``restarts`` times), the others keep training."""

    def __init__(self, argv: list[str], ranks: int, env: dict[str, str], log_dir: str, restarts: int = 3):
        self.argv, self.ranks, self.env, self.log_dir, self.restarts = argv, ranks, env, log_dir, restarts
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: list[tuple[float, int]] = []       # (unix, rank) of every restart
        self.back: dict[int, int] = {}                   # rank -> the batch its restart resumed at
        for r in range(ranks):
            self._start(r)

    def _start(self, r: int) -> None:
        log_file = open(os.path.join(self.log_dir, f"rank{r}.log"), "ab")
        self.procs[r] = subprocess.Popen(self.argv, env={**self.env, "RANK": str(r), "WORLD_SIZE": str(self.ranks)},
                                         stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()

    def poll(self) -> None:
        for r, p in self.procs.items():
            if p.poll() is not None and p.returncode < 0 and self.restarts > 0:
                self.restarts -= 1
                self.started.append((time.time(), r))
                self._start(r)
        for unix, r in self.started:      # the restarted rank's resume line: its first batch follows
            if r not in self.back:
                resumed = _resume_step(os.path.join(self.log_dir, f"rank{r}.log"), r)
                if resumed is not None:
                    self.back[r] = resumed

    def kill_worker(self, rank: int | None = None) -> int:
        p = self.procs[self.ranks - 1 if rank is None else rank]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        return p.pid

    def done(self) -> bool:
        self.poll()
        return all(p.poll() is not None for p in self.procs.values())

    def ok(self) -> bool:
        return all(p.poll() == 0 for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)


def _resume_step(path: str, rank: int) -> int | None:
    """The batch a restarted rank resumed at, from the line examples/common.py and
    bench/goodput_worker.py print before a resumed rank's first batch (``[rank r] ... global batches S..``)."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(rf"\[rank {rank}\] .*global batch(?:es)? (\d+)", line)
                if m:
                    return int(m.group(1))
    except OSError:
        pass
    return None


def char_gpt_module() -> Any:
    """examples/char_gpt.py as a module (it imports torch)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    try:
        import char_gpt
    finally:
        sys.path.pop(0)
    return char_gpt


def char_gpt_lr() -> float:
    return char_gpt_module().DEFAULTS["lr"]


def torchft_available() -> str | None:
    import importlib.util
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed: bash bench/setup.sh installs it"
    if shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) is None:
        return "torchft_lighthouse is not next to this Python"
    return None


def raftps_argv(name: str, prefix: str, steps: int, eval_every: int, sync_every: int, outer: str, out: str,
                chunk_bytes: int = 0, compress: str = "none", pairs: bool = False) -> list[str]:
    """A raftps worker's command line: examples/char_gpt.py's sync mode (its steps in chunks of
    ``chunk_bytes``, 0: whole; in ``pairs`` where chunked), or bench/goodput_worker.py's DiLoCo (pseudo-gradients ``compress``ed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if name in ("raftps-sync", "raftps-sync-overlap"):     # overlap: each chunk sent during backward
        return [sys.executable, os.path.join(root, "examples", "char_gpt.py"), "--backend", "raftps", "--mode", "sync",
                "--prefix", prefix, "--steps", str(steps), "--eval-every", str(eval_every), "--out", out,
                "--chunk-bytes", str(chunk_bytes)] + (["--pairs"] if pairs and chunk_bytes else []) \
            + (["--overlap"] if name == "raftps-sync-overlap" and chunk_bytes else [])
    return [sys.executable, os.path.join(root, "bench", "goodput_worker.py"), "--kind", name, "--steps", str(steps),
            "--eval-every", str(eval_every), "--sync-every", str(sync_every), "--outer", outer, "--prefix", prefix,
            "--compress", compress, "--out", out]
