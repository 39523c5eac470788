"""One worker of a fleet run, on a worker host (tests/fault/test_slow_links.py, bench/fleet_step.py).

    python -m raftps.chaos.fleet_worker MODE ADDRESSES PREFIX RANK WORLD BYTES STEPS TIMEOUT

MODE ``create``: every rank creates the job's tensors itself, all at once (what the ranks of
raftps.torch and DiLoCo did before one rank became the creator), and reports the time.
MODE ``sync``: rank 0 creates, the others wait for the tensors (raftps.jobs.wait_for_tensors),
then STEPS push_step steps, each rank's gradient is rank + 1 everywhere; ``sync-pull``: the
same with ``pull=True`` (each answer carries the step's tensors, as raftps.torch's sync mode
asks), and the wall-clock start and end of each step in ``times``.
MODE ``diloco``: DiLoCo with H = 1 for STEPS rounds (its create: rank 0's).
It prints one JSON line: {"ok": true, ...} or {"ok": false, "error": "..."}.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from raftps import Client
from raftps.diloco import DiLoCo
from raftps.job_steps import wait_for_tensors
from raftps.jobs import tensor

SGD = {"name": "sgd", "lr": 0.5}


def model(nbytes: int) -> dict[str, np.ndarray]:
    """Two float32 tensors of ``nbytes`` in all, the same on every rank."""
    n = nbytes // 4
    return {"w": np.linspace(-1, 1, n - n // 8, dtype=np.float32), "b": np.zeros(n // 8, np.float32)}


def main() -> dict:
    mode, addresses, prefix, rank, world, nbytes, steps, timeout = sys.argv[1:]
    rank, world, steps, timeout = int(rank), int(world), int(steps), float(timeout)
    params = model(int(nbytes))
    started = time.monotonic()
    with Client(addresses, timeout=timeout) as client:
        if mode == "create":
            client.create_many({tensor(prefix, k): v for k, v in params.items()},
                               {tensor(prefix, k): SGD for k in params})
            return {"ok": True, "seconds": time.monotonic() - started}
        if mode == "diloco":
            d = DiLoCo(client, prefix, params, rank=rank, world_size=world, sync_every=1,
                       outer={"name": "sgd", "lr": 1.0}, step_timeout=timeout)
            d.create()
            start, local = d.resume()
            counts = []
            for step in range(start, start + steps):
                local = {k: v - np.float32(0.01 * (rank + 1)) for k, v in local.items()}
                new = d.after_inner_step(step, local)
                if new is not None:
                    local.update(new)
                    counts += [r.count for r in d.rounds]
            return {"ok": True, "counts": counts, "seconds": time.monotonic() - started}
        names = [tensor(prefix, k) for k in params]
        if rank == 0:
            client.create_many(dict(zip(names, params.values())), {n: SGD for n in names})
        else:
            wait_for_tensors(client, names, timeout, prefix)
        counts, times = [], []
        for step in range(steps):
            grads = {n: np.full_like(v, rank + 1) for n, v in zip(names, params.values())}
            began = time.time()
            reply = client.push_step(grads, step, world, job=prefix, rank=rank, timeout=timeout,
                                     pull=mode == "sync-pull")
            times.append([began, time.time()])
            counts.append(reply["count"])
        return {"ok": True, "counts": counts, "seconds": time.monotonic() - started, "times": times}


if __name__ == "__main__":
    try:
        out = main()
    except Exception as exc:        # reported to the test, which names the rank
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
