"""Reads a package's import statements with `ast`, for the import-rule tests (tests/test_package_imports.py,
tests/planner/test_imports.py). Imports anywhere in a module count, function bodies included; imports under
`if TYPE_CHECKING:` are marked so a rule may leave them out. Imports by string (importlib) are not seen.
Entry points: `imports(package, root)`, `import_graph(...)`, `find_cycle(graph)`, `cycles(graph)`."""

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the deepest module of the package that the import names
    name: str | None  # `from target import name` when name is not a submodule; None for a module
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)
    path: Path  # the importing file


def module_files(package: str, root: Path) -> dict[str, Path]:
    """dotted module name -> file, for every .py under root (the directory of `package`)."""

    def name(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))

    return {name(p): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, under_type_checking: bool = False):
    """(node, under TYPE_CHECKING) for every Import/ImportFrom, at any depth."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, under_type_checking
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), under_type_checking)
        else:
            yield from _import_nodes(child, under_type_checking)


def imports(package: str, root: Path) -> list[Import]:
    """Every import of a module of `package` made by a module of `package` (imports of other packages dropped)."""
    files = module_files(package, root)

    def owner(dotted: str) -> str | None:  # the deepest module of the package a dotted name lies in
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = []
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node, tc in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if target := owner(alias.name):
                        found.append(Import(mod, target, None, node.lineno, tc, path))
                continue
            parts = here.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            src = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = owner(f"{src}.{alias.name}")
                if sub is None:
                    continue
                if sub == f"{src}.{alias.name}":  # `from pkg import submodule`
                    found.append(Import(mod, sub, None, node.lineno, tc, path))
                else:
                    found.append(Import(mod, sub, alias.name, node.lineno, tc, path))
    return found


def import_graph(package: str, root: Path, *, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the modules of the package it imports anywhere in its body (`from . import x` names submodule x).
    type_checking=False leaves out the imports under `if TYPE_CHECKING:`."""
    graph: dict[str, set[str]] = {mod: set() for mod in module_files(package, root)}
    for imp in imports(package, root):
        if (type_checking or not imp.type_checking) and imp.target != imp.module:
            graph[imp.module].add(imp.target)
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
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (each sorted; every cycle lies inside one)."""
    nodes = sorted(set(graph) | {n for targets in graph.values() for n in targets})
    reach = {n: _reachable(graph, n) for n in nodes}
    seen: set[str] = set()
    out = []
    for n in nodes:
        if n in seen:
            continue
        comp = sorted(m for m in reach[n] if n in reach[m])
        seen |= set(comp)
        if len(comp) > 1:
            out.append(comp)
    return out


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
