"""The llama.cpp peer: llama-cpp-python (built from its PyPI sdist by scripts/setup-peers.sh) running
a GGUF made by llama.cpp's own converter from the same checkpoint (MXFP4 experts stay MXFP4).

Token ids in, token ids out (no tokenizer): the low-level API decodes batches of (token, position,
sequence) and greedy picks the argmax of the returned logits, like moeswap's greedy sampling.
Entry points: `available()`, `ensure_gguf(model_dir)` (with `converter_flags`), `LlamaCppRunner(gguf, threads,
...)`; where llama-cpp-python is not installed, the decode and prefill benchmarks run llama.cpp as llama-server
(peers/llamaserver.py: LlamaServerRunner).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"
NAME = f"llama.cpp (llama-cpp-python {VERSION})"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[4]


def converter_dir() -> Path:
    """Where setup-peers.sh extracted llama.cpp's converter (override: MOESWAP_LLAMA_CONVERTER)."""
    return Path(os.environ.get("MOESWAP_LLAMA_CONVERTER", repo_root() / ".peers" / "llama.cpp"))


def available() -> tuple[bool, str]:
    """(usable, why not): the library imports and the converter is extracted."""
    try:
        import llama_cpp
    except Exception as err:  # not installed, or the shared library fails to load
        return False, f"llama-cpp-python is not installed ({type(err).__name__}: {err}); run scripts/setup-peers.sh"
    if getattr(llama_cpp, "__version__", None) != VERSION:
        return False, f"llama-cpp-python {llama_cpp.__version__} is installed, the benchmark pins {VERSION}; run scripts/setup-peers.sh"
    if not (converter_dir() / "convert_hf_to_gguf.py").is_file():
        return False, f"llama.cpp's converter is not in {converter_dir()}; run scripts/setup-peers.sh"
    return True, ""


def _checkpoint_digest(model_dir: Path) -> str:
    """Cheap identity of a checkpoint: names, sizes and mtimes of its files."""
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def converter_flags(model_dir: str | Path) -> list[str]:
    """The converter's flags for a checkpoint's stored format beyond --outtype: block-FP8 weights (DeepSeek-V3,
    Kimi K2) become ggml Q8_0 (--fp8-as-q8, llama.cpp's own choice for them: 8.5 bits a weight against the
    stored 8, where its default would widen them to 16)."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = (config.get("text_config") or config).get("quantization_config") or {}
    return ["--fp8-as-q8"] if quant.get("quant_method") == "fp8" else []


def ensure_gguf(model_dir: str | Path, out_dir: str | Path | None = None, outtype: str = "auto") -> Path:
    """Convert MODEL_DIR with llama.cpp's converter once; later calls reuse the file (keyed by the
    checkpoint's files and the flags). outtype: the converter's --outtype for the dense tensors ("auto" keeps
    bf16); MXFP4 routed experts are repacked as ggml MXFP4 whatever it is, block-FP8 weights become Q8_0
    (converter_flags)."""
    model_dir = Path(model_dir).resolve()
    out_dir = Path(out_dir) if out_dir else repo_root() / ".peers" / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = converter_flags(model_dir)
    tag = "".join(f"-{f.strip('-')}" for f in flags)
    out = out_dir / f"{model_dir.name}-{_checkpoint_digest(model_dir)}-{outtype}{tag}.gguf"
    if out.is_file():
        return out
    tmp = out.with_suffix(".part")
    cmd = [sys.executable, "-m", "moeswap.bench.peers.convert_gguf", str(converter_dir()), str(model_dir),
           "--outfile", str(tmp), "--outtype", outtype, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}:\n{proc.stderr[-3000:]}")
    tmp.rename(out)
    return out


_LOG_SINK = None  # keeps the ctypes callback alive while llama.cpp may call it


def _silence(llama_cpp) -> None:
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p())


class LlamaCppRunner:
    """One llama.cpp context over a GGUF: up to `max_seqs` sequences of up to `max_len` tokens each.

    n_batch / n_ubatch and the f16 cache are llama.cpp's defaults (2048 / 512): the peer runs as shipped
    (`repack=False` is its --no-repack)."""

    name = NAME

    def __init__(self, gguf: str | Path, threads: int, max_seqs: int = 1, max_len: int = 4096,
                 n_batch: int = 2048, n_ubatch: int = 512, kv_f32: bool = False, verbose: bool = False,
                 repack: bool = True):
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        if not verbose:
            _silence(L)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        # repack: llama.cpp's default, weights copied into its CPU layouts (anonymous memory); off, as its
        # --no-repack, they are read in place from the GGUF's mapping (bench stream under a memory limit)
        mp.use_extra_bufts = repack
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        per_seq = -(-max_len // 256) * 256
        cp.n_ctx = per_seq * max_seqs
        cp.n_batch, cp.n_ubatch = n_batch, min(n_ubatch, n_batch)
        cp.n_seq_max = max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        if kv_f32:  # cross-checks: keep the MLA latent cache in f32 (llama.cpp's default is f16)
            cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {gguf} ({max_seqs} x {per_seq} tokens)")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch, self.max_seqs = n_batch, max_seqs
        self.batch = L.llama_batch_init(max(n_batch, max_seqs), 0, max_seqs)

    def close(self) -> None:
        L = self.L
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def reset(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _run(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, pos, seq, want_logits) entries as one batch; greedy token per wanted row."""
        b = self.batch
        for j, (tok, pos, seq, want) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, want
            b.seq_id[j][0] = seq
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")
        out = []
        for j, (_, _, _, want) in enumerate(entries):
            if want:
                row = self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def logits_last(self):
        """Logits of the last decoded row (numpy, copied): for cross-checks."""
        return self.np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def prefill(self, prompt: list[int], seq: int = 0) -> int:
        """Feeds the prompt in n_batch pieces; returns the greedy first token."""
        first = None
        for start in range(0, len(prompt), self.n_batch):
            piece = prompt[start:start + self.n_batch]
            last = start + len(piece) == len(prompt)
            res = self._run([(t, start + i, seq, last and i == len(piece) - 1) for i, t in enumerate(piece)])
            first = res[0] if last else first
        return first

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy: each prompt prefilled alone, then all sequences decoded together, one token per step.
        Returns tokens per sequence, ttft_s (all prefills) and decode_s (the decode steps)."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts but the context was made for {self.max_seqs} sequences")
        self.reset()
        t0 = time.perf_counter()
        nxt = [self.prefill(p, seq=i) for i, p in enumerate(prompts)]
        ttft = time.perf_counter() - t0
        outs = [[t] for t in nxt]
        t1 = time.perf_counter()
        for step in range(max_tokens - 1):
            nxt = self._run([(t, len(p) + step, i, True) for i, (t, p) in enumerate(zip(nxt, prompts))])
            for o, t in zip(outs, nxt):
                o.append(t)
        decode_s = time.perf_counter() - t1
        return {"tokens": outs, "ttft_s": ttft, "decode_s": decode_s, "decoded": max_tokens - 1}


class _GGMLTensor(ctypes.Structure):
    """ggml.h `struct ggml_tensor` of the pinned llama.cpp (GGML_MAX_DIMS 4, MAX_SRC 10, MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def capture_intermediates(gguf: str | Path, tokens: list[int], kv_f32: bool = True) -> dict:
    """Run one prompt through llama.cpp and return every named f32/i32 graph tensor it computes (name as
    llama.cpp's graph callbacks give it, e.g. "attn_norm-3", "ffn_moe_topk-1", "l_out-5"), as numpy
    arrays in ggml order reversed ([..., ne1, ne0]). For layer-by-layer cross-checks; slow (the graph
    is evaluated node by node)."""
    import llama_cpp as L
    import numpy as np

    caps: dict = {}

    def on_tensor(ptr, ask, user):
        if ask:
            return True
        t = _GGMLTensor.from_address(ptr)
        name = t.name.decode(errors="replace")
        if t.type in (0, 26) and t.data and name not in caps:  # GGML_TYPE_F32, GGML_TYPE_I32
            ne, nb = list(t.ne), list(t.nb)
            n = sum((ne[i] - 1) * nb[i] for i in range(4)) // 4 + 1
            ctype = ctypes.c_float if t.type == 0 else ctypes.c_int32
            base = np.ctypeslib.as_array((ctype * n).from_address(t.data))
            caps[name] = np.lib.stride_tricks.as_strided(base, shape=ne[::-1], strides=nb[::-1]).copy()
        return True

    callback = L.ggml_backend_sched_eval_callback(on_tensor)
    _silence(L)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = -(-len(tokens) // 256) * 256
    cp.n_threads = cp.n_threads_batch = 1
    cp.cb_eval, cp.cb_eval_user_data = callback, None
    if kv_f32:
        cp.type_k = cp.type_v = 0
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(len(tokens), 0, 1)
    try:
        for j, tok in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, j, 1, True
            batch.seq_id[j][0] = 0
        batch.n_tokens = len(tokens)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed while capturing intermediates")
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return caps
