"""The default model's corpus: the running interpreter's standard-library sources (PSF licence), cleaned and
split deterministically into train and held-out files, so anyone with Python can rebuild the corpus, the
tokenizer and the model. Entry points: `collect(stdlib)`, `write_corpus(out_dir, ...)`.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moeswap import jsonio
from moeswap.atomic_dir import atomic_file

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MAX_FILE_BYTES = 400_000
TRAIN_FILE, EVAL_FILE, INFO_FILE = "train.jsonl", "eval.jsonl", "corpus.json"
LICENCE = "PSF-2.0 (Python Software Foundation License), the licence of the CPython standard library"
_BLANK_RUNS = re.compile(r"\n{4,}")


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path under the stdlib directory
    text: str  # cleaned

    @property
    def held_out(self) -> bool:
        return held_out(self.relpath)


def held_out(relpath: str, eval_per_mille: int = 50) -> bool:
    """Whether a file is in the held-out split: by the SHA-256 of its path alone.

    In the last `eval_per_mille` of the range: the split depends on names only, never on order or on the
    machine.
    """
    digest = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big")
    return digest % 1000 >= 1000 - eval_per_mille


def clean(text: str) -> str:
    """Newlines normalised to "\\n", trailing whitespace removed, runs of blank lines cut to two, tabs kept."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n\n", text).strip("\n") + "\n"


def collect(stdlib: str | Path | None = None) -> list[SourceFile]:
    """The cleaned sources, sorted by path. stdlib: the directory (default: this interpreter's).

    Which files: `*.py` under `sysconfig.get_paths()["stdlib"]`, outside site-packages and the test suites
    (`test`, `tests`, `idle_test`: generated data and deliberately odd code), valid UTF-8, under MAX_FILE_BYTES.
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or path.is_symlink() or not path.is_file():
            continue
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = clean(text)
        if text.strip():
            out.append(SourceFile(rel.as_posix(), text))
    if not out:
        raise ValueError(f"{root}: no Python sources found (is it a standard library directory?)")
    return out


def pieces(text: str, max_chars: int) -> Iterator[str]:
    """`text` cut into pieces of at most max_chars (one line longer than that is cut inside), preferring
    top-level boundaries, then blank lines, then any line end. Joined, the pieces are `text`.

    A top-level boundary is a line that starts a `def`, `class`, decorator or statement at column 0 after a
    blank line, so that a piece fits one training row.
    """
    lines = text.splitlines(keepends=True)
    piece: list[str] = []
    size = 0
    last_top = last_blank = 0  # indices into `piece` where a cut is nicest
    for line in lines:
        while len(line) > max_chars:  # a pathological line (embedded data): cut it
            if piece:
                yield "".join(piece)
                piece, size, last_top, last_blank = [], 0, 0, 0
            yield line[:max_chars]
            line = line[max_chars:]
        if size + len(line) > max_chars and piece:
            cut = last_top or last_blank or len(piece)
            yield "".join(piece[:cut])
            piece = piece[cut:]
            size = sum(len(p) for p in piece)
            last_top = last_blank = 0
        if piece and piece[-1] == "\n" and line[:1] not in ("", " ", "\t", "\n", ")", "]", "}"):
            last_top = len(piece)
        elif line == "\n":
            last_blank = len(piece) + 1
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def write_corpus(out_dir: str | Path, stdlib: str | Path | None = None, max_chars: int = 2000,
                 eval_per_mille: int = 50) -> dict:
    """Writes train.jsonl and eval.jsonl ({"text": piece} per line, files in path order) and corpus.json
    (what was read, from where, the licence, counts and the files' SHA-256); returns corpus.json's content."""
    files = collect(stdlib)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, want in ((TRAIN_FILE, False), (EVAL_FILE, True)):
        chosen = [f for f in files if held_out(f.relpath, eval_per_mille) == want]
        lines = [jsonio.dumps({"text": p}) + "\n" for f in chosen for p in pieces(f.text, max_chars)]
        data = "".join(lines).encode()
        with atomic_file(out / name) as fh:
            fh.write(data)
        counts[name] = {"files": len(chosen), "pieces": len(lines), "chars": sum(len(f.text) for f in chosen),
                        "sha256": hashlib.sha256(data).hexdigest()}
    info = {"source": "Python standard library", "python": sys.version.split()[0],
            "stdlib": str(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"]),
            "licence": LICENCE, "excluded_dirs": sorted(EXCLUDED_DIRS), "max_file_bytes": MAX_FILE_BYTES,
            "max_chars": max_chars, "eval_per_mille": eval_per_mille, **counts}
    (out / INFO_FILE).write_text(jsonio.dumps(info, indent=2) + "\n")
    return info
