"""The fleet goodput bench's failure schedule and DDP's checkpoint interval: pure functions, the
same seeded schedule for every configuration (tests/test_bench_goodput.py checks them).

A schedule is a list of faults in seconds since a configuration's launch: worker preemptions as
a Poisson process (exponential gaps of a stated mean), each preempted worker host returning after
a stated delay, and one loss of the system's coordinator (raftps: its store leader; torchft: the
lighthouse; DDP: rank 0's host, which holds the rendezvous store) at a seeded random offset. The
offsets are drawn in seconds, so they fall on no particular step: not on multiples of DiLoCo's H
or of a checkpoint interval.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

COORDINATOR = "coordinator"


@dataclass(frozen=True)
class Fault:
    at_s: float            # seconds since the launch
    what: str              # "worker" or COORDINATOR
    worker: int            # the worker host preempted (0-based); -1 for the coordinator
    back_s: float          # seconds since the launch at which it returns

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def schedule(seed: int, horizon_s: float, mean_interval_s: float, return_delay_s: float, workers: int,
             coordinator_at: tuple[float, float] = (0.15, 0.5)) -> list[Fault]:
    """The faults up to ``horizon_s``, sorted by time. Preemptions: a Poisson process of mean gap
    ``mean_interval_s`` over the whole fleet, each taking a worker host that is up (drawn
    uniformly), which returns ``return_delay_s`` later; a preemption that finds every host down is
    skipped. The coordinator is lost once, at a uniform offset within ``coordinator_at`` of the
    horizon, and comes back ``return_delay_s`` later."""
    if mean_interval_s <= 0 or return_delay_s < 0 or horizon_s <= 0 or workers < 1:
        raise ValueError(f"a schedule needs a positive mean interval ({mean_interval_s}) and horizon "
                         f"({horizon_s}), a return delay >= 0 ({return_delay_s}) and >= 1 worker ({workers})")
    rng = random.Random(seed)
    faults: list[Fault] = []
    down_until = [0.0] * workers
    t = 0.0
    for _ in range(10_000):                     # bounded: the horizon ends it long before
        t += rng.expovariate(1.0 / mean_interval_s)
        if t >= horizon_s:
            break
        up = [w for w in range(workers) if down_until[w] <= t]
        if not up:
            continue
        w = rng.choice(up)
        down_until[w] = t + return_delay_s
        faults.append(Fault(round(t, 2), "worker", w, round(t + return_delay_s, 2)))
    lo, hi = coordinator_at
    at = rng.uniform(lo * horizon_s, hi * horizon_s)
    faults.append(Fault(round(at, 2), COORDINATOR, -1, round(at + return_delay_s, 2)))
    return sorted(faults, key=lambda f: f.at_s)


def young_daly_s(checkpoint_s: float, mean_interval_s: float) -> float:
    """Young/Daly's best checkpoint interval in seconds, sqrt(2 C M) for a checkpoint that costs C s
    and failures every M s on average (Young 1974; Daly 2006's first-order form)."""
    if checkpoint_s < 0 or mean_interval_s <= 0:
        raise ValueError(f"checkpoint cost {checkpoint_s} s and mean interval {mean_interval_s} s")
    return math.sqrt(2.0 * checkpoint_s * mean_interval_s)


def checkpoint_every(checkpoint_s: float, mean_interval_s: float, steps_per_s: float) -> int:
    """Young/Daly's interval in steps at ``steps_per_s`` (at least 1)."""
    return max(1, round(young_daly_s(checkpoint_s, mean_interval_s) * steps_per_s))

