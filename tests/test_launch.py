"""``python -m raftps.launch``: one process per rank, each supervised on its own (raftps.tools.launch),
on real processes: RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them, a rank killed by a
signal started again alone, a failed rank's exit code returned, and the old import path."""
from __future__ import annotations

import os
import subprocess
import sys

RANK_SCRIPT = """
import os, pathlib, signal, sys
out = pathlib.Path(sys.argv[1])
rank = os.environ["RANK"]
marker = out / f"starts{rank}"
starts = int(marker.read_text()) + 1 if marker.exists() else 1
marker.write_text(str(starts))
if rank == sys.argv[2] and starts == 1:
    os.kill(os.getpid(), signal.SIGKILL)          # dies by a signal once
(out / f"env{rank}").write_text(" ".join(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                  "LOCAL_WORLD_SIZE")))
sys.exit(int(sys.argv[3]) if rank == "0" else 0)
"""


def launch(tmp_path, *flags: str, kill_rank: int = 1, rank0_exit: int = 0) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return subprocess.run([sys.executable, "-m", "raftps.launch", *flags, str(script), str(tmp_path),
                           str(kill_rank), str(rank0_exit)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_each_rank_gets_torchruns_variables(tmp_path):
    done = launch(tmp_path, "--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", kill_rank=4)
    assert done.returncode == 0, done.stderr
    # this node's ranks are 3, 4, 5 of 6; rank 4 was SIGKILLed once and started again, alone
    assert {r: (tmp_path / f"env{r}").read_text() for r in (3, 4, 5)} == \
        {3: "3 6 0 3", 4: "4 6 1 3", 5: "5 6 2 3"}
    assert {r: (tmp_path / f"starts{r}").read_text() for r in (3, 4, 5)} == {3: "1", 4: "2", 5: "1"}


def test_a_killed_rank_is_started_again_and_the_others_are_not(tmp_path):
    done = launch(tmp_path, "--nproc-per-node", "2", kill_rank=1)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"starts{r}").read_text() for r in (0, 1)] == ["1", "2"]
    assert "rank 1 died (signal 9); starting it again" in done.stderr


def test_no_restart_left_or_a_failed_rank_ends_the_launch_with_its_code(tmp_path):
    killed, failed = tmp_path / "killed", tmp_path / "failed"
    killed.mkdir()
    failed.mkdir()
    assert launch(killed, "--nproc-per-node", "2", "--max-restarts", "0").returncode == 128 + 9
    done = launch(failed, "--nproc-per-node", "2", kill_rank=-1, rank0_exit=3)
    assert done.returncode == 3 and (failed / "starts0").read_text() == "1"      # an exit code is no crash


def test_the_old_import_path_still_works():
    from raftps.chaos.torchrun import PerRankJob as old
    from raftps.tools.launch import PerRankJob
    assert old is PerRankJob
