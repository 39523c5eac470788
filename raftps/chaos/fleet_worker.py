"""One worker of a fleet run, on a worker host (tests/fault/test_slow_links.py, bench/fleet_step.py).

    python -m raftps.chaos.fleet_worker MODE ADDRESSES PREFIX RANK WORLD BYTES STEPS TIMEOUT [LANES [WIRE [ANSWERS [CHUNK [PAIRS]]]]]

MODE ``create``: every rank creates the job's tensors itself, all at once (what the ranks of
raftps.torch and DiLoCo did before one rank became the creator), and reports the time.
MODE ``sync``: rank 0 creates, the others wait for the tensors (raftps.jobs.wait_for_tensors),
then STEPS push_step steps, each rank's gradient is rank + 1 everywhere; ``sync-pull``: the
same with ``pull=True`` (each answer carries the step's tensors, as raftps.torch's sync mode
asks), and the wall-clock start and end of each step in ``times``.
MODE ``diloco``: DiLoCo with H = 1 for STEPS rounds (its create: rank 0's).
LANES: the client's max_in_flight (default 16); 1 sends a step's parts in several Raft groups
one after another, as push_step did before they went at once. WIRE ``fp16``: sync steps send
their gradients as fp16 (push_step's encoding; raftps.compress.encode_fp16), the all-reduce
reduces fp16 tensors (the bytes of DDP's fp16_compress_hook); default ``fp32``. ANSWERS
``spread``: sync-pull's tensors read from store member rank mod 3 (push_step's spread_answers).
CHUNK: push_step's chunk_bytes (0, the default: each group's part whole). With several Raft
groups the model is 32 tensors of equal bytes per group (chunks are whole tensors). PAIRS
``pairs``: push_step's pairs (ranks 2i and 2i + 1 add up half the chunks each; needs CHUNK).
MODE ``allreduce``: the DDP baseline, no store: STEPS gloo all-reduces (torch.distributed) of
one float32 tensor of BYTES among WORLD ranks, ADDRESSES being rank 0's host:port for the
rendezvous; the ranks' interface is eth0 (GLOO_SOCKET_IFNAME); ``times`` as sync-pull's.
It prints one JSON line: {"ok": true, ...} or {"ok": false, "error": "..."}.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from raftps import Client
from raftps.compress import encode_fp16
from raftps.client.diloco import DiLoCo
from raftps.groups import group_of
from raftps.client.job_steps import wait_for_tensors
from raftps.jobs import tensor

SGD = {"name": "sgd", "lr": 0.5}


def model(nbytes: int) -> dict[str, np.ndarray]:
    """Two float32 tensors of ``nbytes`` in all, the same on every rank."""
    n = nbytes // 4
    return {"w": np.linspace(-1, 1, n - n // 8, dtype=np.float32), "b": np.zeros(n // 8, np.float32)}


def tcp_retransmits() -> int:
    """Segments this host's TCP sent again (its network namespace's /proc/net/snmp)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def balanced_model(nbytes: int, prefix: str, groups: int, per_group: int = 4) -> dict[str, np.ndarray]:
    """``per_group`` float32 tensors of equal size in each of ``groups`` Raft groups, ``nbytes``
    in all: names picked so that every group holds the same bytes (what a placement that
    balances bytes gives; a real model's tensors hash to groups of uneven bytes)."""
    n = nbytes // 4 // (groups * per_group)
    taken = {g: 0 for g in range(groups)}
    out: dict[str, np.ndarray] = {}
    for i in range(1000 * groups * per_group):       # bounded: the hash spreads names evenly
        g = group_of(tensor(prefix, f"t{i}"), groups)
        if taken[g] < per_group:
            taken[g] += 1
            out[f"t{i}"] = np.linspace(-1, 1, n, dtype=np.float32)
        if len(out) == groups * per_group:
            return out
    raise RuntimeError(f"no balanced names for {groups} groups")


def allreduce(address: str, rank: int, world: int, nbytes: int, steps: int, timeout: float,
              wire: str = "fp32") -> dict:
    """What DDP does with a step's gradients: one all-reduce of them (one bucket) among the ranks."""
    import datetime
    import os

    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    started = time.monotonic()
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        grad = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float16 if wire == "fp16" else torch.float32)
        times = []
        for _ in range(steps):
            began = time.time()
            dist.all_reduce(grad)
            times.append([began, time.time()])
        return {"ok": True, "seconds": time.monotonic() - started, "times": times, "counts": [world] * steps}
    finally:
        dist.destroy_process_group()


def main() -> dict:
    mode, addresses, prefix, rank, world, nbytes, steps, timeout = sys.argv[1:9]
    lanes = int(sys.argv[9]) if len(sys.argv) > 9 else 16
    wire = sys.argv[10] if len(sys.argv) > 10 else "fp32"
    spread = len(sys.argv) > 11 and sys.argv[11] == "spread"
    chunk = int(sys.argv[12]) if len(sys.argv) > 12 else 0
    pairs = len(sys.argv) > 13 and sys.argv[13] == "pairs"
    rank, world, steps, timeout = int(rank), int(world), int(steps), float(timeout)
    if mode == "allreduce":
        return allreduce(addresses, rank, world, int(nbytes), steps, timeout, wire)
    params = model(int(nbytes))
    started = time.monotonic()
    with Client(addresses, timeout=timeout, max_in_flight=lanes) as client:
        if mode != "create" and client.groups() > 1:
            params = balanced_model(int(nbytes), prefix, client.groups(), per_group=32)
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
            encoding = None
            began = time.time()
            if wire == "fp16":
                encoded = {n: encode_fp16(g) for n, g in grads.items()}
                grads, encoding = {n: e[0] for n, e in encoded.items()}, {n: e[1] for n, e in encoded.items()}
            reply = client.push_step(grads, step, world, job=prefix, rank=rank, timeout=timeout,
                                     pull=mode == "sync-pull", encoding=encoding, spread_answers=spread,
                                     chunk_bytes=chunk, pairs=pairs)
            times.append([began, time.time()])
            counts.append(reply["count"])
        return {"ok": True, "counts": counts, "seconds": time.monotonic() - started, "times": times}


if __name__ == "__main__":
    retransmits = tcp_retransmits()
    try:
        out = main()
        out["tcp_retransmits"] = tcp_retransmits() - retransmits
    except Exception as exc:        # reported to the test, which names the rank
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
