"""`pserver.__all__` is what `import pserver` gives a user, and the API reference documents it.

The rule, checked both ways:
- every name in `__all__` is an attribute of `pserver`;
- `pserver`'s namespace holds nothing public beyond `__all__` and its submodules (a name
  imported into pserver/__init__.py for users is in `__all__`; a helper is not left public);
- every name in `__all__` (but `__version__`) is documented in docs/api/*.md, as a member of
  a module whose object it is;
- every member docs/api/*.md documents is in `__all__`, as the same object, except on the
  pages of other namespaces (MODULE_PAGES): docs/api/errors.md documents the module
  pserver.errors, whose finer classes a user imports from there (its four bases are in
  `__all__` by the rule before), and docs/api/keras.md the Keras names of `pserver.keras`.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import types

import pserver

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api"
MODULE_PAGES = {"errors.md": "pserver.errors", "keras.md": "pserver.keras"}


def documented(page: pathlib.Path) -> list[tuple[str, str]]:
    """(module, member) for each member listed under a `::: module` block of a page."""
    out = []
    for block in re.split(r"^::: ", page.read_text(), flags=re.M)[1:]:
        module = block.split()[0]
        listed = re.search(r"members:\s*\[(.*?)\]", block, flags=re.S)
        if listed:
            out += [(module, name.strip()) for name in listed.group(1).split(",")]
    return out


def test_every_name_in_all_exists():
    """Catches a name left in `__all__` after its import was removed (`from pserver import *` fails)."""
    assert [name for name in pserver.__all__ if not hasattr(pserver, name)] == []
    assert len(set(pserver.__all__)) == len(pserver.__all__)


def test_the_namespace_holds_only_all_and_submodules():
    """Catches a name imported into pserver/__init__.py for users but not added to `__all__`."""
    public = {name for name, value in vars(pserver).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public - set(pserver.__all__) == set()


def test_every_name_in_all_is_documented():
    """Catches an export with no entry in the API reference."""
    objects = {id(getattr(importlib.import_module(module), name))
               for page in DOCS.glob("*.md") for module, name in documented(page)}
    assert [name for name in pserver.__all__
            if name != "__version__" and id(getattr(pserver, name)) not in objects] == []


def test_every_documented_member_is_in_all():
    """Catches a function the reference shows under `import pserver` (docs/api/index.md says
    so) that pserver does not export: `evaluate_files` was one."""
    pages = sorted(set(DOCS.glob("*.md")) - {DOCS / page for page in MODULE_PAGES})
    members = [(module, name) for page in pages for module, name in documented(page)]
    assert members, "no members found: the parser no longer reads docs/api"
    assert [f"{module}.{name}" for module, name in members
            if getattr(pserver, name, None) is not getattr(importlib.import_module(module), name)
            or name not in pserver.__all__] == []


def test_a_page_of_another_namespace_documents_only_that_namespace():
    """Catches a page exempted above (MODULE_PAGES) that lists a member of `import pserver`."""
    for page, namespace in MODULE_PAGES.items():
        modules = {module for module, _ in documented(DOCS / page)}
        assert modules and all(m == namespace or m.startswith(namespace + ".") for m in modules), page
