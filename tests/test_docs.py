"""What a user reads points only at what the repository holds, and its commands run as written
after the quick start (which installs into .venv without activating it)."""

from __future__ import annotations

import re

import pytest

from tests.support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "bench" / "tf_baseline" / "README.md"]
# The pages a user reads: the README and the documentation site's pages (mkdocs.yml).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
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
        # A file, not a folder: the site copies the files a page names (docs/hooks.py), and a
        # link to a folder is a broken link there (mkdocs build --strict fails on it).
        assert dest.is_file(), f"{path.name}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(dest), f"{path.name}: link to {target}: no such heading"


def bash_lines(path) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    return [ln.strip() for block in blocks for ln in block.splitlines()]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_use_the_venv(path):
    lines = bash_lines(path)
    assert [ln for ln in lines if re.match(r"(python3? |pip3? )", ln) and "-m venv" not in ln] == []
    # Bench results go to the user's own directory unless a path is given: no command in the
    # documentation writes over the committed figures.
    assert not any("bench/results/" in ln.partition("#")[0] for ln in lines)


def test_the_quick_start_and_the_benchmarks_commands_are_there():
    readme = bash_lines(ROOT / "README.md")
    assert ("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/pserver launch --ps 2 "
            "--workers 4 --optimizer adam --lr 0.001 --epochs 1") in readme
    assert ('python3 -m venv .venv && .venv/bin/pip install -e ".[test,ray]" && .venv/bin/python -m pytest -q'
            in readme)
    assert ".venv/bin/python bench/throughput.py --repeats 3" in bash_lines(
        ROOT / "docs" / "performance" / "throughput.md")


def test_the_readme_example_is_the_guide_s():
    """tests/test_api.py runs the README's example; the guide shows the same code."""
    first = [re.search(r"```python\n(.*?)```", path.read_text(), re.S).group(1)
             for path in (ROOT / "README.md", ROOT / "docs" / "guide" / "your-model.md")]
    assert first[0] == first[1]


def test_every_page_is_in_the_navigation():
    """mkdocs build --strict fails on a page left out of nav too; this says so without MkDocs."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^\n]*: )?(\S+\.md)$", text.partition("\nnav:")[2], re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav names pages that do not exist"


def result_paths(text: str) -> set[str]:
    """Every bench/results/... path a page names, in links, code spans or commands; {a,b}
    alternatives expanded."""
    found = set()
    for path in re.findall(r"bench/results/[\w./{},*-]*", text):
        path = path.rstrip(".,")
        alternatives = re.search(r"\{([^}]*)\}", path)
        choices = alternatives.group(1).split(",") if alternatives else [""]
        for choice in choices:
            found.add(path.replace(alternatives.group(0), choice) if alternatives else path)
    return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_file_named_exists(path):
    for name in result_paths(path.read_text()):
        assert list(ROOT.glob(name)), f"{path.relative_to(ROOT)} names {name}: no such file"


def test_the_semantics_page_covers_what_the_readme_links_to():
    assert {"sharding", "modes", "checkpoints", "security", "errors-and-exit-codes"} <= anchors(
        ROOT / "docs" / "semantics.md")
    assert "docs/semantics.md" in (ROOT / "README.md").read_text()


def test_the_names_page_draws_a_table_from_every_registry_in_the_code():
    """docs/reference/names.md's markers (rendered by docs/hooks.py at build time) name every
    Registry the package defines, and each marker names one: a new registry, or a renamed one,
    fails here before the docs build does."""
    import importlib

    from pserver.registry import Registry
    page = (ROOT / "docs" / "reference" / "names.md").read_text()
    marked = re.findall(r"^<!-- registry: ([\w.]+):(\w+) -->$", page, re.M)
    for module, name in marked:
        assert isinstance(getattr(importlib.import_module(module), name), Registry), (module, name)
    defined = set()
    for path in (ROOT / "pserver").rglob("*.py"):
        for name in re.findall(r"^(\w+) = Registry\(", path.read_text(), re.M):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            defined.add((module, name))
    assert defined and set(marked) == defined


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_registry_marker_names_a_registry(path):
    """The guide's pages list names through the same markers (docs/hooks.py renders them);
    each must name a Registry, as the build requires."""
    import importlib

    from pserver.registry import Registry
    for module, name in re.findall(r"^<!-- registry: ([\w.]+):(\w+) -->$", path.read_text(), re.M):
        assert isinstance(getattr(importlib.import_module(module), name), Registry), (module, name)


@pytest.mark.parametrize("page", ["operations/errors.md", "semantics.md"])
def test_the_error_pages_name_every_error_kind(page):
    """The errors page and the semantics have a row for every kind a refusal may carry
    (pserver.errors.KINDS), with its class."""
    from pserver.errors import KINDS
    text = (ROOT / "docs" / page).read_text()
    rows = set(re.findall(r"^\| `(\w+)` \| [A-Z_]+ \| `(\w+)`", text, re.M))
    assert rows == {(kind, cls.__name__) for kind, cls in KINDS.items()}


def test_where_is_what_covers_every_package_and_module():
    """docs/index.md's "where is what" table has a row for every package under pserver/ and
    names every top-level module in a row's first cell."""
    rows = [line.split("|")[1] for line in (ROOT / "docs" / "index.md").read_text().splitlines()
            if line.startswith("| `")]
    named = {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}
    for path in (ROOT / "pserver").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            assert f"pserver/{path.name}/" in named, f"docs/index.md: no row for pserver/{path.name}/"
        elif path.suffix == ".py":
            assert {path.name, f"pserver/{path.name}"} & named, f"docs/index.md: pserver/{path.name} unnamed"


def test_the_readme_links_every_page():
    """The README's "Documentation" section is the way in to the site: it links every page."""
    readme = (ROOT / "README.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))
               if f"]({p.relative_to(ROOT).as_posix()}" not in readme]
    assert missing == []


def test_the_ci_docs_build_fails_on_a_broken_link(tmp_path):
    """.ci/run's `mkdocs build` flags, on a two-page site whose one link is broken, fail the build;
    with the link mended the same command passes. Catches `--quiet` (MkDocs 1.6 then hides the
    warnings that `--strict` counts, and a broken link passed CI)."""
    pytest.importorskip("mkdocs")          # the docs extra, which .ci/run installs
    import subprocess
    import sys
    line = next(ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
                if re.search(r'mkdocs" build ', ln))
    flags = re.search(r'mkdocs" build (.*?)--site-dir', line).group(1).split()
    assert "--strict" in flags
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nnav:\n  - index.md\n  - other.md\n"
        "validation:\n  not_found: warn\n  anchors: warn\n  unrecognized_links: warn\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")

    def build(link: str) -> int:
        (tmp_path / "docs" / "index.md").write_text(f"# Home\n\nSee [the other page]({link}).\n")
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", *flags, "--site-dir",
                               str(tmp_path / "site")], cwd=tmp_path, capture_output=True,
                              env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}).returncode

    assert build("other.md") == 0
    assert build("no-such-page.md") != 0


def test_a_linked_markdown_file_outside_docs_is_rendered_as_a_page(tmp_path):
    """docs/hooks.py makes a page of a repository Markdown file that a page links to (a
    benchmark's README), so the site shows it rendered, not as raw text, and the link points at
    that page; another file (a JSON) is copied as it is. Catches the hook copying a .md file as
    a static file again, or adding it too late for MkDocs to render it."""
    pytest.importorskip("mkdocs")
    import subprocess
    import sys
    (tmp_path / "docs").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("# Notes\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "notes" / "run.json").write_text("{}\n")
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\n[the notes](../notes/README.md), [a run](../notes/run.json)\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\nnav:\n  - index.md\nhooks:\n  - {ROOT / 'docs' / 'hooks.py'}\n"
        "markdown_extensions:\n  - tables\n"
        "validation:\n  omitted_files: warn\n  not_found: warn\n  unrecognized_links: warn\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr
    page = (tmp_path / "site" / "_repo" / "notes" / "index.html").read_text()
    assert '<h1 id="notes">Notes</h1>' in page and "<table>" in page
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="_repo/notes/"' in home and 'href="_repo/notes/run.json"' in home
    assert (tmp_path / "site" / "_repo" / "notes" / "run.json").is_file()


def test_every_figure_is_drawn_from_result_files_by_the_command_beside_it():
    """Each PNG under docs/assets/figures is bench/docs_figures.py's (a name in its FIGURES), is
    shown by a page, and that page has the command that draws it. Catches a figure left behind
    when its drawing went, or shown without how it was made."""
    script = (ROOT / "bench" / "docs_figures.py").read_text()
    names = set(re.findall(r'"(\w+)": \w+', re.search(r"^FIGURES = \{(.*)\}$", script, re.M).group(1)))
    shown = {}
    for path in PAGES:
        for name in re.findall(r"\]\((?:\.\./)*assets/figures/([\w-]+)\.png\)", path.read_text()):
            shown[name] = path
            assert f".venv/bin/python bench/docs_figures.py --only {name}" in bash_lines(path), (path, name)
    files = {p.stem for p in (ROOT / "docs" / "assets" / "figures").glob("*.png")}
    assert names and names == set(shown) == files


def test_a_mermaid_block_has_the_fence_that_draws_it():
    """A ```mermaid block (the home page's architecture) is drawn only through superfences'
    custom fence in mkdocs.yml; without it the site shows the diagram's source as code and the
    build does not warn. Catches the fence dropped from mkdocs.yml while a page still has one."""
    import yaml
    used = [p for p in PAGES if "```mermaid\n" in p.read_text()]
    assert ROOT / "docs" / "index.md" in used
    text = (ROOT / "mkdocs.yml").read_text()
    config = yaml.load(text, Loader=yaml.BaseLoader)      # strings only: its !!python tags unbuilt
    fences = next(e["pymdownx.superfences"] for e in config["markdown_extensions"]
                  if isinstance(e, dict) and "pymdownx.superfences" in e)["custom_fences"]
    assert any(f["name"] == "mermaid" and f["class"] == "mermaid" for f in fences)
    assert "format: !!python/name:pymdownx.superfences.fence_code_format" in text
