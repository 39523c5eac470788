"""The documentation: the site builds with no warning, and every runnable example runs.

A runnable example is a ```python block of README.md or docs/**/*.md whose fence is preceded by
the line `<!-- runnable -->` (an HTML comment: nothing shows on GitHub or on the site). Each runs
in a fresh namespace against a real 3-node LocalCluster, found as a reader finds theirs after
`cluster/start.sh`: its addresses in RAFTPS_CLUSTER, its token in RAFTPS_TOKEN_FILE. The store's
tensors are deleted after each block, so every block starts with no tensors.
"""
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.conftest import start_cluster

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- runnable -->"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_site_builds_strict_without_warnings(tmp_path):
    # NO_MKDOCS_2_WARNING: the Material theme's banner about its own future, printed on every build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "index.html").is_file()


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(file relative to the repository, line of the block's first code line, code) of every
    block marked runnable."""
    blocks = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            fence = lines[i + 1] if i + 1 < len(lines) else ""
            where = f"{page.relative_to(ROOT)}:{i + 1}"
            assert re.fullmatch(r"```python\s*", fence), f"{where}: {MARKER} is not followed by a ```python fence"
            end = next((k for k in range(i + 2, len(lines)) if lines[k].strip() == "```"), None)
            assert end is not None, f"{where}: the runnable block has no closing fence"
            blocks.append((str(page.relative_to(ROOT)), i + 3, "\n".join(lines[i + 2:end])))
    return blocks


def test_the_marked_examples_are_found():
    files = {path for path, _, _ in runnable_blocks()}
    assert {"README.md", "docs/getting-started.md"} <= files, files


@pytest.fixture(scope="module")
def docs_cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("docs") / "run", base_port=4700)
    yield cluster
    cluster.wipe()


def test_runnable_blocks_run(docs_cluster, monkeypatch):
    for name, value in docs_cluster.client_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAFTPS_TOKEN", raising=False)
    failures = []
    for path, line, code in runnable_blocks():
        try:
            # compiled under its file and line, so a traceback points into the Markdown source
            exec(compile("\n" * (line - 1) + code, str(ROOT / path), "exec"), {"__name__": "__docs__"})
        except BaseException:                 # every block runs; each failure is reported below
            failures.append(f"{path}:{line}: the runnable block raised\n{traceback.format_exc()}")
        finally:
            with docs_cluster.client() as c:
                names = [row["name"] for row in c.tensors()]
                if names:
                    c.delete(names)
    assert not failures, "\n".join(failures)
