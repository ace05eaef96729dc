"""moeswap's packages import one another one way, and no module imports a private name from another package.

A package is the first component under moeswap/ (moeswap.ops.expert -> ops); a top-level module (config.py,
cli.py) is a package of its own. Imports anywhere in a module count, function bodies included; imports under
`if TYPE_CHECKING:` are left out (they never run, so they cannot close a cycle). Imports by string
(`importlib.import_module`, the lazy registries) are not seen. Read with `ast` by tests/import_graph.py.
"""

from collections import defaultdict
from pathlib import Path

import moeswap
from import_graph import Import, cycles, imports

ROOT = Path(moeswap.__file__).parent


def package_of(module: str) -> str:
    """moeswap.ops.expert -> ops; moeswap.config -> config; moeswap -> moeswap (the root __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _where(imp: Import, root: Path) -> str:
    return f"{imp.path.relative_to(root.parent).as_posix()}:{imp.line}"


def package_cycles(found: list[Import], root: Path) -> list[str]:
    """Each cycle between packages and, per package edge on it, the imports that make it:
    'a -> b: file:line, file:line'. Breaking every edge of one direction listed here removes the cycle."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for imp in found:
        a, b = package_of(imp.module), package_of(imp.target)
        if a != b and not imp.type_checking and _where(imp, root) not in edges[a, b]:
            edges[a, b].append(_where(imp, root))
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    lines = []
    for comp in cycles(graph):
        lines.append(f"cycle among {{{', '.join(comp)}}}:")
        lines += [f"  {a} -> {b}: {', '.join(where)}" for (a, b), where in sorted(edges.items())
                  if a in comp and b in comp]
    return lines


def private_imports(found: list[Import], root: Path, *, across: str = "package") -> list[str]:
    """One line per import of a private name (or private module) from another package (across="package") or
    from any other module (across="module")."""
    lines = []
    for imp in found:
        if across == "package" and package_of(imp.module) == package_of(imp.target):
            continue
        if across == "module" and imp.module == imp.target:
            continue
        names = imp.target.split(".")[1:] + ([imp.name] if imp.name else [])
        if any(_private(n) for n in names):
            what = imp.target + (f".{imp.name}" if imp.name else "")
            lines.append(f"{_where(imp, root)} ({imp.module}) imports {what}")
    return lines


def _toy(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "toy"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_rules_find_what_they_should_on_a_toy_package(tmp_path):
    root = _toy(tmp_path, {
        "a/__init__.py": "",
        "a/x.py": "def f():\n    from toy.b.y import _hidden, shown\n",  # function-level, private
        "b/__init__.py": "",
        "b/y.py": "from ..c import z\n_hidden = shown = 1\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.a import x\n"
                "else:\n    import os\nfrom toy.b import y as _y_is_fine\n",
        "d.py": "from toy.a import x\nfrom . import c\nfrom toy.a.x import __doc__\n",
    })
    found = imports("toy", root)
    by = {(i.module, i.target, i.name, i.type_checking) for i in found}
    assert ("toy.a.x", "toy.b.y", "_hidden", False) in by
    assert ("toy.b.y", "toy.c", "z", False) in by  # `from ..c import z`: z is a name in module c
    assert ("toy.c", "toy.a.x", None, True) in by  # under TYPE_CHECKING: seen, but marked
    assert ("toy.d", "toy.c", None, False) in by  # `from . import c` names the module
    assert private_imports(found, root) == ["toy/a/x.py:2 (toy.a.x) imports toy.b.y._hidden"]  # not the alias
    assert private_imports(found, root, across="module") == private_imports(found, root)
    # b -> c -> b is a cycle; c -> a is only under TYPE_CHECKING, so a is not on it
    assert package_cycles(found, root) == ["cycle among {b, c}:", "  b -> c: toy/b/y.py:1", "  c -> b: toy/c.py:6"]
    assert package_of("moeswap.ops.expert") == "ops" and package_of("moeswap.config") == "config"


def test_the_walker_reads_moeswap():
    found = imports("moeswap", ROOT)
    edges = {(i.module, i.target) for i in found}
    assert ("moeswap.__main__", "moeswap.cli") in edges
    assert len({package_of(i.module) for i in found}) > 15  # every package is read, not a few
    assert any(i.type_checking and i.module == "moeswap.models" for i in found)  # TYPE_CHECKING ModelConfig


def test_no_import_cycle_between_packages():
    lines = package_cycles(imports("moeswap", ROOT), ROOT)
    assert not lines, "import cycles between moeswap's packages:\n" + "\n".join(lines)


def test_no_private_name_imported_from_another_package():
    lines = private_imports(imports("moeswap", ROOT), ROOT)
    assert not lines, "private names imported from another package:\n" + "\n".join(lines)


def test_no_private_name_imported_from_another_module():
    """Stricter than the package rule: a private name stays in its module."""
    lines = private_imports(imports("moeswap", ROOT), ROOT, across="module")
    assert not lines, "private names imported from another module:\n" + "\n".join(lines)
