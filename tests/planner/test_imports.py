"""The planner's modules import one another one way (function-level imports included), and describing
a model or reading the hardware catalog imports neither the engine nor (for the catalog) torch."""

import ast
import subprocess
import sys
from pathlib import Path

import moeswap.planner

PACKAGE = "moeswap.planner"
ROOT = Path(moeswap.planner.__file__).parent


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph() -> dict[str, set[str]]:
    """module -> the planner modules it imports anywhere in its body (`from . import x` names submodule x)."""
    files = {_name(p): p for p in ROOT.rglob("*.py")}

    def owner(dotted: str) -> str | None:  # the deepest planner module a dotted name lies in
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                found |= {owner(f"{src}.{a.name}") for a in node.names}
        graph[mod] = found - {None, mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_planner_imports_have_no_cycle():
    graph = import_graph()
    # the graph is read from the code: relative, absolute and function-level imports all appear
    assert "moeswap.planner.local" in graph["moeswap.planner.plan"]  # inside plan(), when measuring
    assert "moeswap.planner.report" in graph["moeswap.planner.cli"]  # `from . import report` inside run()
    assert "moeswap.planner.hardware" in graph["moeswap.planner.local"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_catalog_without_torch_and_model_without_engine():
    code = (
        "import sys\n"
        "from moeswap.planner import cli, validation\n"
        "from moeswap.planner.hardware import resolve_hardware\n"
        "resolve_hardware('h200')\n"
        "assert 'torch' not in sys.modules, 'the hardware catalog imported torch'\n"
        "from moeswap.planner.models import resolve_model\n"
        "from moeswap.planner.params import model_params\n"
        "model_params(resolve_model('kimi-linear-48b')[0])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('moeswap.engine', 'moeswap.experts.store'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
