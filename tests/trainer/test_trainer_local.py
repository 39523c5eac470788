"""--local runs (no cluster): output files, progress line, determinism, plot with event marks."""
import csv
import io
import os

import numpy as np

from trainer.metrics import Progress
from trainer.plot import plot_run

from trainer_helpers import run_trainer


def test_local_run_writes_metrics_plot_and_summary(tmp_path):
    out = str(tmp_path / "local")
    summary = run_trainer(["--local", "--model", "mlp", "--hidden", "64", "--epochs", "2", "--seed", "3"], out)
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    # an evaluation before training, then two per epoch (22 updates per epoch at batch 64)
    assert [int(r["updates"]) for r in rows] == [0, 11, 22, 33, 44]
    assert float(rows[-1]["test_acc"]) > float(rows[0]["test_acc"])
    assert summary["updates"] == 44 and summary["mode"] == "local"
    assert os.path.getsize(os.path.join(out, "plot.png")) > 10_000
    assert "push/s" in summary["log"] and "leader local" in summary["log"]   # the progress line
    assert "final test accuracy" in summary["log"]
    again = run_trainer(["--local", "--model", "mlp", "--hidden", "64", "--epochs", "2", "--seed", "3"],
                        str(tmp_path / "again"))
    a, b = np.load(os.path.join(out, "params.npz")), np.load(str(tmp_path / "again" / "params.npz"))
    assert all(np.array_equal(a[k], b[k]) for k in a)       # same seed, same bits
    assert again["final_test_acc"] == summary["final_test_acc"]


def test_local_softmax_learns_digits(tmp_path):
    summary = run_trainer(["--local", "--model", "softmax", "--epochs", "10", "--lr", "0.5"], str(tmp_path / "sm"))
    assert summary["final_test_acc"] >= 0.9
    assert summary["parameters"] == 650


def test_plot_marks_events(tmp_path):
    rows = [{"time_s": t, "updates": 10 * t, "train_loss": 1 / (t + 1), "test_loss": 1 / (t + 2),
             "test_acc": t / 10} for t in range(10)]
    events = [{"time_s": 4.5, "updates": 45, "event": "kill node 2 (leader)"}]
    path = plot_run(str(tmp_path), rows, events, "t")
    assert os.path.getsize(path) > 10_000


def test_progress_line_fields():
    stream = io.StringIO()
    p = Progress(stream, every=0)
    p.show(elapsed=1.5, done=3, total=10, epoch=0.3, loss=0.5, acc=0.9, rate=12.0, version=42, leader=2)
    line = stream.getvalue()
    for part in ("step 3/10", "loss 0.5000", "acc 0.9000", "12.0 push/s", "version 42", "leader 2"):
        assert part in line


def test_progress_line_before_any_loss_or_evaluation_shows_neither():
    stream = io.StringIO()
    Progress(stream, every=0).show(elapsed=0.1, done=0, total=10, epoch=0.0, loss=None, acc=None, rate=0.0,
                                   version=0, leader=1)
    line = stream.getvalue()
    assert "step 0/10" in line and "version 0" in line and "leader 1" in line
    assert "loss" not in line and "acc" not in line and "nan" not in line


def test_cli_rejects_bad_sync_batch(tmp_path):
    import pytest
    from trainer.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--mode", "sync", "--workers", "3", "--batch", "64", "--out", str(tmp_path)])


def test_diloco_async_defaults_to_averaging_as_the_library_does():
    """--diloco-async without --outer-lr/--outer-momentum takes raftps.client.diloco's asynchronous default
    (plain averaging, staleness-aware): the paper's Nesterov step diverges when pseudo-gradients
    apply on arrival (docs/pytorch.md). Synchronous DiLoCo keeps Nesterov; explicit values win."""
    from raftps.client.diloco import outer_spec
    from trainer.cli import config, parser

    def store_spec(*flags: str) -> dict:
        return config(parser().parse_args(["train", "--mode", "diloco", *flags])).optimizer_spec()
    assert store_spec("--diloco-async") == outer_spec(None, True)
    assert store_spec("--diloco-async")["name"] == "sgd" and store_spec("--diloco-async")["lr"] == 1.0
    assert store_spec() == outer_spec(None, False) and store_spec()["nesterov"]
    explicit = store_spec("--diloco-async", "--outer-lr", "0.5", "--outer-momentum", "0.8")
    assert (explicit["name"], explicit["lr"], explicit["momentum"]) == ("momentum", 0.5, 0.8)
    assert store_spec("--outer-momentum", "0")["name"] == "sgd" and store_spec("--outer-momentum", "0")["lr"] == 0.7
