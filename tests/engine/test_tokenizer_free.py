"""The engine works on token ids only: no module of moeswap.engine imports the text side (moeswap.text) or a
tokenizer or template library, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import moeswap.engine

TEXT_SIDE = ("moeswap.text", "tokenizers", "tiktoken", "jinja2")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _text_side(names: list[str]) -> list[str]:
    return [n for n in names if any(n == t or n.startswith(t + ".") for t in TEXT_SIDE)]


def test_no_engine_module_imports_the_text_side():
    files = sorted(Path(moeswap.engine.__file__).parent.glob("*.py"))
    assert len(files) > 5  # the engine's modules were found
    assert {f.name: found for f in files if (found := _text_side(_imports(f)))} == {}


def test_the_check_sees_the_text_side():
    """The oracle: the tokenizer module itself imports what the engine must not."""
    import moeswap.text.tokenizer

    assert set(_text_side(_imports(Path(moeswap.text.tokenizer.__file__)))) >= {"tokenizers",
                                                                                "moeswap.text.chat_template"}
