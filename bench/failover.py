"""Failover: SIGKILL the leader while a client writes; time to the next committed write; repeat.

One client thread writes 1 KiB values back to back (raftps ``push`` with its own retries; etcd
``put`` on the leader, moving to the next member when its connection fails or a put takes longer
than 0.3 s). Each round: let it write for a moment, SIGKILL the leader by PID, and measure the time
from the kill to the completion of the first write *issued after* the kill (so a reply the old
leader sent just before dying cannot count; this adds one write latency, a few ms at 1 KiB).
Then pause the writer, restart the killed node and wait until every replica holds the same state
(raftps: same version and digest; etcd: same revision), and resume. ``kills`` rounds, each
bounded in time.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import numpy as np

from .common import KiB, log

ROUND_TIMEOUT = 30.0
CATCHUP_TIMEOUT = 60.0
# A put that a follower forwarded to the dead leader is lost and only times out after etcd's
# request timeout (7 s); a short client timeout with a move to the next member is etcd's best case.
ETCD_ATTEMPT_TIMEOUT = 0.3


class Writer:
    """Calls ``write(i)`` back to back in a thread while running; keeps (start, end) of each success."""

    def __init__(self, write: Callable[[int], Any]):
        self.write = write
        self.done: list[tuple[float, float]] = []
        self.errors = 0
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.idle = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        i = 0
        while not self.stopped.is_set():
            if not self.running.wait(0.05):
                self.idle.set()
                continue
            self.idle.clear()
            t0 = time.monotonic()
            try:
                self.write(i)
                self.done.append((t0, time.monotonic()))
            except Exception:               # counted; the next write goes on (after a leader change)
                self.errors += 1
                time.sleep(0.01)
            i += 1
        self.idle.set()

    def first_after(self, t: float, timeout: float, mark: int = 0) -> float | None:
        """End time of the first successful write that started at or after t (bounded wait);
        ``mark``: how many writes had completed before t, so only later ones are scanned."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ends = [e for s, e in self.done[mark:] if s >= t]
            if ends:
                return min(ends)
            time.sleep(0.005)
        return None

    def pause(self, timeout: float = ROUND_TIMEOUT) -> None:
        self.running.clear()
        self.idle.clear()
        self.idle.wait(timeout)


def _summary(system: str, rounds: tuple[list[float], list[float], list[float]], kills: int, writer: Writer,
             extra: dict[str, Any]) -> dict[str, Any]:
    failover, elected, catchup = rounds
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    return {"system": system, "op": "failover", "kills": kills, "measured": len(failover),
            "failover_s": [round(x, 3) for x in failover], "median_s": med(failover),
            "max_s": max(failover, default=float("nan")), "elected_s": [round(x, 3) for x in elected],
            "elected_median_s": med(elected), "catchup_s": [round(x, 3) for x in catchup],
            "catchup_median_s": med(catchup), "write_errors": writer.errors, "writes": len(writer.done), **extra}


def _wait_new_leader(leader: Callable[[], int | None], victim: int, timeout: float) -> float | None:
    """Time at which a node other than ``victim`` is reported leader (polled every ~20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            now = leader()
        except Exception:
            now = None
        if now is not None and now != victim:
            return time.monotonic()
        time.sleep(0.02)
    return None


def _rounds(system: str, kills: int, writer: Writer, leader: Callable[[], int | None], kill: Callable[[int], None],
            restart_and_wait: Callable[[int], bool]) -> tuple[list[float], list[float], list[float]]:
    """(kill -> next committed write, kill -> new leader seen, restart -> caught up) per round."""
    failover: list[float] = []
    elected: list[float] = []
    catchup: list[float] = []
    writer.thread.start()
    try:
        for r in range(kills):
            writer.running.set()
            time.sleep(0.5)                             # writes flow before the kill
            victim = leader()
            if victim is None:
                log(f"{system} failover round {r + 1}: no leader found; skipped")
                continue
            mark = len(writer.done)
            t_kill = time.monotonic()
            kill(victim)
            t_lead = _wait_new_leader(leader, victim, ROUND_TIMEOUT)
            if t_lead is not None:
                elected.append(t_lead - t_kill)
            t_next = writer.first_after(t_kill, ROUND_TIMEOUT, mark)
            if t_next is None:
                log(f"{system} failover round {r + 1}: no write committed within {ROUND_TIMEOUT:.0f} s of the kill")
            else:
                failover.append(t_next - t_kill)
            writer.pause()
            t0 = time.monotonic()
            caught_up = restart_and_wait(victim)
            if caught_up:
                catchup.append(time.monotonic() - t0)
            log(f"{system} failover round {r + 1}/{kills}: killed node {victim}, next write after "
                f"{'-' if t_next is None else f'{t_next - t_kill:.2f} s'} (new leader seen after "
                f"{'-' if t_lead is None else f'{t_lead - t_kill:.2f} s'}); restarted and caught up: {caught_up} "
                f"in {time.monotonic() - t0:.1f} s")
    finally:
        writer.stopped.set()
        writer.running.set()
        writer.thread.join(timeout=ROUND_TIMEOUT + 5)
    return failover, elected, catchup


def raftps(run_dir: str, base_port: int, kills: int) -> list[dict[str, Any]]:
    """``kills`` leader SIGKILLs on a 3-node raftps cluster (default settings)."""
    from raftps.tools.localcluster import LocalCluster
    from raftps.server.node import NodeConfig
    from .push import _wait_converged
    cl = LocalCluster(run_dir, nodes=3, base_port=base_port)
    try:
        cl.start()
        client = cl.client(timeout=ROUND_TIMEOUT)
        client.create("failover", np.zeros(KiB // 4, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        grad = np.full(KiB // 4, 1e-3, np.float32)
        writer = Writer(lambda i: client.push({"failover": grad}))

        def restart_and_wait(node: int) -> bool:
            cl.start_node(node)
            with cl.client(timeout=5.0) as probe:
                return _wait_converged(probe, timeout=CATCHUP_TIMEOUT)

        rounds = _rounds("raftps-3", kills, writer, cl.leader, cl.kill, restart_and_wait)
        client.close()
        return [_summary("raftps-3", rounds, kills, writer,
                         {"settings": "default: election timeout %g-%g s (raftps NodeConfig); raftps.Client retries"
                                      % NodeConfig.election_timeout})]
    finally:
        cl.wipe()


def etcd(run_dir: str, base_port: int, kills: int) -> list[dict[str, Any]]:
    """``kills`` leader SIGKILLs on a 3-member etcd cluster (default heartbeat 100 ms, election 1 s)."""
    from .etcd import EtcdCluster, EtcdKV, etcd_binary
    if etcd_binary() is None:
        raise RuntimeError("etcd is not installed: run bench/setup.sh (Debian's etcd-server)")
    cl = EtcdCluster(run_dir, base_port)
    try:
        leader0 = cl.start()
        state = {"member": leader0}
        kvs = {k: EtcdKV(cl.client_address(k), timeout=ETCD_ATTEMPT_TIMEOUT) for k in range(1, cl.members + 1)}
        value = np.full(KiB // 4, 1e-3, np.float32).tobytes()

        def put(i: int) -> None:
            try:
                kvs[state["member"]].put("failover", value)
            except Exception:
                state["member"] = state["member"] % cl.members + 1     # the next member
                raise

        def revisions() -> set[int]:
            return {int(st["header"]["revision"]) if st else -1 for st in map(cl.member_status, range(1, cl.members + 1))}

        def restart_and_wait(member: int) -> bool:
            cl.start_member(member)
            deadline = time.monotonic() + CATCHUP_TIMEOUT
            while time.monotonic() < deadline:
                revs = revisions()
                if len(revs) == 1 and -1 not in revs and cl.leader() is not None:
                    return True
                time.sleep(0.05)
            return False

        writer = Writer(put)
        rounds = _rounds("etcd", kills, writer, cl.leader, cl.kill, restart_and_wait)
        for kv in kvs.values():
            kv.close()
        return [_summary("etcd", rounds, kills, writer,
                         {"settings": f"default: heartbeat 100 ms, election timeout 1 s; client moves to the next "
                                      f"member on a failed put or after {ETCD_ATTEMPT_TIMEOUT} s"})]
    finally:
        cl.wipe()
