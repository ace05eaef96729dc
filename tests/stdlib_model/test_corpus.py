"""The default model's corpus (stdlib_model/corpus.py) on a made-up standard library: what is read and
left out, the split by path alone, pieces that rebuild each file and fit their limit, strict JSONL."""

from __future__ import annotations

import json

import pytest

from moeswap.stdlib_model import corpus


def _fake_stdlib(root):
    files = {
        "os.py": "import sys\r\n\r\n\r\n\r\n\r\ndef f(x):   \n    return x\n",
        "json/__init__.py": "".join(f"def f{i}(a):\n    return a + {i}\n\n" for i in range(200)),
        "test/test_os.py": "def test(): pass\n",
        "site-packages/pkg.py": "x = 1\n",
        "idlelib/idle_test/t.py": "y = 2\n",
        "latin.py": None,  # not UTF-8
        "empty.py": "\n\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"caf\xe9 = 1\n" if text is None else text.encode())
    return root


def test_collect_reads_only_the_library_sources_cleaned(tmp_path):
    got = corpus.collect(_fake_stdlib(tmp_path / "lib"))
    assert [f.relpath for f in got] == ["json/__init__.py", "os.py"]
    assert got[1].text == "import sys\n\n\ndef f(x):\n    return x\n"  # CRLF, trailing blanks, 4+ blank lines


@pytest.mark.parametrize("limit", [40, 120, 1000])
def test_pieces_rebuild_the_text_within_the_limit(limit):
    text = "".join(f"class C{i}:\n    def m(self):\n        return {i}\n\n" for i in range(30)) + "x = '" + "a" * 300 + "'\n"
    parts = list(corpus.pieces(text, limit))
    assert "".join(parts) == text and all(0 < len(p) <= limit for p in parts)
    if limit == 120:  # cut at top-level boundaries: every piece but the long line's starts a class
        assert all(p.startswith("class ") for p in parts[:-4])


def test_split_depends_on_the_path_only_and_the_files_are_strict_jsonl(tmp_path):
    assert corpus.held_out("a/b.py") == corpus.held_out("a/b.py")
    share = sum(corpus.held_out(f"m{i}.py") for i in range(4000)) / 4000
    assert 0.035 < share < 0.065  # 50 per mille
    lib = _fake_stdlib(tmp_path / "lib")
    info = corpus.write_corpus(tmp_path / "out", lib, max_chars=300, eval_per_mille=500)
    texts = {}
    for name in (corpus.TRAIN_FILE, corpus.EVAL_FILE):
        lines = (tmp_path / "out" / name).read_text().splitlines()
        assert info[name]["pieces"] == len(lines)
        texts[name] = "".join(json.loads(line, parse_constant=lambda c: pytest.fail(c))["text"] for line in lines)
    whole = {f.relpath: f.text for f in corpus.collect(lib)}
    held = [p for p in sorted(whole) if corpus.held_out(p, 500)]
    assert texts[corpus.EVAL_FILE] == "".join(whole[p] for p in held)
    assert texts[corpus.TRAIN_FILE] == "".join(whole[p] for p in sorted(whole) if p not in held)
    assert info["licence"].startswith("PSF")


def test_a_directory_without_sources_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no Python sources"):
        corpus.collect(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.collect(tmp_path / "missing")


def test_heldout_prompts_are_first_lines_of_heldout_defs_and_classes(tmp_path):
    from moeswap.stdlib_model.recipe import write_prompts

    (tmp_path / "corpus").mkdir()
    pieces = ["x = 1\n", "def f(a):\n    return a\n", "class C:\n    pass\n", "def f(a):\n    pass\n", "import os\n"]
    (tmp_path / "corpus" / corpus.EVAL_FILE).write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    assert write_prompts(tmp_path, count=5).read_text() == "def f(a):\nclass C:\n"
