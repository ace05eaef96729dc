"""The planner's modules import one another one way (function-level imports included), and describing
a model or reading the hardware catalog imports neither the engine nor (for the catalog) torch."""

import subprocess
import sys
from pathlib import Path

import moeswap.planner
from import_graph import find_cycle
from import_graph import import_graph as import_graph_of

PACKAGE = "moeswap.planner"
ROOT = Path(moeswap.planner.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """planner module -> the planner modules it imports anywhere in its body (tests/import_graph.py)."""
    return import_graph_of(PACKAGE, ROOT)


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
