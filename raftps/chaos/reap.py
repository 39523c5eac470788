"""Stopping a process this code started together with everything under it, by PID: the one
kill-and-reap that the torchrun fault case (torchrun.py) and bench/goodput's launchers share.

torch's elastic agent starts each worker in a session of its own, so killing torchrun's session
alone leaves the workers it restarted running (found: a restarted DDP group training on, minutes
after its run); every process under it is found through /proc and killed by its PID."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Iterable

from raftps.chaos.harness import children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), parents first."""
    out, todo = [], children(pid)
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(children(child))
    return out


def kill_tree(proc: subprocess.Popen, known: Iterable[int] = (), timeout: float = 10.0) -> None:
    """SIGKILL ``proc`` (its process group too when it leads one: started with
    ``start_new_session``), every process now under it and the PIDs in ``known`` (seen under it
    earlier, e.g. workers that were reparented), then reap ``proc``."""
    # Found before the parent dies; only while it runs (once reaped, its PID may be another's).
    running = proc.poll() is None
    pids = dict.fromkeys([*(descendants(proc.pid) if running else []), *known])
    if running:
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout)
