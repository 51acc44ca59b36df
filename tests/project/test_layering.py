"""The dependency direction of DESIGN.md and ``peer/__init__.py``, read from the source (every import,
function-level ones included): no import cycles between our modules, the packages of ``peer`` only
import the packages below them, the command modules do not import each other, and ``protos`` imports
nothing of ``models``, ``peer`` or ``coordinator``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import peer
from helpers.procs import ROOT
from helpers.pysource import parse_files

TOPS = ("peer", "coordinator", "models", "protos", "hivepath")

PEER_LAYERS = tuple(tuple(name for name, _ in layer) for layer in peer.LAYERS)
"""The packages of ``peer``, lowest first (:data:`peer.LAYERS`): a package imports only packages of earlier layers."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            if "_pb2" not in path.name:
                out[_module_name(path)] = path
    return out


def _imports(path: Path, tree: ast.Module, name: str, modules: set[str]) -> set[str]:
    """Our modules that ``name`` (at ``path``, parsed as ``tree``) imports: ``from a.b import c`` is
    ``a.b.c`` when that is a module, else ``a.b``."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    sources = _sources()
    names = set(sources)
    trees = parse_files(sources.values())
    return {name: _imports(path, trees[path], name, names) for name, path in sources.items()}


def test_no_import_cycles(graph):
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert graph["peer.averaging"], "the graph is real: a package's __init__ imports its modules"
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_peer_packages_import_only_the_layers_below(graph):
    layer = {pkg: i for i, group in enumerate(PEER_LAYERS) for pkg in group}
    on_disk = {p.stem if p.is_file() else p.name for p in (ROOT / "peer").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert on_disk == set(layer), "every package of peer/ has a layer in peer.LAYERS"
    wrong = []
    for name, deps in graph.items():
        parts = name.split(".")
        if parts[0] != "peer" or len(parts) < 2:
            continue
        for dep in deps:
            dparts = dep.split(".")
            if dparts[0] != "peer" or len(dparts) < 2 or dparts[1] == parts[1]:
                continue
            if layer[dparts[1]] >= layer[parts[1]]:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the layering of peer.LAYERS: " + "; ".join(sorted(wrong))


def test_the_readme_shows_the_layer_map():
    """README.md's layout table lists peer's packages as :data:`peer.LAYERS` does, in its order."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regen_readme_layout", ROOT / "tests/golden/regen_readme_layout.py")
    regen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen)
    text = (ROOT / "README.md").read_text()
    assert regen.with_layout(text) == text, "regenerate it: python tests/golden/regen_readme_layout.py"
    assert all(row in text for row in peer.layout_rows())


def test_peer_and_coordinator_meet_only_through_protos_and_models(graph):
    wrong = [f"{a} imports {b}" for a, deps in graph.items() for b in deps
             if {a.split(".")[0], b.split(".")[0]} == {"peer", "coordinator"}
             or (a.split(".")[0] in ("models", "protos") and b.split(".")[0] in ("peer", "coordinator", "hivepath"))
             or (a.split(".")[0] == "protos" and b.split(".")[0] == "models")]
    assert not wrong, "; ".join(sorted(wrong))


def test_command_modules_do_not_import_each_other(graph):
    cmds = {n for n in graph if n.startswith("hivepath.cmd_")}
    assert len(cmds) >= 5
    wrong = [f"{a} imports {b}" for a in cmds for b in graph[a] if b in cmds]
    assert not wrong, "; ".join(sorted(wrong))


def test_benchmarks_do_not_borrow_the_tests_harness():
    """``bench/`` starts its networks with ``peer.localnet``: it imports nothing of ``tests/`` and puts
    nothing on ``sys.path`` to reach it."""
    borrowing = []
    for path, tree in parse_files(sorted((ROOT / "bench").rglob("*.py"))).items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            borrowing += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                          if n.split(".")[0] in ("tests", "helpers", "chaos", "conftest")]
        if "sys.path" in path.read_text():
            borrowing.append(f"{path.relative_to(ROOT)} changes sys.path")
    assert not borrowing, borrowing
