"""The llama-server peer of `bench serve`: llama.cpp's own HTTP server, built from the same
llama-cpp-python sdist by scripts/setup-peers.sh into .peers/bin/, serving the GGUF llama.cpp's converter
makes from the checkpoint (llamacpp.ensure_gguf), with continuous batching over `--parallel` slots. Also
llama.cpp's engine in `bench decode` / `bench prefill` where llama-cpp-python is not installed
(LlamaServerRunner: token ids in, token ids and the server's own timings out).

Entry points: `find(explicit)` (the binary, or why there is none), `command(...)` (its argv), `version(binary)`,
`LlamaServerRunner(gguf, threads, max_seqs, max_len)`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
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


def command(binary: str, gguf: str, port: int, threads: int, parallel: int, ctx_per_slot: int,
            repack: bool = True) -> list[str]:
    """llama-server on 127.0.0.1:port with `parallel` slots of `ctx_per_slot` tokens each and `threads` threads
    for both prompt and generation; everything else as shipped (continuous batching is its default). The web
    UI is off: the benchmark never loads it. repack False: --no-repack (LlamaServerRunner's fallback)."""
    per_slot = -(-ctx_per_slot // 256) * 256
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(per_slot * parallel), "--no-webui",
            *([] if repack else ["--no-repack"])]


class LlamaServerRunner:
    """llama-server on a loopback port with `max_seqs` slots of `max_len` tokens, as a side-by-side worker's
    engine (the interface of llamacpp.LlamaCppRunner). The prompts go in one /completion request (token ids,
    greedy, no prompt cache, end-of-sequence ignored); times are the server's own: decode_s is the longest
    sequence's generation time (from its first token to its last: max_tokens - 1 decode steps, as llama.cpp
    counts them), ttft_s the longest prompt time. A server that dies while loading is started once
    more with --no-repack (below)."""

    def __init__(self, gguf: str | Path, threads: int, max_seqs: int = 1, max_len: int = 4096,
                 binary: str | None = None, start_timeout_s: float = 600.0):
        from moeswap.bench.serve.servers import ServerProcess, free_port

        found, why = find(binary)
        if found is None:
            raise RuntimeError(why)
        self.max_seqs = max_seqs
        for repack in (True, False):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.server = ServerProcess(BINARY, command(found, str(gguf), port, threads, max_seqs, max_len, repack),
                                        {**os.environ, "OMP_NUM_THREADS": str(threads)}, self.url)
            try:
                self.server.wait_ready(start_timeout_s)
                break
            except RuntimeError:
                self.server.stop()
                # A -march=native build compiles ggml's AMX kernels where the CPU lists AMX; a VM that lists it
                # without enabling it kills the server (SIGILL, or an abort placing a graph on AMX buffers) as it
                # loads Q8_0 / Q4 weights into those buffers. Without repacking the weights stay in plain CPU
                # buffers, computed by ggml's ordinary vector kernels; the name says so.
                if not repack:
                    raise
        self.name = f"llama.cpp (llama-server, {version(found)}{'' if repack else ', --no-repack'})"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        import httpx

        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts but the server was started with {self.max_seqs} slots")
        # one request holding every prompt: the server queues them together, prefills them in one batch and
        # then decodes them in step (requests sent one by one would overlap one's decoding with another's prefill)
        body = {"prompt": prompts, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/completion", json=body, timeout=3600)
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"llama-server answered HTTP {r.status_code}: {r.text[:300]}")
        outs = r.json()
        outs = outs if isinstance(outs, list) else [outs]
        outs.sort(key=lambda o: o.get("index", 0))
        timings = [o["timings"] for o in outs]
        return {"tokens": [o["tokens"] for o in outs], "ttft_s": max(t["prompt_ms"] for t in timings) / 1e3,
                "decode_s": max(t["predicted_ms"] for t in timings) / 1e3,
                "decoded": min(t["predicted_n"] for t in timings) - 1, "wall_s": wall}

    def close(self) -> None:
        self.server.stop()
