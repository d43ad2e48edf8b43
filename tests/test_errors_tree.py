"""The exception tree drawn in pserver/errors.py's docstring is the tree of PServerError's
subclasses: every subclass (defined in any module of pserver) is drawn under its parent, and
nothing drawn is missing from the code."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pserver.errors

# One line per class: its name, its PServerError base, its module. Every module of pserver is
# imported first, so that a subclass defined outside errors.py is found too; in a fresh
# interpreter, so that the test session's modules are left as they were.
SUBCLASSES = """
import importlib, json, pkgutil, pserver
from pserver.errors import PServerError
for m in pkgutil.walk_packages(pserver.__path__, "pserver."):
    if not m.name.endswith("__main__"):       # __main__ runs the command line
        importlib.import_module(m.name)
def walk(cls):
    for sub in cls.__subclasses__():
        bases = [b.__name__ for b in sub.__bases__ if issubclass(b, PServerError)]
        yield sub.__name__, bases, sub.__module__
        yield from walk(sub)
print(json.dumps(sorted(set((n, tuple(b), m) for n, b, m in walk(PServerError)))))
"""


def drawn_tree(doc: str) -> dict[str, str | None]:
    """class name -> the name drawn as its parent (None for the root), from the drawing's
    lines: `+-- Name` one column right of where the parent's name starts."""
    tree: dict[str, str | None] = {}
    starts: dict[int, str] = {}            # column where a drawn name starts -> the latest there
    for line in doc.splitlines():
        branch = re.match(r"^(\s*[| ]*)\+-- (\w+)", line)
        if branch:
            column = len(branch.group(1))
            assert column - 1 in starts, f"no parent drawn above {line!r}"
            name = branch.group(2)
            tree[name] = starts[column - 1]
            starts[column + 4] = name
        elif not tree and re.match(r"^    PServerError\b", line):
            tree["PServerError"] = None
            starts[4] = "PServerError"
    return tree


def test_the_drawing_parses_into_a_tree():
    """The parser itself, on a small drawing: a wrong column rule would give a wrong parent."""
    doc = ("    PServerError   base\n"
           "     +-- A         a\n"
           "     |    +-- B    b\n"
           "     |    |    +-- C  c\n"
           "     |    +-- D    d\n"
           "     +-- E         e\n")
    assert drawn_tree(doc) == {"PServerError": None, "A": "PServerError", "B": "A", "C": "B",
                               "D": "A", "E": "PServerError"}


def test_every_subclass_of_pserver_error_is_drawn_under_its_parent():
    """Catches a new error class left out of the drawing (as JoinStepOpen, LeaseGone,
    OverBudget and ProcessFailed once were), one drawn under the wrong parent, one defined
    outside pserver/errors.py (one exception tree), and a drawn class that no longer exists."""
    r = subprocess.run([sys.executable, "-c", SUBCLASSES], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert [(name, module) for name, _, module in found if module != "pserver.errors"] == []
    assert all(len(bases) == 1 for _, bases, _ in found), "a class with two PServerError bases"
    code = {name: bases[0] for name, bases, _ in found} | {"PServerError": None}
    assert drawn_tree(pserver.errors.__doc__) == code
