"""Goodput on a fleet: ``python -m bench.goodput --fleet``. Every configuration of the loopback
bench (bench/goodput.py) on raftps.chaos.fleet's hosts: 3 store hosts and 4 worker hosts, one DDP
rank / torchft replica group / raftps worker per worker host, every host's link shaped both ways,
at each rate of ``--links``, without and with the seeded failure schedule (bench/goodput_schedule.py),
all configurations in one run.

One clock: a configuration's time starts before anything of it starts (its store nodes, its
lighthouse, its processes' imports and rendezvous). Bytes: every host's link counters (the kernel's)
over the configuration. Under the schedule, at the same offsets for every configuration:
  - a preempted worker host loses its process (SIGKILL) and returns after the stated delay;
  - the coordinator is lost once: raftps's store leader (SIGKILL, restarted at its return), torchft's
    lighthouse (SIGKILL, restarted), DDP's rendezvous store, which rank 0's host holds (as torchrun's
    static rendezvous and env:// do), so rank 0's host is preempted.
DDP's ranks form one group: a rank lost fails the group, the others are stopped at once (as
torchrun's agent does) and the job starts again, every rank from the last checkpoint, once every
host is back (a job scheduler's restart; plain DDP has no checkpoint and is run without faults
only: it is the ceiling, and it sets the target). DDP + checkpoint-restart's checkpoint lives on a
store host (bench/checkpoint_server.py), every save and load crossing the shaped links, at
Young/Daly's interval from the save's measured cost on that fleet and the schedule's mean interval.
torchft's replica groups and raftps's workers are restarted alone at their host's return.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .common import log
from .goodput_launch import raftps_argv
from .goodput_report import WORKERS, batch_rows, read_rows, reached, store_check_after, summarize
from .goodput_schedule import COORDINATOR, Fault, checkpoint_every, schedule, young_daly_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt.py")
WORKER = os.path.join(ROOT, "bench", "goodput_worker.py")
STORE_HOSTS = 3
CONTRIBUTING = r"\[rank {rank}\] contributing"        # the line a worker prints after its first step


@dataclass
class Plan:
    links: list[str]
    budget: int
    eval_every: int
    sync_every: int
    outer: str
    timeout: float
    seed: int
    mean_interval_s: float
    return_delay_s: float
    run_dir: str
    base_port: int
    schedules: tuple[bool, ...] = (False, True)          # run without the schedule, with it
    net: tuple[str, str] = ("rpsgp", "10.79.21")           # the fleet's namespace prefix and subnet
    target: float | None = None
    runs: int = 0
    # raftps in its best documented configuration on a fleet (docs/choosing-a-mode.md): the model
    # sharded over ``groups`` Raft groups, their leaders on different store hosts; sync steps
    # streamed in chunks of ``chunk_bytes`` on links of at most CHUNKED_AT_MOST bits/s (where
    # bench/results/fleet_step_100mbit_stream.md measured them to pay; unshaped they only cost:
    # fleet_step_unshaped_stream.md), in ``pairs`` where chunked (bench/results/fleet_step_100mbit_pairs.md:
    # the workers' links carry an all-reduce's bytes); DiLoCo's pseudo-gradients as ``compress`` (int8: the same
    # validation loss, bench/results/diloco_quality_int8.md).
    groups: int = 3
    chunk_bytes: int = 53_000
    pairs: bool = True
    compress: str = "int8"


CHUNKED_AT_MOST = 100e6


def chunk_bytes_for(plan: Plan, fleet: Any) -> int:
    """The sync step's chunk_bytes on this fleet: ``plan.chunk_bytes`` where every link is shaped
    to at most CHUNKED_AT_MOST, else 0 (whole parts)."""
    rates = list(fleet.rates.values())
    slow = all(r is not None and r <= CHUNKED_AT_MOST for r in rates)
    return plan.chunk_bytes if slow else 0


@dataclass
class Clock:
    launch_unix: float = field(default_factory=time.time)
    events: list[tuple[float, str]] = field(default_factory=list)
    returns: list[dict[str, Any]] = field(default_factory=list)     # a worker back: when, rank, seconds to contribute

    def mark(self, text: str) -> None:
        self.events.append((time.time(), text))
        log(f"goodput fleet: {time.time() - self.launch_unix:.1f} s: {text}")


class Ranks:
    """One process per worker host. ``whole_group``: DDP (a lost rank fails the group; all start
    again once every host is up, ``generation`` counting the starts); otherwise a rank restarts alone."""

    def __init__(self, fleet: Any, argv: Any, env: Any, out: str, clock: Clock, whole_group: bool):
        self.fleet, self.argv, self.env, self.out, self.clock = fleet, argv, env, out, clock
        self.whole_group, self.generation = whole_group, 0
        self.procs: dict[int, subprocess.Popen] = {}
        self.down: set[int] = set()
        self.waiting: list[dict[str, Any]] = []           # returned ranks not yet contributing

    def log_path(self, r: int) -> str:
        return os.path.join(self.out, f"rank{r}.log")

    def start(self, r: int, returned: bool = False) -> None:
        path = self.log_path(r)
        offset = os.path.getsize(path) if os.path.exists(path) else 0
        with open(path, "ab") as f:
            self.procs[r] = self.fleet.start_worker(r + 1, self.argv(r, self.generation), self.env(r, self.generation), f)
        if returned:
            self.waiting.append({"rank": r, "unix": time.time(), "path": path, "offset": offset})

    def start_all(self) -> None:
        for r in range(WORKERS):
            self.start(r)

    def kill(self, r: int) -> None:
        p = self.procs.get(r)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def preempt(self, r: int) -> None:
        self.down.add(r)
        killed = list(range(WORKERS)) if self.whole_group else [r]
        for other in killed:
            self.kill(other)
        # a returned rank killed before it contributed has no time to contribute: its host's next return does
        self.waiting = [w for w in self.waiting if w["rank"] not in killed]

    def back(self, r: int) -> None:
        self.down.discard(r)
        if not self.whole_group:
            self.start(r, returned=True)
        elif not self.down:
            self.generation += 1
            for other in range(WORKERS):
                self.start(other, returned=other == r)

    def poll(self) -> None:
        """Restart a whole group whose rank failed by itself; note returned ranks now contributing."""
        if self.whole_group and not self.down and any(p.poll() not in (None, 0) for p in self.procs.values()):
            self.clock.mark(f"DDP group failed (exit codes {[p.poll() for p in self.procs.values()]}): restarting it")
            for r in range(WORKERS):
                self.kill(r)
            self.generation += 1
            self.start_all()
        for w in list(self.waiting):
            with open(w["path"], "rb") as f:
                f.seek(w["offset"])
                text = f.read().decode(errors="replace")
            line = re.search(CONTRIBUTING.format(rank=w["rank"]) + r".*", text)
            if line:
                self.waiting.remove(w)
                phases = re.search(r"\((since the process started [^)]*)\)", line.group(0))
                self.clock.returns.append({"rank": w["rank"], "back_s": round(w["unix"] - self.clock.launch_unix, 1),
                                           "to_contribute_s": round(time.time() - w["unix"], 1),
                                           "phases": phases.group(1) if phases else None})

    def done(self) -> bool:
        p = self.procs.get(0)
        return p is not None and p.poll() == 0 and 0 not in self.down

    def stop(self) -> None:
        for r in range(WORKERS):
            self.kill(r)


def drive(plan: Plan, clock: Clock, ranks: Ranks, faults: list[Fault], coordinator: Any, out: str) -> bool:
    """Fire the schedule's faults and returns at their offsets since the launch; stop once past the
    budget with the target reached (or at twice the budget, the job's end, or the timeout)."""
    actions: list[tuple[float, str, Any]] = []
    for f in faults:
        if f.what == COORDINATOR:
            actions += [(f.at_s, "lose the coordinator", coordinator.lose), (f.back_s, "coordinator back", coordinator.back)]
        else:
            actions += [(f.at_s, f"preempt worker host {f.worker + 1}", lambda w=f.worker: ranks.preempt(w)),
                        (f.back_s, f"worker host {f.worker + 1} back", lambda w=f.worker: ranks.back(w))]
    actions.sort(key=lambda a: a[0])
    said = 0.0
    while True:
        now = time.time() - clock.launch_unix
        while actions and actions[0][0] <= now:
            _, text, action = actions.pop(0)
            clock.mark(f"{text}: {action() or ''}")
        ranks.poll()
        rows = read_rows(os.path.join(out, "metrics.csv"))
        step = max((r["step"] for r in rows), default=0)
        if ranks.done():
            return True
        if step >= 2 * plan.budget or (step >= plan.budget and (plan.target is None or reached(rows, plan.target))):
            return False
        if now > plan.timeout:
            clock.mark(f"timed out at step {step}")
            return False
        if time.monotonic() - said > 20:
            log(f"goodput fleet: step {step}/{plan.budget} at {now:.0f} s")
            said = time.monotonic()
        time.sleep(0.2)


class NoCoordinator:
    def lose(self) -> str:
        return "none"

    def back(self) -> str:
        return ""


class RankZeroHost:
    """DDP's rendezvous store is on rank 0's host: losing it is preempting that host."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def lose(self) -> str:
        self.ranks.preempt(0)
        return "rank 0's host (it holds the rendezvous store)"

    def back(self) -> None:
        self.ranks.back(0)


class StoreLeader:
    def __init__(self, cluster: Any):
        self.cluster, self.node = cluster, None

    def lose(self) -> str:
        self.node = self.cluster.leader()
        if self.node is not None:
            self.cluster.kill(self.node)
        return f"store node {self.node}"

    def back(self) -> str:
        if self.node is not None:
            self.cluster.start_node(self.node)
        return f"store node {self.node} restarted"


class Lighthouse:
    """torchft's lighthouse on store host 1, killed and started again."""

    def __init__(self, fleet: Any, port: int, out: str):
        self.fleet, self.port, self.out, self.proc = fleet, port, out, None
        self.address = f"http://{fleet.ip(1)}:{port}"

    def start(self) -> None:
        binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        with open(os.path.join(self.out, "lighthouse.log"), "ab") as f:
            self.proc = subprocess.Popen(self.fleet.net.command_prefix(1) + [
                binary, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                "--bind", f"{self.fleet.ip(1)}:{self.port}"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.fleet.workers.append(self.proc)          # Fleet.down kills it by PID too

    def lose(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        return "the lighthouse"

    def back(self) -> str:
        self.start()
        return "lighthouse restarted"

    def stop(self) -> None:
        self.lose()


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {"PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **extra}


def _train_args(plan: Plan, steps: int, out: str) -> list[str]:
    return ["--steps", str(steps), "--eval-every", str(plan.eval_every), "--out", out]


def measure_checkpoint(fleet: Any, url: str) -> float:
    """Seconds for worker host 1 to save the char GPT's model and Adam state to the checkpoint
    server (the median of 3), as (b)'s rank 0 does (examples/common.py, save_checkpoint)."""
    code = (f"import sys, time, statistics; sys.path[:0] = [{os.path.join(ROOT, 'examples')!r}]; import torch; "
            "from char_gpt import build; from common import save_checkpoint; "
            "m, bi, lo, _ = build(0, 32); o = torch.optim.Adam(m.parameters()); lo(m, bi(0)[:2]).backward(); o.step(); "
            "ts = []\nfor _ in range(3):\n t = time.perf_counter(); "
            "save_checkpoint(sys.argv[1], {'model': m.state_dict(), 'optimizer': o.state_dict(), 'step': 1}); "
            "ts.append(time.perf_counter() - t)\nprint(statistics.median(ts))")
    proc = fleet.start_worker(1, [sys.executable, "-c", code, url], _env({}), subprocess.PIPE)
    out, _ = proc.communicate(timeout=300)
    return float(out.decode().strip().splitlines()[-1])


# ---- the configurations: each returns (Ranks, coordinator, cleanup) once started ---------------

def start_ddp(fleet: Any, plan: Plan, name: str, out: str, clock: Clock, ckpt: dict[str, Any]) -> tuple:
    """(a) / (b): the 4 ranks of examples/char_gpt.py --backend ddp, rank 0's host holding the
    rendezvous store (MASTER_ADDR), a new port for each start of the group."""
    args = ["--backend", "ddp", *_train_args(plan, plan.budget if name == "ddp" else 2 * plan.budget, out)]
    if name == "ddp-ckpt":
        args += ["--checkpoint", ckpt["url"] + f"/{name}-{plan.runs}.pt", "--checkpoint-every", str(ckpt["every"])]
    port = plan.base_port + 500 + 50 * plan.runs

    def env(r: int, generation: int) -> dict[str, str]:
        return _env({"RANK": str(r), "WORLD_SIZE": str(WORKERS), "LOCAL_RANK": "0", "MASTER_ADDR": fleet.ip(fleet.worker_host(1)),
                     "MASTER_PORT": str(port + generation)})
    ranks = Ranks(fleet, lambda r, g: [sys.executable, CHAR_GPT, *args], env, out, clock, whole_group=True)
    ranks.start_all()
    return ranks, RankZeroHost(ranks), lambda: None


def start_torchft(fleet: Any, plan: Plan, name: str, out: str, clock: Clock, ckpt: dict[str, Any]) -> tuple:
    """(c): a lighthouse on store host 1; one replica group (one process) per worker host, in a UTS
    namespace named by its address (torchft's Manager and its checkpoint transport advertise the
    host name; on one machine every namespace would otherwise share one)."""
    lighthouse = Lighthouse(fleet, plan.base_port + 499 - plan.runs, out)
    lighthouse.start()
    args = ["--kind", name, "--steps", str(2 * plan.budget), "--eval-every", str(plan.eval_every),
            "--sync-every", str(plan.sync_every), "--outer", plan.outer, "--out", out]
    port = plan.base_port + 500 + 50 * plan.runs

    def argv(r: int, generation: int) -> list[str]:
        ip = fleet.ip(fleet.worker_host(r + 1))
        return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ip, sys.executable, WORKER, *args]

    def env(r: int, generation: int) -> dict[str, str]:
        return _env({"REPLICA_GROUP_ID": str(r), "NUM_REPLICA_GROUPS": str(WORKERS), "TORCHFT_LIGHTHOUSE": lighthouse.address,
                     "MASTER_ADDR": fleet.ip(fleet.worker_host(r + 1)), "MASTER_PORT": str(port + generation),
                     "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GOODPUT_REPLICA_STORE": "1"})
    ranks = Ranks(fleet, argv, env, out, clock, whole_group=False)
    ranks.start_all()
    return ranks, lighthouse, lighthouse.stop


def start_raftps(fleet: Any, plan: Plan, name: str, out: str, clock: Clock, ckpt: dict[str, Any]) -> tuple:
    """(d)-(f): a fresh cluster, one node per store host, and one worker per worker host, started
    together."""
    cluster = fleet.cluster(os.path.join(plan.run_dir, f"{name}-{plan.runs}-cluster"), base_port=plan.base_port + 20 * plan.runs,
                            groups=plan.groups)
    # The store nodes and the workers start together, as torchft's lighthouse and replica groups
    # do: a worker's client retries until the store answers, so its imports overlap the election.
    for node in range(1, cluster.nodes + 1):
        cluster.start_node(node)
    prefix = f"goodput-{name}-{plan.runs}"
    argv = raftps_argv(name, prefix, 2 * plan.budget, plan.eval_every, plan.sync_every, plan.outer, out,
                       chunk_bytes_for(plan, fleet), plan.compress if name == "raftps-diloco" else "none", plan.pairs)
    ranks = Ranks(fleet, lambda r, g: argv, lambda r, g: _env({**cluster.client_env, "RANK": str(r),
                                                                "WORLD_SIZE": str(WORKERS)}), out, clock, whole_group=False)
    ranks.start_all()
    ranks.cluster, ranks.prefix = cluster, prefix
    try:
        cluster.wait_ready(120)
    except BaseException:
        ranks.stop()
        cluster.stop()
        raise

    def cleanup() -> None:
        cluster.stop()
        cluster.wipe()
    return ranks, StoreLeader(cluster), cleanup


STARTERS = {"ddp": start_ddp, "ddp-ckpt": start_ddp, "torchft-ddp": start_torchft, "torchft-diloco": start_torchft,
            "raftps-sync": start_raftps, "raftps-sync-overlap": start_raftps, "raftps-diloco": start_raftps,
            "raftps-diloco-async": start_raftps}


def run_config(fleet: Any, plan: Plan, name: str, link: str, faults: list[Fault], ckpt: dict[str, Any]) -> dict[str, Any]:
    """One configuration on the fleet, its clock from before anything of it starts."""
    tag = f"{name}-{link}-{'faults' if faults else 'clean'}"
    out = os.path.join(plan.run_dir, tag)
    os.makedirs(out)
    clock = Clock()
    bytes0 = fleet.link_bytes()
    ranks, coordinator, cleanup, check, completed = None, NoCoordinator(), lambda: None, None, False
    try:
        ranks, coordinator, cleanup = STARTERS[name](fleet, plan, name, out, clock, ckpt)
        completed = drive(plan, clock, ranks, faults, coordinator, out)
        rows = read_rows(os.path.join(out, "metrics.csv"))
        if name in ("raftps-sync", "raftps-sync-overlap", "raftps-diloco"):
            ranks.stop()
            try:
                check = store_check_after(name, ranks.cluster, ranks.prefix, out, batch_rows(rows, completed),
                                          chunk_bytes_for(plan, fleet))
            except Exception as e:               # noqa: BLE001 - reported: a check that could not run
                check = {"ok": False, "verdict": f"FAILED to read the store: {type(e).__name__}: {e}"}
            log(f"goodput fleet {tag}: {check['verdict']}")
    finally:
        if ranks is not None:
            ranks.stop()
        cleanup()
        plan.runs += 1
    bytes1 = fleet.link_bytes()
    sent = {h: bytes1[h][0] - bytes0[h][0] for h in bytes1}
    rows = batch_rows(read_rows(os.path.join(out, "metrics.csv")), completed)
    result: dict[str, Any] = {"config": name, "link": link, "faults": bool(faults), "tag": tag}
    if not rows:
        return {**result, "error": "no metrics (see the run's logs)", "events": [(u - clock.launch_unix, t) for u, t in clock.events]}
    target = plan.target if plan.target is not None else smoothed_target(rows, plan.budget)
    r = summarize(name, rows, completed, clock.launch_unix, plan.budget, target, clock.events,
                  {"bytes_sent_by_host": sent, "bytes_sent_total": sum(sent.values()), "returns": clock.returns})
    last = rows[-1]
    r.update(result)
    r["useful_steps_per_s"] = last["step"] / (last["unix"] - clock.launch_unix)
    r["curve"] = [(x["unix"] - clock.launch_unix, x["val"]) for x in rows if x["val"] is not None]
    if check is not None:
        r["store_check"] = check
    if name == "ddp-ckpt":
        r.update(checkpoint_every=ckpt["every"], checkpoint_save_s=ckpt["save_s"], young_daly_s=ckpt["young_daly_s"])
    log(f"goodput fleet {tag}: to target {r['wall_to_target_s']} s, useful {r['useful_steps_per_s']:.2f} steps/s, "
        f"{sum(sent.values()) / 1e6:.0f} MB sent, returns {clock.returns}")
    return r


def smoothed_target(rows: list[dict], budget: int, around: tuple[float, float] = (0.7, 0.9)) -> float:
    """The ceiling's mean validation loss over its evaluations within ``around`` of the budget: a
    target no single noisy evaluation sets (with evaluations every few batches)."""
    vals = [r["val"] for r in rows if r["val"] is not None and around[0] * budget <= r["step"] <= around[1] * budget]
    if not vals:                 # a tiny budget: the first evaluation past the window's middle
        from .goodput_report import target_from
        return target_from(rows, budget, sum(around) / 2)
    return sum(vals) / len(vals)


# ---- the run: every link rate, without and with the schedule -------------------------------

def run_link(plan: Plan, link: str, configs: list[str], faults: list[Fault], results: list[dict]) -> None:
    """One fleet at ``link``: (a) first (the target, from the first link rate, and its step rate),
    the checkpoint's cost, then every configuration without and with the schedule."""
    from raftps.chaos.fleet import Fleet
    with Fleet(STORE_HOSTS, WORKERS, link=link, prefix=plan.net[0], subnet=plan.net[1]) as fleet:
        server = fleet.net.command_prefix(2) + [sys.executable, "-m", "bench.checkpoint_server",
                                                 os.path.join(plan.run_dir, f"checkpoints-{link}"), fleet.ip(2),
                                                 str(plan.base_port + 498)]
        proc = subprocess.Popen(server, cwd=ROOT, env={**os.environ, **_env({})}, start_new_session=True)
        fleet.workers.append(proc)
        log(f"== goodput fleet {link}: (a) DDP without faults")
        ddp = run_config(fleet, plan, "ddp", link, [], {})
        results.append(ddp)
        if "error" in ddp:
            raise RuntimeError(f"(a) DDP failed on {link}, so there is no target: {ddp['error']}")
        if plan.target is None:
            plan.target = ddp["target"]
        url = f"http://{fleet.ip(2)}:{plan.base_port + 498}"
        save_s = measure_checkpoint(fleet, url + "/probe.pt")
        ckpt = {"url": url, "save_s": save_s, "young_daly_s": young_daly_s(save_s, plan.mean_interval_s),
                "every": checkpoint_every(save_s, plan.mean_interval_s, ddp["steps_before_fault_per_s"] or 1.0)}
        log(f"goodput fleet {link}: a checkpoint save takes {save_s:.2f} s: Young/Daly {ckpt['young_daly_s']:.1f} s, "
            f"every {ckpt['every']} batches")
        for scheduled in plan.schedules:
            for name in configs:
                if name == "ddp" and not scheduled:
                    continue
                if name == "ddp" and scheduled:
                    results.append({"config": name, "link": link, "faults": True, "skipped":
                                    "plain DDP has no checkpoint: under the schedule it restarts from batch 0 "
                                    "(it is the failure-free ceiling)"})
                    continue
                log(f"== goodput fleet {link}: {name}, {'with' if scheduled else 'without'} the schedule")
                try:
                    results.append(run_config(fleet, plan, name, link, faults if scheduled else [], ckpt))
                except Exception as e:       # noqa: BLE001 - reported in the table; the others still run
                    log(f"goodput fleet {name} failed: {type(e).__name__}: {e}")
                    results.append({"config": name, "link": link, "faults": scheduled, "error": f"{type(e).__name__}: {e}"})
