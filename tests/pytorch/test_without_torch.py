"""raftps, its command line and the trainer work on a machine without torch; raftps.torch says
how to get it."""
import subprocess
import sys

BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "      # `import torch` now raises ImportError


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


def test_raftps_cli_and_trainer_import_without_torch():
    p = run("import raftps, raftps.tools.cli, raftps.client.client, raftps.chaos.harness, trainer.cli, trainer.worker; "
            "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_raftps_torch_without_torch_names_the_fix():
    p = run("import raftps.torch")
    assert p.returncode == 1
    assert "raftps.torch needs PyTorch: `bash cluster/setup.sh --torch`" in p.stderr
