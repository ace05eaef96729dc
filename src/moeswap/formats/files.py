"""A model directory's files read as untrusted data: paths confined to the directory, JSON with one-line errors.

A checkpoint is data, never a way to reach other files: a path it names is refused when absolute, when
it has a `..` part, or when it resolves (symlinks included) outside the directory; the one exception is
the Hugging Face hub cache, whose snapshots/<rev>/ files link into the same repository's blobs/.
Knows nothing of what the files hold. Entry points: `confined` / `escape_reason`, `read_json`, `show`.
"""

from __future__ import annotations

import json
import os
import reprlib
from pathlib import Path, PurePosixPath
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 240, 80, 3  # a long path still shows whole
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6


def show(value: object) -> str:
    """repr() cut to a few hundred characters and three levels: a hostile file's value stays one short line."""
    return _SHORT.repr(value)


def confined(root: Path, relative: object, error: type[ValueError], where: str) -> Path:
    """`root / relative`, or `error` starting with `where` when `relative` could reach outside `root`.

    The message says which rule the path broke, never what lies at the place it points to (whether it
    exists, its size or its bytes)."""
    reason = escape_reason(root, relative)
    if reason:
        raise error(f"{where}: {show(relative)} is {reason}; moeswap reads only files inside {root}")
    return root / str(relative)


def escape_reason(root: Path, relative: object) -> str | None:
    """Why `relative` could reach outside `root` (see `confined`), or None when it stays inside."""
    if not isinstance(relative, str) or not relative:
        return "not a file name"
    if not relative.isprintable():  # also NUL, which the OS would reject with a message naming no entry
        return "a name with control characters"
    parts = PurePosixPath(relative).parts
    if os.path.isabs(relative):
        return "an absolute path"
    if ".." in parts:
        return "a path with a '..' part"
    try:
        real = (root / relative).resolve()
        allowed = _allowed_roots(root)
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return "a path that cannot be resolved (a symlink loop?)"
    if not any(real.is_relative_to(r) for r in allowed):
        return "a link that resolves outside its directory"
    return None


def _allowed_roots(root: Path) -> list[Path]:
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        # Hugging Face hub cache: a file of models--ORG--NAME/snapshots/REV links to ../../blobs/HASH. Only
        # the literal blobs/ beside snapshots/ (its ancestors are resolved; if blobs itself were a link, a
        # file reached through it would not resolve under this path).
        roots.append(real.parent.parent / "blobs")
    return roots


def read_json(path: Path, error: type[ValueError]) -> Any:
    """The parsed content of a JSON file, or `error` naming `path` in one line: a directory or special
    file where the file should be, bytes that are not UTF-8, invalid or too deeply nested JSON."""
    if not path.is_file():  # a directory, or a FIFO or device that would block or never end
        found = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "nothing"
        raise error(f"{path}: expected a JSON file, found {found}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid JSON (not UTF-8 text: invalid byte at offset {e.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{path}: not valid JSON for a model file (nested too deeply to parse)") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise error(f"{path}: not valid JSON ({e})") from None
