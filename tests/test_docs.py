"""The documentation holds together: ``docs/`` builds as a site with mkdocs in strict mode (a broken link or anchor,
a page outside the navigation, fails it: what ``make docs`` runs in CI), and every link of the README (the landing
page) to a file of the repository points at one that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (make install) brings mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    built = sorted("index" if p.parent == tmp_path / "site" else p.parent.name
                   for p in (tmp_path / "site").rglob("index.html") if p.parent.name != "search")
    assert built == pages


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The build's strictness is real: a page linking to an anchor its target lacks fails it (mkdocs' ``--quiet`` would
    hide exactly this warning, so ``make docs`` does not pass it)."""
    pytest.importorskip("mkdocs", reason="the docs extra (make install) brings mkdocs")
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (ROOT / "docs").iterdir():
        (docs / page.name).write_bytes(page.read_bytes())
    (docs / "troubleshooting.md").write_text((docs / "troubleshooting.md").read_text() + "\n[x](resume.md#no-such-part)\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "does not contain an anchor '#no-such-part'" in done.stderr, done.stderr[-2000:]


def test_the_readmes_links_point_at_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in target]
    assert links, "the README links to no docs page"
    missing = [link for link in links if link and not (ROOT / link).exists()]
    assert not missing, missing
    assert len(readme.splitlines()) < 120  # a landing page: the rest is in docs/
