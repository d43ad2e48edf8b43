"""What a user reads points only at what the repository holds, and its commands run as written
after the quick start (which installs into .venv without activating it)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "bench" / "tf_baseline" / "README.md"]
SOURCES = [*sorted((ROOT / "pserver").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py")),
           ROOT / "protos" / "pserver.proto"]
OUTSIDE = ("DESIGN", "../shared", "shared/datasets", "the issue", "this project's issues")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(path):
    text = path.read_text()
    for word in OUTSIDE:
        assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(dest), f"{path.name}: link to {target}: no such heading"


def test_readme_commands_use_the_venv():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    assert [ln for ln in lines if re.match(r"(python3? |pip3? )", ln) and "-m venv" not in ln] == []
    assert ".venv/bin/python bench/throughput.py --repeats 3" in lines
    # Bench results go to the user's own directory unless a path is given: no README
    # command writes over the committed figures.
    assert not any("bench/results/" in ln.partition("#")[0] for ln in lines)


def test_the_semantics_page_covers_what_the_readme_links_to():
    assert {"sharding", "modes", "checkpoints", "security", "errors-and-exit-codes"} <= anchors(
        ROOT / "docs" / "semantics.md")
    assert "docs/semantics.md" in (ROOT / "README.md").read_text()
