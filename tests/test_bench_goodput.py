"""bench/goodput_report.py's target, recompute, short-step and report logic, and the resume line
bench/goodput_launch.py reads, on made-up curves (no torch processes, no cluster, no timing)."""
from __future__ import annotations

import json
import os

import pytest

from bench import goodput_launch, goodput_report

T0 = 1000.0        # the launch, unix seconds


def rows(points: list[tuple[float, int, float | None]]) -> list[dict]:
    """(seconds since launch, step, validation loss or None) -> metrics rows."""
    return [{"time": t - 5.0, "step": s, "loss": 3.0, "val": v, "unix": T0 + t} for t, s, v in points]


def curve(steps: range, start_s: float, per_step: float, val_at: dict[int, float]) -> list[tuple]:
    return [(start_s + i * per_step, s, val_at.get(s)) for i, s in enumerate(steps)]


def test_target_is_the_ceilings_loss_at_80_percent_of_the_budget():
    ceiling = rows(curve(range(1, 41), 5.0, 1.0, {4 * k: 4.0 - 0.05 * k for k in range(1, 11)}))
    assert goodput_report.target_from(ceiling, 40) == pytest.approx(4.0 - 0.05 * 8)      # step 32
    assert goodput_report.target_from(ceiling, 38) == pytest.approx(4.0 - 0.05 * 8)      # 30.4: first eval past it
    with pytest.raises(ValueError):
        goodput_report.target_from(ceiling[:20], 40)


def test_a_resume_from_a_checkpoint_counts_recomputed_batches_and_their_tokens():
    # steps 1..12, killed; resumed from the checkpoint at step 10: 11 and 12 computed again
    before = curve(range(1, 13), 5.0, 1.0, {4: 3.5, 8: 3.0, 12: 2.8})
    after = curve(range(11, 31), 40.0, 1.0, {12: 2.8, 16: 2.7, 20: 2.6, 24: 2.5, 28: 2.45})
    r = rows(before + after)
    assert goodput_report.recomputed(r) == 2
    hit = goodput_report.reached(r, 2.5)
    assert hit["step"] == 24 and hit["batches"] == 12 + 14       # 26 batches computed to reach step 24
    s = goodput_report.summarize("ddp-ckpt", r, False, T0, 20, 2.5, [(T0 + 17.0, "SIGKILL worker")], {"short_steps": 0})
    assert s["wall_to_target_s"] == pytest.approx(40.0 + 13)
    assert s["tokens_to_target"] == 26 * goodput_report.TOKENS_PER_BATCH
    assert s["recomputed_steps"] == 2 and s["val_at_budget"] == 2.6 and s["final_val"] == 2.45
    assert s["steps_before_fault_per_s"] == pytest.approx(1.0)   # the rows before the kill only


def test_a_run_that_never_reaches_the_target_reports_none():
    r = rows(curve(range(1, 81), 5.0, 0.5, {4 * k: 3.0 for k in range(1, 21)}))
    s = goodput_report.summarize("raftps-sync", r, True, T0, 40, 2.5, [], {})
    assert s["wall_to_target_s"] is None and s["tokens_to_target"] is None and s["last_step"] == 80


def test_a_completed_runs_final_evaluation_row_is_no_batch():
    r = rows([(6.0, 1, 3.0), (7.0, 2, 2.9), (7.5, 2, 2.85)])
    assert len(goodput_report.batch_rows(r, completed=True)) == 2
    assert len(goodput_report.batch_rows(r, completed=False)) == 3
    assert goodput_report.recomputed(goodput_report.batch_rows(r, completed=True)) == 0


def test_short_steps_run_from_the_kill_to_the_restarted_ranks_resume():
    assert goodput_report.short_steps(kill_step=12, resume_step=13) == 1
    assert goodput_report.short_steps(kill_step=12, resume_step=12) == 0
    assert goodput_report.short_steps(kill_step=12, resume_step=None) is None     # never came back
    assert goodput_report.short_steps(kill_step=None, resume_step=None) == 0      # no worker kill


def test_the_resume_step_is_read_from_the_restarted_ranks_line(tmp_path):
    log = tmp_path / "rank3.log"
    log.write_text("[rank 0] not this rank: global batches 5..80\n"
                   "[rank 3] char_gpt: raftps sync x4, 1,278,720 parameters, global batches 13..80 (start_step 13)\n")
    assert goodput_launch._resume_step(str(log), 3) == 13
    log.write_text("[rank 3] char_gpt: resumed at global batch 20\n")
    assert goodput_launch._resume_step(str(log), 3) == 20
    assert goodput_launch._resume_step(str(log), 2) is None
    assert goodput_launch._resume_step(str(tmp_path / "missing.log"), 3) is None


def test_report_ratios_and_files(tmp_path):
    pytest.importorskip("matplotlib")
    ceiling = rows(curve(range(1, 41), 5.0, 1.0, {4 * k: 4.0 - 0.05 * k for k in range(1, 11)}))
    a = goodput_report.summarize("ddp", ceiling, False, T0, 40, 3.6, [], {"short_steps": 0, "bytes_per_token": 1.0,
                                                                    "bytes_how": "x", "launcher": "y"})
    slow = rows(curve(range(1, 41), 5.0, 2.0, {4 * k: 4.0 - 0.05 * k for k in range(1, 11)}))
    b = goodput_report.summarize("ddp-ckpt", slow, False, T0, 40, 3.6, [(T0 + 30, "SIGKILL worker")],
                          {"short_steps": 0, "bytes_per_token": 1.0, "bytes_how": "x", "launcher": "y"})
    d = goodput_report.summarize("raftps-diloco", ceiling, False, T0, 40, 3.6,
                          [(T0 + 17, "SIGKILL worker"), (T0 + 29, "SIGKILL store leader")],
                          {"short_steps": 3, "bytes_per_token": 0.1, "bytes_how": "x", "launcher": "y"})
    for r, c in ((a, ceiling), (b, slow), (d, ceiling)):
        r["curve"] = [(x["unix"] - T0, x["val"]) for x in c if x["val"] is not None]
    skipped = {"config": "torchft-ddp", "label": "(c) torchft DDP", "skipped": "not installed"}
    (ratio,) = [t for t in goodput_report.ratios([a, b, d, skipped]) if t["limit"] is not None]
    assert ratio["ratio"] == pytest.approx((5.0 + 31) / (5.0 + 62)) and ratio["met"] is True
    meta = {"mode": "quick", "budget": 40, "command": "c", "date": "d", "commit": "x", "machine": "m", "torch": "t",
            "torchft": "f", "uptime_start": "u0", "uptime_end": "u1"}
    md = goodput_report.write_report([a, b, skipped, d], meta, str(tmp_path))
    assert "skipped: not installed" in md and "loaded" in md and "| met |" in md
    for name in ("goodput_quick.md", "goodput_quick.json", "goodput_quick.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert json.loads((tmp_path / "goodput_quick.json").read_text())["ratios"][0]["met"] is True


def test_store_check_finds_a_round_applied_twice_or_acknowledged_and_lost():
    versions = {"p/a": 5, "p/b": 5}
    acked = [(r, 0, n) for n in range(5) for r in range(4)]
    store_check = goodput_report.store_check
    good = store_check(4, versions, acked)
    assert good["ok"] and good["rounds_applied"] == 5 and "exactly 5 times" in good["verdict"]
    twice = store_check(4, {**versions, "p/b": 6}, acked)
    assert not twice["ok"] and "'p/b': 6" in twice["verdict"]
    lost = store_check(3, {"p/a": 4, "p/b": 4}, acked)
    assert not lost["ok"] and "not applied: [4]" in lost["verdict"]
    assert not store_check(4, {}, acked)["ok"]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_kill_tree_stops_a_worker_that_left_for_a_session_of_its_own():
    """What torch's elastic agent does (each worker in its own session) and what left a restarted
    DDP group running after its run: the launcher's stop (raftps.chaos.reap.kill_tree, which
    goodput_launch.Torchrun and chaos.torchrun.TorchrunJob share) kills it by PID."""
    import select
    import subprocess
    import sys
    import time

    from raftps.chaos.reap import kill_tree
    agent = ("import subprocess, sys, time\n"
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
             "print(w.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, start_new_session=True)
    worker = None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20.0)
        assert ready, "the stand-in agent printed no worker PID in 20 s"
        worker = int(proc.stdout.readline())
        assert os.getsid(worker) == worker != os.getsid(proc.pid)
        kill_tree(proc)
        assert proc.returncode == -9
        deadline = time.monotonic() + 5.0
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        for pid in [proc.pid] + ([worker] if worker else []):
            if not _gone(pid):
                os.kill(pid, 9)
        proc.wait(5)
        proc.stdout.close()
