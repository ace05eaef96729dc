"""docs/hardening.md names the test that holds each hostile-input case as a pytest node id: every row has
one, and every one still exists (the file, the test function in it, and a bracketed parameter id among the
ids pytest collects), so a renamed test or a reordered parametrization cannot leave the catalogue pointing
at nothing."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "docs" / "hardening.md"
NODE = re.compile(r"`(tests/[\w/.-]+\.py)::(\w+)(\[[^`]*\])?`")


def node_ids() -> list[tuple[str, str, str]]:
    """(file, function, "[param id]" or "") of every node id the catalogue names, in order."""
    return NODE.findall(CATALOGUE.read_text(encoding="utf-8"))


def table_rows() -> list[str]:
    rows = [line for line in CATALOGUE.read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    return [r for r in rows if not re.fullmatch(r"\|(\s*-+\s*\|)+", r) and not r.startswith(("| case |", "| claim |"))]


@cache
def collected() -> frozenset[str]:
    """The node ids pytest collects from every file the catalogue names (one process: torch is imported once)."""
    files = sorted({f for f, _, _ in node_ids()})
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return frozenset(line.strip() for line in done.stdout.splitlines() if "::" in line)


def test_every_case_names_a_test():
    rows = table_rows()
    assert len(rows) >= 40, f"only {len(rows)} rows found: has the table format changed?"
    bare = [r for r in rows if not NODE.search(r)]
    assert not bare, "rows without a node id:\n" + "\n".join(bare)


def test_every_named_test_function_exists():
    missing = []
    for file, function, _ in node_ids():
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file}: no such file")
            continue
        defined = {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if function not in defined:
            missing.append(f"{file}: no function {function}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_every_named_parameter_id_is_collected():
    ids = collected()
    params = [(f, fn, p) for f, fn, p in node_ids() if p]
    assert params, "the catalogue names no parametrized case: has the node id format changed?"
    unseen = {f for f, _, _ in params if not any(i.startswith(f + "::") for i in ids)}
    missing = [f"{f}::{fn}{p}" for f, fn, p in params if f not in unseen and f"{f}::{fn}{p}" not in ids]
    assert not missing, "not collected:\n" + "\n".join(missing)
    if unseen:  # a module skipped whole where it cannot run (tests/test_unwritable_outputs.py without unshare)
        pytest.skip(f"collected nothing from {', '.join(sorted(unseen))} here: their parameter ids are unchecked")
