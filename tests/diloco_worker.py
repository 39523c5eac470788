"""One DiLoCo rank as a real process, for tests/test_diloco.py's worker SIGKILL.

    python tests/diloco_worker.py ADDRESSES PREFIX RANK WORLD H ROUNDS STEP_SLEEP STEP_TIMEOUT LOG

Inner step: each parameter moves a tenth of the way to the rank's target (rank + 1), after a
sleep of STEP_SLEEP seconds (so a round has a middle to be killed in). It appends one JSON line
to LOG when it resumes ({"start": step}) and after every round ({"round", "count", "late", "step"})."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raftps import Client                # noqa: E402
from raftps.client.diloco import DiLoCo          # noqa: E402

INIT = {"w": np.zeros(6, np.float32), "b": np.zeros(2, np.float32)}


def main() -> None:
    addresses, prefix, rank, world, h, rounds, sleep, timeout, log = sys.argv[1:]
    rank, world, h, rounds = int(rank), int(world), int(h), int(rounds)
    target = np.float32(rank + 1)
    with Client(addresses, timeout=60.0) as client, open(log, "a") as out:
        d = DiLoCo(client, prefix, INIT, rank=rank, world_size=world, sync_every=h, step_timeout=float(timeout))
        d.create()
        start, params = d.resume()
        out.write(json.dumps({"start": start}) + "\n")
        out.flush()
        for step in range(start, rounds * h):
            time.sleep(float(sleep))
            params = {k: v + (target - v) * np.float32(0.1) for k, v in params.items()}
            new = d.after_inner_step(step, params)
            if new is not None:
                params.update(new)
                for r in d.rounds:
                    out.write(json.dumps({"round": r.round, "count": r.count, "late": r.late, "step": step}) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
