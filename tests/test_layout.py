"""The package layout (issue 27): no import cycles, and the module paths from before the
packages still import, warn and give the very same objects."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import grimp
import pytest

from pserver._moved import MOVED


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


OLD_NAMES = {   # an old path, and a name that lived there
    "pserver.allocator": "tune", "pserver.client": "PSClient", "pserver.codec": "parse_chunk",
    "pserver.compress": "ErrorFeedback", "pserver.criteo": "load_file",
    "pserver.dataplane": "DataPlaneServer", "pserver.device": "parse_device",
    "pserver.metrics": "format_summary", "pserver.model_file": "evaluate_files",
    "pserver.progress": "track", "pserver.ray_backend": "RoleHost", "pserver.security": "TOKEN_ENV",
    "pserver.sharding": "shard_range", "pserver.slurm": "slurm_task", "pserver.status": "show_status",
    "pserver.stragglers": "parse_delay", "pserver.telemetry": "ShardMetrics", "pserver.worker": "run_worker",
    "pserver.launch": "Proc",
}


def test_every_moved_path_is_tested():
    assert set(OLD_NAMES) == set(MOVED)


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_path_imports_warns_and_gives_the_new_object(old):
    """In a fresh interpreter, so that the old module is imported (and warns) for the first time."""
    name = OLD_NAMES[old]
    code = f"""
import importlib, warnings
warnings.simplefilter("error", DeprecationWarning)
try:
    getattr(importlib.import_module({old!r}), {name!r})
except DeprecationWarning as e:
    print("warned:", e)
else:
    raise SystemExit("no DeprecationWarning")
warnings.simplefilter("ignore", DeprecationWarning)
got = getattr(importlib.import_module({old!r}), {name!r})
homes = [importlib.import_module(m) for m in {MOVED[old]!r}]
assert any(getattr(h, {name!r}, None) is got for h in homes), "not the new home's object"
print("same object")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"warned: {old} moved to" in r.stdout and "same object" in r.stdout


def test_a_name_no_module_had_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        codec = importlib.import_module("pserver.codec")
    with pytest.raises(AttributeError, match="pserver.codec.*no_such_name"):
        codec.no_such_name


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
