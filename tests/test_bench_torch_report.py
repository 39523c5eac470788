"""bench/torch_train.py's targets and report from made-up runs (no torch, no cluster)."""
from __future__ import annotations

import csv
import json
import os

import pytest

pytest.importorskip("matplotlib")

from bench import torch_train  # noqa: E402


def run(tmp_path, example: str, label: str, rate: float, ttt: float | None) -> dict:
    d = tmp_path / f"{example}-{label.replace(' ', '_')}"
    d.mkdir()
    metric = "test_acc" if example == "cnn_digits" else "val_loss"
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time", "step", "loss", metric])
        w.writerows([[0.1, 1, 2.3, 0.1], [1.0, 2, 1.0, ""], [2.0, 3, 0.5, 0.9]])
    (d / "summary.json").write_text(json.dumps({"label": label}))
    return {"example": example, "label": label, "parameters": 10, "steps": 3, "steady_steps_per_s": rate,
            "time_to_target_s": ttt, "launch_to_target_s": None if ttt is None else ttt + 5,
            "step_at_target": 3, f"final_{metric}": 0.9, "target": 0.5, "wall_s": 9.0,
            "loadavg_1m_at_launch": 1.0, "out": str(d)}


def test_targets_and_report(tmp_path):
    runs = [run(tmp_path, "cnn_digits", "ddp x4", 40.0, 3.0),
            run(tmp_path, "cnn_digits", "raftps sync x4", 19.0, 9.0),        # 0.475x: not met
            run(tmp_path, "cnn_digits", "raftps async x4", 50.0, 4.4),       # 1.47x: met
            run(tmp_path, "char_gpt", "ddp x4", 2.0, 20.0),
            run(tmp_path, "char_gpt", "raftps sync x4", 1.5, 25.0),           # 0.75x: met
            run(tmp_path, "char_gpt", "raftps async x4", 3.0, None)]          # not reached: not met
    overhead = [{"example": "cnn_digits", "param_mb": 0.15, "raw_push_pull_ms": 10.0, "opt_step_ms": 10.5,
                 "ratio": 1.05, "raw_same_fields_ms": 10.2, "ratio_same_fields": 1.03},
                {"example": "char_gpt", "error": "RuntimeError: x"}]
    got = {(t["example"], t["target"].split()[1]): t["met"] for t in torch_train.targets(runs, overhead)}
    assert got == {("cnn_digits", "sync"): False, ("cnn_digits", "async"): True, ("char_gpt", "sync"): True,
                   ("char_gpt", "async"): False, ("cnn_digits", "<="): True}
    meta = {"command": "x", "date": "d", "commit": "c", "machine": "m", "torch": "t", "seconds": 1.0,
            "loadavg_1m_start_end": [1.0, 2.0], "mode": "quick"}
    md = torch_train.write_report(runs + [{"example": "char_gpt", "label": "raftps downpour x4", "error": "exit 1",
                                           "wall_s": 1.0, "loadavg_1m_at_launch": 1.0}], overhead, meta, str(tmp_path))
    assert "NOT met" in md and "failed: exit 1" in md and "not reached" in md
    for name in ("torch_train.md", "torch_train.json", "torch_cnn_digits.png", "torch_char_gpt.png"):
        assert os.path.exists(tmp_path / name), name
