"""examples/: cnn_digits learns with --backend local (a subprocess, as a user runs it), and the
batch schedule gives every rank its part of every global batch exactly once, also on resume."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def test_cnn_digits_local_learns(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "cnn_digits.py"), "--backend", "local",
                        "--steps", "80", "--eval-every", "20", "--threads", "1", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert float(rows[-1]["loss"]) < 0.5 * float(rows[0]["loss"]), (rows[0], rows[-1])
    assert summary["final_test_acc"] > 0.8, summary
    assert summary["label"] == "local x1" and summary["steps"] == 80


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("start_step", [0, 3])
def test_schedule_covers_every_batch_once(sharded, start_step):
    sys.path.insert(0, EXAMPLES)
    try:
        import common
    finally:
        sys.path.remove(EXAMPLES)
    world, steps, batch = 4, 23, 8
    seen: list[tuple[int, int]] = []
    for rank in range(world):
        # async ranks resume at their own count; a sync job at the job's step (same number here)
        b = SimpleNamespace(rank=rank, world=world, sharded=sharded, start_step=start_step)
        for g in common.my_batches(b, steps):
            part = common.my_part(np.arange(g * batch, (g + 1) * batch), b)
            seen += [(g, int(i)) for i in part]
    first = start_step if sharded else start_step * world
    want = [(g, i) for g in range(first, steps) for i in range(g * batch, (g + 1) * batch)]
    assert sorted(seen) == want
