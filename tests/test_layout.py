"""The package layout (issue 27): no import cycles, every module in a layer, the packages
import without a warning, and the command line loads gRPC late."""

from __future__ import annotations

import ast
import pathlib
import pkgutil
import subprocess
import sys

import grimp

import pserver

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10: pytest's own dependency reads TOML there
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's components of more than one module (or a module importing itself)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.find_modules_directly_imported_by(v):
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_pserver_is_in_an_import_cycle():
    """Imports inside functions count (grimp reads every import statement)."""
    graph = grimp.build_graph("pserver", include_external_packages=False)
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle_made_inside_a_function():
    """The check above would catch a cycle of function-level imports: add one and see."""
    graph = grimp.build_graph("pserver", include_external_packages=False)
    graph.add_import(importer="pserver.wire.codec", imported="pserver.worker.client", line_number=1,
                     line_contents="from pserver.worker.client import PSClient")
    assert ["pserver.wire.codec", "pserver.worker.client"] == [
        m for m in next(c for c in strongly_connected(graph) if "pserver.wire.codec" in c)
        if m in ("pserver.wire.codec", "pserver.worker.client")]


def test_every_module_of_pserver_is_in_a_layer():
    """A module directly under pserver/ that no layer of pyproject.toml names escapes
    lint-imports: it may import anything (the forwarding shims of issue 27 were such modules).
    Catches a new top-level module or package left out of [tool.importlinter]."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    top = {m.name for m in pkgutil.iter_modules(pserver.__path__)} - {"__main__"}
    assert top - named == set(), "modules outside pyproject.toml's layers"


def test_the_new_packages_import_without_a_warning():
    code = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
import pserver, pserver.cli, pserver.launch, pserver.launch.ray, pserver.launch.child, pserver.worker.loop
import pserver.server.app, pserver.data, pserver.observe.status
from pserver.worker import client, dataplane, compress
print("quiet")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "quiet"), r.stderr


def test_the_command_line_loads_grpc_only_after_it_quieted_it():
    """cli.main sets GRPC_VERBOSITY before gRPC loads (else the C core prints a line per failed
    TLS handshake): importing the CLI, the launcher or a launched child must not load grpc."""
    code = ("import sys, pserver.cli, pserver.launch, pserver.launch.base, pserver.launch.roles, "
            "pserver.launch.child; print('grpc' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr


def imported_test_modules(module: str, names: list[str]) -> list[str]:
    """The test modules and conftests an import statement brings in: `from tests.test_x import y`,
    `import tests.e2e.conftest`, `from tests import test_x`, `from .conftest import y`."""
    def is_test(dotted: str) -> bool:
        last = dotted.rsplit(".", 1)[-1]
        return last.startswith("test_") or last == "conftest"
    return [m for m in [module, *(f"{module}.{n}" for n in names)] if is_test(m)]


def test_no_test_module_imports_another_test_module_or_a_conftest():
    """What tests share lives in tests/support (helpers) and the conftests (fixtures, found by
    pytest): a test module imported by another runs its module-level code twice under two names,
    and a helper reached through a test module breaks when that test moves. Every import
    statement counts, inside functions too."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                hits = [m for a in node.names for m in imported_test_modules(a.name, [])]
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                hits = imported_test_modules(module, [a.name for a in node.names])
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in hits]
    assert found == []


def test_the_import_check_finds_each_form():
    """The finder itself: each way of importing a test module or a conftest is caught, and a
    helper module whose name merely contains 'test' is not."""
    assert imported_test_modules("tests.test_modes", ["make_cluster"]) == ["tests.test_modes"]
    assert imported_test_modules("tests.e2e.conftest", []) == ["tests.e2e.conftest"]
    assert imported_test_modules("tests", ["test_modes", "support"]) == ["tests.test_modes"]
    assert imported_test_modules(".conftest", ["run"]) == [".conftest"]
    assert imported_test_modules("tests.support.shards", ["make_cluster"]) == []
    assert imported_test_modules("tests.support", ["latest_test_run"]) == []
