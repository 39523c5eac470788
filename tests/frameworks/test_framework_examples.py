"""examples/lightning_gpt.py and examples/hf_trainer.py, a few steps each as a user runs them:
two torchrun workers against a real 3-node cluster (Lightning in sync mode, the Trainer in
diloco mode); each finishes and rank 0 writes its summary. Every process is stopped by PID."""
from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

from raftps.chaos.torchrun import TorchrunJob  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402

BASE_PORT = 25000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("examples") / "run", BASE_PORT)
    yield cl
    cl.wipe()


@pytest.mark.parametrize("script, mode, port", [("lightning_gpt.py", "sync", BASE_PORT + 90),
                                                 ("hf_trainer.py", "diloco", BASE_PORT + 91)])
def test_example_trains_under_torchrun(cluster, tmp_path, script, mode, port):
    args = ["--mode", mode, "--steps", "4", "--sync-every", "2", "--batch", "4", "--prefix", f"example-{mode}",
            "--out", str(tmp_path / "out")]
    env = {**cluster.client_env, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    job = TorchrunJob(os.path.join(ROOT, "examples", script), args, 2, 0, env, str(tmp_path / "log"), port)
    try:
        code = job.wait(180)
    finally:
        job.stop()
    assert code == 0, open(tmp_path / "log", errors="replace").read()[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mode"] == mode and summary["world_size"] == 2 and summary["steps"] == 4
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(97) + 0.5, summary
