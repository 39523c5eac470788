"""The cluster scripts' output, redirected to a file as an operator would (`demo.sh > demo.log 2>&1`)."""
import os
import subprocess
import sys

from raftps.tools.localcluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = 24000
KILL_BASE = 24560


def test_demo_start_step_writes_a_clean_log(tmp_path):
    """demo.sh's start step (start_and_export in cluster/_env.sh) with stdout and stderr sent to
    one file: no NUL bytes (tee /dev/stderr wrote ~2 KB of them), the status table is there, and
    the shell got RAFTPS_CLUSTER."""
    run_dir, log = tmp_path / "run", tmp_path / "demo.log"
    env = {**os.environ, "RAFTPS_RUN_DIR": str(run_dir), "RAFTPS_BASE_PORT": str(BASE), "PYTHON": sys.executable}
    env.pop("RAFTPS_TOKEN_FILE", None)
    script = (f'source "{ROOT}/cluster/_env.sh"; echo "== starting"; start_and_export; '
              'echo "exported RAFTPS_CLUSTER=$RAFTPS_CLUSTER token=$RAFTPS_TOKEN_FILE" >&2')
    try:
        with open(log, "wb") as out:
            done = subprocess.run(["bash", "-c", f"set -euo pipefail; {script}"], stdout=out, stderr=out,
                                  env=env, timeout=120)
        text = log.read_bytes()
        assert done.returncode == 0, text.decode(errors="replace")
        nuls = text.count(b"\0")
        assert nuls == 0, f"{nuls} NUL bytes in the log"
        lines = text.decode().splitlines()
        assert lines[0] == "== starting" and any(line.startswith("node") for line in lines)
        cluster = LocalCluster(str(run_dir), base_port=BASE)
        assert f"exported RAFTPS_CLUSTER={cluster.addresses} token={cluster.token_file}" in lines
    finally:
        LocalCluster(str(run_dir), base_port=BASE).wipe()


def one_line(done: subprocess.CompletedProcess) -> str:
    """The one stderr line a refused command prints (no traceback, no usage block)."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def script(name: str, *args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(ROOT, "cluster", name), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_scripts_answer_a_wrong_node_a_dead_node_and_a_down_cluster_in_one_line(tmp_path):
    """kill.sh 9 on a 3-node cluster, kill.sh of a killed node, kill.sh and status.sh of a stopped
    cluster and a bad flag to start.sh: one line on stderr naming the problem and a non-zero exit."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAFTPS_RUN_DIR": str(run_dir), "RAFTPS_BASE_PORT": str(KILL_BASE), "PYTHON": sys.executable}
    env.pop("RAFTPS_TOKEN_FILE", None)
    try:
        down = script("status.sh", env=env)
        assert down.returncode == 1 and "no node" in one_line(down) and "running" in one_line(down)
        assert script("start.sh", env=env).returncode == 0
        for bad in (["9"], ["0"], ["abc"]):
            done = script("kill.sh", *bad, env=env)
            assert done.returncode == 2 and bad[0] in one_line(done), (bad, done.stderr)
        assert "1..3" in one_line(script("kill.sh", "9", env=env))
        assert script("kill.sh", "2", env=env).returncode == 0
        again = script("kill.sh", "2", env=env)
        assert again.returncode == 1 and "node 2 is not running" in one_line(again)
        status = script("status.sh", env=env)
        assert status.returncode == 0 and "down" in status.stdout       # some nodes up: the table
        flag = script("start.sh", "--nodes", "many", env=env)
        assert flag.returncode == 2 and "many" in one_line(flag)
        assert script("stop.sh", env=env).returncode == 0
        stopped = script("status.sh", env=env)
        assert stopped.returncode == 1 and "no node" in one_line(stopped)
        dead = script("kill.sh", "1", env=env)
        assert dead.returncode == 1 and "node 1 is not running" in one_line(dead)
        again = script("stop.sh", env=env)
        assert again.returncode == 0 and "no node" in again.stdout
    finally:
        LocalCluster(str(run_dir), base_port=KILL_BASE).wipe()


def test_scripts_refuse_arguments_they_do_not_take(tmp_path):
    """Checked before any work: setup.sh installs nothing, demo.sh starts nothing."""
    env = {**os.environ, "RAFTPS_RUN_DIR": str(tmp_path / "run"), "PYTHON": sys.executable}
    for name, args in [("setup.sh", ["--bogus"]), ("demo.sh", ["now"]), ("make-certs.sh", []), ("kill.sh", [])]:
        done = script(name, *args, env=env, timeout=30)
        assert done.returncode == 2 and "usage" in one_line(done).lower(), (name, done.stderr)
    assert not (tmp_path / "run").exists()
    flag = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torchrun_demo.py"), "--steps", "many"],
                          env=env, capture_output=True, text=True, timeout=60)     # demo-torch.sh's flags, after setup
    assert flag.returncode == 2 and "'many'" in one_line(flag)
