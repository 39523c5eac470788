"""raftps.torch works without the training frameworks installed; raftps.torch.lightning and
raftps.torch.hf say how to get them."""
import subprocess
import sys

import pytest

pytest.importorskip("torch")

BLOCK = "import sys; sys.modules['lightning'] = sys.modules['accelerate'] = sys.modules['transformers'] = None; "


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_raftps_torch_imports_without_the_frameworks():
    p = run("import raftps.torch, raftps.torch.optimizer; print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@pytest.mark.parametrize("module, framework", [("raftps.torch.lightning", "PyTorch Lightning"),
                                               ("raftps.torch.hf", "Accelerate")])
def test_the_framework_pieces_name_the_fix(module, framework):
    p = run(f"import {module}")
    assert p.returncode == 1
    assert f"{module} needs {framework}" in p.stderr and "pip install 'raftps[frameworks]'" in p.stderr, p.stderr
