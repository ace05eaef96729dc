"""No file under src/ or tests/ names an absolute path outside the repository (a machine's home or work
directory, a shared docs folder): the package and its tests must run on any machine. String literals,
docstrings and comments all count; only the kernel's own interfaces (/proc, /sys, /dev) and the server's
HTTP routes (/v1/...) may be named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".c", ".h", ".toml", ".json", ".txt", ".md", ".cfg", ".ini", ".sh"}
OS_INTERFACES = {"proc", "sys", "dev"}
URL_ROUTES = {"v1"}  # the OpenAI API's paths (/v1/chat/completions) are HTTP routes, not files

# A slash-name-slash that starts a token (after a quote, a space or a bracket): not "GB/s", "a/b", "./x", "~/x",
# "$HOME/x", "{root}/x" or a URL's "//host/x"
ABSOLUTE = re.compile(r"(?<![\w.~\-/\\:${})\]])/([A-Za-z_][\w.\-]*)/[^\s\"'`),;]*")


def absolute_paths(text: str) -> list[str]:
    return [m.group(0) for m in ABSOLUTE.finditer(text) if m.group(1) not in OS_INTERFACES | URL_ROUTES]


def test_the_pattern_finds_what_it_must_and_nothing_else():
    home, work = "/" + "home/someone/x.json", "/" + "work/shared/docs/kimi_k3.md"
    assert absolute_paths(f'DOCS = Path("{work}")  # and {home}') == [work, home]
    assert absolute_paths(f"'{home}' ({work}/)") == [home, work + "/"]
    ordinary = ('open("/proc/cpuinfo"); "/sys/devices/system/cpu"; 13.4 GB/s; tokens/s; a/b/c; ./x/y; ~/.cache/x; '
                'shared/docs/kimi_k3.md; $HOME/x/; "https://example.org/a/b"; {root}/x/')
    assert absolute_paths(ordinary) == []


def test_no_absolute_paths_outside_the_repository_in_src_or_tests():
    found = []
    for top in ("src", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                found += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in absolute_paths(line)]
    assert not found, "absolute paths outside the repository:\n" + "\n".join(found)
