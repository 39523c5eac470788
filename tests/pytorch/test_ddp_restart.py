"""DDP with checkpoint-restart, as bench/goodput.py's configuration (b) runs it: examples/cnn_digits.py
--backend ddp --checkpoint under torchrun --max-restarts, one worker SIGKILLed after a checkpoint;
the restarted group must build its gloo process group again (examples/common.py, init_gloo) and
finish from the checkpoint. 4 workers: without init_gloo's store prefix this failed here with 4
(`Gloo connectFullMesh failed ... Connection refused`) and passed with 2. Every process is
stopped by PID."""
from __future__ import annotations

import csv
import json
import os
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from raftps.chaos.torchrun import TorchrunJob  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "cnn_digits.py")
STEPS, EVERY = 120, 20


def steps_logged(out) -> list[int]:
    path = out / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("unix")]


def test_ddp_group_restarted_by_torchrun_resumes_from_its_checkpoint(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt.pt"
    args = ["--backend", "ddp", "--steps", str(STEPS), "--eval-every", "40", "--out", str(out),
            "--checkpoint", str(ckpt), "--checkpoint-every", str(EVERY)]
    job = TorchrunJob(SCRIPT, args, 4, 2, {"PYTHONPATH": ROOT}, str(tmp_path / "torchrun.log"), 23590)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (ckpt.exists() and max(steps_logged(out), default=0) >= EVERY + 5):
            assert job.proc.poll() is None, open(tmp_path / "torchrun.log", errors="replace").read()[-3000:]
            time.sleep(0.1)
        killed_at = max(steps_logged(out), default=0)
        assert killed_at >= EVERY + 5, "the job did not get past its first checkpoint in time"
        job.kill_worker()
        code = job.wait(300)
    finally:
        job.stop()
    log = open(tmp_path / "torchrun.log", errors="replace").read()
    assert code == 0, f"torchrun exited {code}:\n{log[-3000:]}"
    steps = steps_logged(out)
    resumed = [b for a, b in zip(steps, steps[1:]) if b <= a and b != STEPS]     # the restart's first step
    assert resumed, f"no resume in the logged steps: {steps}"
    assert (resumed[0] - 1) % EVERY == 0 and resumed[0] - 1 <= killed_at + 1, (resumed, killed_at)
    summary = json.loads((out / "summary.json").read_text())
    # A rank that aborts while exiting (gloo's teardown on a loaded machine) makes torchrun restart the
    # group once more after the last step: that run resumes from the final checkpoint, with no step left.
    assert summary["start_step"] in {r - 1 for r in resumed} | {STEPS}, (summary, resumed)
    assert summary["final_test_acc"] >= 0.5, summary     # untrained: about 0.1
