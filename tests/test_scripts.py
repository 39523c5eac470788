"""The cluster scripts' output, redirected to a file as an operator would (`demo.sh > demo.log 2>&1`)."""
import os
import subprocess
import sys

from raftps.localcluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = 24000


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
