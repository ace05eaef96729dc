"""The llama-server peer of `bench serve`: llama.cpp's own HTTP server, built from the same
llama-cpp-python sdist by scripts/setup-peers.sh into .peers/bin/, serving the GGUF llama.cpp's converter
makes from the checkpoint (llamacpp.ensure_gguf), with continuous batching over `--parallel` slots.

Entry points: `find(explicit)` (the binary, or why there is none), `command(...)` (its argv), `version(binary)`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from moeswap.bench.peers.llamacpp import repo_root

BINARY = "llama-server"


def peers_bin() -> Path:
    """Where scripts/setup-peers.sh puts the binary."""
    return repo_root() / ".peers" / "bin" / BINARY


def find(explicit: str | None = None) -> tuple[str | None, str]:
    """(path, why not): `explicit` if given, else llama-server on PATH, else the one setup-peers.sh built."""
    if explicit:
        p = Path(explicit)
        if p.is_file() and shutil.which(str(p)):
            return str(p), ""
        return None, f"{explicit} is not an executable file"
    on_path = shutil.which(BINARY)
    if on_path:
        return on_path, ""
    built = peers_bin()
    if built.is_file():
        return str(built), ""
    return None, f"{BINARY} is not on PATH nor in {built.parent}; run scripts/setup-peers.sh (or pass --llama-server)"


def version(binary: str) -> str:
    """The binary's own `--version` line (its build number and commit), or why it could not be read."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def command(binary: str, gguf: str, port: int, threads: int, parallel: int, ctx_per_slot: int) -> list[str]:
    """llama-server on 127.0.0.1:port with `parallel` slots of `ctx_per_slot` tokens each and `threads` threads
    for both prompt and generation; everything else as shipped (continuous batching is its default). The web
    UI is off: the benchmark never loads it."""
    per_slot = -(-ctx_per_slot // 256) * 256
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(per_slot * parallel), "--no-webui"]
