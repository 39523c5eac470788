"""A seeded random schedule of faults over a bounded run (case 10). The seed fixes the schedule
(which fault, which node role, how long); the nodes picked are resolved at run time by role."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from raftps.chaos.harness import Harness

PROCESS_FAULTS = ["kill-leader", "kill-follower", "pause-leader", "pause-follower"]
NET_FAULTS = ["isolate-leader", "isolate-follower", "asymmetric-leader", "loss-follower", "flap-leader"]
# Durable clusters on the simulated disk (Harness(power_cuts=True)): SIGKILL, then every file of
# the node(s) cut back to what was fsynced plus a random part of the rest ("torn").
POWER_FAULTS = ["powercut-leader", "powercut-all"]


@dataclass
class Step:
    fault: str
    duration: float          # seconds the fault lasts
    quiet: float             # seconds of calm after recovery


def schedule(seed: int, seconds: float, network: bool, power: bool = False) -> list[Step]:
    rng = random.Random(seed)
    faults = PROCESS_FAULTS + (NET_FAULTS if network else []) + (POWER_FAULTS if power else [])
    steps, t = [], 2.0
    while True:
        step = Step(rng.choice(faults), round(rng.uniform(1.0, 4.0), 1), round(rng.uniform(1.0, 3.0), 1))
        if t + step.duration + step.quiet > seconds - 3.0:
            return steps
        steps.append(step)
        t += step.duration + step.quiet


def apply(h: Harness, step: Step) -> str:
    """Inject one fault, hold it, recover; returns what was done."""
    role, fault = step.fault.rsplit("-", 1)[1], step.fault.rsplit("-", 1)[0]
    node = h.leader() if role == "leader" else h.follower()
    h.event(f"{step.fault} n{node} for {step.duration}s")
    if fault == "powercut":
        victims = list(range(1, h.nodes + 1)) if role == "all" else [node]
        h.power_cut(victims, seed=int(step.duration * 10))
        time.sleep(step.duration)
        for victim in victims:
            h.cluster.start_node(victim)
        node = "all" if role == "all" else node
    elif fault == "kill":
        h.kill(node)
        time.sleep(step.duration)
        h.cluster.start_node(node)
    elif fault == "pause":
        h.cluster.pause(node)
        time.sleep(step.duration)
        h.cluster.resume(node)
    elif fault in ("isolate", "asymmetric"):
        h.net.isolate(node, "in" if fault == "asymmetric" else "both")
        time.sleep(step.duration)
        h.net.heal(node)
    elif fault == "loss":
        h.net.loss(node, 0.3)
        time.sleep(step.duration)
        h.net.heal(node)
    elif fault == "flap":
        h.net.flap(node, period=0.5, count=max(1, int(step.duration))).join(step.duration + 10)
    h.event(f"recovered n{node}")
    time.sleep(step.quiet)
    return f"{step.fault}:n{node}:{step.duration}s"
