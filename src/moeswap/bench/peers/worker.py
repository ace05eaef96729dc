"""One implementation under test (moeswap, llama.cpp through llama-cpp-python or llama-server, or transformers)
in its own process, so that implementations share no heap or OpenMP runtime and the parent can alternate
between them. Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.
Entry points: `Worker(kind, ...)` in the parent; `python -m moeswap.bench.peers.worker` in the child.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from moeswap import jsonio
from moeswap.options import LoadOptions, add_load_flags
from moeswap.tuning import tune_process, use_huge_pages


class MoeswapRunner:
    """moeswap's engine (the continuous-batching scheduler) with its own timings."""

    name = "moeswap"

    def __init__(self, model_dir: str, threads: int, options: LoadOptions, compile: bool = False,
                 reference_step: bool = False):
        import torch

        from moeswap.models.loader import load_model

        tune_process()
        torch.set_num_threads(threads)
        self.model, self.store = load_model(model_dir, options)
        self.compile = compile
        self.native = not reference_step

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from moeswap.engine.scheduler import EngineConfig, Request, Scheduler

        if self.store is not None:  # the reply's store counters are this request's
            self.store.reset_stats()
        longest = max(len(p) for p in prompts) + max_tokens
        # every prompt prefilled in the first step, so each decode step runs the whole batch (the benchmark
        # measures decode at that batch; interleaving prefill with decode is the server's business)
        chunk = max(EngineConfig.prefill_chunk, sum(len(p) for p in prompts))
        sched = Scheduler(self.model, EngineConfig(max_batch=len(prompts), max_len=longest, compile=self.compile,
                                                   native=self.native, prefill_chunk=chunk))
        results = sched.run([Request(p, max_tokens, id=i) for i, p in enumerate(prompts)])
        st = sched.stats
        # decode time without capturing CUDA graphs (reported in engine.graph_capture_s), as engines that
        # capture at start-up report it
        return {"tokens": [r.tokens for r in results], "ttft_s": st.prefill_s,
                "decode_s": st.decode_s - st.graph_capture_s,
                "decoded": st.decode_steps, "engine": st.as_dict(),
                "request_ttft_s": [r.ttft_s for r in results], "request_tpot_s": [r.tpot_s for r in results],
                **({"store": self.store.stats.as_dict()} if self.store is not None else {})}


def _make_runner(args: argparse.Namespace):
    if args.kind == "moeswap":
        return MoeswapRunner(args.model, args.threads, LoadOptions.from_args(args), args.compile, args.reference_step)
    if args.kind == "llama.cpp":
        from moeswap.bench.peers.llamacpp import LlamaCppRunner

        return LlamaCppRunner(args.gguf, args.threads, args.max_seqs, args.max_len, repack=not args.no_repack)
    if args.kind == "llama-server":
        from moeswap.bench.peers.llamaserver import LlamaServerRunner

        return LlamaServerRunner(args.gguf, args.threads, args.max_seqs, args.max_len)
    if args.kind == "transformers":
        from moeswap.bench.peers.hf import TransformersRunner

        return TransformersRunner(args.model, args.threads, args.device, args.dtype)
    raise ValueError(f"unknown peer kind {args.kind!r}")


def serve(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind")
    p.add_argument("model")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--gguf")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--reference-step", action="store_true")
    p.add_argument("--no-repack", action="store_true", help="llama.cpp: its --no-repack")
    add_load_flags(p)  # the parent passes LoadOptions.to_argv()
    args = p.parse_args(argv)
    use_huge_pages()  # for every peer on torch, as the moeswap command has
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    try:
        t0 = time.perf_counter()
        runner = _make_runner(args)
        reply.write(jsonio.dumps({"ready": True, "name": runner.name, "load_s": time.perf_counter() - t0}) + "\n")
    except Exception as err:  # reported to the parent, which skips this peer and says why
        reply.write(jsonio.dumps({"ready": False, "error": f"{type(err).__name__}: {err}"}) + "\n")
        return
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "quit":
                break
            try:
                out = runner.generate(msg["prompts"], msg["max_tokens"])
            except Exception as err:
                out = {"error": f"{type(err).__name__}: {err}"}
            reply.write(jsonio.dumps(out) + "\n")
    finally:
        if hasattr(runner, "close"):  # a runner with a process of its own (llama-server) stops it
            runner.close()


class Worker:
    """Parent side: start a worker process and call it.

    Separate processes keep torch's bundled libgomp and the system's (llama.cpp's) from spinning against each
    other, and let the parent alternate so that load from other users of the machine hits all alike. Requests:
    {"op": "generate", "prompts": [[ids]], "max_tokens": n} or {"op": "quit"}; one JSON reply per line on the
    child's original stdout; everything else goes to stderr.
    """

    def __init__(self, kind: str, model: str, threads: int, extra: list[str] = (), env: dict | None = None,
                 preexec_fn=None):
        """`preexec_fn`: run in the child before it execs (bench stream: join a memory cgroup)."""
        cmd = [sys.executable, "-m", "moeswap.bench.peers.worker", kind, str(model), "--threads", str(threads), *extra]
        environ = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.kind = kind
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks on it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=environ, preexec_fn=preexec_fn)
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(hello.get("error", "worker did not start"))
        self.name, self.load_s = hello["name"], hello["load_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.log.seek(0)
            err = self.log.read()[-3000:]
            raise RuntimeError(f"{self.kind} worker exited (code {code}): {err}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(jsonio.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"{self.kind}: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(jsonio.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
