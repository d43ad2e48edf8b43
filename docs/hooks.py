"""MkDocs hooks: the tables of names drawn from pserver's registries, and links from the
documentation to the repository's other files (a benchmark's result file under bench/results/, a
manifest under deploy/, a module under pserver/).

A line `<!-- registry: MODULE:NAME -->` becomes a table of that registry (pserver/registry.py):
each name as a flag takes it, and its one-line summary, so the names a page lists are the
names the code knows. A marker that names no registry stops the build.

The pages link to such files as they sit in the repository, relative to the page
(`../../bench/results/ctr/lr_sync.json` from docs/performance/ctr.md), so the same link works
on a code host, in an editor and in tests/test_docs.py. MkDocs only knows the files under docs/
and, with --strict, fails on a link outside them. This hook puts each linked file into the site
under `_repo/` and points the link at it: a Markdown file (bench/tf_baseline/README.md, a
benchmark's summary.md) becomes a page of the site, rendered like the others but left out of the
navigation, and any other file is copied as it is. A link to a path that does not exist is
reported as a warning, so that `mkdocs build --strict` fails on it exactly as it does on a broken
link between pages: a wrong path still breaks the build, and only the files a page names go in.
"""

from __future__ import annotations

import importlib
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

log = logging.getLogger("mkdocs.hooks.repository_links")

# [text](target) and ![alt](target), outside code; the target ends at a space or ')'.
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
REGISTRY = re.compile(r"^<!-- registry: ([\w.]+):(\w+) -->$", re.M)


def registry_table(match: re.Match) -> str:
    """The Markdown table of the registry a marker names; PluginError when there is none."""
    module, name = match.groups()
    try:
        registry = getattr(importlib.import_module(module), name)
        rows = registry.table_rows()
    except (ImportError, AttributeError) as e:
        raise PluginError(f"registry marker {match.group(0)!r}: {e}") from None
    lines = ["| name | what it is |", "|---|---|"]
    bar = "\\|"                      # a | inside a cell
    lines += [f"| `{form}` | {summary.replace('|', bar)} |" for form, summary in rows]
    return "\n".join(lines)


class RepositoryFile(File):
    """A file of the repository outside docs/, copied into the site as it is (never rendered)."""

    def is_documentation_page(self) -> bool:
        return False


def outside_links(markdown: str):
    """Each link's match in markdown, outside code blocks: a path in a command is not a link."""
    last = 0
    for fence in [*FENCE.finditer(markdown), None]:
        end = fence.start() if fence else len(markdown)
        yield from LINK.finditer(markdown, last, end)
        last = fence.end() if fence else end


def repository_target(target: str, source: Path) -> Path | None:
    """The file a relative link from source names, or None for a URL, an anchor or an absolute path."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.partition("#")[0]
    return (source.parent / path).resolve() if path else None


def on_files(files, config):
    """The repository's Markdown files that pages link to (and those they link to) become pages:
    MkDocs makes a page of a file only before the pages are read, so they are found here."""
    docs = Path(config.docs_dir).resolve()
    repo = docs.parent
    todo = [Path(f.abs_src_path) for f in files.documentation_pages()]
    while todo:
        source = todo.pop()
        for match in outside_links(source.read_text()):
            resolved = repository_target(match.group(2), source)
            if (resolved is None or resolved.suffix != ".md" or resolved.is_relative_to(docs)
                    or not resolved.is_relative_to(repo) or not resolved.is_file()):
                continue
            uri = "_repo/" + resolved.relative_to(repo).as_posix()
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(resolved),
                                            inclusion=InclusionLevel.NOT_IN_NAV))
                todo.append(resolved)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = REGISTRY.sub(registry_table, markdown)
    docs = Path(config.docs_dir).resolve()
    repo = docs.parent
    source = Path(page.file.abs_src_path).resolve()
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        resolved = repository_target(target, source)
        if resolved is None:
            return match.group(0)
        _, hash_, anchor = target.partition("#")
        if resolved.is_relative_to(docs):      # a page or asset of the site: MkDocs checks it
            uri = resolved.relative_to(docs).as_posix()
        elif resolved.is_relative_to(repo) and resolved.is_file():
            uri = "_repo/" + resolved.relative_to(repo).as_posix()
            if files.get_file_from_path(uri) is None:   # a Markdown file is a page already (on_files)
                files.append(RepositoryFile.generated(config, uri, abs_src_path=str(resolved),
                                                      inclusion=InclusionLevel.INCLUDED))
        else:
            log.warning("Doc file '%s' links to '%s': no such file in the repository",
                        page.file.src_uri, target)
            return match.group(0)
        link = posixpath.relpath(uri, page_dir or ".")
        return f"{match.group(1)}{link}{hash_}{anchor}{match.group(3)}"

    out, last = [], 0
    for match in outside_links(markdown):
        out += [markdown[last:match.start()], rewrite(match)]
        last = match.end()
    out.append(markdown[last:])
    return "".join(out)
