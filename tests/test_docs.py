"""The documentation: the site builds with no warning."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_site_builds_strict_without_warnings(tmp_path):
    # NO_MKDOCS_2_WARNING: the Material theme's banner about its own future, printed on every build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "index.html").is_file()
