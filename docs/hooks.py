"""MkDocs hooks: repository files that the pages link to, put on the site.

A page links to a file outside docs/ by its relative path in the repository
(`../bench/results/results.md` from docs/benchmarks/index.md: the link GitHub follows). The site
holds those files at their repository paths (`bench/results/results.md` on the site), and each
such link is rewritten to point there, so it works on the site and on GitHub alike. A link to a
repository file that is not published here is left as it is, and `mkdocs build --strict` fails on
it.
"""
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

# Published with the site, at their repository paths: the benchmark reports (tables, plots, raw
# JSON) and the READMEs of the examples and the trainer.
PUBLISHED = ["bench/results/*", "examples/README.md", "trainer/README.md", "cluster/grafana-raftps.json"]

# The target of a Markdown link or image: `](target)` or `](target#anchor)`.
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_files(files: Files, config) -> Files:
    repo = Path(config["config_file_path"]).parent
    for pattern in PUBLISHED:
        for path in sorted(p for p in repo.glob(pattern) if p.is_file()):
            name = path.relative_to(repo).as_posix()
            files.append(File(name, str(repo), config["site_dir"], config["use_directory_urls"],
                              inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    if page.file.src_uri.split("/")[0] in ("bench", "examples", "trainer", "cluster"):
        return markdown                          # a published file: its links are repository paths already
    page_dir = posixpath.dirname(posixpath.join("docs", page.file.src_uri))

    def published(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repo = posixpath.normpath(posixpath.join(page_dir, target))
        if in_repo.startswith("docs/") or files.get_file_from_path(in_repo) is None:
            return match.group(0)
        on_site = posixpath.relpath(in_repo, posixpath.dirname(page.file.src_uri) or ".")
        return f"]({on_site}{anchor})"

    return LINK.sub(published, markdown)
